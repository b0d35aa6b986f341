"""What ``anarchon status`` and the status API show: jobs, workflows, runs, recovery logs.

Read only, through the backend's public reads (:meth:`~lease_core.abc.Backend.jobs`,
:meth:`~lease_core.abc.Backend.runs`, :meth:`~lease_core.abc.Backend.check`,
:meth:`~lease_core.abc.Backend.history`, :meth:`~lease_core.abc.Backend.workflows`), so it
works on every backend.

A workflow run is (workflow, slot); each of its steps is a run of job ``<workflow>/<step>``
at the same slot, and the steps and their order are those the store recorded
(:meth:`~lease_core.abc.Backend.register_workflows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from ._checks import check_lookup_name
from ._redact import redact
from ._structures import LAST_SLOT, Attempt, RunInfo, RunState, RunStatus, ms_to_datetime
from .abc import Backend
from .errors import ConfigurationError
from .recovery import (
    attempts_by_slot,
    cancelled_unclaimed,
    other_steps,
    recovery_log,
    run_steps,
    step_job,
)

__all__ = [
    "JobStatus",
    "StoreStatus",
    "iso",
    "list_jobs",
    "parse_run_id",
    "read_recovery_log",
    "read_run",
    "read_runs",
    "read_status",
    "render_status",
    "run_id",
    "run_status",
    "with_retry_due",
    "workflow_status",
]

#: How many recent runs of one job are read to find its last finished one.
_RECENT = 20
#: The open runs one listing reads at most (of every job; of one job when that was full).
_OPEN = 10_000
#: The runs one ``check`` reads at most when finding when retries are due.
_CHECK_BATCH = 500


async def with_retry_due(backend: Backend, runs: Sequence[RunInfo]) -> list[RunInfo]:
    """``runs`` (from :meth:`~lease_core.abc.Backend.runs`), each ``retrying`` one with
    ``expires_ms`` set to when its retry is due.

    ``runs`` reports a lease's expiry only while ``running``; the store keeps a retrying
    run's due time as its expiry, which :meth:`~lease_core.abc.Backend.check` reads (in
    batches, only when some run is retrying). A run that changed in between (its retry
    claimed, cancelled) keeps ``expires_ms`` ``None``: no due time is shown for it.
    """
    waiting = [(r.job, r.slot) for r in runs if r.status is RunStatus.RETRYING]
    if not waiting:
        return list(runs)
    states: dict[tuple[str, int], RunState] = {}
    for start in range(0, len(waiting), _CHECK_BATCH):
        states.update((await backend.check(waiting[start:start + _CHECK_BATCH])).runs)
    found = []
    for run in runs:
        state = states.get((run.job, run.slot))
        if (run.status is RunStatus.RETRYING and state is not None
                and state.status is RunStatus.RETRYING and state.attempt == run.attempt):
            run = replace(run, expires_ms=state.expires_ms)
        found.append(run)
    return found


def iso(moment: datetime | None) -> str | None:
    """ISO-8601 with milliseconds (``2026-11-30T02:00:00.000+00:00``), or ``None``."""
    if moment is None:
        return None
    return moment.isoformat(timespec="milliseconds")


def one_line(text: str) -> str:
    """``text`` as one line of a terminal's table: a character that is not printable (a
    traceback's line break, a tab, an escape sequence's ESC) written as its escape,
    ``\\n``, ``\\x1b``, so a row stays one line and nothing in it acts on the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


@dataclass(frozen=True)
class JobStatus:
    """One job: its runs in progress and its last finished run."""

    name: str
    open: list[RunInfo]
    last: RunInfo | None
    paused: str | None = None
    """Who paused the job (its slots are skipped until resumed), else ``None``."""


