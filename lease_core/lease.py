"""Leases for other libraries: :class:`Lease` (async) and :class:`SyncLease` (sync).

A lease is a hold on a name (``"leader"``, ``"nightly-export"``) by one process at a
time, through any backend: the engine's lease, offered on its own. Its expiry is on the
store's clock (the backend's named-lease calls, :mod:`lease_core._named_leases`); this
process only measures how long ago the store last confirmed it, with
:func:`time.monotonic`, so a process clock that is far off changes nothing.

While held, a background task renews the lease every ``ttl / 3``. When a renewal is
refused (another holder has it), or no renewal has succeeded for a whole ``ttl`` (the
store stopped answering), the lease is **lost**, loudly: :attr:`Lease.lost` is set, a
warning is logged to the ``anarchon`` logger, the body of ``async with`` is cancelled,
and the ``async with`` raises :class:`~lease_core.errors.LeaseLost`.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from types import TracebackType

import anyio
import anyio.from_thread
import sniffio

from ._durations import Duration, parse_duration, to_ms
from ._named_leases import check_lease
from .abc import Backend
from .errors import ConfigurationError, LeaseLost

__all__ = ["Lease", "SyncLease"]

logger = logging.getLogger("anarchon")


def _holder_id() -> str:
    """A holder id unique to one Lease object: host, process and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class _Detached:
    """A task running beside its starter's tasks, cancelled by :meth:`cancel`.

    A lease acquired with ``await lease.acquire()`` outside any task group is still
    renewed: the renewal is a task of the event loop itself (asyncio) or a system task
    (trio), which this wraps in a cancel scope of its own.
    """

    def __init__(self, fn: Callable[[], Awaitable[None]], name: str) -> None:
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._task: asyncio.Task[None] | None = None

        async def body() -> None:
            try:
                with self._scope:
                    await fn()
            except Exception:  # pragma: no cover - the renewal catches its own errors
                logger.exception("the renewal task of a lease failed")
            finally:
                self._done.set()

        if sniffio.current_async_library() == "trio":
            import trio.lowlevel

            trio.lowlevel.spawn_system_task(body, name=name)
        else:
            self._task = asyncio.get_running_loop().create_task(body(), name=name)

    async def cancel(self) -> None:
        """Cancel the task and wait until it has ended."""
        self._scope.cancel()
        await self._done.wait()


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

    ``ttl`` is a duration (``"30s"``, a ``timedelta``, seconds). ``poll`` is how often a
    blocking :meth:`acquire` tries again while another holder has the name (default: a
    tenth of the ttl, between 50 ms and 1 s). ``holder`` names this holder in the store
    (default: host, process id and a random part, unique to this object).

    .. note:: The lease starts ``backend`` when it acquires and closes it when it
       releases; both are counted (see :class:`~lease_core.abc.Backend`), so a backend
       started by its owner stays open, and one backend serves a scheduler and any number
       of leases. What the backend was given (a pool, a client) is never closed.
    """

    def __init__(self, backend: Backend, name: str, ttl: Duration = "30s", *,
                 poll: Duration | None = None, holder: str | None = None) -> None:
        if not isinstance(backend, Backend):
            raise ConfigurationError(
                f"backend={backend!r} is not a lease_core Backend; pass MemoryBackend(), "
                "PostgresBackend(...), RedisBackend(...) or backend_from_url(url)")
        self.backend = backend
        """The backend the lease is held through."""
        self.holder = _holder_id() if holder is None else holder
        """This holder's id in the store (shown to other holders)."""
        check_lease(name, holder=self.holder)
        self.name = name
        """The name held."""
        self.ttl = parse_duration(ttl, what="ttl")
        """The lease's time to live, in seconds (renewed every third of it)."""
        self._ttl_ms = to_ms(self.ttl)
        self.poll = (min(max(self.ttl / 10, 0.05), 1.0) if poll is None
                     else parse_duration(poll, what="poll"))
        """How often a blocking :meth:`acquire` tries again, in seconds."""
        self._token: int | None = None
        self._lost = anyio.Event()
        self._alive_until = 0.0  # monotonic: the hold is surely live until then
        self._keeper: _Detached | None = None
        self._body: anyio.CancelScope | None = None
        self._opened = False  # whether this lease holds a start() of the backend
        self._lost_error: LeaseLost | None = None

    def __repr__(self) -> str:
        state = f"token={self._token}" if self.held else "not held"
        return f"Lease({self.name!r}, ttl={self.ttl:g}s, {state})"

    @property
    def token(self) -> int | None:
        """The fencing token of the current hold: it grows with every new holder of the
        name, across releases and expiries. ``None`` before the first acquire; after a
        release or a loss, the last hold's token."""
        return self._token

    @property
    def lost(self) -> anyio.Event:
        """Set when the current hold is lost: a renewal was refused, or none succeeded for
        a whole ttl. A new event at every acquire."""
        return self._lost

    @property
    def lost_error(self) -> LeaseLost | None:
        """Why the current hold was lost, as the error ``async with`` raises; else None."""
        return self._lost_error

    @property
    def held(self) -> bool:
        """Whether this object holds the lease now (acquired, not released, not lost)."""
        return self._keeper is not None and not self._lost.is_set()

    async def acquire(self, timeout: Duration | None = None) -> bool:  # noqa: ASYNC109
        """Take the lease; return whether it is held.

        ``timeout=None`` waits as long as it takes, ``timeout=0`` tries once, and any
        other duration waits at most that long. Already held: True at once. Errors of
        the store (:class:`~lease_core.errors.BackendUnavailable`) are raised.
        """
        wait = None if timeout is None else parse_duration(timeout, what="timeout",
                                                           allow_zero=True)
        if self.held:
            return True
        await self.release()  # a hold lost earlier: let it go first
        give_up = None if wait is None else time.monotonic() + wait
        await self.backend.start()
        self._opened = True
        try:
            while True:
                sent = time.monotonic()
                answer = await self.backend.acquire_lease(self.name, self.holder,
                                                          self._ttl_ms)
                if answer.held:
                    self._granted(answer.token, sent)
                    return True
                now = time.monotonic()
                if give_up is not None and now >= give_up:
                    await self._close_backend()
                    return False
                pause = min(self.poll, max(answer.expires_ms - answer.now_ms, 1) / 1000)
                if give_up is not None:
                    pause = min(pause, give_up - now)
                await anyio.sleep(pause)
        except BaseException:
            if not self.held:
                with anyio.CancelScope(shield=True):
                    await self._close_backend()
            raise

    def _granted(self, token: int, sent: float) -> None:
        self._token = token
        self._lost = anyio.Event()
        self._lost_error = None
        self._alive_until = sent + self.ttl
        self._keeper = _Detached(self._keep, f"anarchon-lease-{self.name}")

    async def release(self) -> None:
        """Stop renewing and free the name in the store, so a waiter takes it at once.

        Does nothing when not held; a lost lease is not freed (another holder may have
        it), only let go. Closes the backend's start made by :meth:`acquire`.
        """
        if self._keeper is None:
            return
        was_lost = self._lost.is_set()
        token = self._token
        with anyio.CancelScope(shield=True):
            await self._let_go()
            try:
                if not was_lost and token is not None:
                    await self.backend.release_lease(self.name, token)
            finally:
                await self._close_backend()

    async def _let_go(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            await keeper.cancel()

    async def _close_backend(self) -> None:
        if self._opened:
            self._opened = False
            await self.backend.close()

    async def _keep(self) -> None:
        """Renew every third of the ttl until released; mark the lease lost on failure."""
        token = self._token
        assert token is not None
        while True:
            await anyio.sleep(max(0.0, self._alive_until - self.ttl * 2 / 3 - time.monotonic()))
            why = await self._renew(token)
            if why:
                self._mark_lost(token, why)
                return

    async def _renew(self, token: int) -> str | None:
        """One renewal, retried until it succeeds or the ttl since the last one passes.

        Returns None when renewed, else why the lease is lost.
        """
        failure: BaseException | None = None
        with anyio.move_on_after(max(0.0, self._alive_until - time.monotonic())):
            while True:
                sent = time.monotonic()
                try:
                    expires = await self.backend.renew_lease(self.name, token, self._ttl_ms)
                except Exception as exc:
                    if failure is None:
                        logger.warning("lease %r: renewal failed (%s); retrying until its "
                                       "ttl runs out", self.name, exc)
                    failure = exc
                    await anyio.sleep(min(self.poll, self.ttl / 10))
                    continue
                if expires is None:
                    return "the store no longer lists this holder's token (expired or taken)"
                self._alive_until = sent + self.ttl
                return None
        return f"no renewal succeeded within the ttl ({failure or 'no answer'})"

    def _mark_lost(self, token: int, why: str) -> None:
        self._lost_error = LeaseLost(f"lease {self.name!r} (token {token}) was lost: {why}")
        logger.warning("%s", self._lost_error)
        self._lost.set()
        if self._body is not None:
            self._body.cancel()

    async def __aenter__(self) -> Lease:
        """Wait until the lease is held; the body runs in a scope cancelled on loss."""
        await self.acquire()
        self._body = anyio.CancelScope()
        self._body.__enter__()
        if self._lost.is_set():
            self._body.cancel()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool:
        """Release the lease; raise :class:`LeaseLost` when it was lost during the body."""
        body, self._body = self._body, None
        swallowed = body is not None and body.__exit__(exc_type, exc, tb)
        lost = self._lost_error
        await self.release()
        if lost is not None and (exc is None or swallowed):
            raise lost
        return bool(swallowed)


class _Loop:
    """The one background event loop (a blocking portal) every :class:`SyncLease` uses,
    so that a backend shared by several of them is used from one loop."""

    lock = threading.Lock()
    portal: anyio.from_thread.BlockingPortal | None = None
    manager: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
    pid = 0

    @classmethod
    def get(cls) -> anyio.from_thread.BlockingPortal:
        with cls.lock:
            if cls.portal is None or cls.pid != os.getpid():
                cls.manager = anyio.from_thread.start_blocking_portal()
                cls.portal = cls.manager.__enter__()
                cls.pid = os.getpid()
            return cls.portal

    @classmethod
    def close(cls) -> None:
        with cls.lock:
            manager, cls.manager, cls.portal = cls.manager, None, None
            if manager is not None and cls.pid == os.getpid():
                manager.__exit__(None, None, None)


atexit.register(_Loop.close)


class SyncLease:
    """A :class:`Lease` for sync code (Django, Flask, scripts): the same calls, blocking.

    ::

        with SyncLease(backend, "nightly-export", ttl="1m") as lease:
            export(fence=lease.token)

    The lease lives on one background thread with its own event loop, shared by every
    SyncLease of the process, and is renewed there every ``ttl / 3``. A sync body cannot
    be cancelled: check :attr:`lost` (a :class:`threading.Event`) between steps; when the
    lease was lost during the body, ``with`` raises
    :class:`~lease_core.errors.LeaseLost` at its end. Options as for :class:`Lease`.

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

    def __repr__(self) -> str:
        return "Sync" + repr(self._lease)

    @property
    def name(self) -> str:
        """The name held."""
        return self._lease.name

    @property
    def token(self) -> int | None:
        """The fencing token of the current hold (see :attr:`Lease.token`)."""
        return self._lease.token

    @property
    def held(self) -> bool:
        """Whether this object holds the lease now."""
        return self._lease.held

    def acquire(self, timeout: Duration | None = None) -> bool:
        """Take the lease, blocking (see :meth:`Lease.acquire`); return whether held."""
        portal = _Loop.get()
        got = portal.call(self._lease.acquire, timeout)
        if got:
            self.lost.clear()
            self._mirror = portal.start_task_soon(self._mirror_lost, self._lease.lost)
        return got

    async def _mirror_lost(self, event: anyio.Event) -> None:
        await event.wait()
        self.lost.set()

    def release(self) -> None:
        """Stop renewing and free the name (see :meth:`Lease.release`)."""
        portal = _Loop.get()
        portal.call(self._lease.release)
        mirror, self._mirror = self._mirror, None
        if mirror is not None:
            mirror.cancel()

    def __enter__(self) -> SyncLease:
        """Block until the lease is held."""
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Release the lease; raise :class:`LeaseLost` when it was lost during the body."""
        lost = self._lease.lost_error
        self.release()
        if lost is not None and exc is None:
            raise lost
