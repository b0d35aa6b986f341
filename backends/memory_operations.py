"""Operations (trigger, pause, resume, retry, cancel) on the in-memory store.

The memory backend's half of :meth:`~lease_core.abc.Backend.operate`, kept apart from
:mod:`backends.memory` so that the claim path stays short; it runs under the backend's
lock, as one atomic step, like every call of that backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import anyio.lowlevel

from lease_core._operations_store import QUEUED_LIMIT
from lease_core._structures import (
    Attempt,
    ClaimRequest,
    Outcome,
    Reason,
    RunStatus,
    ms_to_datetime,
)
from lease_core.operations import RETRYABLE, Operation, OperationKind, OperationResult

if TYPE_CHECKING:
    from .memory import MemoryBackend, _Job, _Run

__all__ = ["PAUSABLE", "MemoryOperations", "operate", "paused_attempt"]

#: The reasons of claims a paused job refuses (a trigger's or retry's run exists already).
PAUSABLE = frozenset({Reason.SCHEDULED, Reason.CATCH_UP})


def paused_attempt(req: ClaimRequest, now: int, by: str) -> Attempt:
    """The attempt recording that a paused job's new slot was skipped."""
    at = ms_to_datetime(now)
    return Attempt(req.job, req.slot, 1, req.instance_id, req.reason, at, at, Outcome.SKIPPED,
                   f"job paused by {by}")


def operate(store: MemoryBackend, op: Operation, now: int,
            new_run: Callable[..., _Run]) -> OperationResult:
    """Make ``op`` on ``store`` (whose lock the caller holds), or refuse it.

    ``new_run`` is the store's run record type (which makes a triggered run's record).
    """
    job = store._jobs.get(op.job)
    if job is None:
        return OperationResult("unknown_job")
    if op.kind is OperationKind.PAUSE:
        if job.paused_by:  # another pause would hide who paused it (and its record)
            return OperationResult("conflict", paused_by=job.paused_by)
        job.paused_by = op.by
        return OperationResult()
    if op.kind is OperationKind.RESUME:
        if not job.paused_by:
            return OperationResult("conflict")
        # A resume leaves a record on the slots the pause skipped.
        mark = f"job paused by {job.paused_by}"
        history = store._attempts.get(op.job, [])
        for i, a in enumerate(history):
            if a.outcome is Outcome.SKIPPED and a.error == mark:
                history[i] = replace(a, error=f"{mark}; resumed by {op.by}")
        job.paused_by = None
        # The slots due while paused are never caught up, even those no instance was
        # up to skip: a starting scheduler catches up from the job's last slot.
        job.last_slot = now if job.last_slot is None else max(job.last_slot, now)
        return OperationResult()
    if op.kind is OperationKind.TRIGGER:
        slot = now + (now % 1000 == 0)  # off the whole second, where schedules put slots
        while (op.job, slot) in store._runs:
            slot += 1
        store._runs[(op.job, slot)] = new_run(RunStatus.HANDED_OVER, 0, None, op.by, now,
                                              queued=Reason.MANUAL, queued_by=op.by)
        # The job's last slot stays: it is where a starting scheduler catches up from,
        # and a triggered run is no slot of the schedule (its claim raises it).
        return OperationResult(slot=slot)
    assert op.slot is not None
    run = store._runs.get((op.job, op.slot))
    if run is None:
        return OperationResult("no_run", op.slot)
    if op.kind is OperationKind.RETRY:
        if run.status not in RETRYABLE:
            return OperationResult("conflict", op.slot, run.status)
        before = run.status
        run.status, run.token, run.expires_ms = RunStatus.HANDED_OVER, None, now
        run.queued, run.queued_by = Reason.RETRY, op.by
        # The retried run starts anew: max_attempts counts its takeovers from now, and
        # its job's retry= grants its retries again.
        run.takeovers = run.retries = 0
        return OperationResult(slot=op.slot, status=before)
    if run.status.finished:
        return OperationResult("conflict", op.slot, run.status)
    before = run.status
    history = store._attempts.get(op.job, [])
    for i, a in enumerate(history):
        if a.slot == op.slot and a.attempt == run.attempt and a.outcome is None:
            history[i] = replace(a, outcome=Outcome.CANCELLED, error=f"cancelled by {op.by}",
                                 finished_at=ms_to_datetime(now))
    if before in (RunStatus.HANDED_OVER, RunStatus.RETRYING):
        # Nobody holds the run: the cancel is recorded as the attempt it prevents (who
        # cancelled it, and the reason and requester its claim would have had).
        queued = run.queued or Reason.HAND_OVER
        reason = Reason.RETRY if before is RunStatus.RETRYING else queued
        run.attempt, run.instance_id = run.attempt + 1, op.by
        at = ms_to_datetime(now)
        store._attempts.setdefault(op.job, []).append(Attempt(
            op.job, op.slot, run.attempt, op.by, reason, at, at, Outcome.CANCELLED,
            f"cancelled by {op.by}", run.queued_by if run.queued else None))
    # cancel(grace=): the holder's token stays, with the grace, so the holder's next
    # heartbeat answers "cancelled" with it; the run's expiry is the grace's end (as the
    # other stores keep it: a claim and a check of the run report it).
    grace = max(op.grace_ms, 0)
    run.status, run.expires_ms, run.grace_ms = RunStatus.CANCELLED, now + grace, grace
    run.queued = run.queued_by = None
    return OperationResult(slot=op.slot, status=before)


class MemoryOperations:
    """The reads of :class:`~backends.memory.MemoryBackend` about operations and heartbeats."""

    _lock: threading.Lock
    _jobs: dict[str, _Job]
    _runs: dict[tuple[str, int], _Run]

    async def paused(self) -> dict[str, str]:
        """Return the paused jobs, each with who paused it."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return {name: j.paused_by for name, j in sorted(self._jobs.items())
                    if j.paused_by}

    async def queued(self, jobs: Sequence[str]) -> list[tuple[str, int]]:
        """Return the triggered and retried runs of ``jobs`` not claimed yet."""
        wanted = set(jobs)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return sorted(key for key, run in self._runs.items()
                          if key[0] in wanted and run.queued is not None
                          and run.status is RunStatus.HANDED_OVER)[:QUEUED_LIMIT]

    async def heartbeats(self, runs: Sequence[tuple[str, int]],
                         ) -> dict[tuple[str, int], int | None]:
        """Return when each run's lease was last renewed (``None``: not since its claim)."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            return {key: self._runs[key].heartbeat_ms for key in runs if key in self._runs}
