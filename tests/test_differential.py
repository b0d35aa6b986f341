"""The differential model test (:mod:`lease_core.testing.differential`) on PostgreSQL and
Redis: each store behaves like a :class:`MemoryBackend` on an injected clock."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core.testing.differential import run_differential
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix


@pytest.mark.timeout(110)
@pytest.mark.parametrize("server", ["pg16_server", "pgbouncer_server"])
def test_postgres_behaves_like_the_memory_backend(server: str,
                                                  request: pytest.FixtureRequest) -> None:
    """PostgreSQL 16 (psycopg, from a DSN), direct and through PgBouncer, against memory."""
    pg: PgServer = request.getfixturevalue(server)
    table = unique_table()
    try:
        run_differential(PostgresBackend(pg.dsn, table=table))
    finally:
        anyio.run(drop_tables, pg.admin_dsn, table)


@pytest.mark.timeout(110)
def test_redis_behaves_like_the_memory_backend(valkey8_server: Any) -> None:
    """Valkey 8 (redis-py asyncio, from a URL) against MemoryBackend."""
    prefix = f"d{uuid.uuid4().hex[:10]}"
    try:
        run_differential(RedisBackend(valkey8_server.url, prefix=prefix))
    finally:
        delete_prefix(valkey8_server.url, prefix)
