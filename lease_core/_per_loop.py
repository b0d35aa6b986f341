"""What must be one per running event loop (private): :class:`PerLoop` and :class:`StartLock`.

An anyio lock, limiter or event belongs to the event loop it was first used on, and a
backend or an adapter may be used on several: one after another (asyncio, then trio;
the sync front ends' background loop, then the application's) or at once in two threads.
:mod:`adapters.base` re-exports :class:`PerLoop`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["PerLoop", "StartLock"]

T = TypeVar("T")


class PerLoop(Generic[T]):
    """One value per running event loop, made by ``factory`` at its first use there.

    A value lives as long as both this object and its loop do: it is kept here, keyed
    weakly by the loop. (anyio's ``RunVar`` keeps a value as long as its loop runs: an
    adapter made at every start of a backend left its values on a loop that runs for the
    life of the process, two limiters per lease taken and released.)
    """

    __slots__ = ("_factory", "_values")

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._values: weakref.WeakKeyDictionary[object, T] = weakref.WeakKeyDictionary()

    def get(self) -> T:
        """The running loop's value."""
        loop = anyio.lowlevel.current_token().native_token
        value = self._values.get(loop)
        if value is None:
            value = self._values.setdefault(loop, self._factory())
        return value


class StartLock:
    """The lock of a backend's opens and closes (:meth:`Backend.start
    <lease_core.abc.Backend.start>`, :meth:`~lease_core.abc.Backend.close`), whatever
    loop they run on.

    The tasks of one loop queue on an anyio lock of that loop; the one holding it then
    takes a thread lock, which an open or close under way on another loop (another
    thread) holds meanwhile: that wait is polled every :attr:`POLL` seconds (two loops
    starting or closing one backend at the same moment; an anyio lock shared by two
    loops would not wake the other loop's waiter). Free, it is taken without a yield.
    """

    __slots__ = ("_held", "_loops")

    #: Seconds between two looks at a thread lock another loop holds.
    POLL = 0.005

    def __init__(self) -> None:
        self._loops = PerLoop(lambda: anyio.Lock(fast_acquire=True))
        self._held = threading.Lock()

    def locked(self) -> bool:
        """Whether an open or close is under way, on any loop."""
        return self._held.locked()

    def acquire_nowait(self) -> bool:
        """Take the lock if no open or close is under way, on any loop, without waiting
        or yielding; return whether it did (then :meth:`release_nowait` gives it back).

        For a change of the user count that opens or closes nothing: made under this lock,
        it cannot interleave with the last user's close on another thread.
        """
        return self._held.acquire(blocking=False)

    def release_nowait(self) -> None:
        """Give back what :meth:`acquire_nowait` took."""
        self._held.release()

    async def __aenter__(self) -> None:
        lock = self._loops.get()
        await lock.acquire()
        try:
            # (No event: another loop's open or close cannot wake this loop's waiter.)
            while not self._held.acquire(blocking=False):  # noqa: ASYNC110
                await anyio.sleep(self.POLL)
        except BaseException:
            lock.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._held.release()
        self._loops.get().release()
