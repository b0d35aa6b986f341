"""Backends made from a URL keep a bounded pool; a full pool fails clearly, in bounded time.

Real servers: the embedded Redis 6.2 and PostgreSQL 16 the harness starts.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import anyio
import pytest

from adapters.pg8000 import Pg8000PoolAdapter, pg8000_params
from adapters.psycopg import PsycopgDsnAdapter
from adapters.redis import MAX_CONNECTIONS, redis_adapter
from adapters.sql import SqlAdapter
from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core.errors import BackendUnavailable
from tests.stores.postgres import drop_tables, unique_table

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_redis_url_opens_a_bounded_pool_and_a_full_pool_fails_clearly(
    redis62_server: Any,
) -> None:
    # Under asyncio the backend makes an asyncio client, under trio a sync one.
    default = redis_adapter(redis62_server.url)
    assert default.client.connection_pool.max_connections == MAX_CONNECTIONS
    await default.aclose()

    backend = RedisBackend(f"{redis62_server.url}?max_connections=1&timeout=0.3",
                           prefix="bounds")
    await backend.start()
    try:
        adapter = backend._adapter
        assert adapter is not None
        pool = adapter.client.connection_pool
        assert pool.max_connections == 1
        held = pool.get_connection()  # the pool's only connection, held by the test
        if inspect.isawaitable(held):
            held = await held
        try:
            started = time.monotonic()
            with pytest.raises(BackendUnavailable, match="max_connections"):
                await backend.now_ms()
            assert time.monotonic() - started < 5  # the wait is bounded, never retried
        finally:
            released = pool.release(held)
            if inspect.isawaitable(released):
                await released
        assert await backend.now_ms() > 0  # the connection is free again
    finally:
        await backend.close()


@pytest.mark.parametrize(("scheme", "anyio_backend"), [
    ("postgresql://", "asyncio"),  # the psycopg pool the library opens: asyncio only
    ("postgresql+pg8000://", "asyncio"),
    ("postgresql+pg8000://", "trio"),
])
async def test_a_full_postgres_pool_fails_clearly_in_bounded_time(
    pg16_server: Any, scheme: str,
) -> None:
    dsn = pg16_server.dsn.replace("postgresql://", scheme, 1)
    backend = PostgresBackend(f"{dsn}?max_size=1&timeout=300ms", table="bounds")
    await backend.start()
    try:
        adapter = backend._adapter
        async with adapter.transaction() as tx:  # holds the pool's only connection
            await tx.all("SELECT 1")
            started = time.monotonic()
            with pytest.raises(BackendUnavailable, match="max_size"):
                await backend.now_ms()
            assert time.monotonic() - started < 5
        assert await backend.now_ms() > 0
    finally:
        await backend.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the psycopg pool: asyncio only
async def test_the_psycopg_pool_lends_the_connection_given_back_last(pg16_server: Any) -> None:
    # psycopg_pool lends in turn: after a burst grew the pool, sequential statements
    # would go round every server process. The pool the library opens lends the one
    # given back last, so they stay on one.
    adapter = PsycopgDsnAdapter(pg16_server.dsn, min_size=1, max_size=3)
    await adapter.open()
    try:
        grown: set[int] = set()
        deadline = time.monotonic() + 30
        while len(grown) < 3:  # a burst of three statements at once, until three servers
            assert time.monotonic() < deadline, f"the pool did not grow: {grown}"
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(_pid_after, adapter, 0.3, grown)
        assert adapter.pool.get_stats()["pool_size"] == 3
        last = await _pid(adapter)
        sequential = [await _pid(adapter) for _ in range(6)]
        assert sequential == [last] * 6, sequential
    finally:
        await adapter.close()


async def test_a_pg8000_pool_keeps_its_connections_after_a_close_and_a_new_start(
    pg16_server: Any,
) -> None:
    """A pool passed in, which its backend's close() closes: at a new start() it still
    took itself for closed and closed every connection given back, so each statement
    logged in anew."""
    adapter = Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=2)
    backend = PostgresBackend(adapter, table=unique_table())
    try:
        for _ in range(2):  # the first start, then a new one after close()
            await backend.start()
            pids = [await _pid(adapter) for _ in range(3)]
            assert len(set(pids)) == 1, pids
            await backend.close()
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, backend.table)


async def test_a_pg8000_pool_opens_min_size_connections_at_start(pg16_server: Any) -> None:
    """``?min_size=`` was taken and ignored with pg8000 (one connection at start, as the
    psycopg pool's does not): it opens ``min_size`` connections at open()."""
    app = unique_table()
    adapter = Pg8000PoolAdapter(pg8000_params(f"{pg16_server.dsn}?application_name={app}"),
                                min_size=3, max_size=4)
    try:
        await adapter.open()
        rows = await adapter.all("SELECT count(*) FROM pg_stat_activity "
                                 "WHERE application_name = %s", (app,))
        assert rows == [(3,)]
    finally:
        await adapter.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the psycopg pool: asyncio only
async def test_a_dsn_adapter_passed_in_works_after_a_close_and_a_new_start(
    pg16_server: Any,
) -> None:
    """A ``PsycopgDsnAdapter`` passed to a backend, whose close() closes its pools: a new
    start() failed ("pool has already been opened/closed and cannot be reused"), so a
    Lease on such a backend (which starts and closes it at each acquire and release)
    could be taken once."""
    adapter = PsycopgDsnAdapter(pg16_server.dsn, max_size=2)
    backend = PostgresBackend(adapter, table=unique_table())
    try:
        for _ in range(3):  # the first start, then new ones after close()
            await backend.start()
            assert await _pid(adapter) > 0
            await backend.close()
        assert adapter.pool.closed  # what it opened, closed
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, backend.table)


async def _pid(adapter: SqlAdapter) -> int:
    ((pid,),) = await adapter.all("SELECT pg_backend_pid()")
    return int(pid)


async def _pid_after(adapter: PsycopgDsnAdapter, seconds: float, into: set[int]) -> None:
    ((pid,),) = await adapter.all("SELECT pg_backend_pid() FROM pg_sleep(%s)", (seconds,))
    into.add(int(pid))
