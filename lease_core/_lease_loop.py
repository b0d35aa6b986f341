"""The background event loop every :class:`~lease_core.SyncLease` and
:class:`~lease_core.SyncScheduler` uses (private).

One loop (a blocking portal) per process, started on first use, so that a backend shared
by several of them is used from one loop (an async client or pool, and a lock of an
adapter, belong to the loop they were first used on); at interpreter exit the leases
still held are released (the SyncSchedulers, which register their own stop at start,
after this module's import, stop before); a forked child forgets the parent's loop and
leases.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread

from ._platform import asyncio_options
from .errors import BackendUnavailable

if TYPE_CHECKING:
    from .lease import Lease

__all__: list[str] = []  # private: lease.py uses _Loop

_T = TypeVar("_T")


class _Loop:
    """The one background event loop (a blocking portal) every :class:`SyncLease` uses,
    so that a backend shared by several of them is used from one loop."""

    lock = threading.Lock()
    portal: anyio.from_thread.BlockingPortal | None = None
    manager: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
    pid = 0
    thread: threading.Thread | None = None
    """The loop's thread (no blocking call may be made from it)."""

    #: A forked child's inherited loop objects: their thread is not in the child, so
    #: stopping (or collecting) them would wait forever. Kept, never used.
    inherited: list[object] = []

    @classmethod
    def forked(cls) -> None:
        """In a forked child: forget the parent's loop and leases (never release them:
        the parent still holds its leases)."""
        cls.lock = threading.Lock()
        cls.inherited.append((cls.manager, cls.portal))
        cls.manager = cls.portal = cls.thread = None
        cls.leases = weakref.WeakSet()

    @classmethod
    def get(cls) -> anyio.from_thread.BlockingPortal:
        """The running loop's portal, started on first use (and again after a fork)."""
        with cls.lock:
            if (cls.portal is None or cls.pid != os.getpid()
                    or (cls.thread is not None and not cls.thread.is_alive())):
                # none yet, a fork's (see forked), or one that ended (a bug in a task)
                cls.manager = anyio.from_thread.start_blocking_portal(
                    "asyncio", asyncio_options(), name="anarchon-sync")
                cls.portal = cls.manager.__enter__()
                cls.pid = os.getpid()
                cls.thread = cls.portal.call(threading.current_thread)
            return cls.portal

    @classmethod
    def here(cls) -> bool:
        """Whether the caller runs on the loop's thread (where blocking on it would hang)."""
        return cls.thread is not None and threading.current_thread() is cls.thread

    leases: weakref.WeakSet[Lease] = weakref.WeakSet()
    """The leases of the SyncLeases that acquired on this loop (released at exit)."""

    @classmethod
    def track(cls, lease: Lease) -> None:
        """Release ``lease`` at exit if it is still held then (under the lock: the exit's
        look at the set must not see it change size, from a daemon thread's acquire)."""
        with cls.lock:
            cls.leases.add(lease)

    @classmethod
    def close(cls) -> None:
        """Stop the loop (at interpreter exit): the leases still held are released first,
        together, for 5 s at most (a store that does not answer keeps them until their
        ttl); then what still runs on it is cancelled."""
        with cls.lock:
            if cls.pid != os.getpid():
                return  # a forked child's copy of the parent's loop (see forked)
            manager, portal = cls.manager, cls.portal
            cls.manager = cls.portal = cls.thread = None
            if manager is None or portal is None:
                return
            try:
                tracked = list(cls.leases)
                if tracked:
                    with contextlib.suppress(Exception):
                        portal.call(_release_all, tracked)
            finally:  # whatever happened, the loop's thread ends (else the exit hangs)
                with contextlib.suppress(RuntimeError):
                    portal.call(portal.stop, True)  # a lease still held: nothing waits
                manager.__exit__(None, None, None)


async def _release_all(leases: list[Lease]) -> None:
    """Release those of ``leases`` still held, on the loop: a look at ``held`` may mark
    one lost, which only its own loop may do (asyncio's debug mode refuses it from
    another thread, and the leases were then left held)."""
    with anyio.move_on_after(5):
        async with anyio.create_task_group() as tg:
            for lease in leases:
                if lease.held:
                    tg.start_soon(lease.release)


async def answered_within(seconds: float, what: str, after: str,
                          operation: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """``await operation(*args)``, given up after ``seconds``: a blocking call of the sync
    front ends must not wait as long as a partition lasts (a query through a network
    that stopped answering waits for the kernel's TCP timeout, many minutes), where its
    caller (a web view, a shutdown hook) has no timeout of its own to put around it.

    Given up, it raises :class:`BackendUnavailable` naming ``what`` and the time, then
    ``after`` (what became of the operation).
    """
    failed: BackendUnavailable | None = None
    with anyio.move_on_after(seconds) as scope:
        try:
            return await operation(*args)
        except BackendUnavailable as error:
            if not scope.cancel_called:
                raise
            failed = error  # the driver's word on the query given up: the cause
    raise BackendUnavailable(f"{what}: the store did not answer within {seconds:g} s "
                             f"(unreachable, or a network partition); {after}") from failed


atexit.register(_Loop.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Loop.forked)
