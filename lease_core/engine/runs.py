"""The runs one instance deals with: one record per (job, slot), its phase, its transitions.

A run's record goes through these phases (:class:`Phase`); a run in none of them is one
this instance has nothing to do with, or is done with::

    (none) --due, ranked after another member, or at capacity--> PENDING
    PENDING --still unclaimed when its turn comes--> CLAIMING
    PENDING --claimed by another--> WATCHING, or (none) once finished
    (none) --claim sent--> CLAIMING --won--> HELD --handler ended--> FINISHING --> (none)
                              |  |             \\--won while stopping--> HANDING_OVER
                              |  \\--another holds it--> WATCHING --lease expired--> CLAIMING
                              \\--no answer, quarantine--> RECLAIM --next tick--> CLAIMING
    FINISHING --lease lost, or the finish unanswered--> WATCHING
    FINISHING --the handler stopped by stop()--> HANDING_OVER

Every transition is a method of :class:`RunTable`, the only code that changes a phase. A
record this instance executes (``HELD``, ``FINISHING``, ``HANDING_OVER``) is never
replaced by what a claim of the same run answers: only its own execution moves it on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import anyio

from .._outcome import Interruption
from .._structures import Lease, Reason

if TYPE_CHECKING:
    from ..context import RunContext
    from .jobs import Job

__all__ = ["AttemptInfo", "Execution", "Phase", "Run", "RunTable"]


class Phase(StrEnum):
    """Where one run stands for this instance."""

    CLAIMING = "claiming"
    """A claim of the run is on its way to the store."""
    HELD = "held"
    """This instance holds the lease and runs the handler."""
    FINISHING = "finishing"
    """The handler ended; its result and outcome are being recorded."""
    WATCHING = "watching"
    """Another attempt holds the run: this instance backs it up."""
    RECLAIM = "reclaim"
    """The claim's answer is unknown, or the store is in quarantine: claim again next tick."""
    HANDING_OVER = "handing over"
    """Held while the scheduler stops: handed over to a backup once the handlers ended."""
    PENDING = "pending"
    """Due, but another member claims it first (or this one is at capacity): claimed here
    only if the store still has no run by ``claim_after``."""


#: The phases of a run this instance executes, which no claim reply changes.
_OWN = frozenset({Phase.HELD, Phase.FINISHING, Phase.HANDING_OVER})
#: The phases of a run this instance backs up (or must claim again).
_WATCHED = frozenset({Phase.WATCHING, Phase.RECLAIM, Phase.PENDING})


@dataclass(frozen=True, slots=True)
class AttemptInfo:
    """What the events about the end of an attempt this instance won report."""

    attempt: int
    reason: Reason
    started: float
    """When the claim was sent (anyio clock)."""


@dataclass(eq=False)
class Execution:
    """A handler this instance runs: its context, cancel scope and local lease deadline."""

    ctx: RunContext
    scope: anyio.CancelScope
    cancel_reason: Interruption | None = None
    lost: bool = False
    deadline: float = math.inf
    """The local lease deadline; the scope's, except while a fenced transaction is open."""
    transactions: int = 0
    """The fenced transactions of the run open now (a handler's tasks may open several;
    they wait for each other's lock on the run)."""
    cancelled: bool = False
    """An operator cancelled the run (its heartbeat said so): it runs out its grace."""

    @property
    def in_transaction(self) -> bool:
        """True while a fenced transaction of the run is open."""
        return self.transactions > 0

    def set_deadline(self, deadline: float) -> None:
        """Move the local lease deadline (after a claim or a renewal)."""
        self.deadline = deadline
        if not self.in_transaction:
            self.scope.deadline = deadline

    def transaction_hook(self, active: bool, deadline: float | None = None) -> None:
        """Called by the run's context as a fenced transaction opens and closes; with
        ``deadline``, the local lease deadline of the renewal its commit made."""
        # An open fenced transaction locks the run: no backup can take it over, so the
        # local deadline waits until the transaction ends.
        self.transactions += 1 if active else -1
        if deadline is not None:
            self.deadline = max(self.deadline, deadline)
        self.scope.deadline = math.inf if self.in_transaction else self.deadline


