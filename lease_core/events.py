"""The events a scheduler reports to its subscribers (see :meth:`Scheduler.subscribe`).

Every event is a frozen dataclass. Run events name the run (``job``, ``slot``); events that
end an attempt (:class:`Completed`, :class:`Failed`, :class:`TimedOut`, :class:`Lost`,
:class:`HandedOver`, :class:`Cancelled`) derive from :class:`AttemptEnded` and carry its
``outcome`` and ``duration``. Each won claim is reported as :class:`Claimed`; one that
took a run over from another instance is reported as :class:`TakenOver` too. A failure
its job's ``retry=`` retries is reported as :class:`Failed` (or :class:`TimedOut`), then
:class:`Retried`. An attempt that ends with a finish (or a retry) is reported once the
store answered it, as the store records it: :class:`Cancelled` when an operator cancelled
the attempt meanwhile, :class:`Lost` when the store refused it because a backup had taken
the run over.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ._structures import Outcome, Reason, ms_to_datetime

__all__ = [
    "AttemptEnded",
    "Cancelled",
    "Claimed",
    "Completed",
    "Escalated",
    "Event",
    "Failed",
    "HandedOver",
    "HistoryTrimmed",
    "Lost",
    "Retried",
    "RunEvent",
    "Skipped",
    "StandingBy",
    "StoreBack",
    "StoreUnreachable",
    "TakenOver",
    "TimedOut",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """The base of every event: the instance that reports it."""

    instance_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEvent(Event):
    """An event about one run (job, slot)."""

    job: str
    slot: int
    """The run's scheduled time in epoch milliseconds (UTC)."""

    @property
    def scheduled_at(self) -> datetime:
        """The slot as a tz-aware UTC datetime."""
        return ms_to_datetime(self.slot)


@dataclass(frozen=True, slots=True, kw_only=True)
class Claimed(RunEvent):
    """This instance won a claim and starts the handler (attempt ``attempt``)."""

    attempt: int
    reason: Reason
    claim_duration: float
    """Seconds the claim took in the store."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TakenOver(RunEvent):
    """This instance took the run over from another one (``reason`` takeover or hand-over)."""

    attempt: int
    reason: Reason


@dataclass(frozen=True, slots=True, kw_only=True)
class StandingBy(RunEvent):
    """Another instance holds the run (or it waits for its retry); this one backs it up."""

    holder: str | None
    """The instance holding the run, when the store says; ``None`` for a run waiting for
    its retry, which no instance holds."""
    claim_duration: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Skipped(RunEvent):
    """The run was recorded as skipped: an earlier run of the job still holds its lease or
    waits for its retry, or the job is paused."""

    reason: Reason
    claim_duration: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Escalated(RunEvent):
    """The run's lease expired on its last allowed attempt; nobody retries it."""

    attempt: int
    reason: Reason
    claim_duration: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptEnded(RunEvent):
    """The base of the events that end one of this instance's attempts."""

    attempt: int
    reason: Reason
    """Why the attempt claimed the run."""
    duration: float
    """Seconds from the claim to the end of the attempt."""

    @property
    def outcome(self) -> Outcome:
        """How the attempt ended."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True, kw_only=True)
class Completed(AttemptEnded):
    """The handler returned."""

    @property
    def outcome(self) -> Outcome:
        """``completed``."""
        return Outcome.COMPLETED


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed(AttemptEnded):
    """The handler raised ``error``."""

    error: BaseException

    @property
    def outcome(self) -> Outcome:
        """``failed``."""
        return Outcome.FAILED


@dataclass(frozen=True, slots=True, kw_only=True)
class TimedOut(AttemptEnded):
    """The job's timeout cancelled the handler."""

    @property
    def outcome(self) -> Outcome:
        """``timed_out``."""
        return Outcome.TIMED_OUT


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost(AttemptEnded):
    """The attempt lost its lease (``why``); a backup takes, or took, the run over."""

    why: str

    @property
    def outcome(self) -> Outcome:
        """``lost``."""
        return Outcome.LOST


@dataclass(frozen=True, slots=True, kw_only=True)
class HandedOver(AttemptEnded):
    """The scheduler stopped and handed the run over: a backup claims it at once."""

    @property
    def outcome(self) -> Outcome:
        """``handed_over``."""
        return Outcome.HANDED_OVER


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancelled(AttemptEnded):
    """An operator cancelled the run (:meth:`~lease_core.Admin.cancel`) while this
    attempt held it: the handler returned within the grace, or was cancelled after it."""

    @property
    def outcome(self) -> Outcome:
        """``cancelled``."""
        return Outcome.CANCELLED


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreUnreachable(Event):
    """A store call failed after the store had answered."""

    error: BaseException


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreBack(Event):
    """The store answered again after :class:`StoreUnreachable`."""

    downtime: float
    """Seconds since the first failed call."""


# -- retries within a run (issue 19, part 1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Retried(RunEvent):
    """Attempt ``attempt`` failed (or timed out) and the run will be tried again.

    Reported after the attempt's :class:`Failed` (or :class:`TimedOut`): retry number
    ``retry`` of the job's ``retry=`` policy is due ``delay`` seconds from now, on the
    store's clock, and whichever instance claims it first makes it (reason ``retry``).
    """

    attempt: int
    retry: int
    """1 for the first retry of the run, 2 for the second, ..."""
    delay: float
    """Seconds until the retry is due."""
    error: str
    """The failure's error text, as the history records it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryTrimmed(Event):
    """This instance trimmed the store's history (its turn of the fleet's maintenance).

    Reported when at least one attempt was deleted: attempts beyond each job's newest
    ``history_size`` and those finished more than ``history_ttl`` ago, with the finished
    runs and checkpoints left without any attempt.
    """

    attempts: int
    """Attempts deleted."""
    jobs: tuple[str, ...]
    """The jobs some attempts were deleted from."""
    complete: bool
    """False when the period's time budget ran out first, or a call to the store failed
    (reported as :class:`StoreUnreachable` too); the next period goes on."""
    duration: float
    """Seconds the trimming took."""
