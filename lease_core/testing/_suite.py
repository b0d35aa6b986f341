"""The backend contract as a pytest class to subclass: :class:`BackendConformance`."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import pytest

from lease_core.abc import Backend

from . import conformance, lease_checks
from ._tools import Store

Check = Callable[[Store], Awaitable[None]]


def _checks() -> dict[str, Check]:
    """Every ``test_*`` coroutine function of :mod:`lease_core.testing.conformance` and
    :mod:`lease_core.testing.lease_checks` (named leases), in order."""
    return {name: value for module in (conformance, lease_checks)
            for name, value in vars(module).items()
            if name.startswith("test_") and inspect.iscoroutinefunction(value)}


class _Instances(Store):
    """The store of one test of a :class:`BackendConformance` subclass."""

    def __init__(self, suite: BackendConformance) -> None:
        self._suite = suite

    def backend(self) -> Backend:
        return self._suite.make_backend()


class BackendConformance:
    """The backend contract as tests: subclass it in a test module, say how to make your
    backend, and pytest runs every check the built-in backends pass on it.

    ::

        from lease_core import backend_from_url
        from lease_core.testing import BackendConformance

        class TestMyBackend(BackendConformance):
            def make_backend(self):
                return backend_from_url(f"mystore://localhost/{self.namespace}")

            async def cleanup(self):
                ...  # drop what the namespace holds

    pytest makes a new instance of the class for every test, so ``self`` (and
    :attr:`namespace`) belongs to one test. The checks are the coroutine functions of
    :mod:`lease_core.testing.conformance` (marked ``anyio``: they run on each loop of the
    ``anyio_backend`` fixture, by default every loop anyio finds installed; a subclass may
    override the fixture),
    plus :meth:`test_behaves_like_the_memory_backend`, the differential model test of
    :mod:`lease_core.testing.differential`.

    The backend needs nothing beyond the public contract of :class:`~lease_core.abc.Backend`:
    no injected clock. Its store clock (``now_ms``) must move with real time, because the
    checks wait out real leases of 0.3 s and 0.8 s (each wait has a deadline of a few
    seconds) and a history TTL of 0.2 s.
    """

    differential_examples: ClassVar[int] = 40
    """How many examples (random programs) the differential test runs."""
    differential_steps: ClassVar[int] = 30
    """How many steps each example of the differential test takes at most."""

    def make_backend(self) -> Backend:
        """Return a new, not started backend object on this test's store.

        A check calls it once per simulated instance (up to two), starts what it gets and
        closes it: every object made during one test must see the same store (returning
        one shared object is fine too), and a new test must see an empty one (use
        :attr:`namespace` for a table, key prefix or database name of its own).
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define make_backend(self) -> Backend "
            "(see lease_core.testing.BackendConformance)"
        )

    async def cleanup(self) -> None:
        """Remove what the test wrote; runs after every check, passed or failed.

        The backends a check made are closed by then. The default does nothing.
        """

    @property
    def namespace(self) -> str:
        """A name unique to this test: a letter then 11 hex digits, for a table or prefix."""
        name: str | None = self.__dict__.get("_anarchon_namespace")
        if name is None:
            name = self.__dict__["_anarchon_namespace"] = f"t{uuid.uuid4().hex[:11]}"
        return name

    def test_behaves_like_the_memory_backend(self) -> None:
        """The differential test: random programs of calls give what the memory model gives.

        It drives the backend from its own asyncio loop (in a thread), whatever the
        ``anyio_backend`` fixture says; see :func:`lease_core.testing.run_differential`.
        """
        from .differential import run_differential

        try:
            run_differential(self.make_backend(), max_examples=self.differential_examples,
                             step_count=self.differential_steps)
        finally:
            anyio.run(self.cleanup)


def _as_method(name: str, check: Check) -> Callable[[BackendConformance], Awaitable[None]]:
    async def method(self: BackendConformance) -> None:
        try:
            await check(_Instances(self))
        finally:
            await self.cleanup()

    method.__name__ = name
    method.__qualname__ = f"{BackendConformance.__qualname__}.{name}"
    method.__doc__ = check.__doc__ or f"The contract check {name} of lease_core.testing."
    marked: Any = pytest.mark.anyio(method)
    return marked  # type: ignore[no-any-return]


for _name, _check in _checks().items():
    setattr(BackendConformance, _name, _as_method(_name, _check))
