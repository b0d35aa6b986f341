"""Dispatch: when each scheduled job is due, and the claims of its slots (catch-up too).

One task wakes every scheduled job due at an instant (a heap of next slots) and claims
their runs in one go. A job's next slot is queued once its claim is settled, so a job
never has two scheduled claims in flight. Missed slots, at start or after the process was
suspended, are caught up by the job's ``catch_up`` policy, in a task of their own.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .._durations import to_ms
from .._structures import ClaimStatus, JobInfo, Reason, format_slot
from .._wakeups import Alarm, WorkerPool, late_by, slot_wait
from . import base
from .runs import Phase

if TYPE_CHECKING:
    from .jobs import Job
    from .runs import Run
    from .session import Session

__all__ = ["WINDOW_LIMIT", "Dispatcher", "wake_slot"]

#: The most slots one wake-up's window is searched through: past it (thousands of jobs
#: due at one instant, which share their wake-up anyway) the next slot alone sets it.
WINDOW_LIMIT = 1000

#: The phases of a run whose claim this instance has still to make (or to learn of).
_TO_CLAIM = frozenset({Phase.PENDING, Phase.RECLAIM, Phase.CLAIMING})
#: A run this instance still has to claim, or holds: it ends (or is settled) here.
_HERE = _TO_CLAIM | {Phase.HELD, Phase.FINISHING, Phase.HANDING_OVER}


def wake_slot(due: Sequence[tuple[int, int, Any, int, int]]) -> int:
    """The slot (store ms) to wake at for the heap ``due`` of (slot, ..., slack ms) entries.

    It is the latest slot that every slot before it may wait for: each slot up to it is
    then claimed in one wake-up, none later than its own slack and none early. Only the
    heap's entries inside that window are walked, at most :data:`WINDOW_LIMIT` of them
    (past that, the next slot alone). ``due`` must not be empty.
    """
    head = due[0]
    bound = head[0] + head[4]
    inside = [head[0]]
    size = len(due)
    stack = [1, 2]
    while stack:
        i = stack.pop()
        if i < size and due[i][0] <= bound:
            if len(inside) == WINDOW_LIMIT:
                return int(head[0])
            inside.append(due[i][0])
            bound = min(bound, due[i][0] + due[i][4])
            stack += (2 * i + 1, 2 * i + 2)
    # The bound only shrinks, so a slot visited early may lie past its final value.
    return max(slot for slot in inside if slot <= bound)


class Dispatcher:
    """Claims the slots of one scheduler's scheduled jobs as they fall due."""

    def __init__(self, session: Session) -> None:
        self._s = session
        # The scheduled jobs' next slots, earliest first: (slot, order, job, last slot
        # dealt with, how late the slot may be claimed in ms).
        self._due: list[tuple[int, int, Job, int, int]] = []
        # At spread slots one timer wake-up costs about as much process CPU as a run's
        # own work: slots close together share one (see Scheduler's timer_slack).
        self._slack = min(session.settings.timer_slack_ms,
                          to_ms(session.settings.heartbeat) // 4)
        self._order = itertools.count()
        self._alarm = Alarm()
        # The tasks that claim each wake-up's runs and run their handlers, kept for the
        # next wake-up rather than a new task each time.
        self._workers: WorkerPool[list[tuple[Job, int, int]] | Run] = WorkerPool(self._work)
        self._wake_at = float("inf")
        """When (store ms) the current sleep ends."""
        self._wake_margin = 0.0
        """How late (ms) the current sleep may end; 0 when it ends at a slot (one a little
        earlier, within its slack, shares that wake-up)."""
        # Per job, the last slot a catch-up claimed (it may still run).
        self._caught_up: dict[str, int] = {}
        # Per job, since when (store ms) its schedule is the one declared here, when known.
        self._since: dict[str, int] = {}

    def schedule_records(self, recorded: Mapping[str, str], now: int) -> dict[str, str]:
        """The records of the scheduled jobs' schedules to register, given the store's
        ``recorded`` ones: each job's spec, and since when (``since_ms``) it applies.

        A schedule that differs from the recorded one takes effect ``now``: its slots
        before then were never due (another schedule was), so a start-up catch-up never
        claims them, on this instance or on the next ones of the same release. A
        recorded schedule without ``since_ms`` (recorded by an earlier version) is taken
        to have applied forever, as before.
        """
        out: dict[str, str] = {}
        for name, job in self._s.jobs.items():
            if not job.scheduled:
                continue
            spec: dict[str, str | int] = job.schedule.spec()
            since: object = None
            try:
                previous = json.loads(recorded[name])
            except (KeyError, TypeError, ValueError):
                previous = None  # unknown: a new job, or a store that keeps no record
            if isinstance(previous, dict):
                since = previous.pop("since_ms", None)
                if previous != spec:
                    since = now
            if isinstance(since, int) and not isinstance(since, bool):
                self._since[name] = since
                spec = {**spec, "since_ms": since}
            out[name] = json.dumps(spec, sort_keys=True)
        return out

    def schedule_next(self, job: Job, last: int) -> None:
        """Queue ``job``'s first slot after ``last`` (store ms)."""
        if self._s.stopping:
            return
        slot = job.schedule.next_after(last)
        slack = min(self._slack, job.schedule.period_ms // 4)
        heapq.heappush(self._due, (slot, next(self._order), job, last, slack))
        if self._wake_margin:
            # The sleep ends at no slot (a heartbeat, or a first leg): a slot due before
            # its latest end would be claimed late, and the next one queued after it.
            if slot < self._wake_at + self._wake_margin:
                self._alarm.wake()
        elif slot + slack < self._wake_at:
            self._alarm.wake()

    async def start_job(self, job: Job, info: JobInfo) -> None:
        """Catch up a job the store knew before this start, then queue its next slot."""
        s = self._s
        with s.stoppable():
            if job.overlap == "skip":
                # Runs left open by stopped or dead instances are taken over first (by
                # the ticker); caught-up slots would only be skipped meanwhile.
                for slot in info.open_slots:
                    await self.wait_run_ended(job.name, slot)
            # After that wait, which may have lasted slots: "latest" is the newest slot
            # missed until now, not until the start (which then ran beside the newest).
            now = s.clock.now_ms()
            watermark = max(info.first_seen_ms, info.last_slot or info.first_seen_ms,
                            self._since.get(job.name, info.first_seen_ms))
            await self._catch_up(job, watermark, now, final_reason=Reason.CATCH_UP)
            self.schedule_next(job, now)

    async def wake_due_jobs(self) -> None:
        """Wake the jobs due at each instant together, and claim their runs in one go.

        One task for every scheduled job rather than one per job: at an instant when
        thousands of jobs are due, waking a task per job cost more than their claims'
        round trip, and an idle scheduler woke each of them once per heartbeat.
        """
        s = self._s
        with s.stoppable():
            while True:
                # Not rounded to the millisecond: every job due at one instant is woken
                # in the same turn, so their claims go in one batch. The wait is at most
                # a heartbeat, so a changed estimate of the store's clock is followed.
                local_now = s.settings.clock() * 1000 + s.clock.offset_ms
                wait = s.settings.heartbeat
                at_slot = False
                if self._due:
                    wake_at = self._due[0][0]
                    if wake_at - local_now < wait * 1000:
                        wake_at = wake_slot(self._due)
                    # A long wait for a slot ends early, and the rest is slept again: a
                    # sleep ends late by 0.1 % of its length (slot_wait, first_leg).
                    until = (wake_at - local_now) / 1000
                    wait = slot_wait(until, wait)
                    at_slot = wait == until
                if wait > 0:
                    if self._due:
                        self._wake_at = local_now + wait * 1000
                        self._wake_margin = 0.0 if at_slot else late_by(wait) * 1000
                    try:
                        await self._alarm.sleep(wait)
                    finally:
                        self._wake_at, self._wake_margin = float("inf"), 0.0
                    continue
                now = s.clock.now_ms()
                late_ms = s.settings.heartbeat * 1000
                claims: list[tuple[Job, int, int]] = []
                while self._due and self._due[0][0] <= local_now:
                    slot, _, job, _, _ = heapq.heappop(self._due)
                    due = job.schedule.previous_at_or_before(now) or slot
                    if due > slot and job.catch_up == "none" and now - due > late_ms:
                        # Frozen past a slot, and past the newest one's check interval
                        # too: every slot was missed, and catch_up="none" runs none.
                        self.schedule_next(job, due)
                    elif due > slot:
                        # The job fell behind (a suspended process): its catch-up policy.
                        assert s.tg is not None
                        s.tg.start_soon(self._catch_up_then_next, job, slot, due)
                    else:
                        self._caught_up.pop(job.name, None)
                        claims.append((job, slot, max(due, slot)))
                if claims:
                    assert s.tg is not None
                    self._workers.submit(s.tg, claims)

    async def _work(self, item: list[tuple[Job, int, int]] | Run) -> None:
        if isinstance(item, list):
            await self._claim_due(item)
        else:
            await self._s.execution.execute(item)

    async def _claim_due(self, claims: list[tuple[Job, int, int]]) -> None:
        # The member ranked first for a job claims at once; the one ranked k only if the
        # run is still unclaimed k check intervals later (see lease_core.engine.fleet).
        s = self._s
        interval = to_ms(s.settings.heartbeat)
        first: list[tuple[Job, int, Reason]] = []
        for job, slot, _ in claims:
            rank = s.fleet.rank(job.name)
            if rank == 0:
                first.append((job, slot, Reason.SCHEDULED))
            else:
                s.runs.pending(job, slot, claim_after=slot + rank * interval,
                               reason=Reason.SCHEDULED)
        # A job's next slot is queued once its claim is settled, as a loop per job would.
        won: list[Run] = []
        await s.claims.claim_many(first, deferred=won)
        for job, _, last in claims:
            self.schedule_next(job, last)
        # The handlers start now, in workers of their own but the last, which runs in
        # this one: at spread slots most claims win one run, and a task per run was a
        # good part of what a run cost.
        assert s.tg is not None
        for run in won[:-1]:
            self._workers.submit(s.tg, run)
        if won:
            await s.execution.execute(won[-1])

    async def _catch_up_then_next(self, job: Job, slot: int, due: int) -> None:
        with self._s.stoppable():
            await self._catch_up(job, slot - 1, due, final_reason=Reason.SCHEDULED)
            self.schedule_next(job, due)

    async def _catch_up(self, job: Job, after: int, until: int, *, final_reason: Reason) -> None:
        limit = base.CATCH_UP_LIMIT if job.catch_up == "all" else 1
        if job.catch_up == "none":
            limit = 1 if final_reason is Reason.SCHEDULED else 0
        if limit == 0:
            return
        after = max(after, until - base.CATCH_UP_WINDOW_MS)
        missed = job.schedule.slots_between(after, until, limit)
        on_time = until - self._s.settings.heartbeat * 1000
        previous = self._caught_up.pop(job.name, None)
        if previous is not None and missed and job.overlap == "skip":
            # The run an earlier catch-up claimed last may still be going.
            await self.wait_run_ended(job.name, previous)
        for i, slot in enumerate(missed):
            last = i == len(missed) - 1
            # A slot that is due right now is simply scheduled, even at start-up.
            reason = final_reason if last else Reason.CATCH_UP
            result = await self._s.claims.claim(
                job, slot, Reason.SCHEDULED if slot >= on_time else reason)
            active = result is not None and result.status in (ClaimStatus.WON,
                                                               ClaimStatus.RUNNING)
            if job.overlap == "skip" and (active or result is None):
                if last:
                    self._caught_up[job.name] = slot
                else:
                    # Missed slots of a job that must not overlap run one after another;
                    # claiming the next one now would only record it as skipped. That
                    # holds for a claim deferred at capacity (or unanswered) too: it is
                    # pending here until a handler ends, and the next waits for it.
                    await self.wait_run_ended(job.name, slot)

    async def wait_run_ended(self, job: str, slot: int) -> None:
        """Return once the run (job, slot) is finished (or the scheduler stops), or was
        never claimed: a claim of it this instance still has to make (deferred at
        capacity, unanswered) is waited for first.

        A run of this instance's own is followed as it ends here, not a check interval
        later: a catch-up of a job whose period is shorter than the heartbeat ran one
        missed slot per heartbeat, so fell further behind than it caught up. A run held
        elsewhere is read from the store once per check interval."""
        s = self._s
        key = (job, slot)
        heartbeat = s.settings.heartbeat
        while not s.stopping:
            local = s.runs.get(key)
            if local is not None and local.phase in _HERE:
                await s.runs.wait_change(heartbeat)
                continue
            try:
                result = await s.settings.backend.check([key])
            except Exception as exc:
                s.clock.failed(f"check of {job} slot {format_slot(slot)}", exc)
            else:
                state = result.runs.get(key)
                if state is None or state.status.finished:
                    return
            await anyio.sleep(heartbeat)
