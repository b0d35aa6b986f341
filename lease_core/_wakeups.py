"""Cheap waiting and cheap tasks for the engine's hot path.

At spread slots (every run at an instant of its own) a run's client CPU is mostly the
event loop's: waking up, spawning a task, entering cancel scopes. Two helpers cut that:

- :class:`Alarm`: one sleep that ends at a timeout or at an earlier :meth:`Alarm.wake`.
  On asyncio a future and a timer handle, so a wake-up at the timeout takes no cancel
  scope, no event and no cancellation (``move_on_after`` around an event cost all three).
- :class:`WorkerPool`: the tasks that claim a wake-up's runs and run their handlers,
  kept once they are done and given the next piece of work, instead of a new task each
  time (anyio's task spawn makes a task, a cancel scope, an event and a done callback).
  A worker runs one piece of work at a time, so handlers still run side by side, each in
  a task of its own; a new worker starts whenever none is idle. Each piece of work runs
  in a fresh copy of the context the worker started with (:func:`in_context`), so what
  a handler sets in a context variable is not seen by the next one, as with a new task.
"""

from __future__ import annotations

import asyncio
import contextvars
import types
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

import anyio
import sniffio
from anyio.abc import TaskGroup

__all__ = ["PRECISE_FROM", "SPARE_WORKERS", "Alarm", "WorkerPool", "first_leg", "in_context",
           "late_by", "slot_wait"]

#: Idle workers a pool keeps; one that ends its work while that many wait ends too. A
#: pool grows only as far as its busiest moment needed (spread slots at 2,000 runs/s
#: wake about 100 runs at a time with the default timer_slack).
SPARE_WORKERS = 256

#: Waits this long (seconds) or longer that must end on time are slept in two legs (see
#: :func:`first_leg`); a shorter one ends at most 0.5 ms late for the kernel's slack (2.5
#: ms in a niced process), about what the millisecond rounding costs anyway, and is not
#: worth a second wake-up.
PRECISE_FROM = 0.5

T = TypeVar("T")


def first_leg(seconds: float) -> float:
    """How long to sleep first of a wait of ``seconds`` that must end on time.

    A sleep on asyncio or trio is an ``epoll`` timeout, which Linux lets end late by 0.1 %
    of its length (0.5 % in a niced process: ``select_estimate_accuracy`` divides its
    factor by 5; at most 100 ms), on top of the timeout's rounding up to a whole
    millisecond: a 5 s wait ended 5.3 ms late (measured). So a wait of
    :data:`PRECISE_FROM` or more is cut in two: this long one, which ends 2 ms + 0.6 % (at
    most 152 ms) early, and the short rest (late by the rounding alone: 0.4-1.3 ms
    measured after 5 s). A shorter wait is slept whole.
    """
    if seconds < PRECISE_FROM:
        return seconds
    return seconds - late_by(seconds)


def late_by(seconds: float) -> float:
    """How late a sleep of ``seconds`` may end at most: the margin :func:`first_leg`
    leaves (the kernel's slack, niced, and the millisecond's rounding)."""
    return 0.002 + min(seconds * 0.006, 0.15)


def slot_wait(until_slot: float, longest: float) -> float:
    """How long to sleep now when the next slot is ``until_slot`` seconds away and no
    sleep may last more than ``longest`` (the heartbeat): the whole way, or the first leg
    of it (:func:`first_leg`), or ``longest``. Also a slot a little over ``longest``
    away gets a first leg: a sleep of ``longest`` would end after it. Zero or less: the
    slot is due.
    """
    if until_slot <= 0:
        return until_slot
    return min(longest, first_leg(until_slot))


def _resolve(future: asyncio.Future[Any], value: Any = None) -> bool:
    if future.done():
        return False
    future.set_result(value)
    return True


class Alarm:
    """Sleeps until a timeout or an earlier :meth:`wake`; cancelled as any sleep."""

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None
        self._event: anyio.Event | None = None

    async def sleep(self, seconds: float) -> None:
        """Return after ``seconds``, or once :meth:`wake` is called."""
        if sniffio.current_async_library() == "asyncio":
            loop = asyncio.get_running_loop()
            future = self._future = loop.create_future()
            timer = loop.call_later(seconds, _resolve, future)
            try:
                await future
            finally:
                timer.cancel()
                self._future = None
        else:
            self._event = anyio.Event()
            with anyio.move_on_after(seconds):
                await self._event.wait()
            self._event = None

    def wake(self) -> None:
        """End the current sleep now (if any)."""
        if self._future is not None:
            _resolve(self._future)
        elif self._event is not None:
            self._event.set()


@types.coroutine
def in_context(coro: Coroutine[Any, Any, T],
               context: contextvars.Context) -> Generator[Any, Any, T]:
    """Await ``coro`` with every step of it run in ``context`` (a task's own, in effect)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            if error is None:
                yielded = context.run(coro.send, value)
            else:
                yielded, error = context.run(coro.throw, error), None
        except StopIteration as stop:
            result: T = stop.value
            return result
        try:
            value = yield yielded
        except BaseException as exc:  # thrown into this coroutine: passed on to coro
            value, error = None, exc


class _Parked:
    """An idle worker, waiting for its next piece of work."""

    __slots__ = ("event", "future", "work")

    def __init__(self, on_asyncio: bool) -> None:
        self.future: asyncio.Future[Any] | None = (
            asyncio.get_running_loop().create_future() if on_asyncio else None)
        self.event = None if on_asyncio else anyio.Event()
        self.work: Any = None

    def give(self, work: Any) -> bool:
        """Hand ``work`` over; False when the worker is gone (cancelled meanwhile)."""
        if self.future is not None:
            return _resolve(self.future, work)
        assert self.event is not None
        if self.event.is_set():
            return False
        self.work = work
        self.event.set()
        return True

    async def wait(self) -> Any:
        """The work handed over."""
        if self.future is not None:
            return await self.future
        assert self.event is not None
        await self.event.wait()
        return self.work


class WorkerPool(Generic[T]):
    """Runs ``work(item)`` for each item submitted, each in a worker task of its own."""

    def __init__(self, work: Callable[[T], Coroutine[Any, Any, None]], *,
                 spare: int = SPARE_WORKERS) -> None:
        self._work = work
        self._spare = spare
        self._idle: deque[_Parked] = deque()
        self._on_asyncio: bool | None = None
        self.started = 0
        """Worker tasks started so far (for tests and benchmarks)."""

    @property
    def idle(self) -> int:
        """Workers waiting for work now."""
        return len(self._idle)

    def submit(self, tg: TaskGroup, item: T) -> None:
        """Run ``work(item)`` in an idle worker, or in a new one started in ``tg``."""
        while self._idle:
            if self._idle.pop().give(item):
                return
        self.started += 1
        tg.start_soon(self._worker, item)

    async def _worker(self, item: T) -> None:
        if self._on_asyncio is None:
            self._on_asyncio = sniffio.current_async_library() == "asyncio"
        base = contextvars.copy_context()
        while True:
            await in_context(self._work(item), base.copy())
            if len(self._idle) >= self._spare:
                return
            parked = _Parked(self._on_asyncio)
            self._idle.append(parked)
            try:
                item = await parked.wait()
            except BaseException:
                # cancelled while parked (work handed over has popped it already)
                if parked in self._idle:
                    self._idle.remove(parked)
                raise
