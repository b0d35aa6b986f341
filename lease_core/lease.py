"""Leases for other libraries: :class:`Lease` (async; :class:`~lease_core.SyncLease`, in
:mod:`lease_core._sync_lease`, is its blocking twin) and :class:`LeaseHolder`.

A lease is a hold on a name (``"leader"``, ``"nightly-export"``) by one process at a
time, through any backend: the engine's lease, offered on its own. Its expiry is on the
store's clock (the backend's named-lease calls, :mod:`lease_core._named_leases`); this
process only measures how long ago the store last confirmed it, with
:func:`~lease_core._lease_clock.lease_clock` (monotonic, and counting a suspend), so a
process clock that is far off changes nothing.

While held, a background task renews the lease every ``ttl / 3``. When a renewal is
refused (another holder has it), or no renewal has succeeded for a whole ``ttl`` (the
store stopped answering), the lease is **lost**, loudly: :attr:`Lease.lost` is set, a
warning is logged to the ``anarchon`` logger, the body of ``async with`` is cancelled,
and the ``async with`` raises :class:`~lease_core.errors.LeaseLost`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from types import TracebackType

import anyio

from ._backend_check import check_backend
from ._durations import Duration, parse_duration, to_ms
from ._lease_clock import lease_clock
from ._lease_holders import forget_parent, gave_up, holder_id
from ._lease_keeper import _Hold, _Keeper
from ._lease_waiters import Waiter, wake_waiters
from ._named_leases import LeaseAnswer, check_lease
from .abc import Backend
from .errors import ConfigurationError, LeaseLost, StoreNotFound

__all__ = ["Lease", "LeaseHolder"]

#: The shortest ttl a :class:`Lease` takes, in ms: below it a hold lapses before a
#: renewal, sent every third of the ttl, can come back from the store.
_MIN_TTL_MS = 100

logger = logging.getLogger("anarchon")


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    """Who holds a lease's name, as the store answered :meth:`Lease.current_holder`.

    ``holder``: the holder id (:attr:`Lease.holder` of the process holding it);
    ``token``: its fencing token; ``expires_in``: seconds its hold had left at the read,
    on the store's clock, unless renewed (a holder renews every ``ttl / 3``).
    """

    name: str
    holder: str
    token: int
    expires_in: float


async def _read_holder(lease: Lease) -> LeaseHolder | None:
    """:meth:`Lease.current_holder`: one read, the backend started for it if needed, as
    read-only tools start it (``create=False``: nothing made nor upgraded; no store there
    is a name nobody holds).

    A hold of ``lease`` lost when its event loop ended is released first, as its next
    :meth:`~Lease.acquire` does: that lets go of its start of the backend, whose client
    may be the ended loop's (a failed release is logged), so the read opens one here."""
    if lease._last is not None and lease._last.orphaned and lease._opened \
            and not lease._acquiring:
        await lease.release()
    backend, name = lease.backend, lease.name
    try:
        await backend.start(create=False)
    except StoreNotFound:
        return None
    try:
        answer = await backend.read_lease(name)
    finally:
        if not backend._drop_user_now():
            with anyio.CancelScope(shield=True):
                await backend.close()
    if not answer.held or answer.holder is None:
        return None
    return LeaseHolder(name, answer.holder, answer.token,
                       max(answer.expires_ms - answer.now_ms, 0) / 1000)


