"""Claims: every claim an instance makes goes through here, and is settled here.

Claims made at the same instant go to the store together, in one ``claim_many`` call
(see :mod:`lease_core._batch`); each is then settled as if it had been made alone: a won
run starts its handler, a run held elsewhere is backed up, a claim without an answer is
made again at the next tick.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .. import events as ev
from .._batch import Abandoned, ClaimBatcher
from .._structures import (
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    Lease,
    Reason,
    RunStatus,
    format_slot,
)
from ..errors import BackendUnavailable
from .base import logger
from .runs import AttemptInfo, Phase, Run

if TYPE_CHECKING:
    from .jobs import Job
    from .session import Session

__all__ = ["Claimer"]

#: The claim answers that record an attempt (and so wrote to the store).
_WRITING = frozenset({ClaimStatus.WON, ClaimStatus.SKIPPED, ClaimStatus.ESCALATED})


class Claimer:
    """Sends one scheduler's claims and settles their answers."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self._batcher = ClaimBatcher(session.settings.backend)
        self._in_flight = 0
        self._claims_in_flight = 0
        self._idle: anyio.Event | None = None
        self._quarantine_logged = session.carry.quarantine_logged
        # Fences (issue 21): the highest store epoch each job's claims answered with.
        self._epochs: dict[str, int] = {}
        # Runs whose claim went unanswered: the store may hold them under this instance's
        # id (its own attempt, won without the answer arriving), not another process's.
        self._unanswered: set[tuple[str, int]] = set()
        self._unanswered_cap = 256  # pruned past it, of runs no longer tracked
        # Per job, the newest slot whose scheduled claim waits here for capacity (see
        # _claim_within and _supersede_deferred).
        self._deferred: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        """Claims sent and not answered yet (runs whose handlers may start any moment)."""
        return self._claims_in_flight

    async def claim(self, job: Job, slot: int, reason: Reason) -> ClaimResult | None:
        """Claim one run; ``None`` when the answer is unknown (claimed again next tick)."""
        (result,) = await self.claim_many([(job, slot, reason)])
        return result

    async def claim_many(
        self, claims: Sequence[tuple[Job, int, Reason]], *,
        deferred: list[Run] | None = None, after_step: bool = False,
    ) -> list[ClaimResult | None]:
        """Claim several runs at once; each answer as :meth:`claim` gives it.

        With ``deferred``, the runs won are held but their handlers not started: they are
        appended there for the caller to start (see :meth:`Executor.launch
        <lease_core.engine.execution.Executor.launch>`).

        ``after_step``: the claims are of later workflow steps, by the instance that has
        just completed the step before each (:attr:`Run.successor
        <lease_core.engine.runs.Run.successor>`, kept through the claim's retries and a
        deferral at capacity). Only those start a run the store finds missing past its
        trimmed history (:attr:`ClaimRequest.scheduled` False): steps of overlapping
        workflow runs come after newer runs of the step were trimmed. Any other claim of
        a later step (a backup's at its turn, at start) may come after the run ran and
        was trimmed, and starts nothing then. They are sent while the scheduler stops
        too: the run won is handed over at once, so that no backup has to start it.
        """
        s = self._s
        if not claims:
            return []
        if s.tg is None or (s.stopping and not after_step):
            return [None] * len(claims)
        settings = s.settings
        if settings.max_running is not None:
            free = (settings.max_running - s.runs.held_count - self._claims_in_flight
                    - s.execution.abandoned_threads)
            if free < len(claims):
                return await self._claim_within(claims, max(0, free), deferred, after_step)
        requests = [
            ClaimRequest(
                job.name, slot, settings.instance_id, os.urandom(16).hex(), job.lease_ms,
                reason, job.overlap == "skip", job.max_attempts, settings.history_size,
                settings.history_ttl_ms,
                job.scheduled or not s.runs.claiming(job, slot, successor=after_step),
            )
            for job, slot, reason in claims
        ]
        if self._deferred:
            self._supersede_deferred(claims)
        clock = settings.clock
        sent = clock()
        sent_loop = anyio.current_time()
        answers: list[ClaimResult | Exception] | None = None
        # Shielded: a claim cancelled mid-flight could win in the store without the
        # instance knowing, leaving the run unattended until its lease expires. stop()
        # waits for claims in flight before it hands over.
        self._in_flight += 1
        self._claims_in_flight += len(claims)
        limit = min(job.lease_ms for job, _, _ in claims) / 2000
        try:
            with anyio.move_on_after(limit, shield=True):
                answers = await self._batcher.claim_many(requests)
        finally:
            self._in_flight -= 1
            self._claims_in_flight -= len(claims)
            if not self._in_flight and self._idle is not None:
                self._idle.set()
        received = clock()
        if answers is None:  # no answer in time: as a claim that failed (retried)
            s.clock.failed(
                f"claim of {claims[0][0].name} slot {format_slot(claims[0][1])}"
                + (f" and {len(claims) - 1} more" if len(claims) > 1 else "")
                + " (will retry)",
                BackendUnavailable(f"the store did not answer within {limit:g}s"),
                write=True)
        answered = next((a for a in answers or () if isinstance(a, ClaimResult)), None)
        if answered is not None:
            # Only a claim that recorded an attempt surely wrote: one that found the run
            # held or finished may write nothing, and a store refusing writes (Redis short
            # of min-replicas-to-write) answers it; it must not end a write outage.
            s.clock.note(answered.now_ms, sent, received, wrote=any(
                isinstance(a, ClaimResult) and a.status in _WRITING for a in answers or ()))
        results: list[ClaimResult | None] = []
        for i, (job, slot, reason) in enumerate(claims):
            answer = None if answers is None else answers[i]
            if isinstance(answer, Exception):
                if not isinstance(answer, Abandoned):
                    s.clock.failed(
                        f"claim of {job.name} slot {format_slot(slot)} (will retry)", answer,
                        write=True)
                answer = None
            results.append(self._settle(job, slot, reason, requests[i].token, answer,
                                        received - sent, sent_loop, deferred))
        return results

    async def _claim_within(self, claims: Sequence[tuple[Job, int, Reason]], free: int,
                            deferred: list[Run] | None,
                            after_step: bool) -> list[ClaimResult | None]:
        # At capacity: claim what fits; the rest wait, pending, until a handler ends (the
        # member ranked next takes them meanwhile if it can).
        now = self._s.clock.now_ms()
        for job, slot, reason in claims[free:]:
            if _supersedes(job, reason):
                # As after a store failure (leases.py, _newest_missed): a job's slots
                # deferred at capacity do not pile up and run oldest first once a handler
                # ends; only the newest waits (catch_up="all" with overlapping runs keeps
                # them all). The older ones are backed up only if someone claimed them.
                self._s.runs.superseded(job, slot)
                self._deferred[job.name] = max(slot, self._deferred.get(job.name, slot))
            self._s.runs.pending(job, slot, claim_after=now, reason=reason,
                                 successor=after_step)
        results = (await self.claim_many(claims[:free], deferred=deferred,
                                         after_step=after_step) if free else [])
        return results + [None] * (len(claims) - free)

    def _supersede_deferred(self, claims: Sequence[tuple[Job, int, Reason]]) -> None:
        """A scheduled claim sent of a slot newer than one deferred here at capacity
        supersedes it (as a newer deferral does): once capacity freed, the newer slot
        was claimed at once, and the deferred one, claimed at the next tick, ran beside
        it (a job with overlap="skip" too: the store skips a slot only for earlier runs)
        and after it. It is backed up only if another member claimed it."""
        for job, slot, reason in claims:
            deferred = self._deferred.get(job.name)
            if deferred is None or slot < deferred or not _supersedes(job, reason):
                continue
            del self._deferred[job.name]
            if slot > deferred:
                self._s.runs.superseded(job, slot)

    async def drain(self, seconds: float) -> None:
        """Wait, for ``seconds`` at most, until no claim is in flight."""
        with anyio.move_on_after(seconds):
            while self._in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()

    # -- a new store epoch (issue 21) ---------------------------------------------------
    def _new_epoch(self, job: Job, epoch: int) -> None:
        """The store found that ``job``'s data may have lost writes (a failover, a restart
        without persistence): runs it had ended can be open again, with nobody watching
        them. List the job's open runs again, as at start, and watch them."""
        if epoch < self._epochs[job.name]:
            return
        self._epochs[job.name] = epoch
        s = self._s
        if s.stopping or s.tg is None:
            return

        async def rescan() -> None:
            try:
                infos = await s.settings.backend.register_jobs([job.name])
            except Exception as exc:  # the next epoch change, or a restart, lists them
                s.clock.failed(f"listing the open runs of {job.name}", exc)
                return
            for open_slot in infos[job.name].open_slots:
                if s.runs.get((job.name, open_slot)) is None:  # tracked ones go on as they are
                    s.runs.watch(job, open_slot)

        s.tg.start_soon(rescan)

    def _drop_missed(self) -> None:
        """Keep what an outage leaves bounded (past :attr:`_unanswered_cap` unanswered
        claims): forget the unanswered claims of runs no longer tracked, and stop backing
        up the older slots whose claims went unanswered and that a newer slot superseded
        (``WATCHING``: kept only in case such a claim won, they added a record per job
        and slot for as long as the outage lasted, all read by the first check after it).
        Whether one of them was won is read once the store answers instead: this
        instance is listed as departed, and the lease keeper backs up the open runs held
        under its id that it does not track (``LeaseKeeper._adopt``)."""
        s = self._s
        dropped = False
        for key in list(self._unanswered):
            run = s.runs.get(key)
            if (run is not None and run.phase is Phase.WATCHING
                    and run.completed_attempt is None):
                s.runs.forget(key)
                run, dropped = None, True
            if run is None:
                self._unanswered.discard(key)
        if dropped:
            s.fleet.departed.add(s.settings.instance_id)
        self._unanswered_cap = max(256, 2 * len(self._unanswered))

    def _shared_id(self, job: Job, slot: int) -> None:
        """Warn, once, of a run held under this instance's id by another attempt (claims
        are idempotent by token, so not one of ours; nor one whose claim went unanswered
        here, which may have won): another process runs with the same instance id (or
        this one's previous process, its lease not yet lapsed)."""
        if (self._s.carry.shared_id_warned or (job.name, slot) in self._unanswered
                or any(run.key == (job.name, slot) for run in self._s.runs.held())):
            return
        self._s.carry.shared_id_warned = True
        logger.warning(
            "%s slot %s is held under this instance's id %r by another process (this "
            "instance's previous one, its lease not yet lapsed, or another instance "
            "with the same id): give every instance its own instance_id (the default is "
            "unique); instances that share one do not take over each other's runs that "
            "only one of them knew of (a triggered run, a retry) when it dies",
            job.name, format_slot(slot),
            self._s.settings.instance_id)

    def _settle(self, job: Job, slot: int, reason: Reason, token: str,
                result: ClaimResult | None, took: float, sent_loop: float,
                deferred: list[Run] | None = None) -> ClaimResult | None:
        s = self._s
        if result is None:
            # Unknown outcome (error or too slow): retry, or take it over if it was won.
            # Kept (claimed even once a newer slot is due) when the store had answered
            # after the slot was due: a member ranked after the first, or a claim retried,
            # whose turn came as the store went away (issue 21, sentinelfix).
            answered = s.clock.last_answer
            kept = answered is not None and answered * 1000 + s.clock.offset_ms >= slot
            s.runs.watch(job, slot, reclaim=reason, kept=kept)
            self._unanswered.add((job.name, slot))
            if len(self._unanswered) > self._unanswered_cap:  # an outage: slots dropped
                self._drop_missed()
            return None
        if self._unanswered and (result.status is not ClaimStatus.RUNNING
                                 or result.instance_id != s.settings.instance_id):
            # Settled: whoever held it, no more; or held by another instance, so the
            # unanswered claim did not win (kept, _drop_missed would forget its backup).
            self._unanswered.discard((job.name, slot))
        if result.epoch != self._epochs.setdefault(job.name, result.epoch):
            self._new_epoch(job, result.epoch)
        lease = Lease(job.name, slot, token, job.lease_ms)
        # Events are made only for subscribers: in a burst, thousands of claims are settled
        # in one go, and every object made costs the garbage collector too.
        events = s.bus.wanted
        run: dict[str, Any] = {}
        if events:
            run = {"instance_id": s.settings.instance_id, "job": job.name, "slot": slot}
        if result.status is ClaimStatus.WON:
            won = result.reason or Reason.SCHEDULED
            info = AttemptInfo(result.attempt, won, sent_loop)
            if events:
                s.bus.emit(ev.Claimed(**run, attempt=result.attempt, reason=won,
                                      claim_duration=took))
            if events and won in (Reason.TAKEOVER, Reason.HAND_OVER):
                s.bus.emit(ev.TakenOver(**run, attempt=result.attempt, reason=won))
            if s.stopping or s.tg is None:
                s.runs.hand_over_later(job, lease, info)
                s.hand_over_soon(lease)
            else:
                s.execution.launch(job, lease, result, sent_loop, info, deferred=deferred)
        elif result.status is ClaimStatus.RUNNING and result.run_status is None:
            # No run: the store is in quarantine after losing its data; claim again at
            # the next tick (the claim writes nothing until the quarantine ends). The store
            # answered: the slot is claimed after it even if a newer one is due by then.
            s.runs.watch(job, slot, reclaim=reason, kept=True)
            if self._quarantine_logged.get(job.name) != result.expires_ms:
                self._quarantine_logged[job.name] = result.expires_ms
                logger.warning(
                    "%s slot %s: the store found that writes it acknowledged may be lost "
                    "(a failover to a replica, or a server that lost its data): no new "
                    "attempt before %s (the store's clock), when every lease it may have "
                    "held has expired; it goes on by itself", job.name,
                    format_slot(slot), format_slot(result.expires_ms or 0))
        elif result.status is ClaimStatus.RUNNING:
            if (result.instance_id == s.settings.instance_id
                    and result.run_status is RunStatus.RUNNING):  # (retrying: no holder)
                self._shared_id(job, slot)
            s.runs.watch(job, slot)
            if events:
                holder = (None if result.run_status is RunStatus.RETRYING  # nobody holds it
                          else result.instance_id)
                s.bus.emit(ev.StandingBy(**run, holder=holder, claim_duration=took))
        else:
            s.runs.forget((job.name, slot))
            if result.status is ClaimStatus.SKIPPED:
                logger.info("%s slot %s skipped: an earlier run still holds its lease or "
                            "waits for its retry, or the job is paused (its history says "
                            "which)",
                            job.name, format_slot(slot))
                if events:
                    s.bus.emit(ev.Skipped(**run, reason=reason, claim_duration=took))
            elif result.status is ClaimStatus.ESCALATED:
                logger.error("%s slot %s escalated after %d attempts", job.name,
                             format_slot(slot), result.attempt)
                if events:
                    s.bus.emit(ev.Escalated(**run, attempt=result.attempt, reason=reason,
                                            claim_duration=took))
            elif result.status is ClaimStatus.FINISHED:
                if result.run_status is None:
                    # No run, and the store trimmed the history of a run at or after
                    # this slot: it ran and was trimmed, or its turn passed meanwhile.
                    if job.scheduled:
                        logger.info("%s slot %s not claimed: older than the history the "
                                    "store keeps, which was trimmed past it", job.name,
                                    format_slot(slot))
                    else:  # a later step whose agent did not claim it (ClaimRequest)
                        logger.warning(
                            "%s slot %s not claimed: the step's history was trimmed past "
                            "this slot, so it ran already, or its workflow run stops "
                            "here (keep more history than workflow runs overlap)",
                            job.name, format_slot(slot))
                s.steps.seen_finished(job, slot, result.run_status)
        return result


def _supersedes(job: Job, reason: Reason) -> bool:
    """Whether a claim of ``job`` with ``reason`` makes its older scheduled slots still
    waiting here no longer due: only the newest waits, except for a job with
    ``catch_up="all"`` whose runs may overlap."""
    return (reason is Reason.SCHEDULED and job.scheduled
            and (job.catch_up != "all" or job.overlap == "skip"))