@dataclass(eq=False)
class Run:
    """One run (job, slot) this instance deals with."""

    job: Job
    slot: int
    phase: Phase
    lease: Lease | None = None
    """The lease this instance holds (``HELD``, ``FINISHING``, ``HANDING_OVER``)."""
    execution: Execution | None = None
    """The running handler (``HELD`` and ``FINISHING``)."""
    attempt: AttemptInfo | None = None
    """The attempt this instance won, until the event about its end is reported."""
    reclaim_reason: Reason | None = None
    """The reason to claim with (``RECLAIM``, ``PENDING``)."""
    claim_after: int = 0
    """Store time (ms) from which a ``PENDING`` run is claimed here if still unclaimed."""
    kept: bool = False
    """A ``RECLAIM`` run the store answered for after its slot was due (a quarantine, or
    a claim that failed after the store had answered): claimed again even once a newer
    slot of its job is due, since it was not missed while the store was unreachable."""
    successor: bool = False
    """A later workflow step's run that this instance claims as the agent of the step
    before (it completed it): a missing run is new even past the step's trimmed history
    (:attr:`ClaimRequest.scheduled <lease_core.abc.ClaimRequest.scheduled>` False), through
    the claim's retries and a deferral at capacity too."""

    completed_attempt: int | None = None
    """On a ``WATCHING`` run: the attempt this instance completed, its finish unknown. If
    the store shows that attempt completed, this instance is the agent of the next step
    (:attr:`successor`); if another attempt completed it, the other instance is."""

    @property
    def key(self) -> tuple[str, int]:
        """The run's identity: (job name, slot)."""
        return (self.job.name, self.slot)