class Lease:
    """Hold ``name`` on ``backend`` for ``ttl``, renewed in the background.

    ::

        async with Lease(backend, "leader", ttl="30s") as lease:
            ...  # this process alone holds "leader"; lease.token fences what it writes

    ``async with`` waits until the lease is held (:meth:`acquire` with no timeout),
    renews it every ``ttl / 3`` and releases it on exit. When the lease is lost (see the
    module docs) the body is cancelled and ``async with`` raises
    :class:`~lease_core.errors.LeaseLost`. Without ``async with``: ``if await
    lease.acquire(timeout=0): ... finally: await lease.release()`` (renewed the same way,
    but nothing is cancelled: watch :attr:`lost`).

    ``ttl`` is a duration (``"30s"``, a ``timedelta``, seconds) of at least 100 ms.
    ``poll`` is how often a blocking :meth:`acquire` tries again while another holder has
    the name (default: a tenth of the ttl, between 50 ms and 1 s); a release by a lease of
    this process, through the same backend on the same event loop, wakes it at once.
    ``holder`` names this holder in the store (default: host, pid and a random part,
    unique to this object, new in a forked child's copy); one given must be unique too:
    the store gives a live hold back to its holder, so two leases given one would share it.

    .. note:: The lease starts ``backend`` when it acquires and closes it when it
       releases, counted (:class:`~lease_core.abc.Backend`): one backend serves a scheduler
       and any number of leases; what it was given (a pool, a client) is never closed.
    """

    def __init__(self, backend: Backend, name: str, ttl: Duration = "30s", *,
                 poll: Duration | None = None, holder: str | None = None) -> None:
        check_backend(backend)
        self.backend = backend
        """The backend the lease is held through."""
        self.holder = holder_id() if holder is None else holder
        """This holder's id in the store (shown to other holders)."""
        self._own_holder = holder is None  # made here: a forked copy makes a new one
        self._pid = os.getpid()  # the process it was made or last acquired in
        self.ttl = parse_duration(ttl, what="ttl")
        """The lease's time to live, in seconds (renewed every third of it)."""
        self._ttl_ms = to_ms(self.ttl)
        check_lease(name, holder=self.holder, ttl_ms=self._ttl_ms, ttl=ttl)
        if self._ttl_ms < _MIN_TTL_MS:
            raise ConfigurationError(
                f"ttl={ttl!r} is shorter than {_MIN_TTL_MS} ms: the hold would lapse before "
                "its first renewal could reach the store; give a ttl of seconds (the "
                "lease is renewed every third of it)")
        # How long a hold surely lives in the store after the call that set it was sent:
        # the store's expiry is its now (in whole ms, rounded down) + the ttl in whole ms,
        # so 2 ms less, and 0.5 % less for a store clock that runs a little faster.
        self._alive_s = max(self._ttl_ms * 0.995 - 2, self._ttl_ms / 2) / 1000
        self.name = name
        """The name held."""
        self.poll = (min(max(self.ttl / 10, 0.05), 1.0) if poll is None
                     else parse_duration(poll, what="poll"))
        """How often a blocking :meth:`acquire` tries again, in seconds."""
        self._last: _Hold | None = None  # the latest hold, held or not
        self._never: anyio.Event | None = None  # lost, before any hold (never set)
        self._body: anyio.CancelScope | None = None
        self._opened = False  # whether this lease holds a start() of the backend
        self._acquiring = False  # an acquire() runs (in some task)
        self._abort = False  # a release() asked the running acquire() to give up
        self._acquired: anyio.Event | None = None  # set when that acquire() has ended
        self._pause: anyio.CancelScope | None = None  # a blocking acquire's wait

    def __repr__(self) -> str:
        state = f"token={self.token}" if self._live(mark=False) else "not held"
        return f"Lease({self.name!r}, ttl={self.ttl:g}s, {state})"

    @property
    def token(self) -> int | None:
        """The fencing token of the current hold: it grows with every new holder of the
        name, across releases and expiries. ``None`` before the first acquire; after a
        release or a loss, the last hold's token."""
        return None if self._last is None else self._last.token

    @property
    def lost(self) -> anyio.Event:
        """Set when the current hold is lost: a renewal was refused, or none succeeded for
        a whole ttl. A new event at every acquire."""
        if self._last is not None:
            return self._last.lost
        if self._never is None:
            self._never = anyio.Event()
        return self._never

    @property
    def lost_error(self) -> LeaseLost | None:
        """Why the latest hold was lost, as the error ``async with`` raises; else None."""
        return None if self._last is None else self._last.error

    async def current_holder(self) -> LeaseHolder | None:
        """Who holds this lease's name now, read from the store without taking it;
        ``None`` when the name is free (never held, released, or expired).

        One read, on the store's clock, held by this object or not. A snapshot. Opens only
        a store that exists, creating nothing (none: ``None``). A hold lost when its event
        loop ended is released first, as :meth:`acquire` does. A backend of your own
        without ``read_lease()`` raises ``ConfigurationError``.
        """
        return await _read_holder(self)

    @property
    def held(self) -> bool:
        """Whether this object holds the lease now (acquired, not released, not lost).

        A hold not renewed for a whole ttl (a process stalled, a renewal failing) is lost
        as soon as this is asked, even before the renewal task runs again: the store may
        have given the name to another holder by then.
        """
        return self._live(mark=True)

    def _live(self, *, mark: bool) -> bool:
        """Whether the latest hold is live; past its ttl, it is marked lost if ``mark``
        (only on the lease's own event loop: the loss sets an event and cancels a scope)."""
        hold = self._last
        if hold is None or hold.over or hold.pid != os.getpid():  # (a fork's: the parent's)
            return False
        if lease_clock() >= hold.alive_until:
            if mark:
                self._mark_lost(hold, "no renewal succeeded within the ttl (the process "
                                "stalled?)")
            return False
        return True

    async def acquire(self, timeout: Duration | None = None) -> bool:  # noqa: ASYNC109
        """Take the lease; return whether it is held.

        ``timeout=None`` waits as long as it takes, ``timeout=0`` tries once, and any
        other duration waits at most that long for the holder to let go. A store call in
        flight is not cut short (its answer is used; cancelled, it would have to be
        undone by another call): a store that answers slowly can make the acquire
        last as long as that call. Already held: True at once. Errors of
        the store (:class:`~lease_core.errors.BackendUnavailable`) are raised.
        """
        wait = None if timeout is None else parse_duration(timeout, what="timeout",
                                                           allow_zero=True)
        if self._pid != os.getpid():  # a forked copy of this lease: the parent's hold
            forget_parent(self)
        if self.held:
            return True
        if self._body is not None:  # its end would release a new hold, not raise LeaseLost
            raise RuntimeError(f"Lease {self.name!r}: acquire() while its lost `async with` "
                               "body runs; let it end (LeaseLost) and enter it again")
        if self._acquiring:
            raise RuntimeError(f"Lease {self.name!r}: acquire() is already running in another "
                               "task; one holder each: give each task a Lease, each thread a "
                               "SyncLease, of its own")
        self._acquiring = True
        try:
            return await self._acquire(wait)
        finally:
            self._acquiring = self._abort = False
            done, self._acquired = self._acquired, None
            if done is not None:
                done.set()

    async def _acquire(self, wait: float | None) -> bool:
        if self._opened:  # a hold lost earlier: let go of its start of the backend
            try:
                await self._release()
            except Exception as exc:  # a courtesy; it fails when the hold's event loop
                # ended (the client was that loop's, let go of now: start() makes another)
                logger.warning("lease %r: the release of its lost hold (token %s) "
                               "failed (%s); acquiring anew", self.name, self.token, str(exc))
        give_up = None if wait is None else lease_clock() + wait
        await self.backend.start()
        self._opened, waiter = True, Waiter(self.backend, self.name, wait != 0)
        try:
            while True:
                sent, waiter.woken = lease_clock(), False
                answer = await self._try_acquire()
                fresh = lease_clock() < sent + self._alive_s  # else read after a stall
                if answer.held and (self._abort or not fresh):  # given up, or given away?
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception), \
                            anyio.move_on_after(min(self.ttl, 5.0)):
                        await _free(self, answer.token)
                if self._abort:  # released meanwhile (by another task): give up
                    await self._close_backend()
                    return False
                if answer.held and fresh:
                    hold = self._last = _Hold(answer.token, sent + self._alive_s)
                    _Keeper.schedule(self, hold, sent + self.ttl / 3)
                    return True
                now = lease_clock()
                if give_up is not None and now >= give_up:
                    await self._close_backend()
                    return False
                pause = min(self.poll, max(answer.expires_ms - answer.now_ms, 1) / 1000)
                if give_up is not None:
                    pause = min(pause, give_up - now)
                try:
                    with waiter.pause() as self._pause:  # a release() ends it early
                        await anyio.sleep(pause)
                finally:
                    self._pause = None
                if self._abort:
                    await self._close_backend()
                    return False
        except BaseException:
            if not self.held:
                with anyio.CancelScope(shield=True):
                    await self._close_backend()
            raise

    async def _try_acquire(self) -> LeaseAnswer:
        """One acquire call."""
        try:
            return await self.backend.acquire_lease(self.name, self.holder, self._ttl_ms)
        except BaseException:
            # Cancelled, or failed (a reply lost with its connection): the store may have
            # given this holder the name all the same.
            await self._free_unanswered()
            raise

    async def _free_unanswered(self) -> None:
        """An acquire cancelled or failed before the store answered: the store may have
        given this holder the name, which nothing would renew nor release (held until its
        ttl).
        Asked again, the store gives a live hold of this holder back (or the free name),
        and it is released at once. Shielded, for a few seconds at most."""
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            with anyio.move_on_after(min(self.ttl, 5.0)):
                answer = await self.backend.acquire_lease(self.name, self.holder,
                                                          self._ttl_ms)
                if answer.held:
                    await _free(self, answer.token)

    async def release(self) -> None:
        """Stop renewing and free the name in the store: a waiter takes it at its next try
        (one of this process, on the same backend and event loop, at once).

        While another task's :meth:`acquire` of this lease waits, it makes that acquire
        give up (return False, holding nothing) and waits for it.

        Does nothing when not acquired. A lost lease's release is sent too: its token
        frees the name only if it still holds it live, never another holder's. Closes
        the backend's start made by :meth:`acquire`. A cancellation does not stop it
        half-way: a release cancelled before the store answered is sent again, shielded,
        before the cancellation goes on (an error of the store is raised as it is; for a
        hold lost when its event loop ended, released from another loop, it is logged).
        """
        if self._acquiring:
            self._abort = True
            if self._pause is not None:
                self._pause.cancel()
            if self._acquired is None:
                self._acquired = anyio.Event()
            await self._acquired.wait()
            return
        if self._last is not None and self._last.orphaned:
            try:  # lost as its event loop ended: through that loop's client, a courtesy
                await self._release()
            except Exception as exc:  # that may fail (the name is free at its ttl)
                logger.warning("lease %r: the release of the hold its ended event loop "
                               "left (token %s) failed (%s)", self.name, self.token,
                               str(exc))
            return
        await self._release()

    async def _release(self) -> None:
        if not self._opened:
            return
        hold = self._last
        token = None
        if hold is not None and not hold.released:
            if self._body is not None and not hold.over:
                # Released while the body of ``async with`` runs (by another task, or the
                # body itself): the body runs without the lease from now, so it is
                # cancelled and ``async with`` raises, as after a loss.
                self._mark_lost(hold, "released while the body of `async with` ran")
            # A lost hold is freed too: the token frees the name only if it still holds
            # it live (a renewal task ended, a stall the store has not noticed yet).
            hold.over = hold.released = True
            token = hold.token
            if hold.scope is not None:
                hold.scope.cancel()
        # No cancel scope around the usual path (it cost more client CPU than the rest of
        # the lease's own work): only a release that was interrupted pays for one.
        try:
            if token is not None:
                await self.backend.release_lease(self.name, token)
                wake_waiters(self.backend, self.name)  # this process's, at once
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                try:
                    if token is not None:
                        # Bounded: a cancellation is not held up for a driver's timeout
                        # (unanswered, the name is free when its ttl runs out).
                        with anyio.move_on_after(min(self.ttl, 5.0)):
                            await _free(self, token)
                finally:
                    await self._close_backend()
            raise
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._close_backend()
            raise
        if not self._opened:
            return  # a release made meanwhile (another task's) has let go of it
        self._opened = False
        if not self.backend._drop_user_now():  # its last user: the close is awaited
            with anyio.CancelScope(shield=True):
                await self.backend.close()

    async def _close_backend(self) -> None:
        if self._opened:
            self._opened = False
            with anyio.CancelScope(shield=True):  # its user count is already taken off
                await self.backend.close()

    async def _renew_hold(self, hold: _Hold) -> None:
        """Renew ``hold`` once (the keeper calls it when due): scheduled again, or lost."""
        why: str | None = None
        with anyio.CancelScope() as scope:
            hold.scope = scope
            why = await self._renew(hold)
        hold.scope = None
        if hold.over:
            return  # released meanwhile: the answer means nothing
        if why is not None:
            self._mark_lost(hold, why)
        else:
            _Keeper.schedule(self, hold, hold.alive_until - self._alive_s + self.ttl / 3)

    async def _renew(self, hold: _Hold) -> str | None:
        """One renewal, retried until it succeeds or the ttl since the last one passes.

        Returns None when renewed, else why the lease is lost.
        """
        failure: BaseException | None = None
        with anyio.move_on_after(max(0.0, hold.alive_until - lease_clock())):
            while True:
                sent = lease_clock()
                try:
                    expires = await self.backend.renew_lease(self.name, hold.token,
                                                             self._ttl_ms)
                except Exception as exc:
                    if failure is None:
                        logger.warning("lease %r: renewal failed (%s); retrying until its "
                                       "ttl runs out", self.name, exc)
                    failure = exc
                    await anyio.sleep(min(self.poll, self.ttl / 10))
                    continue
                if expires is None:
                    return "the store no longer lists this holder's token (expired or taken)"
                hold.alive_until = sent + self._alive_s
                return None
        return f"no renewal succeeded within the ttl ({failure or 'no answer'})"

    def _mark_lost(self, hold: _Hold, why: str) -> None:
        """Record ``hold`` as lost, loudly: the error, a warning, :attr:`lost`, and the
        body of ``async with`` cancelled."""
        hold.over = True
        hold.error = LeaseLost(f"lease {self.name!r} (token {hold.token}) was lost: {why}")
        logger.warning("%s", hold.error)
        hold.lost.set()
        if self._body is not None and self._last is hold:
            self._body.cancel()

    async def __aenter__(self) -> Lease:
        """Wait until the lease is held; the body runs in a scope cancelled on loss.

        Raises :class:`~lease_core.errors.LeaseLost` when another task's :meth:`release`
        made the wait give up: the body never runs without the lease."""
        if self._body is not None:
            raise RuntimeError(
                f"Lease {self.name!r} is already entered by `async with` (in another task?); "
                "one Lease is one holder: give each task a Lease of its own")
        if not await self.acquire():
            raise gave_up(self.name)
        self._body = anyio.CancelScope()
        self._body.__enter__()
        if self.lost.is_set():
            self._body.cancel()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool:
        """Release the lease; raise :class:`LeaseLost` when it was lost during the body."""
        body, self._body = self._body, None
        swallowed = body is not None and body.__exit__(exc_type, exc, tb)
        # A hold past its ttl is lost even if the keeper has not run since (the loop was
        # blocked): the store may have given the name away while the body ran.
        self._live(mark=True)
        lost = self.lost_error
        if lost is None:
            await self.release()
            return bool(swallowed)
        # Lost: the release is a courtesy (the token frees the name only if it still
        # holds it), bounded and never in the way of the LeaseLost (a store that stopped
        # answering made the loss, and would fail the release too).
        failed: Exception | None = None
        with anyio.move_on_after(min(self.ttl, 5.0)):
            try:
                await self.release()
            except Exception as error:
                failed = error
        if exc is None or swallowed:
            raise lost from failed
        return bool(swallowed)


async def _free(lease: Lease, token: int) -> None:
    """Free ``lease``'s name in the store if ``token`` holds it, and wake the waiters of
    this process for it (the rarer paths that free a name; a plain release does both
    itself)."""
    if await lease.backend.release_lease(lease.name, token):
        wake_waiters(lease.backend, lease.name)
