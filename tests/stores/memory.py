"""The memory backend: one shared object is the store."""

from __future__ import annotations

import pytest

from backends.memory import MemoryBackend
from lease_core.abc import Backend

from . import Store, StoreSpec


class MemoryStore(Store):
    """Every simulated instance shares one MemoryBackend."""

    def __init__(self) -> None:
        self.shared = MemoryBackend()

    def backend(self) -> Backend:
        return self.shared


async def _make(request: pytest.FixtureRequest) -> Store:
    return MemoryStore()


STORES = [StoreSpec("memory", _make, ("asyncio", "trio"))]
