"""An in-process backend for tests and single-process applications.

It implements the whole contract of :class:`lease_core.abc.Backend` with plain Python
structures. Its clock is injectable, so time-dependent behaviour can be tested without
waiting. Schedulers in one process (even on different event loops) may share one instance.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio.lowlevel

from lease_core._registry import check_url, merge_options, split_url_options
from lease_core._structures import (
    Attempt,
    CheckResult,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    HeartbeatResult,
    JobInfo,
    Lease,
    Outcome,
    Reason,
    RunInfo,
    RunState,
    RunStatus,
    ms_to_datetime,
)
from lease_core.abc import (
    Backend,
    check_every,
    check_leave,
    check_limit,
    check_members,
    check_prune,
    decode_checkpoint,
    encode_checkpoint,
    finish_status,
)
from lease_core.errors import ConfigurationError
from lease_core.operations import Operation, OperationResult
from lease_core.recovery import sibling_steps

from . import memory_operations
from .memory_leases import MemoryNamedLeases
from .memory_trim import trim_job

__all__ = ["MemoryBackend"]


@dataclass
class _Run:
    status: RunStatus
    attempt: int
    token: str | None
    instance_id: str | None
    expires_ms: int | None
    checkpoint: str | None = None
    #: Attempts that started by taking over an expired lease (max_attempts counts them
    #: and the first attempt, never hand-overs).
    takeovers: int = 0
    #: Attempts that started by retry (issue 19, part 1).
    retries: int = 0
    # Operations: the reason of the next attempt of a triggered or retried run, and who
    # asked for it (backends/memory_operations.py).
    queued: Reason | None = None
    queued_by: str | None = None
    heartbeat_ms: int | None = None  # the last renewal (the status API's heartbeat_at)
    grace_ms: int = 0  # a cancel's grace (Admin.cancel), told to the holder's heartbeat


def _retrying(run: _Run | None, now: int, delays: Sequence[int]) -> int:
    """Mark a just-failed run ``retrying`` if retries remain: the retry's number, else 0."""
    if run is None or run.retries >= len(delays):
        return 0
    run.status, run.expires_ms = RunStatus.RETRYING, now + delays[run.retries]
    return run.retries + 1


@dataclass
class _Job:
    first_seen_ms: int
    last_slot: int | None = None
    paused_by: str | None = None  # operations: who paused the job
    #: The newest slot whose run history trimming deleted (ClaimRequest.scheduled).
    trimmed_slot: int | None = None


class _Fleet:
    """The fleet's records of :class:`MemoryBackend`: maintenance periods and members."""

    _lock: threading.Lock
    #: (end of the period in ms on the backend's clock, the instance that won it), or None.
    _maintenance: tuple[int, str] | None
    #: instance id -> end of its membership in ms on the backend's clock.
    _members: dict[str, int]

    def _now(self) -> int:
        raise NotImplementedError  # pragma: no cover - MemoryBackend's own

    async def maintenance_due(self, instance_id: str, every_ms: int) -> bool:
        """Win the maintenance period for ``instance_id`` if none is running (one lock)."""
        check_every(every_ms)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            if self._maintenance is not None and now < self._maintenance[0]:
                return False
            self._maintenance = (now + every_ms, instance_id)
            return True

    async def members(self, instance_id: str, ttl_ms: int) -> list[str]:
        """Renew ``instance_id``'s membership and list the live members (one lock).

        Members whose membership has ended are deleted at once: nothing else reads them.
        """
        check_members(instance_id, ttl_ms)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            self._members[instance_id] = now + ttl_ms
            for name in [name for name, until in self._members.items() if until <= now]:
                del self._members[name]
            return sorted(self._members)

    async def leave(self, instance_id: str) -> None:
        """End ``instance_id``'s membership now (one lock)."""
        check_leave(instance_id)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._members.pop(instance_id, None)


