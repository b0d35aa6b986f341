"""The backend contract (:mod:`lease_core.testing.conformance`), on every store and loop.

The checks ship in the library, so a third-party backend runs the very same ones; here
the ``store`` fixture (tests/conftest.py) parametrizes each over every store the harness
starts and both anyio event loops.
"""

from __future__ import annotations

import pytest

from lease_core.testing.conformance import *  # noqa: F403 - every test_* check is collected here
from lease_core.testing.lease_checks import *  # noqa: F403 - and the named leases' checks

pytestmark = pytest.mark.anyio
