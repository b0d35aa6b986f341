"""Named leases for sync code: :class:`SyncLease`, a :class:`~lease_core.Lease` whose calls
block, run on the background event loop that every SyncLease and
:class:`~lease_core.SyncScheduler` of a process shares (see :mod:`lease_core.lease`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future, wait
from functools import partial
from types import TracebackType

import anyio
import anyio.from_thread

from ._durations import Duration
from ._lease_clock import lease_clock
from ._lease_holders import gave_up
from ._lease_loop import _Loop, answered_within
from .abc import Backend
from .errors import LeaseLost
from .lease import Lease, LeaseHolder

logger = logging.getLogger("anarchon")

__all__ = ["SyncLease"]


class SyncLease:
    """A :class:`Lease` for sync code (Django, Flask, scripts): the same calls, blocking.

    ::

        with SyncLease(backend, "nightly-export", ttl="1m") as lease:
            export(fence=lease.token)

    The lease lives on one background thread with its own event loop, shared by every
    SyncLease and :class:`~lease_core.SyncScheduler` of the process (so one backend
    serves them all), and is renewed there every ``ttl / 3``. A sync body cannot
    be cancelled: check :attr:`lost` (a :class:`threading.Event`) between steps; when the
    lease was lost during the body, ``with`` raises
    :class:`~lease_core.errors.LeaseLost` at its end. Options as for :class:`Lease`. A
    lease still held when the interpreter exits is released then (5 s at most, for all
    of them together), so the name is free at once, not after its ttl. In a forked child,
    make a SyncLease and its backend anew: a call through a backend the parent held open
    (its connections are the parent's) raises ``RuntimeError``.

    .. note:: The backend is started and closed on the background loop, so an async pool
       or client passed in must not be bound to another loop (a DSN, a URL, a blocking
       driver object or a MemoryBackend always works).
    """

    def __init__(self, backend: Backend, name: str, ttl: Duration = "30s", *,
                 poll: Duration | None = None, holder: str | None = None) -> None:
        self._lease = Lease(backend, name, ttl, poll=poll, holder=holder)
        self.lost = threading.Event()
        """Set when the current hold is lost (cleared by the next :meth:`acquire`)."""
        self._mirror: Future[None] | None = None
        self._in_body = False  # within ``with`` (or waiting there for the lease)
        self._entering = threading.Lock()  # one ``with`` at a time
        self._released_in_body = False  # release() called meanwhile (another thread)
        self._pid: int | None = None  # the process that holds it, acquired and not released
        self._used: int | None = None  # the process that last called it

    def __repr__(self) -> str:
        return "Sync" + repr(self._lease)

    @property
    def name(self) -> str:
        """The name held."""
        return self._lease.name

    @property
    def holder(self) -> str:
        """This object's holder id, as the store records it (see :attr:`Lease.holder`)."""
        return self._lease.holder

    @property
    def token(self) -> int | None:
        """The fencing token of the current hold (see :attr:`Lease.token`)."""
        return self._lease.token

    @property
    def held(self) -> bool:
        """Whether this object holds the lease now (see :attr:`Lease.held`); never in a
        forked child of the process that acquired it."""
        # not on the lease's loop: only looked at
        return not self._forked() and self._lease._live(mark=False)

    def current_holder(self) -> LeaseHolder | None:
        """Who holds the name now, read without taking it, blocking (see
        :meth:`Lease.current_holder`). A store that does not answer within ``max(ttl, 5 s)``
        raises :class:`~lease_core.errors.BackendUnavailable`."""
        holder: LeaseHolder | None = self._portal("current_holder").call(partial(
            answered_within, max(self._lease.ttl, 5.0),
            f"SyncLease {self.name!r}.current_holder()", "nothing was read",
            self._lease.current_holder))
        return holder

    def _forked(self) -> bool:  # a fork of a process holding it: the hold is the parent's
        return self._pid is not None and self._pid != os.getpid()

    def _portal(self, what: str) -> anyio.from_thread.BlockingPortal:
        pid = os.getpid()
        # A fork of a process that held the backend open (its connections are the
        # parent's: using them here breaks the parent's), as SyncAdmin refuses it; not a
        # memory store (no connections: the child's copy is its own).
        backend = self._lease.backend
        open_there = (backend._users and not getattr(backend, "in_process", False)
                      and (self._used not in (None, pid) or _Loop.pid not in (0, pid)))
        if self._forked() or open_there:
            raise RuntimeError(
                f"SyncLease {self.name!r}.{what}(): this process is a fork of the one that "
                "used it (the parent's hold and connections are not this process's); make "
                "a SyncLease, and its backend, in the child")
        if _Loop.here():
            raise RuntimeError(
                f"SyncLease {self.name!r}.{what}() would block the event loop it runs on "
                "(called from an async handler of a SyncScheduler?); in async code use "
                "Lease")
        self._used = pid
        return _Loop.get()

    def acquire(self, timeout: Duration | None = None) -> bool:
        """Take the lease, blocking (see :meth:`Lease.acquire`); return whether held."""
        portal = self._portal("acquire")
        pending = portal.start_task_soon(self._lease.acquire, timeout)
        try:
            got = pending.result()
        except BaseException as exc:
            if pending.done() and not pending.cancelled() and pending.exception() is exc:
                raise  # the acquire's own error (it let go of what it had)
            # Interrupted here (Ctrl-C, a signal; also just as the acquire ended): the
            # acquire on the background loop is cancelled, and a hold it may have won
            # is released, not renewed with nobody to release it.
            pending.cancel()
            with contextlib.suppress(BaseException):
                wait([pending])
                portal.call(_release_within, self._lease, min(self._lease.ttl, 5.0))
            raise
        if got:
            self._pid = os.getpid()
            _Loop.track(self._lease)
            mirror, self._mirror = self._mirror, None
            if mirror is not None:  # held already: one task watches the current hold
                mirror.cancel()
            self.lost.clear()
            self._mirror = portal.start_task_soon(self._mirror_lost)
        return got

    async def _mirror_lost(self) -> None:
        # The hold's event is read here, on the lease's loop: made lazily, it must not be
        # made from the caller's thread at the same time as the loop makes it.
        await self._lease.lost.wait()
        self.lost.set()

    def release(self) -> None:
        """Stop renewing and free the name (see :meth:`Lease.release`).

        Called while another thread runs the body of ``with``: :attr:`lost` is set and
        ``with`` raises :class:`~lease_core.errors.LeaseLost` at its end (the body ran on
        without the lease).

        A store that does not answer (a partition) is given up after ``min(ttl, 5 s)``
        (twice that at most, the release being sent again once), with a warning: the
        lease is no longer held here, and the store frees the name when its ttl runs out.
        """
        self._release(min(self._lease.ttl, 5.0))

    def _release(self, within: float) -> None:
        """:meth:`release`, given up after ``within`` seconds."""
        if self._forked():
            return  # the parent's hold: a forked child never releases it
        portal = self._portal("release")  # refused (on the loop's thread): nothing changes
        if self._in_body and self.held:
            self._released_in_body = True
            self.lost.set()
        try:
            portal.call(_release_within, self._lease, within)
            self._pid = None
        finally:
            mirror, self._mirror = self._mirror, None
            if mirror is not None:
                mirror.cancel()

    def __enter__(self) -> SyncLease:
        """Block until the lease is held (:class:`~lease_core.errors.LeaseLost` when a
        :meth:`release` from another thread made the wait give up). One body at a time:
        a second ``with`` of the same SyncLease (another thread) raises ``RuntimeError``,
        as the first holds the lease already; give each thread a SyncLease of its own."""
        with self._entering:
            if self._in_body:
                raise RuntimeError(
                    f"SyncLease {self.name!r} is already entered by `with` (in another "
                    "thread?); one SyncLease is one holder: give each thread a SyncLease "
                    "of its own")
            self._in_body, self._released_in_body = True, False
        try:
            if not self.acquire():
                raise gave_up(self._lease.name)
        except BaseException:
            self._in_body = False
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Release the lease; raise :class:`LeaseLost` when it was lost during the body
        (also when the body outlasted the ttl since the last renewal: a process stalled,
        the store may have given the name away meanwhile). In a forked child (the body
        ran on, as with ``sys.exit()`` there): nothing, the hold is the parent's."""
        self._in_body = False
        if self._forked():
            return
        hold = self._lease._last
        if hold is not None and not hold.over and lease_clock() >= hold.alive_until:
            _Loop.get().call(partial(self._lease._live, mark=True))
        lost = self._lease.lost_error
        if lost is None and self._released_in_body:
            lost = LeaseLost(f"lease {self.name!r} (token {self.token}) was released while "
                             "the body of `with` ran (by another thread, or the body "
                             "itself)")
        if lost is None:
            self.release()
            return
        failed: Exception | None = None
        try:  # lost: the release is a courtesy, never in the way of the LeaseLost
            # Bounded, as by ``async with``: a store that stopped answering made the loss,
            # and a release through a partition waited for it as long as the network did.
            self._release(min(self._lease.ttl, 5.0))
        except Exception as error:
            failed = error
        if exc is None:
            raise lost from failed


async def _release_within(lease: Lease, seconds: float) -> None:
    """``lease.release()``, given up after ``seconds`` with a warning."""
    with anyio.move_on_after(seconds):
        await lease.release()
        return
    logger.warning("lease %r: the store did not answer its release within %g s; the name "
                   "is free when its ttl (%g s) runs out", lease.name, seconds, lease.ttl)