@dataclass(frozen=True)
class StoreStatus:
    """The store's clock and every job it knows."""

    now_ms: int
    jobs: list[JobStatus]

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (times as ISO-8601 UTC, slots also in epoch milliseconds)."""
        return {
            "now": iso(ms_to_datetime(self.now_ms)),
            "jobs": [
                {
                    "name": job.name,
                    "running": [_run_json(r) for r in job.open],
                    "last": None if job.last is None else _run_json(job.last),
                    "paused": job.paused,
                }
                for job in self.jobs
            ],
        }


def _run_json(run: RunInfo) -> dict[str, Any]:
    return {
        "slot": run.slot,
        "scheduled_at": iso(run.scheduled_at),
        "status": str(run.status),
        "attempt": run.attempt,
        "instance_id": run.instance_id,
        **_expiry_fields(run),
    }


def _expiry_fields(run: RunInfo | None) -> dict[str, str | None]:
    """``lease_expires_at`` and ``retry_at``: what a run's stored expiry means.

    Only a running run holds a lease (its expiry, past when the holder stopped renewing
    it); a retrying run's expiry is when its retry is due (``retry_at``); a handed-over
    run's is past, and a cancelled run keeps the end of its holder's grace there
    (:meth:`~lease_core.operations.Admin.cancel`): no lease, no retry.
    """
    status = None if run is None else run.status
    expiry = None if run is None else iso(run.expires_at)
    return {"lease_expires_at": expiry if status is RunStatus.RUNNING else None,
            "retry_at": expiry if status is RunStatus.RETRYING else None}


async def read_status(backend: Backend, job: str | Sequence[str] | None = None,
                      ) -> StoreStatus:
    """Read the status of every job (or of ``job``, or of the jobs ``job`` lists) from a
    started backend."""
    now = await backend.now_ms()
    names = (await backend.jobs() if job is None
             else [job] if isinstance(job, str) else list(job))
    one = names[0] if len(names) == 1 else None
    open_runs = await with_retry_due(
        backend, await backend.runs(one, open_only=True, limit=_OPEN))
    # A full listing may leave some jobs' open runs out: each job's are read then.
    full = len(open_runs) >= _OPEN and one is None
    paused = await backend.paused()
    jobs = []
    for name in names:
        recent = await backend.runs(name, limit=_RECENT)
        last = next((r for r in recent if r.status.finished), None)
        mine = (await with_retry_due(backend, await backend.runs(
                    name, open_only=True, limit=_OPEN)) if full
                else [r for r in open_runs if r.job == name])
        jobs.append(JobStatus(name, mine, last, paused.get(name)))
    return StoreStatus(now, jobs)


def render_status(status: StoreStatus) -> str:
    """The status as a table for a terminal."""
    now = iso(ms_to_datetime(status.now_ms))
    if not status.jobs:
        return f"store time {now}: no jobs recorded yet\n"
    lines = [f"store time {now}", ""]
    header = ("JOB", "LAST OUTCOME", "LAST SLOT (UTC)", "IN PROGRESS")
    rows = []
    for job in status.jobs:
        last = job.last
        progress = "; ".join(([f"paused by {job.paused}"] if job.paused is not None else [])
                             + [_describe_open(r, status.now_ms) for r in job.open]) or "-"
        rows.append((one_line(job.name), str(last.status) if last else "-",
                     iso(last.scheduled_at) or "-" if last else "-", one_line(progress)))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(3)]
    for row in (header, *rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
                     + "  " + row[3])
    return "\n".join(lines).rstrip() + "\n"


def _describe_open(run: RunInfo, now_ms: int) -> str:
    slot = iso(run.scheduled_at)
    if run.status is RunStatus.HANDED_OVER:
        # No holder: a run handed over at a stop, or queued by an operation (a trigger's
        # new run has no attempt yet, and names who asked; a retry's names its last holder).
        if run.attempt == 0:
            return f"slot {slot} queued by {run.instance_id}, not claimed yet (handed_over)"
        return (f"slot {slot} attempt {run.attempt} by {run.instance_id} ended; the next "
                "not claimed yet (handed_over: handed over at a stop, or retried)")
    if run.expires_ms is None:
        return f"slot {slot} attempt {run.attempt} {run.status} (by {run.instance_id})"
    left = (run.expires_ms - now_ms) / 1000
    if run.status is RunStatus.RETRYING:  # no holder: the expiry is when the retry is due
        due = f"due in {left:.1f}s" if left > 0 else f"due {-left:.1f}s ago, not claimed yet"
        return (f"slot {slot} attempt {run.attempt} by {run.instance_id} failed; retry at "
                f"{iso(run.expires_at)} ({due}, retrying)")
    state = f"lease {left:.1f}s left" if left > 0 else f"lease expired {-left:.1f}s ago"
    return (f"slot {slot} attempt {run.attempt} held by {run.instance_id}, "
            f"{state} (until {iso(run.expires_at)})")


# The status API's reads (lease_core.http): one JSON shape for a run, in lists and alone.

#: How many attempts of one job are read first to find those of its runs (the store keeps
#: ``history_size`` attempts per job, 100 by default); more when a run's are older.
_HISTORY = 1_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def run_id(name: str, slot: int) -> str:
    """The id of a run in the status API: ``<name>@<slot in epoch milliseconds>``."""
    return f"{name}@{slot}"


def parse_run_id(text: str) -> tuple[str, int]:
    """Split ``<name>@<slot>`` into the name and the slot in epoch milliseconds.

    The slot is epoch milliseconds (``1764460800000``) or an ISO-8601 time
    (``2025-11-30T00:00:00Z``; without an offset it is read as UTC). Raises
    :class:`~lease_core.errors.ConfigurationError` when ``text`` is not such an id.
    """
    name, at, slot = text.rpartition("@")
    if not at or not name or not slot:
        raise ConfigurationError(
            f"run id {text!r} is malformed: expected <name>@<slot>, the slot in epoch "
            "milliseconds or ISO-8601 UTC (export@1764460800000, export@2025-11-30T00:00:00Z)")
    check_lookup_name(name)
    # Leading zeros dropped and the length bounded first: int() refuses more than 4300
    # digits with a ValueError, not a ConfigurationError (the API answered 500).
    digits = slot.lstrip("0") or "0"
    if slot.isascii() and slot.isdigit() and len(digits) <= len(str(LAST_SLOT)) \
            and int(digits) <= LAST_SLOT:
        return name, int(digits)
    try:
        moment = datetime.fromisoformat(slot)
    except ValueError:
        raise ConfigurationError(
            f"run id {text!r} has a malformed slot {slot!r}: give epoch milliseconds (up to "
            f"{LAST_SLOT}) or an ISO-8601 time such as 2025-11-30T00:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    ms = (moment - _EPOCH) // _MS
    if not 0 <= ms <= LAST_SLOT:
        raise ConfigurationError(
            f"run id {text!r} has a slot out of range: from 1970-01-01T00:00:00Z to "
            f"9999-12-31T23:59:59.999Z (epoch milliseconds 0 to {LAST_SLOT})")
    return name, ms


def run_status(status: RunStatus | None) -> str:
    """A run's (or a step's) status in the API: ``None`` (no run yet) is ``pending``.

    ``running``, ``handed_over`` and ``retrying`` are ``running``; ``timed_out`` is
    ``failed``; the others keep their name (``completed``, ``failed``, ``skipped``,
    ``escalated``, ``cancelled``).
    """
    if status is None:
        return "pending"
    if not status.finished:
        return "running"
    if status is RunStatus.TIMED_OUT:
        return "failed"
    return str(status)


def workflow_status(steps: Sequence[RunStatus | None]) -> str:
    """A workflow run's status from its steps' run statuses, in step order.

    ``failed`` when a step failed, timed out or escalated; ``completed`` when every step
    completed; ``pending`` when no step has a run; ``cancelled`` when a step was
    cancelled and none is running (the later steps never run); ``skipped`` when a step
    was skipped and none is running; ``running`` otherwise.
    """
    failed = (RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.ESCALATED)
    if any(s in failed for s in steps):
        return "failed"
    if any(s is RunStatus.CANCELLED for s in steps) and all(
            s is None or s.finished for s in steps):
        return "cancelled"
    if steps and all(s is RunStatus.COMPLETED for s in steps):
        return "completed"
    if all(s is None for s in steps):
        return "pending"
    if any(s is RunStatus.SKIPPED for s in steps) and all(
            s is None or s.finished for s in steps):
        return "skipped"
    return "running"


async def list_jobs(backend: Backend, limit: int = 5) -> dict[str, Any]:
    """``GET /jobs``: every job and workflow the store knows with its ``limit`` latest runs.

    The steps of a registered workflow are shown in their workflow's runs, not as jobs.
    """
    now = await backend.now_ms()
    workflows = await backend.workflows()
    steps_jobs = {step_job(w, s) for w, steps in workflows.items() for s in steps}
    jobs = await backend.jobs()
    entries = [await _job_entry(backend, name, limit) for name in jobs
               if name not in steps_jobs]
    entries += [await _workflow_entry(backend, name, steps, limit, jobs=jobs)
                for name, steps in workflows.items()]
    entries.sort(key=lambda e: (e["name"], e["kind"]))
    return {"now": iso(ms_to_datetime(now)), "jobs": entries}


async def read_runs(backend: Backend, name: str, limit: int = 20) -> dict[str, Any] | None:
    """``GET /runs/{name}``: one job's or workflow's ``limit`` latest runs, or ``None``.

    ``None`` when the store knows no job or workflow ``name``.
    """
    now = await backend.now_ms()
    workflows = await backend.workflows()
    if name in workflows:
        entry = await _workflow_entry(backend, name, workflows[name], limit)
    elif name in await backend.jobs():
        entry = await _job_entry(backend, name, limit)
    else:
        return None
    return {"now": iso(ms_to_datetime(now)), **entry}


async def _job_entry(backend: Backend, name: str, limit: int) -> dict[str, Any]:
    runs = await with_retry_due(backend, await backend.runs(name, limit=limit))
    attempts = await _attempts(backend, name, _claimed(runs)) if runs else {}
    return {"name": name, "kind": "job", "runs": [
        _job_run_json(name, r, attempts.get(r.slot, [])) for r in runs]}


async def _workflow_entry(backend: Backend, name: str, steps: Sequence[str],
                          limit: int, *, jobs: Sequence[str] | None = None,
                          ) -> dict[str, Any]:
    # A step a deploy removed or renamed shows in the runs it ran for (run_steps); the
    # store's jobs read once for every workflow of GET /jobs (``jobs``).
    others = await other_steps(backend, name, steps, jobs=jobs)
    by_step = {s: {r.slot: r for r in await with_retry_due(
                   backend, await backend.runs(step_job(name, s), limit=limit))}
               for s in [*steps, *others]}
    slots = sorted({slot for runs in by_step.values() for slot in runs}, reverse=True)
    attempts_by_step = {s: await _attempts(backend, step_job(name, s),
                                           _claimed(by_step[s].values()))
                        if by_step[s] else {} for s in by_step}
    runs = []
    for slot in slots[:limit]:
        here = [*steps, *(s for s in others if slot in by_step[s])]
        at_slot = {s: by_step[s].get(slot) for s in here}
        runs.append(_workflow_run_json(
            name, here, slot, at_slot, {s: attempts_by_step[s].get(slot, []) for s in here},
            ended=await _ended_before_added_steps(backend, name, here, slot, at_slot)))
    return {"name": name, "kind": "workflow", "steps": list(steps), "runs": runs}


async def _ended_before_added_steps(backend: Backend, name: str, steps: Sequence[str],
                                    slot: int, runs: dict[str, RunInfo | None]) -> bool:
    """True when the workflow run at ``slot`` ended with a step that was its workflow's
    last when it completed (its result carries ``"last": true``), and steps were added to
    the workflow since, after it or before it (inserted): they never run for this run (see
    "Adding a step" in :mod:`lease_core.workflows`), so the run is completed, not running.
    Read only for a run whose steps with a run are all completed, some steps having none."""
    ran = [s for s in steps if runs[s] is not None]
    if not ran or len(ran) == len(steps):
        return False
    if any(r is None or r.status is not RunStatus.COMPLETED for r in map(runs.get, ran)):
        return False
    payload = await backend.get_checkpoint(step_job(name, ran[-1]), slot)
    return isinstance(payload, dict) and payload.get("last") is True


async def read_run(backend: Backend, name: str, slot: int) -> dict[str, Any] | None:
    """``GET /jobs/{id}``: the run of job or workflow ``name`` at ``slot``, or ``None``."""
    found = await _read(backend, name, slot)
    return None if found is None else found[0]


async def read_recovery_log(backend: Backend, name: str, slot: int,
                            ) -> list[dict[str, Any]] | None:
    """``GET /jobs/{id}/recovery-log``: the run's recovery log oldest first, or ``None``."""
    found = await _read(backend, name, slot)
    if found is None:
        return None
    run, attempts = found
    if run["kind"] != "workflow":
        entries = recovery_log(attempts)
    else:
        entries = recovery_log(attempts, workflow=name,
                               steps=[step["name"] for step in run["steps"]])
    # A detail is an attempt's error (a failure's, a retry's cause): masked as the
    # attempts' errors are, for rows an older release stored unmasked.
    return [{**e.as_json(), "detail": None if e.detail is None else redact(e.detail)}
            for e in entries]


