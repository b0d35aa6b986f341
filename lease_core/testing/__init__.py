"""The backend contract as tests that ship: every backend, ours or a third party's, passes them.

Importing this package needs pytest (the ``anarchon[testing]`` extra); ``import lease_core``
never imports it.
"""

from __future__ import annotations

import pytest

# Plain asserts in the shipped checks report their values as a test module's asserts do.
pytest.register_assert_rewrite("lease_core.testing.conformance", "lease_core.testing.differential")

from ._tools import Store, wait_for  # noqa: E402

__all__ = ["Store", "wait_for"]
