"""Adapters leave no transaction open and no connection behind, whatever the caller does.

Real servers: the embedded PostgreSQL 16 and a PgBouncer in transaction mode in front of
it. Each test checks from another session what the server holds (rows committed, sessions
idle in a transaction, the server process a pooled connection runs on).
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pg8000.dbapi
import pg8000.native
import psycopg
import pytest
import redis
from psycopg_pool import ConnectionPool

from adapters.base import WorkerThreads
from adapters.pg8000 import Pg8000ConnectionAdapter, Pg8000PoolAdapter, pg8000_params
from adapters.psycopg import (
    PsycopgConnectionAdapter,
    PsycopgDsnAdapter,
    PsycopgSyncConnectionAdapter,
    PsycopgSyncPoolAdapter,
)
from adapters.sql import SqlAdapter
from backends.postgres.statements import sqlstate
from backends.redis import RedisBackend
from lease_core.errors import BackendUnavailable, ConfigurationError, StoreRefused
from lease_core.testing import wait_for
from tests.chaos.proxy import Proxy, with_port
from tests.stores.postgres import PgServer

pytestmark = pytest.mark.anyio


def _outside(admin_dsn: str, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """The first value of ``sql``'s first row (None: no rows), from a session of its own."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)  # type: ignore[arg-type]
        row = cur.fetchone() if cur.description else None
        return None if row is None else row[0]


async def _query(admin_dsn: str, sql: str, params: tuple[Any, ...] = ()) -> Any:
    return await anyio.to_thread.run_sync(_outside, admin_dsn, sql, params)


async def _table(admin_dsn: str) -> str:
    name = f"anarchon_safety_{uuid.uuid4().hex[:12]}"
    await _query(admin_dsn, f"CREATE TABLE {name} (x int)")
    return name


async def _drop(admin_dsn: str, table: str) -> None:
    await _query(admin_dsn, f"DROP TABLE IF EXISTS {table}")


async def _idle_in_transaction(admin_dsn: str, app: str) -> int:
    return int(await _query(
        admin_dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
        "AND state LIKE 'idle in transaction%%'", (app,)))


async def _until(check: Callable[[], Any], what: str) -> None:
    """Poll ``check`` (a blocking call, run in a worker thread) until it is true."""
    await wait_for(lambda: anyio.to_thread.run_sync(check), timeout=3.0, interval=0.01,
                   what=what)


async def _commit_as_cancelled(adapter: SqlAdapter, table: str) -> bool:
    """A block that cancels its own scope after its last statement; whether Cancelled
    reached the scope (it may: the commit is done first)."""
    with anyio.CancelScope() as scope:
        async with adapter.transaction() as tx:
            await tx.all(f"INSERT INTO {table} VALUES (1)")
            scope.cancel()  # a handler's own cancel, a stop request: nothing awaited after
        await anyio.lowlevel.checkpoint()
    return scope.cancelled_caught


# -- 1. pg8000: the COMMIT of a block that ended is sent, whatever is pending --------------


@pytest.mark.parametrize("via", ["direct", "pgbouncer"])
async def test_pg8000_pool_commits_a_block_ended_with_a_cancellation_pending(
    pg16_server: PgServer, pgbouncer_server: PgServer, via: str
) -> None:
    table = await _table(pg16_server.admin_dsn)
    app = f"safety-{uuid.uuid4().hex[:8]}"
    server = pg16_server if via == "direct" else pgbouncer_server
    adapter = Pg8000PoolAdapter(dict(pg8000_params(server.dsn), application_name=app),
                                max_size=1)
    await adapter.open()
    try:
        assert await _commit_as_cancelled(adapter, table)
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 1
        assert await _idle_in_transaction(pg16_server.admin_dsn, app) == 0
        # The connection lent next is in no transaction: what it commits is seen.
        async with adapter.transaction() as tx:
            await tx.all(f"INSERT INTO {table} VALUES (2)")
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 2
    finally:
        await adapter.close()
        await _drop(pg16_server.admin_dsn, table)


async def test_pg8000_user_connection_commits_a_block_ended_with_a_cancellation_pending(
    pg16_server: PgServer,
) -> None:
    table = await _table(pg16_server.admin_dsn)
    p = pg8000_params(pg16_server.dsn)
    conn = pg8000.native.Connection(p["user"], host=p["host"], port=p["port"],
                                    password=p["password"], database=p["database"])
    try:
        adapter = Pg8000ConnectionAdapter(conn)
        await _commit_as_cancelled(adapter, table)
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 1
        await adapter.all(f"INSERT INTO {table} VALUES (2)")  # not inside a transaction
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 2
    finally:
        conn.close()
        await _drop(pg16_server.admin_dsn, table)


async def test_pg8000_pool_closes_a_connection_given_back_in_a_transaction(
    pg16_server: PgServer,
) -> None:
    table = await _table(pg16_server.admin_dsn)
    app = f"safety-{uuid.uuid4().hex[:8]}"
    adapter = Pg8000PoolAdapter(dict(pg8000_params(pg16_server.dsn), application_name=app),
                                max_size=1)
    await adapter.open()
    try:
        await adapter.all("BEGIN")  # a statement that leaves its connection in a transaction

        def none_idle_in_transaction() -> bool:
            return not _outside(
                pg16_server.admin_dsn, "SELECT count(*) FROM pg_stat_activity WHERE "
                "application_name = %s AND state LIKE 'idle in transaction%%'", (app,))

        await _until(none_idle_in_transaction, "the connection left in a transaction closed")
        await adapter.all(f"INSERT INTO {table} VALUES (1)")  # on a connection of its own
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 1
    finally:
        await adapter.close()
        await _drop(pg16_server.admin_dsn, table)