async def _read(backend: Backend, name: str, slot: int,
                ) -> tuple[dict[str, Any], list[Attempt]] | None:
    """The run's JSON and its attempts (every step's, for a workflow), or ``None``."""
    workflows = await backend.workflows()
    if name in workflows:
        steps = await run_steps(backend, name, workflows[name], slot)
        jobs = [step_job(name, s) for s in steps]
        found = (await backend.check([(job, slot) for job in jobs])).runs
        states = {s: _info(found.get((job, slot))) for s, job in zip(steps, jobs, strict=True)}
        if all(state is None for state in states.values()):
            return None
        attempts = {s: (await _attempts(backend, job, _claimed([states[s]]))).get(slot, [])
                    for s, job in zip(steps, jobs, strict=True)}
        run = _workflow_run_json(
            name, steps, slot, states, attempts,
            ended=await _ended_before_added_steps(backend, name, steps, slot, states))
        for step, job in zip(run["steps"], jobs, strict=True):
            await _heartbeat(backend, step, job, slot, attempts[step["name"]])
        return run, [a for s in steps for a in attempts[s]]
    state = _info((await backend.check([(name, slot)])).runs.get((name, slot)))
    if state is None:
        return None
    job_attempts = (await _attempts(backend, name, _claimed([state]))).get(slot, [])
    run = _job_run_json(name, state, job_attempts)
    await _heartbeat(backend, run, name, slot, job_attempts)
    return run, job_attempts