class RunTable:
    """The records of the runs one scheduler deals with, and every change of their phase."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, int], Run] = {}
        self._held: dict[str, Run] = {}
        """The ``HELD`` runs by token."""
        self.idle: anyio.Event | None = None
        """Set (when there is one) as the last held run stops being held."""
        self._change: anyio.Event | None = None
        self.holding: anyio.Event | None = None
        """Set (when there is one) as a run starts being held (the ticker's nap)."""

    async def wait_change(self, within: float) -> None:
        """Wait until a run stops being this instance's own, or is settled elsewhere (it is
        released, forgotten or watched), ``within`` seconds at most."""
        if self._change is None:
            self._change = anyio.Event()
        with anyio.move_on_after(within):
            await self._change.wait()

    def _changed(self) -> None:
        change, self._change = self._change, None
        if change is not None:
            change.set()

    # -- reading

    def get(self, key: tuple[str, int]) -> Run | None:
        """The record of ``key``, if any."""
        return self._runs.get(key)

    def held(self) -> list[Run]:
        """The runs whose handlers run now."""
        return list(self._held.values())

    def holds(self, token: str) -> bool:
        """True while the attempt with ``token`` runs its handler here."""
        return token in self._held

    @property
    def held_count(self) -> int:
        """How many handlers run now."""
        return len(self._held)

    def watched(self) -> Iterator[Run]:
        """The runs this instance backs up or must claim again, oldest record first."""
        return (run for run in self._runs.values() if run.phase in _WATCHED)

    @property
    def watched_count(self) -> int:
        """How many runs this instance backs up or must claim again."""
        return sum(1 for _ in self.watched())

    def awaiting_hand_over(self) -> list[Lease]:
        """The leases of runs won while stopping, or whose handlers stopped for the stop."""
        return [run.lease for run in self._runs.values()
                if run.phase is Phase.HANDING_OVER and run.lease is not None]

    def successors_waiting(self) -> list[tuple[Job, int, Reason]]:
        """The agent's claims of later workflow steps (:attr:`Run.successor`) to make
        again: unanswered, or deferred at capacity."""
        return [(run.job, run.slot, run.reclaim_reason) for run in self._runs.values()
                if run.successor and run.reclaim_reason is not None
                and run.phase in (Phase.RECLAIM, Phase.PENDING)]

    # -- transitions

    def claiming(self, job: Job, slot: int, *, successor: bool = False) -> bool:
        """A claim of (job, slot) is sent; return whether it is the agent's claim of a
        later step (:attr:`Run.successor`)."""
        run = self._runs.get((job.name, slot))
        if run is None:
            self._runs[(job.name, slot)] = Run(job, slot, Phase.CLAIMING, successor=successor)
            return successor
        if run.phase not in _OWN:
            run.phase, run.reclaim_reason = Phase.CLAIMING, None
            run.successor = run.successor or successor
        return run.successor

    def hold(self, job: Job, lease: Lease, execution: Execution,
             attempt: AttemptInfo | None) -> Run:
        """The claim was won: the handler starts."""
        run = Run(job, lease.slot, Phase.HELD, lease, execution, attempt)
        self._runs[run.key] = run
        self._held[lease.token] = run
        holding, self.holding = self.holding, None
        if holding is not None:
            holding.set()
        return run

    def hand_over_later(self, job: Job, lease: Lease, attempt: AttemptInfo | None) -> None:
        """Won, or handed over by its handler, while stopping: hand it over at the end."""
        run = self._runs.get((job.name, lease.slot))
        if run is None or run.lease is None or run.lease.token != lease.token:
            run = Run(job, lease.slot, Phase.HANDING_OVER, lease, attempt=attempt)
            self._runs[run.key] = run
        run.phase, run.execution = Phase.HANDING_OVER, None
        self._held.pop(lease.token, None)

    def watch(self, job: Job, slot: int, *, reclaim: Reason | None = None,
              kept: bool = False) -> None:
        """Back the run up, or (``reclaim``) claim it again with that reason next tick
        (``kept``: even once a newer slot is due, see :attr:`Run.kept`; once kept, a
        run stays kept; so does the agent's claim of a later step, :attr:`Run.successor`)."""
        key = (job.name, slot)
        run = self._runs.get(key)
        if run is not None and run.phase in _OWN:
            return
        kept = bool(reclaim) and (kept or (run is not None and run.kept))
        successor = bool(reclaim) and run is not None and run.successor
        self._runs[key] = Run(job, slot, Phase.RECLAIM if reclaim else Phase.WATCHING,
                              reclaim_reason=reclaim, kept=kept, successor=successor)
        if not reclaim:
            self._changed()

    def pending(self, job: Job, slot: int, *, claim_after: int, reason: Reason,
                successor: bool = False) -> None:
        """Claim the run at ``claim_after`` (store ms) if the store has none by then
        (``successor``: as the agent of the step before, :attr:`Run.successor`)."""
        key = (job.name, slot)
        run = self._runs.get(key)
        if run is None or run.phase in (Phase.CLAIMING, Phase.RECLAIM, Phase.PENDING):
            successor = successor or (run is not None and run.successor)
            self._runs[key] = Run(job, slot, Phase.PENDING, reclaim_reason=reason,
                                  claim_after=claim_after, successor=successor)

    def superseded(self, job: Job, slot: int) -> None:
        """``job``'s scheduled runs still pending at slots before ``slot`` are no longer
        to claim: each is only backed up, and forgotten at the next check unless another
        member claimed it."""
        older = [run for (name, at), run in self._runs.items()
                 if name == job.name and at < slot and run.phase is Phase.PENDING
                 and run.reclaim_reason is Reason.SCHEDULED and not run.successor]
        for run in older:
            self.watch(run.job, run.slot)

    def rewatch(self, run: Run, *, completed: bool = False) -> None:
        """The run's own attempt lost its lease, or its end is unknown: back it up
        (``completed``: its handler completed it here, :attr:`Run.completed_attempt`)."""
        current = self._runs.get(run.key)
        if current is None or current is run:
            attempt = (run.execution.ctx.attempt if completed and run.execution is not None
                       else None)
            self._runs[run.key] = Run(run.job, run.slot, Phase.WATCHING,
                                      completed_attempt=attempt)
            self._changed()

    def finishing(self, run: Run) -> None:
        """The run's handler ended: its outcome is recorded next."""
        assert run.lease is not None
        self._held.pop(run.lease.token, None)
        if self._runs.get(run.key) is run:
            run.phase = Phase.FINISHING
        if not self._held and self.idle is not None:
            self.idle.set()

    def release(self, run: Run) -> None:
        """The run's outcome is recorded (or nothing may be): this instance is done with it."""
        if self._runs.get(run.key) is run and run.phase is Phase.FINISHING:
            del self._runs[run.key]
            self._changed()

    def forget(self, key: tuple[str, int]) -> None:
        """Stop backing up ``key`` (it ended, or a claim of it is settled elsewhere)."""
        run = self._runs.get(key)
        if run is not None and run.phase not in _OWN:
            del self._runs[key]
            self._changed()

    def ended_attempt(self, lease: Lease) -> AttemptInfo | None:
        """Take the attempt ``lease`` won here, to report its end once."""
        run = self._runs.get((lease.job, lease.slot))
        if run is None or run.lease is None or run.lease.token != lease.token:
            return None
        info, run.attempt = run.attempt, None
        return info

    def handed_over(self, leases: list[Lease]) -> None:
        """The runs of ``leases`` were handed over (or could not be): done with them."""
        tokens = {lease.token for lease in leases}
        for key in [k for k, r in self._runs.items() if r.phase is Phase.HANDING_OVER
                    and r.lease is not None and r.lease.token in tokens]:
            del self._runs[key]

    def clear(self) -> None:
        """The scheduler stopped: it deals with no run any more."""
        self._runs.clear()
        self._held.clear()
