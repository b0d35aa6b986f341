"""Seed 004's own history query runs as written against the store's attempts table.

``SELECT job, slot, attempt, instance_id, reason, claimed_at FROM anarchon_runs_attempts
WHERE job = 'sync' ORDER BY slot DESC, attempt DESC``: the table keeps ``claimed_ms``, and
``claimed_at`` is written with it (store code v4). The store lives in a schema of
its own, found through the connection's search_path, so the query's unqualified table name
is the default one.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import psycopg
import pytest

from backends.postgres import PostgresBackend
from lease_core.abc import ClaimRequest, Lease, Outcome
from tests.stores.postgres import PgServer

pytestmark = pytest.mark.anyio

SEED_QUERY = ("SELECT job, slot, attempt, instance_id, reason, claimed_at "
              "FROM anarchon_runs_attempts WHERE job = 'sync' ORDER BY slot DESC, attempt DESC")


@pytest.mark.asyncio_only
async def test_seed_004_history_query_runs_as_written(pg16_server: PgServer) -> None:
    schema = f"seed_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'GRANT ALL ON SCHEMA "{schema}" TO PUBLIC')
    try:
        backend = PostgresBackend(pg16_server.dsn, table=f"{schema}.anarchon_runs")
        await backend.start()
        try:
            for slot in (1000, 2000):
                await backend.claim(ClaimRequest("sync", slot, "i-1", f"t{slot}", 30_000))
                assert await backend.finish(Lease("sync", slot, f"t{slot}", 30_000),
                                            Outcome.COMPLETED)
            history = await backend.history("sync", 10)
        finally:
            await backend.close()
        with psycopg.connect(pg16_server.dsn, autocommit=True) as conn:
            conn.execute(f'SET search_path TO "{schema}"')
            rows = conn.execute(SEED_QUERY).fetchall()
    finally:
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    claimed = {a.slot: a.claimed_at for a in history}
    assert [(job, slot, attempt, instance, reason) for job, slot, attempt, instance, reason, _
            in rows] == [("sync", 2000, 1, "i-1", "scheduled"), ("sync", 1000, 1, "i-1",
                                                                 "scheduled")]
    for _, slot, _, _, _, at in rows:
        assert isinstance(at, datetime) and at.tzinfo is not None
        assert at.astimezone(UTC) == claimed[slot]