def _user_connection(kind: str, dsn: str) -> Any:
    """A connection of the application's, in a transaction it opened and left open."""
    if kind == "pg8000":
        p = pg8000_params(dsn)
        conn = pg8000.dbapi.Connection(p["user"], host=p["host"], port=p["port"],
                                       password=p["password"], database=p["database"])
        conn.cursor().execute("SELECT 1")  # the DB-API opens a transaction at it
        return conn
    conn = psycopg.connect(dsn)  # autocommit off: the SELECT opens a transaction
    conn.execute("SELECT 1")
    return conn


@pytest.mark.parametrize("kind", ["pg8000", "psycopg-sync"])
async def test_a_connection_the_application_left_in_a_transaction_is_refused(
    pg16_server: PgServer, kind: str
) -> None:
    """The store's statements ran inside the application's transaction: psycopg's as
    savepoints, seen by no other instance (a claim's row locks held) until the
    application committed; pg8000's BEGIN was ignored with a warning and its COMMIT
    committed the application's work. Both are refused, and nothing is written; once the
    application commits, the connection serves the store as any other."""
    table = await _table(pg16_server.admin_dsn)
    conn = _user_connection(kind, pg16_server.dsn)
    adapter: SqlAdapter = (Pg8000ConnectionAdapter(conn) if kind == "pg8000"
                           else PsycopgSyncConnectionAdapter(conn))
    try:
        with pytest.raises(ConfigurationError, match="in a transaction the application opened"):
            await adapter.all(f"INSERT INTO {table} VALUES (1)")
        with pytest.raises(ConfigurationError, match="commit or roll it back first"):
            async with adapter.transaction() as tx:
                await tx.all(f"INSERT INTO {table} VALUES (2)")
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 0
        conn.commit()
        await adapter.all(f"INSERT INTO {table} VALUES (3)")
        async with adapter.transaction() as tx:
            await tx.all(f"INSERT INTO {table} VALUES (4)")
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 2
    finally:
        conn.close()
        await _drop(pg16_server.admin_dsn, table)


@pytest.mark.asyncio_only
async def test_an_async_psycopg_connection_left_in_a_transaction_is_refused(
    pg16_server: PgServer,
) -> None:
    table = await _table(pg16_server.admin_dsn)
    conn = await psycopg.AsyncConnection.connect(pg16_server.dsn)
    await conn.execute("SELECT 1")
    adapter = PsycopgConnectionAdapter(conn)
    try:
        with pytest.raises(ConfigurationError, match="in a transaction the application opened"):
            await adapter.all(f"INSERT INTO {table} VALUES (1)")
        with pytest.raises(ConfigurationError, match="in a transaction the application opened"):
            async with adapter.transaction() as tx:
                await tx.all(f"INSERT INTO {table} VALUES (2)")
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 0
        await conn.commit()
        await adapter.all(f"INSERT INTO {table} VALUES (3)")
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 1
    finally:
        await conn.close()
        await _drop(pg16_server.admin_dsn, table)


def test_a_loop_that_ends_while_the_pool_connects_ends() -> None:
    """psycopg_pool catches the cancellation of a connection attempt (and its workers that
    of their tasks): an ``asyncio.run`` that returned while a DSN adapter's pool was
    making a connection (a CLI run, a lease left held, right after a start) cancelled the
    worker making it, which went back to wait for its next task, and ``asyncio.run``
    waited for it for ever. Here the server accepts and never answers."""
    import asyncio
    import socket

    from adapters._psycopg_pools import dsn_pools

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        pools = dsn_pools(f"host=127.0.0.1 port={port} user=u dbname=d connect_timeout=60",
                          1, 2, 10.0)

        async def main() -> None:
            for pool in pools:
                await pool.open(wait=False)  # as PsycopgDsnAdapter.open() does
            await asyncio.sleep(0.2)  # its connections are being made: the loop ends

        ended = threading.Event()

        def run() -> None:
            asyncio.run(main())
            ended.set()

        threading.Thread(target=run, daemon=True).start()
        assert ended.wait(30), "asyncio.run did not return: the pool's worker outlived it"


