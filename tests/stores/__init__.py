"""Stores the conformance suite runs on.

Each backend family contributes a module with ``STORES``: a list of :class:`StoreSpec`.
A spec makes, for one test, an isolated :class:`Store` (its own table or key prefix) on a
server that the test harness started itself.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from lease_core.testing import Store

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class StoreSpec:
    """How to make a store of one kind: ``make(request)`` returns it."""

    id: str
    make: Callable[[pytest.FixtureRequest], Awaitable[Store]]
    anyio_backends: tuple[str, ...] = ("asyncio",)
    """Event loops the backend supports; trio only where its driver does."""
    scenarios: bool = True
    """Whether the (slower) scheduler scenarios run on this store too, not only the contract.

    Adapter variants of one server set this to False: the contract tests exercise the
    adapter, and one variant per server runs the scenarios.
    """


def missing_service(what: str) -> None:
    """Fail under CI, skip elsewhere, when a service the test needs cannot be started."""
    if CI:
        pytest.fail(f"{what} is not available, and CI=true requires it")
    pytest.skip(f"{what} is not available")


def all_specs() -> list[StoreSpec]:
    """Collect the specs of every backend family whose module is present."""
    from . import memory

    specs = list(memory.STORES)
    for name in ("postgres", "redis"):
        try:
            module = __import__(f"tests.stores.{name}", fromlist=["STORES"])
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("tests.stores"):
                continue
            raise
        specs.extend(module.STORES)
    return specs