async def _heartbeat(backend: Backend, fields: dict[str, Any], job: str, slot: int,
                     attempts: list[Attempt]) -> None:
    """Fill ``heartbeat_at`` of a running run or step: its lease's last renewal, or its
    claim when not renewed since (left ``None`` where the store keeps no such record)."""
    if fields.get("store_status") != "running":
        return
    beats = await backend.heartbeats([(job, slot)])
    if (job, slot) not in beats:
        return
    current = [a for a in attempts if a.attempt == fields.get("attempt")]
    claimed = int(current[-1].claimed_at.timestamp() * 1000) if current else None
    beat = beats[(job, slot)]
    latest = max((t for t in (beat, claimed) if t is not None), default=None)
    fields["heartbeat_at"] = None if latest is None else iso(ms_to_datetime(latest))


def _info(state: RunState | None) -> RunInfo | None:
    """A :class:`RunState` read by ``check`` as a :class:`RunInfo`."""
    if state is None:
        return None
    return RunInfo(state.job, state.slot, state.status, state.attempt, state.instance_id,
                   state.expires_ms)


def _claimed(runs: Iterable[RunInfo | None]) -> set[int]:
    """The slots of ``runs`` claimed at least once (a triggered run not yet claimed has
    no attempt)."""
    return {r.slot for r in runs if r is not None and r.attempt}


