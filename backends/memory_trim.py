"""History trimming on the in-memory store (:meth:`~lease_core.abc.Backend.prune`).

The memory backend's half of ``prune_many``, kept apart from :mod:`backends.memory`; it
runs under the backend's lock, on its clock. A workflow run's steps are trimmed together:
none while the run goes on (see :func:`held_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from lease_core._structures import Attempt, RunStatus, ms_to_datetime

if TYPE_CHECKING:
    from .memory import _Job, _Run

__all__ = ["held_slots", "trim_job"]


def held_slots(attempts: dict[str, list[Attempt]], runs: dict[tuple[str, int], _Run],
               steps: Sequence[str], slots: set[int], cutoff_ms: int | None) -> set[int]:
    """The ``slots`` whose workflow run, of ``steps`` (every step's job; none: no
    workflow), goes on: one of its steps' runs is open (running, handed over, waiting for
    a retry), or, with ``cutoff_ms``, one of their attempts is open or ended at or after
    it (the run ended less than the ttl ago). Its steps' attempts are then all kept."""
    if not steps or not slots:
        return set()
    held = {slot for slot in slots for step in steps
            if (run := runs.get((step, slot))) is not None and not run.status.finished}
    if cutoff_ms is not None:
        cutoff = ms_to_datetime(cutoff_ms)
        held |= {a.slot for step in steps for a in attempts.get(step, ())
                 if a.slot in slots and (a.finished_at is None or a.finished_at >= cutoff)}
    return held


def _instant(ms: int) -> datetime | None:
    """``ms`` as a datetime, or None before any datetime can be (a ttl longer than the
    clock's count: nothing finished that long ago)."""
    try:
        return ms_to_datetime(ms)
    except (ValueError, OverflowError, OSError):
        return None


def trim_job(attempts: dict[str, list[Attempt]], runs: dict[tuple[str, int], _Run],
             jobs: dict[str, _Job], job: str, size: int | None, ttl_ms: int | None,
             now: int, batch: int, steps: Sequence[str] = (),
             maybe_running: dict[str, set[int]] | None = None) -> int:
    """Trim ``job``'s history (:meth:`Backend.prune`); return the attempts deleted.

    ``steps`` are the jobs of every step of ``job``'s workflow when it is a step of one
    (:func:`lease_core.recovery.sibling_steps`): the attempts of a workflow run that goes
    on are kept (:func:`held_slots`). ``maybe_running`` is the store's index of the slots
    whose runs may be running, by job: a deleted run's slot leaves it (only an overlap
    check pruned it, so a job whose overlap is allowed kept every slot it ever ran)."""
    history = attempts.get(job, [])
    doomed: set[int] = set()

    def trimmable(a: Attempt) -> bool:
        # Never an open attempt, nor any attempt of an open run (running, handed over,
        # waiting for a retry: its recovery log, the failure a retry follows, stays until
        # the run ends), nor that of a run cancelled with a grace still running
        # (Admin.cancel(grace=)): its holder's heartbeat must still find the run
        # cancelled, and the run goes once the grace has passed.
        if a.finished_at is None:
            return False
        run = runs.get((job, a.slot))
        if run is not None and not run.status.finished:
            return False
        return (run is None or run.status is not RunStatus.CANCELLED or run.token is None
                or run.attempt != a.attempt
                or a.finished_at <= ms_to_datetime(now - run.grace_ms))

    if size is not None and len(history) > size:
        beyond = [i for i in range(len(history) - size) if trimmable(history[i])]
        held = held_slots(attempts, runs, steps, {history[i].slot for i in beyond}, None)
        doomed.update([i for i in beyond if history[i].slot not in held][:batch])
    cutoff = None if ttl_ms is None else _instant(now - ttl_ms)
    if ttl_ms is not None and cutoff is not None:
        old = [i for i, a in enumerate(history)
               if a.finished_at is not None and a.finished_at < cutoff and trimmable(a)]
        held = held_slots(attempts, runs, steps, {history[i].slot for i in old}, now - ttl_ms)
        doomed.update([i for i in old if history[i].slot not in held][:batch])
    if doomed:
        keep = [a for i, a in enumerate(history) if i not in doomed]
        attempts[job] = keep
        # The finished runs of the deleted attempts' slots left with no attempt go (as on
        # PostgreSQL and Redis): only those runs are looked at, not every run of the
        # store, so a trimming costs the job's history, not jobs times runs.
        slots = {history[i].slot for i in doomed}.difference(a.slot for a in keep)
        record = jobs.get(job)
        for slot in slots:
            run = runs.get((job, slot))
            if run is None or not run.status.finished:
                continue
            del runs[(job, slot)]
            if maybe_running is not None:
                maybe_running.get(job, set()).discard(slot)
            if record is not None:  # the newest slot trimmed (ClaimRequest.scheduled)
                record.trimmed_slot = max(slot, record.trimmed_slot or slot)
    return len(doomed)
