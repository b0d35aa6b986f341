"""The status page's overview: one row per job and workflow, filtered, searched and paged.

Read in a bounded number of store calls whatever the number of jobs: the jobs, workflows
and schedules the store records, every open run, and the newest attempts of all jobs in
one read each (a job whose last finished run is older than that window, its attempts there
all of runs in progress, is read on its own). A row shows the job's kind, schedule and
next slot (from the schedule the store recorded at the declaring instances' start), its
last finished run (outcome, when, how long), its runs in progress with their holder and
the lease left (or, waiting for a retry, when it is due), and ``paused``: who paused the
job (an operation), else ``None``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from ._status import iso, run_id, with_retry_due, workflow_status
from ._structures import Attempt, Outcome, RunInfo, RunStatus, ms_to_datetime
from .abc import Backend
from .errors import ConfigurationError
from .recovery import cancelled_unclaimed, step_job
from .schedules import schedule_from_spec

__all__ = ["FILTERS", "MAX_PER_PAGE", "read_overview"]

#: The row filters: every row, rows with runs in progress, and by the last finished run:
#: failed (failed, timed out or escalated), ok (completed, skipped or cancelled), never
#: (none yet). A row with a run in progress is also in the filter of its last finished
#: run; a run waiting for its retry is in progress, not finished.
FILTERS = ("all", "running", "failed", "ok", "never")
#: Most rows one page may ask for.
MAX_PER_PAGE = 200
#: Attempts of all jobs read at once to find each job's last finished one.
_WINDOW = 20_000
_FAILED = {Outcome.FAILED, Outcome.TIMED_OUT, Outcome.ESCALATED}
_OK = {Outcome.COMPLETED, Outcome.SKIPPED, Outcome.CANCELLED}
_ENDS = _FAILED | _OK


def check_query(status: str, page: int, per_page: int) -> None:
    """Refuse a filter, page or page size the overview does not have."""
    if status not in FILTERS:
        raise ConfigurationError(f"status={status!r} is not a filter; use one of "
                                 + ", ".join(FILTERS))
    if page < 1:
        raise ConfigurationError(f"page={page} must be at least 1")
    if not 1 <= per_page <= MAX_PER_PAGE:
        raise ConfigurationError(f"per_page={per_page} must be from 1 to {MAX_PER_PAGE}")


async def read_overview(backend: Backend, *, status: str = "all", query: str = "",
                        page: int = 1, per_page: int = 50) -> dict[str, Any]:
    """``GET /overview``: the rows of one page, the counts of every filter, the store's time.

    ``status`` is one of :data:`FILTERS`, ``query`` a case-insensitive part of the name,
    ``page`` counts from 1.
    """
    check_query(status, page, per_page)
    now = await backend.now_ms()
    workflows = await backend.workflows()
    schedules = await backend.schedules()
    steps = {step_job(w, s) for w, names in workflows.items() for s in names}
    jobs = [name for name in await backend.jobs() if name not in steps]
    open_runs: defaultdict[str, list[RunInfo]] = defaultdict(list)
    for run in await with_retry_due(backend,
                                    await backend.runs(None, open_only=True, limit=100_000)):
        open_runs[run.job].append(run)
    # The slots in progress of each job, and of each step its workflow's: an attempt at
    # one of them ended no run (a failed attempt waiting for its retry, a retried run).
    busy = {name: {r.slot for r in open_runs[name]} for name in jobs}
    for name, names in workflows.items():
        slots = {r.slot for s in names for r in open_runs[step_job(name, s)]}
        busy.update((step_job(name, s), slots) for s in names)
    finished, starts = await _finished_attempts(backend, busy)
    paused = await backend.paused()  # operations: who paused which job

    rows = [dict(_job_row(name, schedules.get(name), open_runs[name], finished[name], now,
                          starts), paused=paused.get(name)) for name in jobs]
    rows += [dict(_workflow_row(name, names, schedules, open_runs, finished, now, starts),
                  paused=paused.get(step_job(name, names[0])) if names else None)
             for name, names in workflows.items()]  # a workflow is paused at its first step
    rows.sort(key=lambda row: (row["name"], row["kind"]))
    needle = query.strip().lower()
    searched = [row for row in rows if needle in row["name"].lower()]
    counts = {f: sum(1 for row in searched if f == "all" or row["state"] == f
                     or (f == "running" and row["running"])) for f in FILTERS}
    chosen = [row for row in searched if status == "all" or row["state"] == status
              or (status == "running" and row["running"])]
    pages = max(1, -(-len(chosen) // per_page))
    start = (page - 1) * per_page
    return {"now": iso(ms_to_datetime(now)), "now_ms": now, "status": status,
            "query": query, "page": page, "per_page": per_page, "pages": pages,
            "total": len(chosen), "counts": counts,
            "rows": chosen[start:start + per_page]}


async def _finished_attempts(backend: Backend, busy: dict[str, set[int]],
                             ) -> tuple[defaultdict[str, list[Attempt]],
                                        dict[tuple[str, int], datetime]]:
    """Each job's finished attempts among the newest of the store, newest first, and when
    each run read started (its first attempt's claim). ``busy``: every job (and step),
    with the slots it (its workflow) has in progress."""
    recent = await backend.history(None, _WINDOW)
    by_job: defaultdict[str, list[Attempt]] = defaultdict(list)
    for attempt in recent:  # only the outcomes that end a run (not lost, handed over)
        if attempt.outcome in _ENDS:
            by_job[attempt.job].append(attempt)
    starts = _starts(recent)
    if len(recent) >= _WINDOW:  # the window may have missed a job that runs rarely
        for name, open_slots in busy.items():
            # Read alone too when the window holds only attempts of runs in progress (a
            # rare job retrying now): its last finished run is older, not missing.
            if all(a.slot in open_slots for a in by_job.get(name, ())):
                alone = await backend.history(name, 20)
                by_job[name] = [a for a in alone if a.outcome in _ENDS]
                starts.update(_starts(alone))
    return by_job, starts


def _starts(attempts: Iterable[Attempt]) -> dict[tuple[str, int], datetime]:
    """When each run of ``attempts`` started: its first claim (a taken-over or retried run
    took from there to its end, not only its last attempt's time); the record of a cancel
    of a run nobody held is no start."""
    starts: dict[tuple[str, int], datetime] = {}
    for a in attempts:
        key = (a.job, a.slot)
        if not cancelled_unclaimed(a) and (key not in starts or a.claimed_at < starts[key]):
            starts[key] = a.claimed_at
    return starts


def _next(spec: str | None, now: int) -> tuple[str | None, int | None]:
    """The schedule's description and its next slot after ``now``, when recorded; no next
    slot when it has no date (beyond the year 9999: a spec an older version recorded), so
    that one job's schedule never fails the overview of all."""
    if spec is None:
        return None, None
    try:
        schedule = schedule_from_spec(json.loads(spec))
    except (ConfigurationError, ValueError):
        return None, None
    try:
        slot = schedule.next_after(now)
        ms_to_datetime(slot)
    except (ValueError, OverflowError, OSError):
        return schedule.describe(), None
    return schedule.describe(), slot


def _running(name: str, runs: Sequence[RunInfo], now: int) -> list[dict[str, Any]]:
    """The runs in progress: ``status`` is ``running``, ``handed_over`` or ``retrying``
    (its attempt failed, and the retry waits, unleased); only a running run has
    ``lease_left_ms``, only a retrying one ``retry_at`` (when its retry is due)."""
    return [{"id": run_id(name, r.slot), "slot": r.slot, "scheduled_at": iso(r.scheduled_at),
             "attempt": r.attempt, "instance_id": r.instance_id, "status": str(r.status),
             "handed_over": r.status is RunStatus.HANDED_OVER,
             "lease_left_ms": (r.expires_ms - now if r.expires_ms is not None
                               and r.status is RunStatus.RUNNING else None),
             "retry_at": iso(r.expires_at) if r.status is RunStatus.RETRYING else None}
            for r in sorted(runs, key=lambda r: r.slot)]


def _state(last_status: str | None) -> str:
    """The filter a row's last finished run puts it in: ``failed``, ``ok`` or ``never``."""
    if last_status is None:
        return "never"
    return "failed" if last_status == "failed" else "ok"


def _row(name: str, kind: str, spec: str | None, running: list[dict[str, Any]],
         last: dict[str, Any] | None, now: int) -> dict[str, Any]:
    schedule, next_slot = _next(spec, now)
    return {"name": name, "kind": kind, "schedule": schedule, "next_slot": next_slot,
            "next_at": None if next_slot is None else iso(ms_to_datetime(next_slot)),
            "last": last, "running": running,
            "state": _state(None if last is None else last["status"])}


def _job_row(name: str, spec: str | None, runs: Sequence[RunInfo],
             finished: Sequence[Attempt], now: int,
             starts: dict[tuple[str, int], datetime]) -> dict[str, Any]:
    last = None
    in_progress = {r.slot for r in runs}  # a failed attempt whose run waits for a retry
    ended = [a for a in finished if a.slot not in in_progress]
    if ended:
        a = ended[0]
        assert a.outcome is not None and a.finished_at is not None
        first = min(a.claimed_at, starts.get((name, a.slot), a.claimed_at))
        last = {"id": run_id(name, a.slot), "slot": a.slot, "scheduled_at": iso(a.scheduled_at),
                "status": "failed" if a.outcome in _FAILED else str(a.outcome),
                "outcome": str(a.outcome), "finished_at": iso(a.finished_at),
                "duration_ms": int((a.finished_at - first).total_seconds() * 1000)}
    return _row(name, "job", spec, _running(name, runs, now), last, now)


def _workflow_row(name: str, names: Sequence[str], schedules: dict[str, str],
                  open_runs: dict[str, list[RunInfo]], finished: dict[str, list[Attempt]],
                  now: int, starts: dict[tuple[str, int], datetime]) -> dict[str, Any]:
    jobs = [step_job(name, s) for s in names]
    running = [dict(r, step=s) for s, job in zip(names, jobs, strict=True)
               for r in _running(name, open_runs.get(job, []), now)]
    last = None
    in_progress = {r.slot for job in jobs for r in open_runs.get(job, [])}
    slots = sorted({a.slot for job in jobs for a in finished.get(job, [])} - in_progress,
                   reverse=True)
    for slot in slots:  # the newest run that ended: completed, failed, skipped, cancelled
        at_slot = {job: [a for a in finished.get(job, []) if a.slot == slot] for job in jobs}
        status = workflow_status([RunStatus(str(found[0].outcome)) if found else None
                                  for found in at_slot.values()])
        if status not in ("completed", "failed", "skipped", "cancelled"):
            continue
        mine = [a for found in at_slot.values() for a in found]
        first = min([a.claimed_at for a in mine]
                    + [starts[(job, slot)] for job in jobs if (job, slot) in starts])
        end = max(a.finished_at for a in mine if a.finished_at is not None)
        last = {"id": run_id(name, slot), "slot": slot,
                "scheduled_at": iso(ms_to_datetime(slot)), "status": status,
                "outcome": None, "finished_at": iso(end),
                "duration_ms": int((end - first).total_seconds() * 1000)}
        break
    spec = schedules.get(jobs[0]) if jobs else None
    return _row(name, "workflow", spec, running, last, now)