async def _attempts(backend: Backend, job: str, slots: set[int],
                    ) -> dict[int, list[Attempt]]:
    """The job's recorded attempts by slot, oldest first, every one of ``slots`` complete
    (:func:`~lease_core.recovery.attempts_by_slot`, the newest ``_HISTORY`` first)."""
    return await attempts_by_slot(backend, job, slots, _HISTORY)


def _run_fields(run: RunInfo | None, attempts: list[Attempt]) -> dict[str, Any]:
    """What a job's run and a workflow's step show alike.

    ``heartbeat_at`` is ``None`` here; the view of one run fills it (:func:`_heartbeat`).
    """
    open_run = run is not None and not run.status.finished
    return {
        "status": run_status(None if run is None else run.status),
        "store_status": None if run is None else str(run.status),
        "attempt": None if run is None else run.attempt,
        "instance_id": None if run is None else run.instance_id,
        "started_at": next((iso(a.claimed_at) for a in attempts
                            if not cancelled_unclaimed(a)), None),
        "finished_at": None if open_run or not attempts else iso(attempts[-1].finished_at),
        "heartbeat_at": None,
        **_expiry_fields(run),
    }


def _attempt_json(a: Attempt, step: str | None) -> dict[str, Any]:
    return {
        "step": step,
        "attempt": a.attempt,
        "instance_id": a.instance_id,
        "reason": str(a.reason),
        "claimed_at": iso(a.claimed_at),
        "finished_at": iso(a.finished_at),
        "outcome": None if a.outcome is None else str(a.outcome),
        "error": None if a.error is None else redact(a.error),
        "requested_by": a.requested_by,
    }


