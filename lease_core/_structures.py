"""The values that travel between the scheduler and a backend: runs, attempts and claims."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

__all__ = [
    "FENCE_NUMBER_BITS",
    "LAST_SLOT",
    "Attempt",
    "CheckResult",
    "ClaimRequest",
    "ClaimResult",
    "ClaimStatus",
    "HeartbeatResult",
    "JobInfo",
    "Lease",
    "Outcome",
    "Reason",
    "RunInfo",
    "RunState",
    "RunStatus",
    "fence_of",
    "format_slot",
    "ms_to_datetime",
]


#: The last millisecond of year 9999, the latest slot a run id or an operation may name.
LAST_SLOT = 253_402_300_799_999


def ms_to_datetime(ms: int) -> datetime:
    """Return epoch milliseconds as a tz-aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


FENCE_NUMBER_BITS = 20
"""Bits of a fence (:func:`fence_of`) that hold the attempt number, or a lease's counter."""


def fence_of(epoch: int, number: int) -> int:
    """Return the fence of attempt ``number`` of a run, issued in store ``epoch``.

    A fence is one integer that only grows for a run, across failovers too: it is what to
    hand to a system outside the store that rejects "anything below the highest fence
    seen". ``epoch`` is 0 until the store detects a loss of acknowledged data (a failover
    to a lagging replica, a restart without persistence; on Redis, a job new to the server
    too, which it cannot tell from one whose keys were all lost); after that it is the store's
    clock, in milliseconds, when the loss was detected, so every attempt numbered after
    the loss fences above every attempt numbered before it, even when the lost writes
    make the store number an attempt again. With epoch 0 the fence is the attempt number.

    A standalone lease's integer token follows the same rule without this function: after
    a detected loss, the store issues the next token at or above ``epoch << FENCE_NUMBER_BITS``.
    """
    if epoch < 0 or not 0 <= number < 1 << FENCE_NUMBER_BITS:
        raise ValueError(
            f"fence_of({epoch!r}, {number!r}): the epoch must be >= 0 and the number "
            f"between 0 and {(1 << FENCE_NUMBER_BITS) - 1}")
    return (epoch << FENCE_NUMBER_BITS) + number


def format_slot(ms: int) -> str:
    """Return a slot for logs: ISO-8601 UTC, e.g. ``2026-11-30T01:00:00Z``."""
    text = ms_to_datetime(ms).strftime("%Y-%m-%dT%H:%M:%S")
    if ms % 1000:
        text += f".{ms % 1000:03d}"
    return text + "Z"


class Reason(StrEnum):
    """Why an attempt claimed its run."""

    SCHEDULED = "scheduled"
    TAKEOVER = "takeover"
    HAND_OVER = "hand-over"
    CATCH_UP = "catch-up"
    # -- retries within a run (issue 19, part 1); also an operation's retry (part 2)
    RETRY = "retry"
    # -- operations (issue 19, part 2)
    MANUAL = "manual"


class Outcome(StrEnum):
    """How an attempt ended. ``None`` stands for an attempt that is still running."""

    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    LOST = "lost"
    HANDED_OVER = "handed_over"
    ESCALATED = "escalated"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


class RunStatus(StrEnum):
    """The state of a run (job, slot) in the store."""

    RUNNING = "running"
    HANDED_OVER = "handed_over"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    ESCALATED = "escalated"
    SKIPPED = "skipped"
    # -- operations (issue 19, part 2)
    CANCELLED = "cancelled"
    # -- retries within a run (issue 19, part 1)
    RETRYING = "retrying"
    """A failed attempt left retries: the next attempt (reason ``retry``) is due at the
    run's ``expires_ms`` (store clock); no lease is held meanwhile."""

    @property
    def finished(self) -> bool:
        """True for the statuses a run never leaves."""
        return self not in (RunStatus.RUNNING, RunStatus.HANDED_OVER, RunStatus.RETRYING)


class ClaimStatus(StrEnum):
    """What a claim of a run found."""

    WON = "won"
    """The caller holds the run now, with the token it sent."""
    RUNNING = "running"
    """Another attempt holds a live lease; the caller should stand by as a backup.

    With no run (``run_status`` ``None``) the store is in quarantine after a data loss
    until ``expires_ms``: the caller should claim again later.
    """
    FINISHED = "finished"
    """The run already ended (see :attr:`ClaimResult.run_status`); with no run status and
    attempt 0, its slot was trimmed past and never runs (:attr:`ClaimRequest.scheduled`)."""
    SKIPPED = "skipped"
    """The run was recorded as skipped: an earlier slot of the job still holds a live lease
    or waits for its retry (``overlap_skip``), or the job is paused."""
    ESCALATED = "escalated"
    """The lease expired on the last allowed attempt; the run is now escalated."""


