"""The backend contract: what every store (PostgreSQL, Redis, memory) implements.

A backend stores runs, attempts, jobs and checkpoints, and does all lease arithmetic on
**its own clock**. The scheduler never compares a lease with a local clock of its own.

The contract, which the conformance suite (:mod:`lease_core.testing`) checks on every
backend:

*Runs.* A run is identified by (job, slot). Its status is one of :class:`RunStatus`.
Exactly one attempt holds a run at a time; that attempt's ``token`` fences every write.

*Claim* (:meth:`Backend.claim`), atomically and serialised per job (claims of different
jobs never wait for each other):

1. Register the job if it is new (``first_seen`` = now) and raise its ``last_slot`` to
   the slot. A claim answered from a run that exists without writing (3, 4) may leave
   ``last_slot`` as it is (PostgreSQL's read-only path does): only a trigger's run
   (:meth:`~lease_core.Admin.trigger`) can lie past ``last_slot`` before its first claim.
2. If the run does not exist:

   - for a request with ``scheduled`` set and reason ``scheduled`` or ``catch-up``, when
     the slot is at or before the job's ``last_slot`` before this claim and at or before
     its newest slot whose run trimming deleted (see 7), return ``FINISHED`` with attempt
     0 and no run status, writing nothing: the slot ran and was trimmed, or its turn
     passed while newer runs ran;
   - for reason ``scheduled`` or ``catch-up`` of a paused job (:meth:`~lease_core.Admin.pause`),
     insert the run as ``skipped`` (one attempt, error "job paused by <who>"): ``SKIPPED``;
   - with ``overlap_skip``, when another run of the job with a smaller slot is
     ``running`` with ``expires > now``, or ``retrying`` (whatever its due time: the run
     has not ended), insert the run as ``skipped`` with one attempt whose outcome is
     ``skipped`` (its error "an earlier run of the job still holds its lease", or, when
     only retrying runs are earlier, "... waits for its retry") and return ``SKIPPED``;
   - otherwise insert it as ``running``, attempt 1, the request's token and reason,
     ``expires = now + lease``, and return ``WON``.

3. If the run is finished, return ``FINISHED`` with its status.
4. If it is ``running`` with ``expires > now``, return ``RUNNING`` (stand by as backup).
   But when the request's token is the one holding the run (the same claim sent again
   after its reply was lost), return ``WON`` as the first answer did, changing nothing.
5. If it is ``handed_over``: the next attempt takes it with reason ``hand-over``, or
   ``manual`` / ``retry`` for a run an operation queued (a trigger, an admin's retry; its
   ``requested_by`` says who asked); never escalated, whatever the attempt number. ``WON``.
6. If it is ``running`` with ``expires <= now``: when ``max_attempts`` is set and the run's
   counted attempts, the first attempt plus every attempt that started by takeover, are
   already ``>= max_attempts``, the run becomes ``escalated``, its last attempt's outcome
   becomes ``escalated`` (if it had none) and ``ESCALATED`` is returned. Attempts that
   started by hand-over are not counted: a run handed over on every rolling deploy is
   never escalated for it. (The attempt number still counts every attempt.)
   Otherwise the last attempt's outcome becomes ``lost`` (if it had none), and the next
   attempt takes the run with reason ``takeover``; return ``WON``.
6b. If it is ``retrying``: ``RUNNING`` while ``expires > now``; then the next attempt
   takes it, reason ``retry`` (never counted by ``max_attempts``); return ``WON``.
7. A claim trims no history (the request's ``history_size`` and ``history_ttl_ms`` are
   for backends of their own that still do): :meth:`Backend.prune` does, called by the
   scheduler's maintenance for every job of the store, one instance at a time
   (:meth:`Backend.maintenance_due`). It keeps the newest ``history_size`` attempts and
   any not finished, drops those that finished ``history_ttl`` ago, and deletes finished
   runs with no attempt left (never open ones), keeping their newest slot per job, for 2.
   The steps of a workflow run are kept together until it has ended (see ``prune``).

*Fencing.* :meth:`heartbeat`, :meth:`finish`, :meth:`hand_over` and
:meth:`set_checkpoint` act only where the run's current token equals the caller's token
and the run is ``running``; otherwise they change nothing. A heartbeat also requires
``expires > now``: an expired lease is never revived, so a backup's takeover is never
raced by the old holder.

*Single and batch twins.* Three operations come as a single call and a batch:
:meth:`~Backend.claim` and :meth:`~Backend.claim_many`, :meth:`~Backend.finish` and
:meth:`~Backend.finish_many`, :meth:`~Backend.prune` and :meth:`~Backend.prune_many`
(:data:`TWINS`). A backend implements one of each pair, usually the batch, and inherits
the other from :class:`Backend` (a batch of one, or the single calls one after the
other, through ``self``). A batch answers, item by item, what the single calls made one
after the other would have answered; a backend implementing both must keep them so,
which the conformance suite checks. A backend class implementing neither ``claim`` nor
``claim_many`` (or neither ``finish`` nor ``finish_many``) cannot be instantiated:
:class:`TypeError`, naming the pair. One implementing neither ``prune`` nor
``prune_many`` keeps its history (both validate their arguments and delete nothing).

*Membership* (:meth:`Backend.members`). Each instance renews its membership of the fleet
for ``ttl_ms`` (an absolute expiry, ``now + ttl_ms``, on the store's clock, never the
client's) and reads, in the same call and one round trip, the ids of every live member
(expiry after now), itself included, sorted (Python's ``sorted``). An expired member is
not returned; the store deletes its record later (records expired more than
:data:`MEMBER_RETENTION_MS` ago go in the same call), so records never accumulate. The
scheduler ranks instances per job from this list (rendezvous hashing); a backend that
keeps no membership returns ``None`` (the default), and the scheduler then claims every
slot on every instance.

*Quarantine.* A store that finds it lost data (Redis restarted without persistence) may
answer a claim ``RUNNING`` with no run (``run_status`` ``None``, ``expires_ms`` the end of
its quarantine), writing nothing, until every lease that may have been live has expired;
the caller claims again later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from os import getpid
from typing import Any, Self

from ._checks import (
    FINISH_OUTCOMES,
    MEMBER_RETENTION_MS,
    check_every,
    check_leave,
    check_limit,
    check_members,
    check_not_forked,
    check_prune,
    decode_checkpoint,
    encode_checkpoint,
    finish_status,
    run_status,
)
from ._descriptions import DescriptionStore
from ._named_leases import LeaseAnswer, NamedLeaseStore
from ._operations_store import OperationsStore
from ._per_loop import StartLock
from ._structures import (
    Attempt,
    CheckResult,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    HeartbeatResult,
    JobInfo,
    Lease,
    Outcome,
    Reason,
    RunInfo,
    RunState,
    RunStatus,
)
from .errors import ConfigurationError

#: How many attempts the default :meth:`Backend.jobs` and :meth:`Backend.runs` read.
_DERIVED_LIMIT = 10_000

# The contract's data types are re-exported here: a backend is written against this module.
__all__ = [
    "FINISH_OUTCOMES",
    "MEMBER_RETENTION_MS",
    "TWINS",
    "Attempt",
    "Backend",
    "CheckResult",
    "ClaimRequest",
    "ClaimResult",
    "ClaimStatus",
    "HeartbeatResult",
    "JobInfo",
    "Lease",
    "LeaseAnswer",
    "Outcome",
    "Reason",
    "RunInfo",
    "RunState",
    "RunStatus",
    "check_every",
    "check_leave",
    "check_limit",
    "check_members",
    "check_prune",
    "decode_checkpoint",
    "encode_checkpoint",
    "finish_status",
]


#: The single/batch twins of the contract (see the module docs): a backend implements at
#: least one method of each pair, and :class:`Backend` derives the other from it.
TWINS: tuple[tuple[str, str], ...] = (
    ("claim", "claim_many"), ("finish", "finish_many"), ("prune", "prune_many"))
#: The twins without a default of their own: a backend must implement one of each pair.
_REQUIRED_TWINS = TWINS[:2]


def _implements(cls: type, name: str) -> bool:
    """Whether backend class ``cls`` has a ``name`` of its own, not the one Backend derives."""
    return getattr(cls, name, None) is not getattr(Backend, name)


def _require(cls: type, twin: str, caller: str) -> None:
    """Refuse to derive ``caller`` from ``twin`` when ``cls`` implements neither.

    Only reachable through ``super()`` from an override of ``caller`` (a class with
    neither method is refused at instantiation): raised rather than recursing.
    """
    if not _implements(cls, twin):
        raise NotImplementedError(
            f"{cls.__name__}.{caller}() reached Backend.{caller}(), which is derived from "
            f"{twin}(), and {cls.__name__} does not implement {twin}(); implement one of "
            f"{caller}() and {twin}() without calling the other through super()"
        )


class Backend(NamedLeaseStore, OperationsStore, DescriptionStore, ABC):
    """The store a :class:`~lease_core.Scheduler` coordinates through.

    A backend may be shared by several schedulers in one process. :meth:`start` and
    :meth:`close` are counted: what the backend opened itself (a pool made from a DSN, a
    client from a URL) is closed when the last user closes it; what the user passed, never.

    A subclass implements the abstract methods and one method of each pair of
    :data:`TWINS` (see *Single and batch twins* in the module docs), and may implement
    the named leases of :class:`~lease_core._named_leases.NamedLeaseStore` and the
    operations of :class:`~lease_core._operations_store.OperationsStore`.
    """

    #: The URL schemes :func:`~lease_core.backend_from_url` maps to this backend.
    schemes: tuple[str, ...] = ()
    #: True for a store in the process's memory, no connections: a forked child may use it.
    in_process: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Refuse a backend class that implements neither method of a required twin pair."""
        made = super().__new__(cls)  # an abstract method left: ABC's own TypeError first
        missing = [f"{single}() or {batch}()" for single, batch in _REQUIRED_TWINS
                   if not (_implements(cls, single) or _implements(cls, batch))]
        if missing:
            raise TypeError(
                f"Can't instantiate backend class {cls.__name__} without an implementation "
                f"of {' and of '.join(missing)}: implement one method of each pair (the "
                "batch, usually); Backend derives the other (see lease_core.abc)"
            )
        return made

    def __init__(self) -> None:
        self._users = 0
        self._start_lock = StartLock()  # leases start it per hold; any loop, one at a time
        self._existing_only = False  # opened by start(create=False): nothing made yet
        self._opened_in = 0  # the process that opened it (a forked copy must not use it)

    async def start(self, *, create: bool = True) -> None:
        """Open connections and create the store's structures when missing.

        Safe to call from many schedulers and processes at once. With ``create=False``
        the store is opened only if it exists, nothing created or changed (as read-only
        tools such as ``anarchon status`` do, with SELECT-only rights too):
        :class:`~lease_core.errors.StoreNotFound` when there is no store there. Later
        users share what the first opened (one with ``create`` joining one without makes
        or upgrades the store then: :meth:`_open_joined`). Other calls come between it
        and the last close (else a URL's backend raises). In a forked child, a copy its
        parent had open raises ``RuntimeError`` (:attr:`in_process` aside)."""
        if self._users:
            check_not_forked(self, self._opened_in)
        if self._users and not (create and self._existing_only) and self._count_now(1):
            return  # already open, no open or close under way: no wait
        async with self._start_lock:
            if self._users == 0:
                await (self._open() if create else self._open_existing())
                self._existing_only, self._opened_in = not create, getpid()
            elif create and self._existing_only:  # a reader opened it: upgrade it now
                await self._open_joined()
                self._existing_only = False
            self._users += 1

    async def close(self) -> None:
        """Release this user's hold; the last one closes what the backend opened."""
        if self._drop_user_now():
            return
        async with self._start_lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0:
                await self._close()

    def _drop_user_now(self) -> bool:
        """Release this user's hold at once when that closes nothing (not the last user, no
        start or close under way; never for a subclass with a :meth:`close` of its own);
        return whether it did. What :meth:`close` does first, without awaiting: a
        :class:`~lease_core.Lease` lets go of its hold this way at every release."""
        return type(self).close is Backend.close and self._users > 1 and self._count_now(-1)

    def _count_now(self, change: int) -> bool:
        """Add ``change`` (1 or -1) to the user count, without waiting, when that leaves
        a user and no start or close is under way on any loop; return whether it did.
        Under the start lock: a last close on another thread cannot come in between."""
        if not self._start_lock.acquire_nowait():
            return False
        try:
            if self._users + min(change, 0) < 1:
                return False
            self._users += change
            return True
        finally:
            self._start_lock.release_nowait()

    @abstractmethod
    async def _open(self) -> None:
        """Open the backend's resources (first :meth:`start`)."""

    async def _open_joined(self) -> None:
        """What :meth:`_open` does beyond :meth:`_open_existing` (create, upgrade), on
        what is open: a start() that may create joins one with ``create=False``. Default:
        nothing."""

    async def _open_existing(self) -> None:
        """Open the resources of a store that must exist already, writing nothing.

        The first :meth:`start` with ``create=False`` calls this. The default opens as
        :meth:`_open` does; a backend whose ``_open`` creates structures overrides it to
        raise :class:`~lease_core.errors.StoreNotFound` instead.
        """
        await self._open()

    @abstractmethod
    async def _close(self) -> None:
        """Close the resources the backend opened itself (last :meth:`close`)."""

    @abstractmethod
    async def now_ms(self) -> int:
        """Return the store's clock, in epoch milliseconds."""

    @abstractmethod
    async def register_jobs(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """Record the jobs as seen (keeping an earlier ``first_seen``) and describe each.

        One :class:`JobInfo` per name (a name given twice is one job, ``new`` if this call
        was the first to see it), listing the slots of its open runs (``running``,
        ``handed_over`` or ``retrying``) so that a starting scheduler can watch them.
        """

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        """Win, take over, or find the state of a run, atomically (see module docs).

        Implement this or :meth:`claim_many` (see *Single and batch twins*); the one
        inherited here is a batch of one, ``claim_many([request])``.
        """
        _require(type(self), "claim_many", "claim")
        (result,) = await self.claim_many([request])
        return result

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        """Make the claims in order, as one batch where the store allows it.

        Returns one result per request, in the requests' order, each equal to what
        :meth:`claim` would have answered had the requests been claimed one after the
        other (a later request of the same job sees what an earlier one wrote); an empty
        batch answers ``[]``. Implement this or :meth:`claim`: the one inherited here
        claims the requests one at a time with :meth:`claim`. The built-in backends
        implement this one and send the whole batch to the store at once (one statement
        on PostgreSQL, one round trip on Redis).
        """
        _require(type(self), "claim", "claim_many")
        return [await self.claim(request) for request in requests]

    @abstractmethod
    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        """Renew every lease in one round trip; return the tokens still held (and renewed).

        Each renewal sets ``expires = now + lease_ms`` (an absolute expiry on the store's
        clock, never an addition to the remaining time), and only where the token still
        holds a ``running`` run whose lease has not expired.
        """

    async def finish(self, lease: Lease, outcome: Outcome, error: str | None = None) -> bool:
        """End the attempt with ``outcome`` (completed, failed or timed_out).

        Returns False, changing nothing, when the token no longer holds the run; another
        outcome raises :class:`~lease_core.errors.ConfigurationError` (see
        :func:`finish_status`). Implement this or :meth:`finish_many`; the one inherited
        here is a batch of one, ``finish_many([(lease, outcome, error)])``.
        """
        _require(type(self), "finish_many", "finish")
        (done,) = await self.finish_many([(lease, outcome, error)])
        return done

    async def finish_many(
        self, items: Sequence[tuple[Lease, Outcome, str | None]]
    ) -> list[bool]:
        """End many attempts, as one batch where the store allows it.

        ``items`` are ``(lease, outcome, error)`` triples, as :meth:`finish` takes them.
        Returns one answer per item, in order, each what :meth:`finish` would have
        answered had the items been finished one after the other (the same lease twice:
        True, then False). An outcome :meth:`finish` refuses fails the whole call before
        anything is written. Implement this or :meth:`finish`: the one inherited here
        finishes the items one at a time with :meth:`finish`. The built-in backends
        implement this one and send the whole batch at once (one statement on
        PostgreSQL, one round trip on Redis).
        """
        _require(type(self), "finish", "finish_many")
        for _, outcome, _ in items:
            finish_status(outcome)
        return [await self.finish(lease, outcome, error) for lease, outcome, error in items]

    # -- retries within a run (issue 19, part 1)
    async def retry_later(self, items: Sequence[tuple[Lease, Outcome, str | None, Sequence[int]]]
                          ) -> list[int]:
        """End failed attempts ``(lease, outcome, error, delays_ms)``, fenced as :meth:`finish`;
        with ``n`` retries made, ``n < len(delays_ms)`` leaves the run ``retrying`` until
        ``now + delays_ms[n]`` (answer ``n + 1``), else ends it (0); -1: not held. Without
        it, ``retry=`` is refused (:func:`lease_core.retry.supports_retries`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement retry_later()")

    @abstractmethod
    async def hand_over(self, leases: Sequence[Lease]) -> frozenset[str]:
        """Release runs so a backup claims them at its next check; return tokens released.

        Each run becomes ``handed_over`` and its attempt's outcome ``handed_over``.
        """

    @abstractmethod
    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        """Read the state of many runs in one round trip, for backups."""

    @abstractmethod
    async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return at most ``limit`` attempts, newest claim first, of one job or of all jobs.

        ``limit`` 0 answers ``[]``; a negative one raises
        :class:`~lease_core.errors.ConfigurationError` (:func:`check_limit`), as :meth:`runs`.
        """

    async def prune(self, job: str, *, keep: int | None = None,
                    older_than_ms: int | None = None, batch: int = 1000) -> int:
        """Trim ``job``'s history now (the scheduler's maintenance, ``anarchon prune``).

        Deletes the finished attempts beyond the newest ``keep`` (``None``: no limit; an
        open run's stays) and those that finished more than ``older_than_ms`` ago on the
        store's clock (``None``: none), at most ``batch`` of each kind per call, then the
        finished runs (and checkpoints) left with no attempt; never an open run, nor a run
        cancelled in a grace not yet passed (``Admin.cancel``) or its attempt. Returns how
        many attempts were deleted: call again while it returns a full batch. Implement
        this or :meth:`prune_many` (the one inherited here is ``prune_many([job])``, and
        deletes nothing when neither is; every built-in backend implements the latter).
        The built-in backends trim a step of a workflow the store records
        (:meth:`register_workflows`) by workflow run: nothing of a slot where one of the
        workflow's steps has an open run, nor, by age, of one where any of its steps'
        attempts is open or ended less than ``older_than_ms`` ago (the run's end).
        """
        check_prune(keep, older_than_ms, batch)
        if not _implements(type(self), "prune_many"):
            return 0
        counts = await self.prune_many([job], keep=keep, older_than_ms=older_than_ms,
                                       batch=batch)
        return counts.get(job, 0)

    async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                         older_than_ms: int | None = None,
                         batch: int = 1000) -> dict[str, int]:
        """Trim the history of many jobs, as one batch where the store allows it.

        Each job is trimmed as :meth:`prune` would trim it (at most ``batch`` attempts of
        each kind per job); returns the attempts deleted per job (a job given twice is
        trimmed once). Implement this or :meth:`prune`: the one inherited here calls
        :meth:`prune` for each job (and deletes nothing when neither is implemented).
        PostgreSQL sends one statement, Redis one pipelined round trip, memory takes its
        lock once.
        """
        check_prune(keep, older_than_ms, batch)
        names = list(dict.fromkeys(jobs))
        if not _implements(type(self), "prune"):
            return dict.fromkeys(names, 0)
        return {job: await self.prune(job, keep=keep, older_than_ms=older_than_ms,
                                      batch=batch)
                for job in names}

    async def maintenance_due(self, instance_id: str, every_ms: int) -> bool:
        """Return True to one caller per ``every_ms`` across every instance of the store.

        The first call made when no call has won within the last ``every_ms`` ms (on the
        store's clock) wins, atomically, and records ``instance_id`` as the winner;
        every other call of that period returns False. The scheduler calls it before
        trimming history (see :meth:`prune`), so that one instance at a time does it.
        The default decides within this object only (every instance sharing the store
        then wins its own periods); the built-in backends decide in the store.
        """
        check_every(every_ms)
        now = await self.now_ms()
        until = self.__dict__.get("_maintenance_until", -1)
        if now < until:
            return False
        self.__dict__["_maintenance_until"] = now + every_ms
        return True

    async def members(self, instance_id: str, ttl_ms: int) -> list[str] | None:
        """Renew ``instance_id``'s membership of the fleet for ``ttl_ms`` (store clock) and
        return the ids of every live member, this one included, sorted.

        The membership ends at ``now + ttl_ms`` on the store's clock (an absolute expiry,
        like a heartbeat's); a member whose membership has ended is not returned, and
        records that ended more than :data:`MEMBER_RETENTION_MS` ago are deleted by the
        same call. One round trip where the store allows it (one statement on
        PostgreSQL, one script on Redis, one lock on memory). ``ttl_ms`` must be a whole
        number, 1 or more, and ``instance_id`` a non-empty string
        (:class:`~lease_core.errors.ConfigurationError` otherwise, writing nothing).

        The default returns ``None``: this backend keeps no membership, and the scheduler
        then claims every slot on every instance. The built-in backends keep it in the
        store.
        """
        check_members(instance_id, ttl_ms)
        return None

    async def leave(self, instance_id: str) -> None:
        """End ``instance_id``'s membership of the fleet now: a scheduler stopping gracefully
        calls it as it stops claiming (before its handlers end and its runs are handed over).

        From then on :meth:`members` no longer lists ``instance_id`` (until it renews
        again), so the other members re-rank its jobs at their next renewal instead of
        when its membership would have ended. Leaving when not a member does nothing.
        ``instance_id`` must be a non-empty string
        (:class:`~lease_core.errors.ConfigurationError` otherwise, writing nothing).

        The default does nothing (a backend that keeps no membership, or one written
        before this call): the membership then ends with its ``ttl_ms``.
        """
        check_leave(instance_id)

    async def jobs(self) -> list[str]:
        """Return the name of every job the store knows, sorted.

        The default derives them from :meth:`history`; backends override it with a read of
        their own job records, which also knows jobs whose history was trimmed.
        """
        return sorted({a.job for a in await self.history(None, _DERIVED_LIMIT)})

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:
        """Return runs as the store holds them now, newest slot first.

        ``job`` limits them to one job; ``open_only`` to open runs (``running``,
        ``handed_over`` or ``retrying``); at most ``limit`` (0 or more, as for
        :meth:`history`). The default derives them from :meth:`history` (no lease expiry,
        and a run whose last attempt is open shows as ``running``); backends override it
        with a read of their runs.
        """
        check_limit(limit)
        latest: dict[tuple[str, int], Attempt] = {}
        for a in await self.history(job, _DERIVED_LIMIT):
            key = (a.job, a.slot)
            if key not in latest or a.attempt > latest[key].attempt:
                latest[key] = a
        found = [RunInfo(a.job, a.slot, run_status(a), a.attempt, a.instance_id)
                 for a in latest.values()]
        if open_only:
            found = [r for r in found if not r.status.finished]
        found.sort(key=lambda r: (-r.slot, r.job))
        return found[:limit]

    @abstractmethod
    async def get_checkpoint(self, job: str, slot: int) -> Any:
        """Return the run's checkpoint, or ``None`` when it has none."""

    @abstractmethod
    async def set_checkpoint(self, lease: Lease, value: Any) -> bool:
        """Store the run's checkpoint if ``lease`` still holds the run; return success."""

    @abstractmethod
    async def delete_checkpoint(self, lease: Lease) -> bool:
        """Remove the run's checkpoint if ``lease`` still holds the run; return success."""

    def transaction(self, lease: Lease, *,
                    complete: bool = True) -> AbstractAsyncContextManager[Any]:
        """Open a fenced transaction that completes the run when it commits (unless
        ``complete`` is false: then it only commits the effects, fenced).

        Only SQL backends support it; others raise :class:`ConfigurationError`.
        """
        raise ConfigurationError(
            f"{type(self).__name__} has no fenced transactions; "
            "use PostgresBackend for ctx.transaction()"
        )