class _Users:
    """Start and close of :class:`MemoryBackend`: a count of users, nothing to open."""

    _lock: threading.Lock
    _users: int
    _clock: Callable[[], float]
    #: Whether a use before start() was warned of (once per store, :meth:`_now`).
    _warned = False

    async def start(self, *, create: bool = True) -> None:
        """Count a user; there is nothing to open (safe from any event loop or thread).

        ``create`` is accepted for the contract's sake: an in-process store always exists.
        """
        with self._lock:
            self._users += 1

    async def close(self) -> None:
        """Release a user; nothing is closed."""
        with self._lock:
            self._users = max(0, self._users - 1)

    async def _open(self) -> None:
        pass

    async def _close(self) -> None:
        pass

    def _now(self) -> int:
        if not (self._users or self._warned):
            self._warn_unstarted()
        return int(self._clock() * 1000)

    def _warn_unstarted(self) -> None:
        # Once per store: a library author's test on memory should still catch the
        # missing start() (or a use after close()) that the other backends refuse.
        self._warned = True
        warnings.warn(
            f"{type(self).__name__} is used before start() or after close(); "
            "PostgresBackend and RedisBackend raise ConfigurationError here. Call "
            "'await backend.start()' first (a Scheduler, Admin or Lease starts it "
            "itself), and close() it when done", RuntimeWarning, stacklevel=4)


def _clock_option(url: str, options: dict[str, Any]) -> Callable[[], float] | None:
    """The ``clock`` of ``memory://`` options; any option but ``namespace`` is refused
    (by :func:`lease_core._registry.check_url`, as every backend's)."""
    check_url("memory", url, ("namespace",), ())
    _, from_url = split_url_options(url, ("namespace",))
    merged = merge_options("MemoryBackend", options, from_url, ("namespace", "clock"))
    clock: Callable[[], float] | None = merged.get("clock")
    return clock