@pytest.mark.asyncio_only
@pytest.mark.parametrize("kind", ["async-connection", "sync-connection", "sync-pool"])
async def test_the_applications_isolation_level_and_read_only_do_not_reach_the_stores(
    pg16_server: PgServer, kind: str
) -> None:
    """psycopg began the store's transactions with the isolation level and read-only flag
    the application set on its connection or pool: read only, every write was refused as
    by a standby; serializable, racing claims failed. The store's transactions are read
    committed and read write, and the application's settings are put back after."""
    table = await _table(pg16_server.admin_dsn)
    level, ro = psycopg.IsolationLevel.SERIALIZABLE, True

    def configure(conn: Any) -> None:
        conn.isolation_level, conn.read_only = level, ro

    conn: Any = None
    pool: Any = None
    if kind == "async-connection":
        conn = await psycopg.AsyncConnection.connect(pg16_server.dsn)
        await conn.set_isolation_level(level)
        await conn.set_read_only(ro)
        adapter: SqlAdapter = PsycopgConnectionAdapter(conn)
    elif kind == "sync-connection":
        conn = psycopg.connect(pg16_server.dsn)
        configure(conn)
        adapter = PsycopgSyncConnectionAdapter(conn)
    else:
        pool = ConnectionPool(pg16_server.dsn, min_size=1, max_size=1, open=True,
                              configure=configure)
        adapter = PsycopgSyncPoolAdapter(pool)
    try:
        async with adapter.transaction() as tx:
            await tx.all(f"INSERT INTO {table} VALUES (1)")
            seen = await tx.all("SELECT current_setting('transaction_isolation'), "
                                "current_setting('transaction_read_only')")
        assert seen == [("read committed", "off")]
        await adapter.all(f"INSERT INTO {table} VALUES (2)")  # a single statement too
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 2
        if pool is not None:
            with pool.connection() as conn:
                assert (conn.isolation_level, conn.read_only) == (level, ro)
        else:
            assert (conn.isolation_level, conn.read_only) == (level, ro)
    finally:
        if pool is not None:
            pool.close()
        elif kind == "async-connection":
            await conn.close()
        else:
            conn.close()
        await _drop(pg16_server.admin_dsn, table)


@pytest.mark.asyncio_only
@pytest.mark.parametrize("setting", ["row_factory", "cursor_factory"])
@pytest.mark.parametrize("kind", ["async-pool", "sync-connection"])
async def test_a_psycopg_row_factory_or_cursor_class_of_the_users_is_not_the_stores(
    pg16_server: PgServer, kind: str, setting: str
) -> None:
    """A pool or connection made with row_factory=dict_row gave the store rows of column
    names (start() raised IndexError), one with a RawCursor class refused the store's %s
    placeholders (TypeError); the store's statements use psycopg's own cursor, tuple rows."""
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    from backends.postgres import PostgresBackend
    from lease_core.abc import ClaimRequest, ClaimStatus
    from tests.stores.postgres import drop_tables, unique_table

    raw = psycopg.AsyncRawCursor if kind == "async-pool" else psycopg.RawCursor
    options: dict[str, Any] = {setting: dict_row if setting == "row_factory" else raw}
    pool: Any = None
    if kind == "async-pool":
        pool = given = AsyncConnectionPool(pg16_server.dsn, kwargs=options, open=False)
        await pool.open()
    else:
        given = psycopg.connect(pg16_server.dsn, **options)
    backend = PostgresBackend(given, table=unique_table())
    try:
        await backend.start()
        assert abs(await backend.now_ms() - time.time() * 1000) < 60_000
        won = await backend.claim(ClaimRequest("job", 1, "a", "ta", 60_000))
        held = await backend.claim(ClaimRequest("job", 1, "b", "tb", 60_000))
        assert (won.status, held.status) == (ClaimStatus.WON, ClaimStatus.RUNNING)
        assert [(a.job, a.instance_id) for a in await backend.history("job")] == [("job", "a")]
    finally:
        await backend.close()
        await pool.close() if pool is not None else given.close()
        await drop_tables(pg16_server.admin_dsn, backend.table)


@pytest.mark.parametrize(("anyio_backend", "kind"), [
    ("asyncio", "async"), ("asyncio", "sync"), ("trio", "sync")])
async def test_a_psycopg_pool_passed_in_unopened_is_refused_at_start(
    pg16_server: PgServer, kind: str
) -> None:
    """A pool passed in that the application had not opened failed each statement ("the
    pool is not open yet"), read as a store that cannot be reached: a scheduler waited for
    it for ever. start() refuses it, saying to open it; opened, it serves."""
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from backends.postgres import PostgresBackend
    from lease_core import ConfigurationError
    from tests.stores.postgres import drop_tables, unique_table

    make = AsyncConnectionPool if kind == "async" else ConnectionPool
    pool: Any = make(pg16_server.dsn, min_size=1, max_size=2, open=False, name="app-pool")
    backend = PostgresBackend(pool, table=unique_table())
    try:
        with pytest.raises(ConfigurationError,
                           match="the psycopg pool 'app-pool' passed to the backend is not "
                                 "open: open it before the backend starts"):
            await backend.start()
        await pool.open() if kind == "async" else pool.open()
        await backend.start()
        assert abs(await backend.now_ms() - time.time() * 1000) < 60_000
    finally:
        await backend.close()
        await pool.close() if kind == "async" else pool.close()
        await drop_tables(pg16_server.admin_dsn, backend.table)


# -- 2. sync psycopg: the same, and a block cancelled during a statement goes no further ---


@pytest.mark.parametrize("kind", ["connection", "pool"])
async def test_sync_psycopg_commits_a_block_ended_with_a_cancellation_pending(
    pg16_server: PgServer, kind: str
) -> None:
    table = await _table(pg16_server.admin_dsn)
    conn = pool = None
    adapter: SqlAdapter
    if kind == "connection":
        conn = psycopg.connect(pg16_server.dsn)  # autocommit off, as by default
        adapter = PsycopgSyncConnectionAdapter(conn)
    else:
        pool = ConnectionPool(pg16_server.dsn, min_size=1, max_size=1, open=True)
        adapter = PsycopgSyncPoolAdapter(pool)
    try:
        await _commit_as_cancelled(adapter, table)
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 1
        if conn is not None:
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        await adapter.all(f"INSERT INTO {table} VALUES (2)")
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 2
    finally:
        if conn is not None:
            conn.close()
        if pool is not None:
            pool.close()
        await _drop(pg16_server.admin_dsn, table)


