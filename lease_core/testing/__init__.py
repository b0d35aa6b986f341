"""The backend contract as tests that ship, so a third-party backend passes the same ones.

- :class:`BackendConformance`: subclass it in a test module and define ``make_backend``;
  pytest then runs every contract check and the differential test on that backend.
- :func:`run_differential`: the differential model test on its own (needs hypothesis).
- :class:`Store` and :func:`wait_for`: what the checks run on, for a project's own
  fixtures (anarchon's test suite runs the checks on every store it starts through them).

This package needs pytest, and hypothesis for the differential test: install the
``anarchon[testing]`` extra. ``import lease_core`` never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

# Plain asserts in the shipped checks report their values as a test module's asserts do.
pytest.register_assert_rewrite("lease_core.testing.conformance", "lease_core.testing.differential")

from ._suite import BackendConformance  # noqa: E402
from ._tools import Store, wait_for  # noqa: E402

if TYPE_CHECKING:
    from .differential import run_differential

__all__ = ["BackendConformance", "Store", "run_differential", "wait_for"]


def __getattr__(name: str) -> Any:
    """Import hypothesis only when the differential test is asked for."""
    if name == "run_differential":
        from .differential import run_differential

        return run_differential
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