@dataclass(frozen=True, slots=True)
class Lease:
    """What identifies one attempt's hold on a run: enough for every fenced call."""

    job: str
    slot: int
    token: str
    lease_ms: int


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """A request to win, or take over, the run (job, slot)."""

    job: str
    slot: int
    instance_id: str
    token: str
    """A token unique to this attempt, made by the caller; it fences every later call."""
    lease_ms: int
    reason: Reason = Reason.SCHEDULED
    """``scheduled`` or ``catch-up`` for a new run; a takeover gets ``takeover`` or
    ``hand-over`` from the backend, whatever is sent here."""
    overlap_skip: bool = True
    max_attempts: int | None = None
    history_size: int = 100
    history_ttl_ms: int | None = None
    scheduled: bool = True
    """``False`` only for the first claim of a later workflow step by the instance that
    has just completed the step before it: such a missing run is new even at or before
    the job's trimmed history (steps of overlapping workflow runs come after newer runs
    of the step were trimmed). Any other ``scheduled`` or ``catch-up`` claim, when the
    store has no run for the slot, has claimed the slot or a later one before, and
    trimmed the run of a slot at or after it, finds it ``finished`` (attempt 0, no run
    status) and writes nothing: the slot ran and was trimmed, or its turn passed while
    newer runs ran and were trimmed, and it never runs a second time (see
    :mod:`lease_core.abc`, *Claim*)."""


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What a claim found or did."""

    status: ClaimStatus
    job: str
    slot: int
    now_ms: int
    """The store's clock when the claim ran."""
    attempt: int = 0
    """The run's current attempt number (0 when the run was never attempted)."""
    reason: Reason | None = None
    """Why the caller's attempt claimed, when it won."""
    expires_ms: int | None = None
    """When the current lease expires, by the store's clock."""
    run_status: RunStatus | None = None
    instance_id: str | None = None
    """The instance holding the run."""
    epoch: int = 0
    """The store epoch the attempt number was issued in (see :func:`fence_of`): on
    PostgreSQL and in memory 0 unless the store detected a loss of acknowledged data that
    may have affected this job; on Redis never 0, since a job new to the server starts an
    epoch (the server's clock in ms when it was first registered or claimed there)."""


@dataclass(frozen=True, slots=True)
class RunState:
    """One run as a backup sees it."""

    job: str
    slot: int
    status: RunStatus
    attempt: int
    expires_ms: int | None
    instance_id: str | None

    def claimable(self, now_ms: int) -> bool:
        """True when a backup may take the run over at store time ``now_ms``."""
        if self.status is RunStatus.HANDED_OVER:
            return True
        if self.status is RunStatus.RETRYING:  # due once its backoff has passed
            return self.expires_ms is None or self.expires_ms <= now_ms
        return self.status is RunStatus.RUNNING and (
            self.expires_ms is None or self.expires_ms <= now_ms
        )


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The answer to a batched check of watched runs; missing runs were deleted."""

    now_ms: int
    runs: dict[tuple[str, int], RunState] = field(default_factory=dict)
    lost: frozenset[tuple[str, int]] = frozenset()
    """Missing runs that were lost with the store's data rather than deleted: claim them
    again (the claim waits out the store's quarantine)."""


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """The answer to a batched heartbeat: the tokens still held, and those renewed."""

    now_ms: int
    held: frozenset[str] = frozenset()
    """Tokens that still hold a live lease; any other token lost its run."""
    renewed: frozenset[str] | None = None
    """Tokens whose lease was renewed now; ``None`` means all of :attr:`held`. A backend
    may skip renewing a run that a transaction has locked (a fenced transaction), which
    stays held."""
    cancelled: dict[str, int] = field(default_factory=dict)
    """Tokens whose run an operator cancelled (:meth:`~lease_core.Admin.cancel`), each with
    the cancel's grace in milliseconds: the holder asks its handler to stop and cancels
    it once the grace has passed. Never in :attr:`held`. A backend without
    operations leaves it empty (the holder then finds its lease lost)."""


@dataclass(frozen=True, slots=True)
class JobInfo:
    """What the store knows of a job when a scheduler starts."""

    job: str
    first_seen_ms: int
    """When the store first saw the job; slots before it are never caught up."""
    last_slot: int | None
    """The newest slot ever claimed for the job, or the store's time of its last resume
    (:meth:`~lease_core.Admin.resume`) when that is later: no slot up to it is caught up."""
    open_slots: tuple[int, ...] = ()
    """Slots of runs still open (running, handed over or retrying), which backups must
    watch."""
    new: bool = False
    """True when this registration was the first the store saw of the job."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of a run, as recorded in the history."""

    job: str
    slot: int
    attempt: int
    instance_id: str
    reason: Reason
    claimed_at: datetime
    finished_at: datetime | None = None
    outcome: Outcome | None = None
    error: str | None = None
    """The error text, when there is one: for a failed attempt the exception's type and
    message, passwords masked, at most 8 KiB of UTF-8 (a longer one is stored as its
    start and its end with ``… [N characters cut] …`` between them)."""
    requested_by: str | None = None
    """Who asked for this attempt through an operation (``trigger`` or ``retry``): an
    instance id, ``cli`` or ``http``; ``None`` for an attempt the schedule made."""

    @property
    def scheduled_at(self) -> datetime:
        """The slot as a tz-aware UTC datetime."""
        return ms_to_datetime(self.slot)


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run as the store holds it now, for status pages and ``anarchon status``."""

    job: str
    slot: int
    status: RunStatus
    attempt: int
    """The current (or last) attempt number."""
    instance_id: str | None
    """The instance holding the run (``running``), or the one that held it last."""
    expires_ms: int | None = None
    """The lease's expiry on the store's clock, while ``running``; else ``None``."""

    @property
    def scheduled_at(self) -> datetime:
        """The slot as a tz-aware UTC datetime."""
        return ms_to_datetime(self.slot)

    @property
    def expires_at(self) -> datetime | None:
        """:attr:`expires_ms` as a tz-aware UTC datetime."""
        return None if self.expires_ms is None else ms_to_datetime(self.expires_ms)