async def test_sync_psycopg_block_cancelled_during_a_statement_rolls_back(
    pg16_server: PgServer,
) -> None:
    table = await _table(pg16_server.admin_dsn)
    app = f"safety-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().int % (1 << 62)
    holder = await anyio.to_thread.run_sync(
        lambda: psycopg.connect(pg16_server.admin_dsn, autocommit=True))
    conn = await anyio.to_thread.run_sync(
        lambda: psycopg.connect(pg16_server.dsn, application_name=app))
    adapter = PsycopgSyncConnectionAdapter(conn)
    went_on = False
    try:
        await anyio.to_thread.run_sync(holder.execute, "SELECT pg_advisory_lock(%s)", (key,))
        scope = anyio.CancelScope()

        async def block() -> None:
            nonlocal went_on
            with scope:
                async with adapter.transaction() as tx:
                    await tx.all(f"INSERT INTO {table} VALUES (1)")
                    await tx.all("SELECT pg_advisory_xact_lock(%s)", (key,))  # waits
                    went_on = True

        def waiting() -> bool:
            return bool(_outside(
                pg16_server.admin_dsn, "SELECT count(*) FROM pg_stat_activity WHERE "
                "application_name = %s AND wait_event_type = 'Lock'", (app,)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(block)
            await _until(waiting, "the block to wait for the lock")
            scope.cancel()  # while the statement runs in its worker thread
            await anyio.to_thread.run_sync(
                holder.execute, "SELECT pg_advisory_unlock(%s)", (key,))
        assert scope.cancelled_caught
        assert not went_on, "the block went on after its caller was cancelled"
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert await _query(pg16_server.admin_dsn, f"SELECT count(*) FROM {table}") == 0
    finally:
        conn.close()
        holder.close()
        await _drop(pg16_server.admin_dsn, table)


# -- 3. pg8000: placeholders that do not match the parameters -----------------------------


async def test_pg8000_placeholder_mismatch_is_a_configuration_error_and_keeps_the_connection(
    pg16_server: PgServer,
) -> None:
    adapter = Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=1)
    await adapter.open()
    try:
        pid = await adapter.all("SELECT pg_backend_pid()")
        for _ in range(3):
            with pytest.raises(ConfigurationError, match=r"2 placeholder\(s\) but 1 parameter"):
                await adapter.all("SELECT %s::int, %s::int", (1,))
            with pytest.raises(ConfigurationError, match=r"1 placeholder\(s\) but 2 parameter"):
                await adapter.all_reserved("SELECT %s::int", (1, 2))
            with pytest.raises(ConfigurationError, match="placeholders"):
                await adapter.all("SELECT %(x)s::int", ())
        # The pooled connection was neither lost nor replaced.
        assert await adapter.all("SELECT pg_backend_pid()") == pid
        async with adapter.transaction() as tx:
            with pytest.raises(ConfigurationError, match=r"2 placeholder\(s\) but 1 parameter"):
                await tx.all("SELECT %s::int, %s::int", (1,))
        assert await adapter.all("SELECT pg_backend_pid()") == pid
    finally:
        await adapter.close()


# -- 4. pg8000: a negative number written after a minus sign ------------------------------


async def test_pg8000_negative_numbers_after_a_minus_sign(pg16_server: PgServer) -> None:
    adapter = Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=1)
    await adapter.open()
    try:
        assert await adapter.all("SELECT 10-%s::int, 'after'", (-5,)) == [(15, "after")]
        assert await adapter.all("SELECT 1-%s::float8, 'after'", (-1.5,)) == [(2.5, "after")]
        assert await adapter.all("SELECT %s::int[], 'after'", ([-2, 3],)) == [([-2, 3], "after")]
    finally:
        await adapter.close()


# -- 5. %% and a stray % are the same on both drivers, with or without parameters ---------


@pytest.mark.parametrize(("anyio_backend", "driver"), [  # psycopg's async pool: asyncio
    ("asyncio", "psycopg"), ("asyncio", "psycopg-sync"), ("trio", "psycopg-sync"),
    ("asyncio", "pg8000"), ("trio", "pg8000")])
async def test_percent_signs_follow_one_rule_whatever_the_driver(
    pg16_server: PgServer, driver: str
) -> None:
    pool = None
    adapter: SqlAdapter
    if driver == "psycopg":
        adapter = PsycopgDsnAdapter(pg16_server.dsn, max_size=1)
    elif driver == "psycopg-sync":
        pool = ConnectionPool(pg16_server.dsn, min_size=1, max_size=1, open=True)
        adapter = PsycopgSyncPoolAdapter(pool)
    else:
        adapter = Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=1)
    await adapter.open()
    try:
        assert await adapter.all("SELECT '100%%'") == [("100%",)]
        assert await adapter.all("SELECT '100%%', %s::int", (1,)) == [("100%", 1)]
        async with adapter.transaction() as tx:
            assert await tx.all("SELECT '100%%'") == [("100%",)]
            assert await tx.all("SELECT 'a%%s'") == [("a%s",)]
        refused = (ConfigurationError, psycopg.ProgrammingError)
        for sql in ("SELECT '100%'", "SELECT 'a%sb'"):
            with pytest.raises(refused):
                await adapter.all(sql)
        # Several statements without parameters still go as one (the simple protocol; the
        # drivers differ in which rows they return).
        assert await adapter.all("SELECT 1; SELECT '5%%'") in (
            [(1,)], [("5%",)], [(1,), ("5%",)])
    finally:
        await adapter.close()
        if pool is not None:
            pool.close()


