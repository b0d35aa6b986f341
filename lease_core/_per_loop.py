"""What must be one per running event loop (private): :class:`PerLoop`.

An anyio lock, limiter or event belongs to the event loop it was first used on, and a
backend or an adapter may be used on several: one after another (asyncio, then trio;
the sync front ends' background loop, then the application's) or at once in two threads.
:mod:`adapters.base` re-exports :class:`PerLoop`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["PerLoop"]

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
