"""The backend contract as tests that ship, so a third-party backend passes the same ones.

- :class:`BackendConformance`: subclass it in a test module and define ``make_backend``;
  pytest then runs every contract check and the differential test on that backend.
- :func:`run_differential`: the differential model test on its own (needs hypothesis).
- :class:`Store` and :func:`wait_for`: what the checks run on, for a project's own
  fixtures (anarchon's test suite runs the checks on every store it starts through them).
- Test hooks into a running scheduler (:mod:`lease_core.testing.hooks`), for tests of the
  engine and of a backend under a real scheduler: :func:`claim_now` claims a run at once,
  as the scheduler does when its slot is due, and :func:`renew_membership` renews a
  fleet membership at once; :func:`claim_now_sync`, :func:`awaiting_hand_over`,
  :func:`subscriber_count`, :func:`open_event_streams`, :func:`backend_users` and
  :func:`close_backend` read or release what no public property shows.

This package needs pytest, and hypothesis for the differential test: install the
``anarchon[testing]`` extra. ``import lease_core`` never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

# Plain asserts in the shipped checks report their values as a test module's asserts do.
pytest.register_assert_rewrite("lease_core.testing.conformance", "lease_core.testing.differential",
                               "lease_core.testing.lease_checks")

from ._suite import BackendConformance  # noqa: E402
from ._tools import Store, wait_for  # noqa: E402
from .hooks import (  # noqa: E402
    awaiting_hand_over,
    backend_users,
    claim_now,
    claim_now_sync,
    close_backend,
    open_event_streams,
    renew_membership,
    subscriber_count,
)

if TYPE_CHECKING:
    from .differential import run_differential

__all__ = [
    "BackendConformance",
    "Store",
    "awaiting_hand_over",
    "backend_users",
    "claim_now",
    "claim_now_sync",
    "close_backend",
    "open_event_streams",
    "renew_membership",
    "run_differential",
    "subscriber_count",
    "wait_for",
]


def __getattr__(name: str) -> Any:
    """Import hypothesis only when the differential test is asked for."""
    if name == "run_differential":
        from .differential import run_differential

        return run_differential
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