# -- 6. a statement the server gave up on its own timeout --------------------------------


@pytest.mark.parametrize(("anyio_backend", "driver"),  # psycopg's async pool: asyncio
                         [("asyncio", "psycopg"), ("asyncio", "pg8000"), ("trio", "pg8000")])
async def test_a_statement_timeout_is_said_so_the_same_way_and_keeps_the_connection(
    pg16_server: PgServer, driver: str
) -> None:
    """psycopg said "cannot reach PostgreSQL", pg8000 raised its own error and closed the
    connection: both now raise BackendUnavailable saying the server gave it up."""
    adapter: SqlAdapter = (PsycopgDsnAdapter(pg16_server.dsn, max_size=1) if driver == "psycopg"
                           else Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=1))
    await adapter.open()
    try:
        pid = await adapter.all("SELECT pg_backend_pid()")
        with pytest.raises(BackendUnavailable, match="gave the statement up") as raised:
            async with adapter.transaction() as tx:
                await tx.all("SELECT set_config('statement_timeout', '50', true)")
                await tx.all("SELECT pg_sleep(2)")
        assert "cannot reach" not in str(raised.value)
        assert await adapter.all("SELECT pg_backend_pid()") == pid
    finally:
        await adapter.close()


@pytest.mark.parametrize(("anyio_backend", "driver"),  # psycopg's async pool: asyncio
                         [("asyncio", "psycopg"), ("trio", "pg8000")])
async def test_a_missing_function_or_table_names_the_search_path(
    pg16_server: PgServer, driver: str
) -> None:
    """A store function or table the server cannot find (42883, 42P01) is refused as a
    configuration error naming the search_path, which another client of a shared
    PgBouncer can change under anarchon's feet (a SET search_path in transaction mode
    stays on the server connection); an unknown function reached the scheduler as the
    driver's own error ("claim failed unexpectedly", with a traceback), a table with no
    hint."""
    adapter: SqlAdapter = (PsycopgDsnAdapter(pg16_server.dsn, max_size=1) if driver == "psycopg"
                           else Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=1))
    await adapter.open()
    try:
        for sql in ("SELECT anarchon_no_such_function_v4()", "SELECT * FROM anarchon_no_such"):
            with pytest.raises(StoreRefused, match="search_path does not reach them"):
                await adapter.all(sql)
        assert await adapter.all("SELECT 1") == [(1,)]  # the connection is kept
    finally:
        await adapter.close()


@pytest.mark.parametrize(("anyio_backend", "driver"),  # psycopg's async pool: asyncio
                         [("asyncio", "psycopg"), ("trio", "pg8000")])
async def test_a_statement_over_a_server_limit_is_a_configuration_error(
    pg16_server: PgServer, driver: str
) -> None:
    """SQLSTATE class 54 (program_limit_exceeded: 54023 more than 100 arguments, 54000 an
    index row too large) fails again whenever it is sent: psycopg said "cannot reach
    PostgreSQL" (BackendUnavailable, retried as an outage), pg8000 raised its own error.
    Both raise a ConfigurationError naming the SQLSTATE and the server's message. Other
    server errors of no outage class are the drivers' own."""
    adapter: SqlAdapter = (PsycopgDsnAdapter(pg16_server.dsn, max_size=1) if driver == "psycopg"
                           else Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=1))
    await adapter.open()
    try:
        with pytest.raises(ConfigurationError, match="SQLSTATE 54023") as raised:
            await adapter.all("SELECT concat(" + ", ".join(["1"] * 101) + ")")
        assert "more than 100 arguments" in str(raised.value)
        with pytest.raises(ConfigurationError, match="SQLSTATE 54000") as raised:
            async with adapter.transaction() as tx:
                await tx.all("CREATE TEMP TABLE anarchon_limit (t text PRIMARY KEY)")
                await tx.all("INSERT INTO anarchon_limit SELECT string_agg(md5(i::text), '') "
                              "FROM generate_series(1, 400) i")
        assert "index row" in str(raised.value)
        assert type(raised.value) is ConfigurationError  # not StoreRefused, not unavailable
        assert await adapter.all("SELECT 1") == [(1,)]  # the connection is kept
        # A server's error of no outage class (3B001; psycopg files class 3B under
        # OperationalError) is the driver's own, as pg8000's: it said "cannot reach".
        with pytest.raises(Exception) as other:
            async with adapter.transaction() as tx:
                await tx.all("ROLLBACK TO SAVEPOINT anarchon_none")
        assert sqlstate(other.value) == "3B001", other.value
        assert not isinstance(other.value, BackendUnavailable | ConfigurationError), other.value
        assert await adapter.all("SELECT 1") == [(1,)]
        # 40003 statement_completion_unknown (a commit's fate unknown, as some compatible
        # servers answer): a lost answer, not the driver's raw error
        with pytest.raises(BackendUnavailable, match="could not say whether"):
            await adapter.all("DO $$ BEGIN RAISE EXCEPTION 'fate unknown (test)' "
                              "USING ERRCODE = '40003'; END $$")
        assert await adapter.all("SELECT 1") == [(1,)]
    finally:
        await adapter.close()


