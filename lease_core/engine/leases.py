"""Leases: once per heartbeat, renew every held lease and check every run backed up.

Both are batched: one heartbeat call renews all the leases an instance holds, and one
check call covers every run it backs up, so the store's load grows with the number of
instances, not with the number of jobs. A backed-up run whose lease expired (or that was
handed over) is claimed; a run whose claim got no answer is claimed again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import anyio

from .._durations import to_ms
from .._lease_clock import RESUME_CHECK, lease_clock
from .._outcome import Interruption
from .._structures import CheckResult, Reason, RunStatus, format_slot
from ..errors import BackendUnavailable
from .base import logger
from .runs import Phase

if TYPE_CHECKING:
    from .._structures import RunState
    from .jobs import Job
    from .runs import Run
    from .session import Session

__all__ = ["LeaseKeeper"]

#: The open runs one listing of :meth:`LeaseKeeper._adopt` reads at most, newest slot
#: first (a job's, when the listing of every job's was full).
_OPEN_LIMIT = 10_000

#: The most slots newer than a pending one that its turn's check reads (see _newer_keys).
_NEWER_LIMIT = 32

#: How much more time :func:`lease_clock` may count than the event loop's clock over one
#: nap of the ticker before the machine is taken to have been suspended (seconds).
_SUSPEND_S = 0.25


class LeaseKeeper:
    """Renews one scheduler's held leases and backs up the runs of other instances."""

    def __init__(self, session: Session) -> None:
        self._s = session
        # The declared jobs whose open runs are still to read, job by job, for the
        # departed members named alongside (see _adopt).
        self._unread: list[str] = []
        self._unread_for: set[str] = set()

    def tick_limit(self) -> float:
        """How long one tick may take before the next one starts anyway."""
        s = self._s
        shortest = min((j.lease_ms for j in s.jobs.values()),
                       default=to_ms(s.settings.lease))
        return max(s.settings.heartbeat, shortest / 1000 - s.settings.heartbeat)

    async def ticker(self) -> None:
        """Tick every heartbeat until cancelled."""
        s = self._s
        while True:
            await self._nap(s.settings.heartbeat)
            # A hung store must not stall later ticks; the handlers' own deadlines
            # cancel them before their leases could expire.
            limit = self.tick_limit()
            with anyio.move_on_after(limit) as scope:
                try:
                    await self.tick()
                except Exception as exc:
                    s.clock.failed("heartbeat and backup check", exc)
            if scope.cancelled_caught:
                s.clock.failed("tick", BackendUnavailable(
                    f"the store did not answer within {limit:g}s (the tick was cut "
                    "short)"))

    async def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` on the event loop's clock; while handlers run, in naps of
        :data:`RESUME_CHECK` at most, after each of which a suspend of the machine is
        looked for.

        The handlers' local lease deadlines are on the event loop's clock, which does not
        count a suspend (a laptop's lid closed, a VM paused: ``CLOCK_MONOTONIC``), while
        the store's clock ran on and a backup may have taken the runs over. The time the
        loop's clock missed (:func:`lease_clock` counts it) is taken off every deadline,
        so a handler is cancelled soon after the machine resumes, not at the next tick.
        """
        runs = self._s.runs
        until = anyio.current_time() + seconds
        while (left := until - anyio.current_time()) > 0:
            if not runs.held_count:  # until a run is held
                holding = runs.holding = anyio.Event()
                with anyio.move_on_after(left):
                    await holding.wait()
                continue
            loop, boot = anyio.current_time(), lease_clock()
            await anyio.sleep(min(left, RESUME_CHECK))
            missed = (lease_clock() - boot) - (anyio.current_time() - loop)
            if missed > _SUSPEND_S:
                logger.warning("the machine was suspended for about %.1fs; the held "
                               "leases' deadlines are moved as much earlier", missed)
                for run in runs.held():
                    if run.execution is not None:
                        run.execution.set_deadline(run.execution.deadline - missed)
                return  # a tick at once: renewals, and the runs taken over meanwhile

    async def tick(self) -> None:
        """Renew the held leases, check the backed-up runs, sample the store's clock."""
        s = self._s
        try:
            await self._renew()
        except Exception as exc:
            s.clock.failed("heartbeat", exc, write=True)
            return
        try:
            # Before the checks: a check that fails (or a slow tick cut short) must not
            # put the renewal off, or a live member's membership could lapse. After a
            # failed write, at every tick: the renewal is the write that shows the store
            # takes writes again (StoreClock).
            if s.fleet.renewal_due() or s.clock.awaits_write:
                await s.fleet.renew()
        except Exception as exc:
            # The last membership stands: a stale one costs an extra claim at most.
            s.clock.failed("membership renewal", exc, write=True)
        if s.fleet.departed:
            try:
                await self._adopt()
            except Exception as exc:  # looked for again at the next tick
                s.clock.failed("listing the open runs of members that left", exc)
        await self._check_watched()
        await self._pick_up()
        # An idle instance still asks the store once per heartbeat, so health() knows it
        # answers; the clock is sampled at least every minute.
        if s.settings.clock() - s.clock.last_sample > min(60.0, s.settings.heartbeat / 2):
            await s.clock.sample()

    async def _renew(self) -> None:
        s = self._s
        # A run inside its fenced transaction is locked by it: no backup can take it over,
        # whatever its expiry, so it needs no renewal and is never reported lost here.
        helds = [run for run in s.runs.held()
                 if run.execution is not None and not run.execution.lost
                 and not run.execution.in_transaction and not run.execution.cancelled]
        if not helds:
            return
        clock = s.settings.clock
        sent = clock()
        sent_loop = anyio.current_time()
        result = await s.settings.backend.heartbeat(
            [run.lease for run in helds if run.lease is not None])
        renewed = result.held if result.renewed is None else result.renewed
        # A heartbeat that renewed no lease (all lost, cancelled, or in their fenced
        # transactions) wrote nothing: a store refusing writes answers it too.
        s.clock.note(result.now_ms, sent, clock(), wrote=bool(renewed))
        for run in helds:
            execution, lease = run.execution, run.lease
            if execution is None or lease is None:
                continue  # its handler handed it over (a stop) while the call was made
            if lease.token in renewed:
                execution.set_deadline(s.execution.deadline(sent_loop, run.job))
            elif lease.token in result.held:
                pass  # held but locked by its fenced transaction; renewed next time
            elif lease.token in result.cancelled:
                s.execution.cancel_after(run, result.cancelled[lease.token])
            elif s.runs.holds(lease.token) and not execution.in_transaction:
                s.execution.lose(run, Interruption.LEASE_LOST)

    async def _check_watched(self) -> None:
        s = self._s
        if s.stopping:
            return
        watched = list(s.runs.watched())
        if not watched:
            return
        retries = [run for run in watched if run.phase is Phase.RECLAIM]
        newest: dict[str, int] = {}
        again: list[tuple[Job, int, Reason]] = []
        missed: list[tuple[str, int]] = []
        for run in retries:
            newest[run.job.name] = max(run.slot, newest.get(run.job.name, run.slot))
        for run in retries:
            older = run.slot < newest[run.job.name]
            if (older and not run.kept and run.reclaim_reason is not Reason.TAKEOVER
                    and (run.job.catch_up != "all" or run.job.overlap == "skip")):
                # The store was unreachable for several slots: as with catch-up, only
                # the newest missed slot is claimed (all of them only for a job with
                # catch_up="all" whose runs may overlap). The older run is still watched,
                # in case an unanswered claim won it. A kept run was due while the store
                # answered (a quarantine, a ranked member's turn): it is claimed.
                s.runs.watch(run.job, run.slot)
                missed.append(run.key)
                continue
            assert run.reclaim_reason is not None
            again.append((run.job, run.slot, run.reclaim_reason))
        s.clock.log.missed(missed, down=s.clock.down)
        await s.claims.claim_many(again)
        # A run ranked to another member is read only once its own turn comes before the
        # next tick: until then its state does not matter here (the members ranked before
        # this one back it up), and at a burst those reads were most of what a tick cost.
        horizon = s.clock.now_ms() + to_ms(s.settings.heartbeat)
        backups = [run for run in s.runs.watched() if run.phase is not Phase.RECLAIM
                   and (run.phase is not Phase.PENDING or run.claim_after <= horizon)]
        if not backups:
            return
        keys = [run.key for run in backups]
        clock = s.settings.clock
        sent = clock()
        result = await s.settings.backend.check(
            keys + _newer_keys(backups, s.clock.now_ms(), keys))
        s.clock.note(result.now_ms, sent, clock())
        claims: list[tuple[Job, int, Reason]] = []
        due: list[tuple[Job, int, Reason]] = []
        later: dict[int, list[tuple[str, int]]] = {}
        for key in keys:
            current = s.runs.get(key)
            if current is None or current.phase not in (Phase.WATCHING, Phase.RECLAIM,
                                                        Phase.PENDING):
                continue
            run = current
            state = result.runs.get(key)
            if key in result.lost:
                # Lost with the store's data while its holder may still run it: claim it
                # again; the claim waits out the store's quarantine.
                s.runs.forget(key)
                await s.claims.claim(run.job, key[1], Reason.TAKEOVER)
            elif run.phase is Phase.PENDING and not _ended(run, state):
                if self._settle_pending(run, state, result.now_ms, due, result):
                    later.setdefault(run.claim_after, []).append(key)
            elif state is None or state.status.finished:
                self._ended_run(run, state, result.now_ms)
            elif state.claimable(result.now_ms):
                # Expired, handed over, or its retry due: every member backing it up
                # claims it at once (the store decides; takeovers are rare).
                claims.append((run.job, key[1], Reason.TAKEOVER))
        for at, keys_due in later.items():
            assert s.tg is not None
            s.tg.start_soon(self._cover_at, at, keys_due)
        # Oldest slot first: the store skips a slot of an overlap="skip" job for the
        # earlier runs of the batch, not for the later ones.
        await s.claims.claim_many(claims + sorted(self._newest_missed(due), key=_slot))

    def _newest_missed(self, due: list[tuple[Job, int, Reason]]) -> list[tuple[Job, int, Reason]]:
        """The claims of runs ranked to this member whose turn came, less the older slots
        of a job whose turn came while the store did not answer: as for the top-ranked
        member's claims (``RECLAIM``), only the newest slot of the job is claimed (all of
        them only for a job with ``catch_up="all"`` whose runs may overlap), here or by
        the member its turn is with. A slot the store had answered after, before the
        outage began, was not missed (its turn met one failed call): it is claimed, as a
        top-ranked member's claim that failed then is (:attr:`Run.kept`)."""
        s = self._s
        clock = s.clock
        failed_ms = clock.last_failure * 1000 + clock.offset_ms
        before = clock.answered_before_outage
        answered_ms = -math.inf if before is None else before * 1000 + clock.offset_ms
        now_ms = clock.now_ms()
        newest: dict[str, int] = {}
        for job, slot, _ in due:  # the job's slot due now counts too, claimed or not
            current = job.schedule.previous_at_or_before(now_ms)
            newest[job.name] = max(slot, newest.get(job.name, slot),
                                   slot if current is None else current)
        kept: list[tuple[Job, int, Reason]] = []
        skipped: list[tuple[str, int]] = []
        for job, slot, reason in due:
            record = s.runs.get((job.name, slot))
            missed = (record is not None and record.claim_after <= failed_ms
                      and answered_ms < slot)
            if (missed and slot < newest[job.name] and reason is Reason.SCHEDULED
                    and job.scheduled
                    and (job.catch_up != "all" or job.overlap == "skip")):
                s.runs.watch(job, slot)  # forgotten at the next check unless claimed
                skipped.append((job.name, slot))
                continue
            kept.append((job, slot, reason))
        clock.log.missed(skipped, down=clock.down)
        return kept

    def _ended_run(self, run: Run, state: RunState | None, now_ms: int) -> None:
        """A backed-up run is over: stop backing it up, and back its workflow's next step
        up if it completed.

        Supervisor: the step completed, and its agent claims the next step as it completes
        it. The members make sure it was claimed, in rank order: the one ranked k claims it
        only if it is still unclaimed k + 1 check intervals from now (issue 18: about one
        claim per step, not one per member; an agent that died in between is covered an
        interval later).
        """
        s = self._s
        s.runs.forget(run.key)
        next_step = s.steps.successor(run.job, None if state is None else state.status)
        if next_step is not None:
            # This instance's own attempt completed it (its finish's answer was lost):
            # it is the agent, and claims the next step at once (Run.successor).
            own = (run.phase is Phase.WATCHING and state is not None
                   and run.completed_attempt == state.attempt)
            turn = 0 if own else s.fleet.rank(next_step.name) + 1
            s.runs.pending(next_step, run.slot, reason=Reason.SCHEDULED,
                           claim_after=now_ms + turn * to_ms(s.settings.heartbeat),
                           successor=own)

    def _settle_pending(self, run: Run, state: RunState | None, now_ms: int,
                        claims: list[tuple[Job, int, Reason]],
                        result: CheckResult | None = None) -> bool:
        """Act on what the store says of a ``PENDING`` run that has not ended (see
        :func:`_ended`): claimed by another member (back it up), unclaimed (no run, or
        one to take over) with its turn come (claim it: appended to ``claims``), unless
        ``result`` shows a newer slot of its job running (:func:`_newer_keys`). True when
        it is unclaimed and its turn comes later (a timer claims it then)."""
        if state is not None and not state.claimable(now_ms):
            self._s.runs.watch(run.job, run.slot)  # claimed by another: back it up
            return False
        if now_ms >= run.claim_after:
            if state is None:  # nobody claimed it: the member ranked first may be gone
                if self._s.fleet.rank(run.job.name):
                    # Not when ranked first: then it waited for this instance's capacity
                    # (or its claim failed), and a renewal at every tick would change no
                    # rank.
                    self._s.fleet.renew_soon()
                if result is not None and _newer_running(run, result):
                    self._s.runs.watch(run.job, run.slot)  # forgotten unless claimed
                    # DEBUG: every member ranked after the first says so of every slot,
                    # thousands of lines after an outage (and the first-ranked member's
                    # claim, skipped, is logged and in the history).
                    logger.debug("%s slot %s not claimed: a newer slot of the job runs "
                                 "(overlap=\"skip\")", run.job.name, format_slot(run.slot))
                    return False
                if self._s.steps.continue_later(run):
                    return False
            claims.append((run.job, run.slot, run.reclaim_reason or Reason.SCHEDULED))
            return False
        return True

    async def _cover_at(self, at_ms: int, keys: list[tuple[str, int]]) -> None:
        """At ``at_ms`` (store ms), claim the runs of ``keys`` still pending and unclaimed.

        A tick finds a run its turn reaches before the next tick: waiting for that tick
        would cover a late member up to a whole check interval after its turn.
        """
        s = self._s
        with s.stoppable():
            await anyio.sleep(max(0.0, (at_ms - s.clock.now_ms()) / 1000))
            runs = [run for run in map(s.runs.get, keys)
                    if run is not None and run.phase is Phase.PENDING]
            if not runs:
                return
            sent = s.settings.clock()
            keys = [run.key for run in runs]
            try:
                result = await s.settings.backend.check(
                    keys + _newer_keys(runs, at_ms, keys))
            except Exception as exc:  # the next tick checks them again
                s.clock.failed("check of runs ranked to another member", exc)
                return
            s.clock.note(result.now_ms, sent, s.settings.clock())
            claims: list[tuple[Job, int, Reason]] = []
            for run in runs:
                if s.runs.get(run.key) is run and run.phase is Phase.PENDING:
                    state = result.runs.get(run.key)
                    if _ended(run, state):
                        self._ended_run(run, state, result.now_ms)
                    else:
                        self._settle_pending(run, state, max(result.now_ms, at_ms), claims,
                                             result)
            await s.claims.claim_many(sorted(claims, key=_slot))  # as in _check_watched

    async def _adopt(self) -> None:
        """Back up the open runs of declared jobs that members which left or lapsed
        held, and that this instance does not watch yet.

        A scheduled run's slot has its backups already (every member knows the slot);
        a run an operation made (a trigger, a retry, their workflows' later steps) was
        known only to the member that claimed it, so nobody else would take it over or
        claim its hand-over. Listed once per departure (the open runs, through the
        store's index of them), not at every tick. When the store has more open runs
        than one listing reads, the declared jobs' own are read too, job by job, so an
        older run past the listing is not left running for good: for at most half a
        tick's time, so that the checks after it do not wait behind a slow store, the
        rest at the next ticks.
        """
        s = self._s
        backend = s.settings.backend
        departed = set(s.fleet.departed)
        s.fleet.departed.clear()
        try:
            infos = await backend.runs(None, open_only=True, limit=_OPEN_LIMIT)
            if len(infos) >= _OPEN_LIMIT:
                if not self._unread or departed - self._unread_for:  # (again) from the start
                    self._unread, self._unread_for = list(reversed(s.jobs)), departed
                with anyio.move_on_after(self.tick_limit() / 2):
                    while self._unread:
                        infos += await backend.runs(self._unread[-1], open_only=True,
                                                    limit=_OPEN_LIMIT)
                        self._unread.pop()
                if self._unread:  # the rest at the next tick
                    s.fleet.departed |= departed
        except BaseException:
            # Kept for the next tick: a store error, or a slow listing the tick's deadline
            # cancelled (then lost, its runs would never be backed up).
            s.fleet.departed |= departed
            raise
        for info in infos:
            job = s.jobs.get(info.job)
            if (job is not None and info.instance_id in departed
                    and s.runs.get((info.job, info.slot)) is None):
                s.runs.watch(job, info.slot)

    async def _pick_up(self) -> None:
        """Claim the handed-over runs of declared jobs that this instance does not watch.

        What operations leave (a triggered or retried run, see
        :mod:`lease_core.operations`) is claimed so within one heartbeat; the store gives
        the attempt its reason (``manual`` or ``retry``).
        """
        s = self._s
        if s.stopping or not s.jobs:
            return
        queued = await s.settings.backend.queued(list(s.jobs))
        claims: list[tuple[Job, int, Reason]] = []
        now_ms, interval = s.clock.now_ms(), to_ms(s.settings.heartbeat)
        for name, slot in queued:
            if name not in s.jobs or s.runs.get((name, slot)) is not None:
                continue
            # In rank order, as a takeover: the first member at once, the one ranked k
            # only if the run is still queued k check intervals from now.
            rank = s.fleet.rank(name)
            if rank == 0:
                claims.append((s.jobs[name], slot, Reason.HAND_OVER))
            else:
                s.runs.pending(s.jobs[name], slot, reason=Reason.HAND_OVER,
                               claim_after=now_ms + rank * interval)
        if claims:
            await s.claims.claim_many(claims)


def _slot(claim: tuple[Job, int, Reason]) -> int:
    """A claim's slot (the order of a batch of claims)."""
    return claim[1]


def _skips_behind_newer(run: Run) -> bool:
    """Whether ``run`` is a scheduled slot of a job with ``overlap="skip"`` waiting for its
    turn, which must not start while a newer slot of its job runs."""
    return (run.phase is Phase.PENDING and run.reclaim_reason is Reason.SCHEDULED
            and run.job.scheduled and run.job.overlap == "skip" and not run.successor)


def _newer(run: Run, now_ms: int) -> list[int]:
    """The job's slots due by ``now_ms`` that are newer than ``run``'s, the newest
    :data:`_NEWER_LIMIT` at most (the slots of a job whose period is shorter than the
    turn's delay: a newer slot that runs may be followed by slots skipped for it)."""
    schedule = run.job.schedule
    if schedule.next_after(run.slot) > now_ms:
        return []  # the common case, one computation: a slot's turn before the next
    return schedule.slots_between(run.slot, now_ms, _NEWER_LIMIT)


def _newer_keys(runs: list[Run], now_ms: int, keys: list[tuple[str, int]]
                ) -> list[tuple[str, int]]:
    """The keys to read beside ``keys`` so that a pending slot of a job with
    ``overlap="skip"`` whose turn comes by ``now_ms`` is not claimed while a newer slot of
    its job runs (:func:`_newer_running`): the job's slots due since (:func:`_newer`).

    The store skips a slot only while an *earlier* one runs; a member's turn for a slot
    that the member ranked first could not claim (at capacity, or gone) comes a check
    interval or more after it, and the first member (free again, or re-ranked) may have
    claimed the job's next slots meanwhile, which run then."""
    seen = set(keys)
    extra: list[tuple[str, int]] = []
    for run in runs:
        if _skips_behind_newer(run) and run.claim_after <= now_ms:
            for slot in _newer(run, now_ms):
                if (run.job.name, slot) not in seen:
                    seen.add((run.job.name, slot))
                    extra.append((run.job.name, slot))
    return extra


def _newer_running(run: Run, result: CheckResult) -> bool:
    """Whether ``result`` shows a newer slot of ``run``'s job holding a live lease or
    waiting for its retry, as a store skips a slot for an earlier one
    (:func:`_newer_keys`)."""
    if not _skips_behind_newer(run):
        return False
    now_ms = result.now_ms
    for slot in _newer(run, now_ms):
        state = result.runs.get((run.job.name, slot))
        if state is not None and (state.status is RunStatus.RETRYING or (
                state.status is RunStatus.RUNNING and not state.claimable(now_ms))):
            return True
    return False


def _ended(run: Run, state: RunState | None) -> bool:
    """Whether a watched run is over: finished, or gone from the store when it had been
    claimed before: a watched one, or one an operation queued (a pending run to pick up,
    see ``_pick_up``). Any other pending run with no run in the store is yet to claim."""
    if state is None:
        return run.phase is not Phase.PENDING or run.reclaim_reason is Reason.HAND_OVER
    return state.status.finished
