"""What the shipped checks run on: an isolated :class:`Store`, and :func:`wait_for`."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from lease_core.abc import Backend


class Store(ABC):
    """One isolated store for one test."""

    @abstractmethod
    def backend(self) -> Backend:
        """Return a new backend object on this store (one per simulated instance)."""

    async def cleanup(self) -> None:  # noqa: B027 - optional hook
        """Remove what the test wrote (tables, keys)."""


async def wait_for(
    predicate: Callable[[], Any] | Callable[[], Awaitable[Any]],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(interval)