def _job_run_json(name: str, run: RunInfo, attempts: list[Attempt]) -> dict[str, Any]:
    fields = _run_fields(run, attempts)
    return {
        "id": run_id(name, run.slot),
        "name": name,
        "kind": "job",
        "slot": run.slot,
        "scheduled_at": iso(run.scheduled_at),
        "status": fields.pop("status"),
        **fields,
        "attempts": [_attempt_json(a, None) for a in attempts],
    }


def _workflow_run_json(name: str, steps: Sequence[str], slot: int,
                       runs: dict[str, RunInfo | None], attempts: dict[str, list[Attempt]],
                       *, ended: bool = False) -> dict[str, Any]:
    """One workflow run; ``ended``: it completed with a step that was its workflow's last
    then (:func:`_ended_before_added_steps`)."""
    ordered = sorted(((a, s) for s in steps for a in attempts[s]),
                     key=lambda pair: (pair[0].claimed_at, pair[0].attempt))
    return {
        "id": run_id(name, slot),
        "name": name,
        "kind": "workflow",
        "slot": slot,
        "scheduled_at": iso(ms_to_datetime(slot)),
        "status": "completed" if ended else workflow_status(
            [None if (r := runs[s]) is None else r.status for s in steps]),
        "attempts": [_attempt_json(a, s) for a, s in ordered],
        "steps": [{"name": s, "job": step_job(name, s), **_run_fields(runs[s], attempts[s])}
                  for s in steps],
    }
