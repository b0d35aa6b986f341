"""An instance starting while ``anarchon migrate`` upgrades its store starts on the result.

The application's user may not upgrade a store; ``anarchon migrate``, run by its owner,
does. During a rolling deploy the instances of the new release (application's user)
may start while the migrate is under way: each finds the store older, and waits for the
upgrade's lock to upgrade it itself. Once the migrate committed, the store is complete
and of this release's store code: the instance must use it, not make again what the
migrate made (which its user may not: it failed to start, with an error saying the
store's functions were missing and to run ``anarchon migrate``, the one just done).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import anyio
import psycopg
import pytest

from backends.postgres import PostgresBackend, migrate
from lease_core._structures import ClaimRequest, ClaimStatus
from tests.helpers import wait_for
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.test_store_upgrade import FIXTURE, names, sql

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]

#: Sessions waiting for a lock, by kind ('advisory', 'relation').
WAITING = "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = %s"


@pytest.fixture
async def v1_store(pg16_server: PgServer) -> AsyncIterator[tuple[str, str]]:
    """A store 0.1.0 made, and the DSN of an application's user of its tables."""
    admin, table = pg16_server.admin_dsn, unique_table()
    sql(admin, FIXTURE.read_text().format(**names(table)))
    role, password = f"app_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    sql(admin, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    tables = ", ".join(f"{table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
    sql(admin, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
    try:
        yield table, pg16_server.server.dsn_for(role, password)
    finally:
        await drop_tables(admin, table)
        sql(admin, f"DROP OWNED BY {role}")
        sql(admin, f"DROP ROLE {role}")


async def test_an_instance_starting_during_a_migrate_starts_on_the_upgraded_store(
    pg16_server: PgServer, v1_store: tuple[str, str]
) -> None:
    admin, (table, app) = pg16_server.admin_dsn, v1_store
    failures: list[BaseException] = []
    with psycopg.connect(admin) as reader:  # a transaction in flight holds the runs table
        reader.execute(f'SELECT count(*) FROM "{table}"')

        async def upgrade() -> None:
            await migrate(admin, table=table)

        async def start() -> None:
            backend = PostgresBackend(app, table=table)
            try:
                await backend.start()
                won = await backend.claim(ClaimRequest("j", 1, "new", "t1", 60_000))
                assert won.status is ClaimStatus.WON
            except Exception as exc:
                failures.append(exc)
            finally:
                await backend.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(upgrade)
            # the migrate holds the upgrade's lock and waits for the runs table
            await wait_for(lambda: sql(admin, WAITING, ("relation",))[0][0] >= 1,
                           what="the migrate waiting for the table")
            tg.start_soon(start)
            await wait_for(lambda: sql(admin, WAITING, ("advisory",))[0][0] >= 1,
                           what="the instance waiting for the upgrade's lock")
            reader.commit()  # the migrate goes on, and commits; then the instance
    assert not failures, failures
