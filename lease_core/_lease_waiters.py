"""Blocking acquires waiting in this process, woken by a release (private).

A :class:`~lease_core.Lease` whose :meth:`~lease_core.Lease.acquire` waits for another
holder tries again every ``poll``. When the holder is a lease of the same process, on the
same backend object and the same event loop (so the same thread: every ``SyncLease``
shares one), its release wakes the waiters at once, and one of them takes the name
without waiting for its next try. Waiters elsewhere (other processes, threads, event
loops or backends) keep their ``poll``: the store has no way to tell them. A waiter of
another loop of the same thread (one that ended, or was stopped, with the acquire's task
still pending) is not woken: its cancel scope is that loop's, and cancelling it from
here raised ('Event loop is closed') or left anyio delivering the cancellation at every
turn of this loop, for ever.

A release that comes while a waiter's try is in flight (refused, as the name was still
held when the store read it) is not lost: the waiter is marked woken, and skips the
pause that follows that try.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator

import anyio
import anyio.lowlevel

__all__ = ["Waiter", "wake_waiters"]

_lock = threading.Lock()
# (id of the backend, name) -> the acquires waiting for it. A waiter holds its backend, so
# the id is not reused while it lives; it leaves the set when its acquire drops it.
_waiting: dict[tuple[int, str], weakref.WeakSet[Waiter]] = {}


class Waiter:
    """One blocking acquire of ``name`` on ``backend``, registered while it lives.

    Before each try the acquire sets :attr:`woken` to False; its pause between tries is
    :meth:`pause`, which a release of the name (:func:`wake_waiters`) ends, or skips when
    the release came during the try."""

    def __init__(self, backend: object, name: str, blocking: bool = True) -> None:
        self.backend = backend
        self.woken = False
        self.scope: anyio.CancelScope | None = None
        if not blocking:  # an acquire that tries once never pauses: nothing to wake
            return
        self.loop = anyio.lowlevel.current_token().native_token  # its event loop
        key = (id(backend), name)
        with _lock:
            if len(_waiting) > 64:  # names whose waiters have all gone
                for gone in [k for k, waiters in _waiting.items() if not waiters]:
                    del _waiting[gone]
            _waiting.setdefault(key, weakref.WeakSet()).add(self)

    @contextlib.contextmanager
    def pause(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope around the pause: cancelled by a release, at once if one came
        since the last try."""
        scope = self.scope = anyio.CancelScope()
        if self.woken:
            scope.cancel()
        try:
            with scope:
                yield scope
        finally:
            self.scope = None


def wake_waiters(backend: object, name: str) -> None:
    """Wake the acquires waiting for ``name`` on ``backend`` on this event loop (``name``
    was just freed): each tries again now."""
    if not _waiting.get((id(backend), name)):  # (no lock: a waiter of this loop would be
        return                                  # registered already, on this thread)
    loop = anyio.lowlevel.current_token().native_token
    with _lock:
        waiters = [w for w in _waiting.get((id(backend), name), ()) if w.loop is loop]
    for waiter in waiters:
        waiter.woken = True
        if waiter.scope is not None:
            waiter.scope.cancel()


def _forked() -> None:
    """In a forked child: a new lock (a thread of the parent may have held this one as it
    forked: the child's copy would stay locked, and every acquire wait for it), and no
    waiters (the parent's, not this process's)."""
    global _lock
    _lock = threading.Lock()
    _waiting.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