@asynccontextmanager
async def _default_threads_all_busy() -> AsyncIterator[None]:
    """Every token of anyio's default thread limiter held by a blocked worker thread, as
    an application's slow sync endpoints or ``to_thread`` calls can hold them."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    gate = threading.Event()
    async with anyio.create_task_group() as tg:
        for _ in range(int(limiter.total_tokens)):
            tg.start_soon(anyio.to_thread.run_sync, gate.wait)
        try:
            await wait_for(lambda: limiter.available_tokens == 0, what="busy threads")
            yield
        finally:
            gate.set()


BLOCKING_KINDS = ["pg8000-pool", "pg8000-connection", "psycopg-sync-pool",
                  "psycopg-sync-connection"]


def _blocking_adapter(kind: str, dsn: str, closing: list[Callable[[], Any]]) -> SqlAdapter:
    """An adapter of a blocking driver over one connection at most (``closing``: what
    the test closes after it)."""
    if kind == "pg8000-pool":
        return Pg8000PoolAdapter(pg8000_params(dsn), max_size=1)
    if kind == "pg8000-connection":
        p = pg8000_params(dsn)
        conn = pg8000.native.Connection(p["user"], host=p["host"], port=p["port"],
                                        password=p["password"], database=p["database"])
        closing.append(conn.close)
        return Pg8000ConnectionAdapter(conn)
    if kind == "psycopg-sync-pool":
        pool = ConnectionPool(dsn, min_size=1, max_size=1, open=True, timeout=5)
        closing.append(pool.close)
        return PsycopgSyncPoolAdapter(pool)
    sync_conn = psycopg.connect(dsn, autocommit=True)
    closing.append(sync_conn.close)
    return PsycopgSyncConnectionAdapter(sync_conn)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", BLOCKING_KINDS)
async def test_a_blocking_driver_runs_while_the_default_threads_are_all_busy(
    pg16_server: PgServer, kind: str
) -> None:
    """The blocking drivers run in worker threads of their own: with anyio's default
    limiter exhausted by the application, statements and transactions still run (they
    queued behind it, and heartbeats with them)."""
    closing: list[Callable[[], Any]] = []
    adapter = _blocking_adapter(kind, pg16_server.dsn, closing)
    if kind == "pg8000-pool":
        await adapter.open()
    try:
        async with _default_threads_all_busy():
            with anyio.fail_after(10):
                assert await adapter.all("SELECT 1") == [(1,)]
                async with adapter.transaction() as tx:
                    assert await tx.all("SELECT 2") == [(2,)]
    finally:
        await adapter.close()
        for close in closing:
            close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_sync_redis_client_runs_while_the_default_threads_are_all_busy(
    redis62_server: Any,
) -> None:
    """As the blocking SQL drivers: a sync redis-py client's batches (a Redis URL's
    client under trio) run in worker threads of their own."""
    backend = RedisBackend(redis.Redis(port=redis62_server.port), prefix="threads")
    await backend.start()
    try:
        async with _default_threads_all_busy():
            with anyio.fail_after(10):
                assert await backend.now_ms() > 0
    finally:
        await backend.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_sync_pool_transaction_holding_the_only_connection_is_never_starved(
    pg16_server: PgServer,
) -> None:
    """A pool of one connection, held by a transaction, and statements waiting for it:
    the waiting statements never hold every thread the transaction needs for its next
    statement (that stalled it until the pool's timeout)."""
    pool = ConnectionPool(pg16_server.dsn, min_size=1, max_size=1, open=True, timeout=30)
    adapter = PsycopgSyncPoolAdapter(pool)
    answers: list[Any] = []

    async def one(n: int) -> None:
        answers.extend(await adapter.all("SELECT %s::int", (n,)))

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg, adapter.transaction() as tx:
                for n in range(3):
                    tg.start_soon(one, n)
                await anyio.sleep(0.2)  # the three statements now wait for the pool
                assert await tx.all("SELECT 10") == [(10,)]
                assert await tx.all("SELECT 11") == [(11,)]
        assert sorted(answers) == [(0,), (1,), (2,)]
    finally:
        pool.close()


@pytest.mark.parametrize("kind", BLOCKING_KINDS)
def test_a_blocking_drivers_adapter_runs_under_asyncio_then_trio(
    pg16_server: PgServer, kind: str
) -> None:
    """An adapter of a blocking driver keeps nothing bound to one event-loop library:
    used under asyncio, then under trio, it works under both (its lock, slots or
    checkouts were asyncio's for good, and trio's first call failed with "no running
    event loop")."""
    closing: list[Callable[[], Any]] = []
    adapter = _blocking_adapter(kind, pg16_server.dsn, closing)

    async def use() -> None:
        with anyio.fail_after(10):
            assert await adapter.all("SELECT 1") == [(1,)]
            async with adapter.transaction() as tx:
                assert await tx.all("SELECT 2") == [(2,)]

    try:
        anyio.run(use, backend="asyncio")
        anyio.run(use, backend="trio")
        anyio.run(use, backend="asyncio")
    finally:
        anyio.run(adapter.close)
        for close in closing:
            close()


@pytest.mark.parametrize("kind", ["pg8000-connection", "psycopg-sync-connection"])
def test_a_connection_adapter_refuses_a_second_event_loop_at_once(
    pg16_server: PgServer, kind: str
) -> None:
    """One connection, two event loops in two threads: the second loop's call, while the
    first holds the connection in a transaction, raises a clear error instead of
    interleaving its statements on the connection; once the first is done, it runs."""
    closing: list[Callable[[], Any]] = []
    adapter = _blocking_adapter(kind, pg16_server.dsn, closing)
    holding, done = threading.Event(), threading.Event()

    async def hold() -> None:
        async with adapter.transaction() as tx:
            await tx.all("SELECT 1")
            holding.set()
            await anyio.to_thread.run_sync(done.wait, 30)

    async def second() -> None:
        with pytest.raises(RuntimeError, match="in use by another event loop"):
            await adapter.all("SELECT 2")

    first = threading.Thread(target=anyio.run, args=(hold,), daemon=True)
    first.start()
    try:
        assert holding.wait(10)
        anyio.run(second)
    finally:
        done.set()
        first.join(10)
    assert not first.is_alive()

    async def after() -> None:
        with anyio.fail_after(10):
            assert await adapter.all("SELECT 3") == [(3,)]

    anyio.run(after, backend="trio")
    for close in closing:
        close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_sync_pool_adapter_follows_a_resized_pool(pg16_server: PgServer) -> None:
    """``pool.resize()`` after the adapter was made: the adapter's checkouts and threads
    follow, so three transactions hold three connections at once (one at a time before,
    the adapter's bound staying the pool's first max_size)."""
    pool = ConnectionPool(pg16_server.dsn, min_size=1, max_size=1, open=True, timeout=10)
    adapter = PsycopgSyncPoolAdapter(pool)
    inside = 0
    most = 0
    all_in = anyio.Event()

    async def hold() -> None:
        nonlocal inside, most
        async with adapter.transaction() as tx:
            await tx.all("SELECT 1")
            inside += 1
            most = max(most, inside)
            if inside == 3:
                all_in.set()
            with anyio.move_on_after(3):
                await all_in.wait()
            inside -= 1

    try:
        assert await adapter.all("SELECT 0") == [(0,)]
        pool.resize(1, 3)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(hold)
        assert most == 3
    finally:
        pool.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_sync_pool_statement_waiting_for_a_checkout_gives_up_at_the_pool_timeout(
    pg16_server: PgServer,
) -> None:
    """A statement of the adapter run inside one of its transactions, every connection
    held: it fails after the pool's timeout, as getconn does, and does not wait for good
    (it waited for a checkout the transaction holds, the transaction for it)."""
    pool = ConnectionPool(pg16_server.dsn, min_size=1, max_size=1, open=True, timeout=0.5)
    adapter = PsycopgSyncPoolAdapter(pool)
    try:
        with anyio.fail_after(10):
            async with adapter.transaction() as tx:
                assert await tx.all("SELECT 1") == [(1,)]
                with pytest.raises(BackendUnavailable, match="became free in time"):
                    await adapter.all("SELECT 2")
                assert await tx.all("SELECT 3") == [(3,)]
            assert await adapter.all("SELECT 4") == [(4,)]
    finally:
        pool.close()


def test_a_blocking_drivers_threads_are_a_limiter_per_running_event_loop() -> None:
    """WorkerThreads: a limiter per running loop (asyncio, then trio; and two asyncio
    loops at once in two threads, which shared one limiter and lost its wake-ups)."""
    threads = WorkerThreads(1)
    seen: list[Any] = []

    async def use() -> None:
        seen.append(threads.limiter())
        assert await threads.run(lambda: 1) == 1
        assert threads.limiter() is seen[-1]

    anyio.run(use)
    anyio.run(use, backend="trio")
    assert len({id(limiter) for limiter in seen}) == 2

    async def busy() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(threads.run, time.sleep, 0.001)

    loops = [threading.Thread(target=anyio.run, args=(busy,), daemon=True) for _ in range(2)]
    for loop in loops:
        loop.start()
    for loop in loops:
        loop.join(30)
    assert not any(loop.is_alive() for loop in loops), "a loop's calls never ended"


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_pg8000_pool_statement_gives_up_when_no_slot_frees(pg16_server: PgServer) -> None:
    """Every slot of a pg8000 pool held by a transaction: another statement waits the
    pool's timeout, then says what to raise; nothing is left held (the transaction goes
    on, and statements run again once it ends)."""
    adapter = Pg8000PoolAdapter(pg8000_params(pg16_server.dsn), max_size=1, timeout=0.3)
    try:
        with anyio.fail_after(10):
            async with adapter.transaction() as tx:
                assert await tx.all("SELECT 1") == [(1,)]
                with pytest.raises(BackendUnavailable, match=r"became free within 0\.3s: all 1 "
                                   r"were busy; raise max_size"):
                    await adapter.all("SELECT 2")
                assert await tx.all("SELECT 3") == [(3,)]
            assert await adapter.all("SELECT 4") == [(4,)]
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(adapter.all, "SELECT pg_sleep(0.01)")
    finally:
        await adapter.close()



def test_pg8000_reserved_connection_taken_from_two_threads_at_once_stays_one(
        pg16_server: PgServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two event loops in two threads (the sync front ends' loop and the application's)
    want the pool's reserved connection at once: one has it, the other runs on the pool,
    so the pool never holds more than its bound plus the reserved one. Its busy flag was
    read, and set after a call, with no lock: a thread switch in between let both take
    it, and the second open a connection beyond the bounds (which replaced the first's
    reserved one when it came back)."""
    import adapters.pg8000 as module

    app = f"anarchon-reserved-{uuid.uuid4().hex[:8]}"
    adapter = Pg8000PoolAdapter(dict(pg8000_params(pg16_server.dsn), application_name=app),
                                max_size=1)
    count = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
             " AND pid <> pg_backend_pid() AND %s::float >= 0 AND pg_sleep(%s) IS NOT NULL")
    active = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
              " AND query LIKE '%%pg_sleep%%' AND state = 'active'")
    first_in, second_running = threading.Event(), threading.Event()
    threads: dict[str, threading.Thread] = {}
    real_alone = module._alone

    def alone(sql: str, params: Any) -> Any:
        # The first thread's call stops here (inside all_reserved, between its look at
        # the flag and setting it, before the fix) until the second thread's statement
        # runs on the reserved connection.
        if threading.current_thread() is threads.get("first") and not first_in.is_set():
            first_in.set()
            second_running.wait(5)
            deadline = time.monotonic() + 5
            while not _outside(pg16_server.dsn, active, (app,)) and time.monotonic() < deadline:
                time.sleep(0.01)
        elif threading.current_thread() is threads.get("second"):
            second_running.set()
        return real_alone(sql, params)

    monkeypatch.setattr(module, "_alone", alone)
    seen: dict[str, int] = {}

    def run(name: str, sleep_s: float) -> None:
        async def one() -> None:
            rows = await adapter.all_reserved(count, (app, 0, sleep_s))
            seen[name] = int(rows[0][0])

        anyio.run(one)

    async def open_() -> None:
        await adapter.open()  # one idle pooled connection

    anyio.run(open_)
    try:
        threads["first"] = threading.Thread(target=run, args=("first", 0), daemon=True)
        threads["second"] = threading.Thread(target=run, args=("second", 1), daemon=True)
        threads["first"].start()
        assert first_in.wait(5)
        threads["second"].start()
        for thread in threads.values():
            thread.join(20)
        assert not any(t.is_alive() for t in threads.values())
        # The first ran on the pooled connection; the only other one is the reserved
        # one, the second's (before the fix: a third, opened beyond the bounds).
        assert seen["first"] == 1, seen
    finally:
        async def close() -> None:
            await adapter.close()

        anyio.run(close)


async def test_pg8000_pool_open_keeps_its_first_connection(pg16_server: PgServer) -> None:
    """``open()`` logs in once to report a bad login or host at once, and keeps that
    connection for the first statement. pg8000 leaves a new connection's transaction
    status unset until its first statement, which the pool read as "in a transaction":
    it closed the connection and the first statement logged in again."""
    app = f"anarchon-open-{uuid.uuid4().hex[:8]}"
    adapter = Pg8000PoolAdapter(dict(pg8000_params(pg16_server.dsn), application_name=app),
                                max_size=2)
    await adapter.open()
    try:
        sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        assert await _query(pg16_server.dsn, sessions, (app,)) == 1
        rows = await adapter.all("SELECT pg_backend_pid()")
        assert await _query(pg16_server.dsn, sessions, (app,)) == 1, "logged in again"
        assert await adapter.all("SELECT pg_backend_pid()") == rows
    finally:
        await adapter.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # psycopg's async pool
async def test_a_pool_that_cannot_reconnect_does_not_blame_its_size(pg16_server: PgServer) -> None:
    """A server gone after the pool opened: the pool timed out while trying to open a
    connection, and the error said every connection was busy and to raise max_size,
    which an operator reading an outage's log line could only get wrong."""
    proxy = Proxy(int(pg16_server.dsn.rsplit(":", 1)[1].split("/")[0]))
    await anyio.to_thread.run_sync(proxy.start)
    adapter = PsycopgDsnAdapter(with_port(pg16_server.dsn, proxy.port), max_size=1,
                                timeout=0.5)
    try:
        await adapter.open()
        assert await adapter.all("SELECT 1") == [(1,)]
    finally:
        await anyio.to_thread.run_sync(proxy.close)  # nothing listens any more
    try:
        errors: list[str] = []
        with anyio.fail_after(10):
            while not any("became free in time" in e for e in errors):
                with pytest.raises(BackendUnavailable) as raised:
                    await adapter.all("SELECT 1")
                errors.append(str(raised.value))
        timed_out = next(e for e in errors if "became free in time" in e)
        assert "or the pool could not open one" in timed_out, timed_out
    finally:
        await adapter.close()


@pytest.mark.asyncio_only
async def test_psycopg_on_windows_default_loop_is_a_configuration_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On Windows' default asyncio loop (ProactorEventLoop) psycopg refuses to connect
    at all; that was "cannot reach PostgreSQL" (an outage, retried for ever). Now one
    error says to run on a selector loop or use pg8000 (Windows simulated: psycopg checks
    ``sys.platform`` and the loop's class, before it connects anywhere)."""
    import asyncio

    from backends.postgres import PostgresBackend

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(asyncio, "ProactorEventLoop", asyncio.AbstractEventLoop, raising=False)
    backend = PostgresBackend("postgresql://app@127.0.0.1:1/app")
    with pytest.raises(ConfigurationError, match=r"ProactorEventLoop.*selector loop.*pg8000"):
        await backend.start()
    await backend.close()