class MemoryBackend(_Users, _Fleet, MemoryNamedLeases, memory_operations.MemoryOperations, Backend):
    """Keep runs, attempts and checkpoints in this process's memory.

    ``clock`` returns the store's time in seconds since the epoch; it defaults to the
    system clock and is meant to be replaced in tests. Nothing survives the process.
    """

    schemes = ("memory",)
    #: No connections: a forked child's copy is a store of its own, usable there (the fork
    #: refusals of :meth:`~lease_core.abc.Backend.start` and SyncLease spare it, and any
    #: subclass, whatever its schemes).
    in_process = True

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        super().__init__()
        if clock is not None and not callable(clock):
            raise ConfigurationError(
                f"clock={clock!r} is not callable; pass a function returning the store's "
                "time in seconds since the epoch (time.time by default), e.g. a test clock"
            )
        self._clock = clock or time.time
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._runs: dict[tuple[str, int], _Run] = {}
        #: Per job, the slots whose runs may be running (a superset, pruned as it is
        #: read, and of the runs trimming deletes): the overlap check reads these, not
        #: every run in the store.
        self._maybe_running: dict[str, set[int]] = {}
        self._attempts: dict[str, list[Attempt]] = {}
        #: When the current maintenance period ends (ms), and who won it.
        self._maintenance: tuple[int, str] | None = None
        #: The fleet's members: instance id -> end of its membership (ms, this clock).
        self._members: dict[str, int] = {}
        self._named = {}  # the named leases (MemoryNamedLeases)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        """Make a new, empty store for ``memory://``.

        ``namespace`` (keyword or ``?namespace=`` in the URL) is accepted so that code
        written for any backend runs unchanged, and ignored: each object is its own store.
        ``clock`` is passed on. Any other option raises
        :class:`~lease_core.errors.ConfigurationError`.
        """
        return cls(clock=_clock_option(url, options))

    async def now_ms(self) -> int:
        """Return the injected clock's time in epoch milliseconds."""
        await anyio.lowlevel.checkpoint()
        return self._now()

    async def register_jobs(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """Record the jobs as seen and list their open runs (one pass over the runs)."""
        names = dict.fromkeys(jobs)  # a name listed twice is one job, as on the other stores
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            opened: dict[str, list[int]] = {name: [] for name in names}
            for (j, slot), run in self._runs.items():
                if j in opened and not run.status.finished:
                    opened[j].append(slot)
            out: dict[str, JobInfo] = {}
            for name in names:
                job = self._jobs.get(name)
                new = job is None
                if job is None:
                    job = self._jobs[name] = _Job(first_seen_ms=now)
                out[name] = JobInfo(name, job.first_seen_ms, job.last_slot,
                                    tuple(sorted(opened[name])), new)
            return out

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        """Win, take over or inspect the runs, in order, all under one hold of the lock.

        :meth:`~lease_core.abc.Backend.claim` is inherited: a batch of one.
        """
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return [self._claim(req) for req in requests]

    def _claim(self, req: ClaimRequest) -> ClaimResult:
        now = self._now()
        key = (req.job, req.slot)
        job = self._jobs.setdefault(req.job, _Job(first_seen_ms=now))
        run = self._runs.get(key)
        if (run is None and req.scheduled and req.reason in memory_operations.PAUSABLE
                and job.last_slot is not None and req.slot <= job.last_slot
                and job.trimmed_slot is not None and req.slot <= job.trimmed_slot):
            # A slot at or before a run whose history was trimmed: it ran, or its turn
            # passed while newer runs ran (ClaimRequest.scheduled). Never run again.
            return ClaimResult(ClaimStatus.FINISHED, req.job, req.slot, now)
        job.last_slot = req.slot if job.last_slot is None else max(job.last_slot, req.slot)
        history = self._attempts.setdefault(req.job, [])

        def result(status: ClaimStatus, run: _Run, reason: Reason | None = None) -> ClaimResult:
            return ClaimResult(
                status, req.job, req.slot, now, run.attempt, reason, run.expires_ms,
                run.status, run.instance_id,
            )

        if run is None:
            # Operations: a paused job's new slot is skipped (a trigger's run exists).
            if job.paused_by is not None and req.reason in memory_operations.PAUSABLE:
                run = self._runs[key] = _Run(RunStatus.SKIPPED, 1, None, req.instance_id, None)
                history.append(memory_operations.paused_attempt(req, now, job.paused_by))
                return result(ClaimStatus.SKIPPED, run)
            why = req.overlap_skip and self._earlier_open(req.job, req.slot, now)
            if why:
                run = self._runs[key] = _Run(RunStatus.SKIPPED, 1, None, req.instance_id, None)
                at = ms_to_datetime(now)
                history.append(Attempt(req.job, req.slot, 1, req.instance_id, req.reason, at,
                                       at, Outcome.SKIPPED, why))
                return result(ClaimStatus.SKIPPED, run)
            run = self._runs[key] = _Run(
                RunStatus.RUNNING, 1, req.token, req.instance_id, now + req.lease_ms
            )
            self._maybe_running.setdefault(req.job, set()).add(req.slot)
            history.append(
                Attempt(req.job, req.slot, 1, req.instance_id, req.reason, ms_to_datetime(now))
            )
            return result(ClaimStatus.WON, run, req.reason)
        if run.status is RunStatus.RUNNING and run.token == req.token:
            # the same request again (a retry after a lost reply) answers as it did
            first = next((a.reason for a in history
                          if a.slot == req.slot and a.attempt == run.attempt), req.reason)
            return result(ClaimStatus.WON, run, first)
        if run.status.finished:
            return result(ClaimStatus.FINISHED, run)
        if run.status is RunStatus.RUNNING and run.expires_ms is not None and run.expires_ms > now:
            return result(ClaimStatus.RUNNING, run)
        requested_by = run.queued_by
        if run.status is RunStatus.RETRYING:
            # -- retries within a run (issue 19, part 1): due once the backoff passed
            if run.expires_ms is not None and run.expires_ms > now:
                return result(ClaimStatus.RUNNING, run)
            reason = Reason.RETRY
            run.retries += 1
        elif run.status is RunStatus.HANDED_OVER:
            reason = run.queued or Reason.HAND_OVER  # operations: manual or retry
            run.queued = run.queued_by = None
        else:
            if req.max_attempts is not None and 1 + run.takeovers >= req.max_attempts:
                self._end_attempt(req.job, req.slot, run.attempt, now, Outcome.ESCALATED,
                                  f"lease lost on attempt {run.attempt} of "
                                  f"max_attempts={req.max_attempts} (hand-overs not "
                                  "counted); escalated")
                run.status = RunStatus.ESCALATED
                run.token = None
                run.expires_ms = None
                return result(ClaimStatus.ESCALATED, run)
            self._end_attempt(req.job, req.slot, run.attempt, now, Outcome.LOST,
                              "lease expired without renewal")
            reason = Reason.TAKEOVER
            run.takeovers += 1
        run.status = RunStatus.RUNNING
        self._maybe_running.setdefault(req.job, set()).add(req.slot)
        run.attempt += 1
        run.token = req.token
        run.instance_id = req.instance_id
        run.expires_ms = now + req.lease_ms
        history.append(
            Attempt(req.job, req.slot, run.attempt, req.instance_id, reason, ms_to_datetime(now),
                    requested_by=requested_by if reason is not Reason.HAND_OVER else None)
        )
        return result(ClaimStatus.WON, run, reason)

    def _earlier_open(self, job: str, slot: int, now: int) -> str | None:
        """Why a new run of ``job`` at ``slot`` is skipped (overlap): a run before it holds
        a live lease, or waits for its retry; None when neither."""
        slots = self._maybe_running.get(job)
        if not slots:
            return None
        why = None
        for s in list(slots):
            r = self._runs.get((job, s))
            if r is None or r.status not in (RunStatus.RUNNING, RunStatus.RETRYING):
                slots.discard(s)
            elif s >= slot:
                continue
            elif r.status is RunStatus.RETRYING:
                why = why or "an earlier run of the job waits for its retry"
            elif r.expires_ms is not None and r.expires_ms > now:
                why = "an earlier run of the job still holds its lease"
        return why

    def _end_attempt(
        self, job: str, slot: int, attempt: int, now: int, outcome: Outcome, error: str | None
    ) -> None:
        history = self._attempts.get(job, [])
        for i in range(len(history) - 1, -1, -1):
            a = history[i]
            if a.slot == slot and a.attempt == attempt:
                if a.outcome is None:
                    history[i] = replace(
                        a, outcome=outcome, error=error, finished_at=ms_to_datetime(now)
                    )
                return

    async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                         older_than_ms: int | None = None,
                         batch: int = 1000) -> dict[str, int]:
        """Trim the jobs' histories under one hold of the lock (see :meth:`Backend.prune`,
        inherited: a batch of one); a workflow run's steps are kept while it goes on
        (:mod:`backends.memory_trim`)."""
        check_prune(keep, older_than_ms, batch)
        await anyio.lowlevel.checkpoint()
        workflows = await self.workflows()
        with self._lock:
            now = self._now()
            return {job: trim_job(self._attempts, self._runs, self._jobs, job, keep,
                                  older_than_ms, now, batch, sibling_steps(job, workflows),
                                  self._maybe_running)
                    for job in dict.fromkeys(jobs)}

    def _held(self, lease: Lease, now: int, *, live: bool = False) -> _Run | None:
        run = self._runs.get((lease.job, lease.slot))
        if run is None or run.token != lease.token or run.status is not RunStatus.RUNNING:
            return None
        if live and (run.expires_ms is None or run.expires_ms <= now):
            return None
        return run

    def _cancelled(self, lease: Lease) -> dict[str, int]:
        # cancel(grace=): the run keeps the holder's token, and the grace.
        run = self._runs.get((lease.job, lease.slot))
        if run is None or run.token != lease.token or run.status is not RunStatus.CANCELLED:
            return {}
        return {lease.token: run.grace_ms}

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        """Renew every live lease in ``leases`` to ``now + lease_ms``."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            held = set()
            cancelled: dict[str, int] = {}
            for lease in leases:
                run = self._held(lease, now, live=True)
                if run is not None:
                    run.expires_ms = now + lease.lease_ms
                    run.heartbeat_ms = now
                    held.add(lease.token)
                else:
                    cancelled.update(self._cancelled(lease))
            return HeartbeatResult(now, frozenset(held), cancelled=cancelled)

    async def finish_many(
        self, items: Sequence[tuple[Lease, Outcome, str | None]]
    ) -> list[bool]:
        """End the attempts the leases still hold, in order, under one hold of the lock.

        :meth:`~lease_core.abc.Backend.finish` is inherited: a batch of one.
        """
        statuses = [finish_status(outcome) for _, outcome, _ in items]
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return [self._finish(lease, status, error)
                    for (lease, _, error), status in zip(items, statuses, strict=True)]

    def _finish(self, lease: Lease, status: RunStatus, error: str | None) -> bool:
        now = self._now()
        run = self._held(lease, now)
        if run is None:
            return False
        run.status = status
        run.token = None
        run.expires_ms = None
        self._end_attempt(lease.job, lease.slot, run.attempt, now, Outcome(status.value), error)
        return True

    # -- retries within a run (issue 19, part 1)
    async def retry_later(
        self, items: Sequence[tuple[Lease, Outcome, str | None, Sequence[int]]]
    ) -> list[int]:
        """End the failed attempts; runs with retries left wait, ``retrying`` (one lock)."""
        statuses = [finish_status(outcome) for _, outcome, _, _ in items]
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return [_retrying(self._runs.get((lease.job, lease.slot)), self._now(), delays)
                    if self._finish(lease, status, error) else -1
                    for (lease, _, error, delays), status in zip(items, statuses, strict=True)]

    async def hand_over(self, leases: Sequence[Lease]) -> frozenset[str]:
        """Mark each held run ``handed_over`` so a backup claims it at once."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            done = set()
            for lease in leases:
                run = self._held(lease, now)
                if run is not None:
                    run.status = RunStatus.HANDED_OVER
                    run.token = None
                    run.expires_ms = now
                    self._end_attempt(lease.job, lease.slot, run.attempt, now,
                                      Outcome.HANDED_OVER, None)
                    done.add(lease.token)
            return frozenset(done)

    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        """Read the watched runs."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            found = {}
            for key in runs:
                run = self._runs.get(key)
                if run is not None:
                    found[key] = RunState(key[0], key[1], run.status, run.attempt,
                                          run.expires_ms, run.instance_id)
            return CheckResult(self._now(), found)

    async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return at most ``limit`` attempts, newest first."""
        check_limit(limit)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            if job is None:
                items = [a for h in self._attempts.values() for a in h]
            else:
                items = list(self._attempts.get(job, []))
        items.sort(key=lambda a: (a.claimed_at, a.slot, a.attempt), reverse=True)
        return items[:limit]

    async def jobs(self) -> list[str]:
        """Return every job the store has seen, sorted."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return sorted(self._jobs)

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:
        """Return runs, newest slot first (see :meth:`Backend.runs`)."""
        check_limit(limit)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            found = [
                RunInfo(j, slot, run.status, run.attempt, run.instance_id,
                        run.expires_ms if run.status is RunStatus.RUNNING else None)
                for (j, slot), run in self._runs.items()
                if (job is None or j == job) and not (open_only and run.status.finished)
            ]
        found.sort(key=lambda r: (-r.slot, r.job))
        return found[:limit]

    async def operate(self, op: Operation) -> OperationResult:
        """Make an operation (see :mod:`backends.memory_operations`)."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return memory_operations.operate(self, op, self._now(), _Run)

    async def get_checkpoint(self, job: str, slot: int) -> Any:
        """Return the run's checkpoint."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            run = self._runs.get((job, slot))
            return decode_checkpoint(run.checkpoint if run else None)

    async def set_checkpoint(self, lease: Lease, value: Any) -> bool:
        """Store the checkpoint, fenced by the lease's token."""
        text = encode_checkpoint(value)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            run = self._held(lease, self._now())
            if run is None:
                return False
            run.checkpoint = text
            return True

    async def delete_checkpoint(self, lease: Lease) -> bool:
        """Remove the checkpoint, fenced by the lease's token."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            run = self._held(lease, self._now())
            if run is None:
                return False
            run.checkpoint = None
            return True
