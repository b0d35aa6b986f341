"""The operations' scenarios (tests/test_operations.py) on PostgreSQL on trio.

The store matrix runs those scenarios on PostgreSQL through psycopg, which is asyncio
only; here they run through pg8000 on trio, directly and through PgBouncer in
transaction mode, each on a table of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from backends.postgres import PostgresBackend
from lease_core.abc import Backend
from lease_core.testing import Store
from tests import test_operations as scenarios
from tests.stores.postgres import PgServer, drop_tables, unique_table

pytestmark = pytest.mark.anyio

SCENARIOS: list[Callable[[Store], Awaitable[None]]] = [
    scenarios.test_trigger_runs_once_within_a_heartbeat_with_reason_manual,
    scenarios.test_pause_skips_new_slots_until_resume,
    scenarios.test_retry_runs_a_failed_run_again_with_reason_retry,
    scenarios.test_cancel_stops_the_holder_and_nobody_takes_over,
    scenarios.test_bad_input_is_refused_and_changes_nothing,
    scenarios.test_heartbeat_at_of_a_running_run_is_its_last_renewal,
    scenarios.test_retry_of_a_failed_workflow_resumes_at_the_step_that_failed,
    scenarios.test_cancel_lets_a_cooperative_handler_finish_within_its_grace,
    scenarios.test_cancel_cancels_a_stubborn_handler_once_its_grace_has_passed,
    scenarios.test_trigger_of_a_workflow_by_its_name_runs_it_from_its_first_step,
    scenarios.test_pause_of_a_workflow_by_its_name_skips_its_slots_until_resume,
]


class Pg8000Store(Store):
    """A fresh table on ``server`` through pg8000 (which runs on trio)."""

    def __init__(self, server: PgServer, admin: PgServer) -> None:
        self.dsn = server.dsn.replace("postgresql://", "postgresql+pg8000://", 1)
        self.admin = admin
        self.table = unique_table()

    def backend(self) -> Backend:
        return PostgresBackend(self.dsn, table=self.table)

    async def cleanup(self) -> None:
        await drop_tables(self.admin.admin_dsn, self.table)


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("server", ["pg16_server", "pgbouncer_server"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__[5:] for s in SCENARIOS])
async def test_scenario_on_trio(anyio_backend: str, server: str,
                                scenario: Callable[[Store], Awaitable[None]],
                                request: pytest.FixtureRequest) -> None:
    store = Pg8000Store(request.getfixturevalue(server), request.getfixturevalue("pg16_server"))
    try:
        await scenario(store)
    finally:
        await store.cleanup()
