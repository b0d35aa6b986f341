"""Events: the subscribers of one scheduler, each fed in order through its own buffer."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .. import events as ev
from ..errors import AnarchonError, ConfigurationError
from . import base
from .base import INSIDE, is_async, logger, unrun
from .execution import _stray

__all__ = ["EventBus"]


@dataclass(eq=False)
class _Subscriber:
    """A callback subscribed to events, and its stream while the scheduler runs."""

    callback: Callable[[ev.Event], Any]
    is_async: bool
    send: MemoryObjectSendStream[ev.Event] | None = None
    dropped: int = 0


class EventBus:
    """Delivers a scheduler's events to its subscribers (see :meth:`Scheduler.subscribe`).

    Subscribers outlive a start: they are fed while the scheduler runs, from tasks of the
    task group given to :meth:`open`. ``owner`` is the scheduler, which the subscribers'
    tasks see as :data:`~lease_core.engine.base.INSIDE`.
    """

    def __init__(self, owner: object) -> None:
        self._owner = owner
        self._subscribers: list[_Subscriber] = []
        self._receivers: list[MemoryObjectReceiveStream[ev.Event]] = []
        self._tg: TaskGroup | None = None
        self._threads: anyio.CapacityLimiter | None = None
        self._capacity = base.EVENT_BUFFER
        self.dropped = 0
        """Events dropped because a subscriber's buffer was full (since creation)."""

    @property
    def wanted(self) -> bool:
        """True when some callback is subscribed (events are made only then)."""
        return bool(self._subscribers)

    @property
    def subscriber_count(self) -> int:
        """How many callbacks are subscribed."""
        return len(self._subscribers)

    @property
    def open_streams(self) -> int:
        """How many subscribers' event streams are open (each is released when it ends)."""
        return len(self._receivers)

    def subscribe(self, callback: Callable[[ev.Event], Any]) -> Callable[[], None]:
        """Subscribe ``callback``; return the function that unsubscribes it."""
        if not callable(callback):
            raise ConfigurationError(f"subscribe({callback!r}): the callback must be callable")
        try:
            inspect.signature(callback).bind(None)
        except ValueError:  # no signature to read (some builtins): it may work
            pass
        except TypeError as exc:  # it would fail at every event, each failure logged
            raise ConfigurationError(
                f"subscribe({callback!r}): the callback cannot be called with one argument, "
                f"the event ({exc}); subscribe a function such as 'def on_event(event)'"
            ) from None
        call = getattr(callback, "__call__", None)  # noqa: B004 - callable objects too
        if any(test(f) for f in (callback, call) for test in (
                inspect.isasyncgenfunction, inspect.isgeneratorfunction)):
            # Calling it would only make a generator: none of its body would ever run.
            raise ConfigurationError(
                f"subscribe({callback!r}): the callback is a generator function (its body "
                "has 'yield'), so none of its body would run; subscribe a function such as "
                "'def on_event(event)' without 'yield'")
        sub = _Subscriber(callback, is_async(callback))
        if self._tg is not None:
            self._open_subscriber(sub)  # raises, registering nothing, off the loop's thread
        self._subscribers.append(sub)

        def unsubscribe() -> None:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            if sub.send is not None:
                sub.send.close()

        return unsubscribe

    def open(self, tg: TaskGroup, threads: anyio.CapacityLimiter, *, jobs: int = 0) -> None:
        """Start feeding every subscriber, in tasks of ``tg`` (sync ones in ``threads``),
        each through a buffer of :data:`~lease_core.engine.base.EVENT_BUFFER` events, or
        :data:`~lease_core.engine.base.EVENTS_PER_JOB` per one of the ``jobs`` declared
        when more (a burst of them all due at once fits)."""
        self._tg, self._threads = tg, threads
        self._capacity = max(base.EVENT_BUFFER, base.EVENTS_PER_JOB * jobs)
        for sub in self._subscribers:
            self._open_subscriber(sub)

    def close(self, *, senders_only: bool = False) -> None:
        """Stop taking events; with ``senders_only``, let the subscribers drain theirs (a
        callback subscribed meanwhile is kept for the next start, not fed: the drain would
        wait for its stream, which nothing closes, until its time ran out)."""
        self._tg = None
        for sub in self._subscribers:
            if sub.send is not None:
                sub.send.close()
                sub.send = None
        if not senders_only:
            for receive in self._receivers:
                receive.close()
            self._receivers.clear()

    def emit(self, event: ev.Event) -> None:
        """Queue ``event`` for every subscriber; a full buffer drops it (and counts it)."""
        for sub in self._subscribers:
            if sub.send is None:
                continue
            try:
                sub.send.send_nowait(event)
            except anyio.WouldBlock:
                sub.dropped += 1
                self.dropped += 1
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def _open_subscriber(self, sub: _Subscriber) -> None:
        assert self._tg is not None
        send, receive = anyio.create_memory_object_stream[ev.Event](self._capacity)
        dispatch = self._dispatch(sub, receive)
        try:
            self._tg.start_soon(lambda: dispatch)
        except BaseException as exc:
            dispatch.close()
            send.close()
            receive.close()
            if isinstance(exc, anyio.NoEventLoopError):
                raise AnarchonError(
                    "subscribe() of a running scheduler must be called on its event loop's "
                    "thread; from another thread, call it on that loop (anyio.from_thread.run_sync("
                    "scheduler.subscribe, callback, token=...)), or subscribe "
                    "before start()") from exc
            raise
        sub.send = send
        self._receivers.append(receive)

    async def _dispatch(self, sub: _Subscriber,
                        receive: MemoryObjectReceiveStream[ev.Event]) -> None:
        INSIDE.set(self._owner)  # stop() or abort() from a subscriber only requests it
        try:
            with receive, contextlib.suppress(anyio.ClosedResourceError):
                async for event in receive:
                    try:
                        if sub.is_async:
                            await sub.callback(event)
                        else:
                            await anyio.to_thread.run_sync(_call_in_thread, sub.callback,
                                                           event, abandon_on_cancel=True,
                                                           limiter=self._threads)
                    except Exception as exc:
                        logger.error("event subscriber %r failed on %s", sub.callback,
                                     type(event).__name__, exc_info=exc)
                    except BaseException as exc:
                        if not _failure(exc):
                            raise
                        # Out of a task they would end the event loop (SystemExit,
                        # KeyboardInterrupt: on asyncio, with every scheduler and
                        # SyncLease sharing it), or stop the scheduler without a word (a
                        # CancelledError of a task or future the subscriber awaited,
                        # which cancels nothing here): logged as a failure. Any other
                        # BaseException ends the scheduler, which stop() raises.
                        logger.error("event subscriber %r raised %r on %s, which it "
                                     "cannot: logged as a failure", sub.callback, exc,
                                     type(event).__name__)
        finally:
            # An unsubscribed callback leaves nothing behind in a long-running scheduler.
            if receive in self._receivers:
                self._receivers.remove(receive)


def _failure(exc: BaseException) -> bool:
    """True when a subscriber's ``exc``, not an ``Exception``, is logged as its failure:
    ``SystemExit``, ``KeyboardInterrupt``, and a ``CancelledError`` it let out of a task
    or future it awaited (see ``execution._stray``); not a cancellation of the
    subscriber's own task (the scheduler's stop, the end of its delivery time), which
    goes on, nor any other ``BaseException``, which is not for catching."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return True
    return isinstance(exc, asyncio.CancelledError) and _stray(exc)


def _call_in_thread(callback: Callable[[ev.Event], Any], event: ev.Event) -> Any:
    """A sync subscriber's call in its worker thread: its ``sys.exit()`` or a
    ``KeyboardInterrupt`` it raises ends the call only, as in any thread."""
    try:
        value = callback(event)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise RuntimeError(f"the subscriber raised {exc!r}") from exc
    failure = unrun(value, callback, "event subscriber", "so none of its work ran",
                    fix="subscribe a function declared with")
    if failure is not None:
        raise failure
    return value
