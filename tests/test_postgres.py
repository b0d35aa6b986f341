"""PostgreSQL-specific behaviour: creation races, format, privileges, names, errors, fencing."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from backends.embedded.postgres import EmbeddedPostgres, find_free_port
from backends.postgres import CODE_VERSION, FORMAT_VERSION, PostgresBackend, migrate
from lease_core import Lease as NamedLease
from lease_core._structures import (
    ClaimRequest,
    ClaimStatus,
    Lease,
    Outcome,
    Reason,
    RunStatus,
)
from lease_core.errors import (
    BackendUnavailable,
    ConfigurationError,
    LeaseLost,
    StoreFormatError,
)
from tests.helpers import wait_for
from tests.stores.postgres import (
    STORES,
    CustomPoolAdapter,
    PgServer,
    drop_tables,
    unique_table,
)

pytestmark = pytest.mark.anyio

# psycopg's async API needs asyncio; pg8000 runs in worker threads, so on trio too.
LOOP_SCHEMES = [("asyncio", "postgresql://"), ("asyncio", "postgresql+pg8000://"),
                ("trio", "postgresql+pg8000://")]
LOOP_DRIVERS = [("asyncio", "psycopg"), ("asyncio", "pg8000"), ("trio", "pg8000")]
#: Each store of the suite, on each event loop it supports.
EVERY_STORE = pytest.mark.parametrize(
    ("anyio_backend", "spec"),
    [(loop, spec) for spec in STORES for loop in spec.anyio_backends],
    ids=[f"{spec.id}-{loop}" for spec in STORES for loop in spec.anyio_backends],
)
#: Stores built on one connection: no fenced transactions there.
ONE_CONNECTION = ("pg16-psycopg-conn", "pg16-pg8000")



@pytest.fixture
async def table(pg16_server: PgServer) -> AsyncIterator[str]:
    """A fresh table name on PostgreSQL 16, dropped afterwards."""
    name = unique_table()
    yield name
    await drop_tables(pg16_server.admin_dsn, name)


def request_for(job: str, slot: int, token: str, lease_ms: int = 60_000, **kw: Any) -> ClaimRequest:
    """A claim request from instance ``i-<token>``."""
    return ClaimRequest(job, slot, f"i-{token}", token, lease_ms, **kw)


async def wait_until_expired(backend: PostgresBackend, expires_ms: int) -> None:
    """Wait, with a deadline, until the store's clock passes ``expires_ms``."""

    async def passed() -> bool:
        return await backend.now_ms() > expires_ms

    await wait_for(passed, what=f"store clock past {expires_ms}")


def admin(server: PgServer, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run ``sql`` as the superuser, straight on the server."""
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


@EVERY_STORE
async def test_contract_round_trip_on_every_store(
    request: pytest.FixtureRequest, spec: Any, anyio_backend: str
) -> None:
    store = await spec.make(request)
    try:
        a, b = store.backend(), store.backend()
        await a.start()
        await b.start()
        job = "job"
        # More than psycopg's prepare_threshold (5) of the same statements: PgBouncer safe.
        for slot in range(1, 8):
            won = await a.claim(request_for(job, slot, f"a{slot}", overlap_skip=False))
            assert won.status is ClaimStatus.WON and won.attempt == 1
            backup = await b.claim(request_for(job, slot, f"b{slot}", overlap_skip=False))
            assert backup.status is ClaimStatus.RUNNING and backup.instance_id == f"i-a{slot}"
            lease = Lease(job, slot, f"a{slot}", 60_000)
            beat = await a.heartbeat([lease, Lease(job, slot, "stale", 1000)])
            assert beat.held == {f"a{slot}"}
            assert await a.set_checkpoint(lease, {"n": slot})
            assert await b.get_checkpoint(job, slot) == {"n": slot}
            assert await a.finish(lease, Outcome.COMPLETED)
            assert not await a.finish(lease, Outcome.COMPLETED)
        handed = await a.claim(request_for(job, 100, "h1"))
        assert await a.hand_over([Lease(job, 100, "h1", 60_000)]) == {"h1"}
        taken = await b.claim(request_for(job, 100, "h2"))
        assert (taken.status, taken.reason, taken.attempt) == (
            ClaimStatus.WON, Reason.HAND_OVER, handed.attempt + 1)
        if spec.id in ONE_CONNECTION:
            # heartbeats would wait behind the transaction: refused before it begins
            with pytest.raises(ConfigurationError, match="pool or a DSN"):
                async with b.transaction(Lease(job, 100, "h2", 60_000)):
                    pytest.fail("a fenced transaction began on one connection")
            assert await b.finish(Lease(job, 100, "h2", 60_000), Outcome.COMPLETED)
        else:
            async with b.transaction(Lease(job, 100, "h2", 60_000)) as tx:
                assert await tx.execute("SELECT %s::int * 2", (21,)) == [(42,)]
                assert tx.connection is not None
        state = await a.check([(job, 100), (job, 99)])
        assert state.runs[(job, 100)].status is RunStatus.COMPLETED
        assert (job, 99) not in state.runs
        history = await b.history(job, limit=3)
        assert [(h.slot, h.attempt, h.outcome) for h in history] == [
            (100, 2, Outcome.COMPLETED), (100, 1, Outcome.HANDED_OVER), (7, 1, Outcome.COMPLETED)
        ]
        await a.close()
        await b.close()
    finally:
        await store.cleanup()


@pytest.mark.asyncio_only
async def test_eight_backends_create_the_tables_concurrently(
    pg16_server: PgServer, table: str
) -> None:
    backends = [PostgresBackend(pg16_server.dsn, table=table) for _ in range(8)]
    async with anyio.create_task_group() as tg:
        for backend in backends:
            tg.start_soon(backend.start)
    results = [await b.claim(request_for("j", 1, f"t{i}")) for i, b in enumerate(backends)]
    assert [r.status for r in results].count(ClaimStatus.WON) == 1
    # The store's creation also records the server's timeline, epoch 0 (failover detection).
    assert admin(pg16_server, f"SELECT key, value FROM {table}_meta ORDER BY key") == [
        ("code", str(CODE_VERSION)), ("failover", "00000001 0 0"),
        ("format", str(FORMAT_VERSION))
    ]
    for backend in backends:
        await backend.close()


@pytest.mark.asyncio_only
async def test_newer_format_is_refused_and_nothing_is_written(
    pg16_server: PgServer, table: str
) -> None:
    admin(pg16_server, f"CREATE TABLE {table}_meta (key text PRIMARY KEY, value text NOT NULL)")
    admin(pg16_server, f"INSERT INTO {table}_meta VALUES ('format', '{FORMAT_VERSION + 1}')")
    backend = PostgresBackend(pg16_server.dsn, table=table)
    with pytest.raises(StoreFormatError, match=f"format '{FORMAT_VERSION + 1}'"):
        await backend.start()
    tables = admin(pg16_server, "SELECT relname FROM pg_class WHERE relname LIKE %s",
                   (table + "%",))
    assert {name for (name,) in tables} >= {f"{table}_meta"}
    assert f"{table}_jobs" not in {name for (name,) in tables}
    # A complete store with a newer format is refused too, and left untouched.
    admin(pg16_server, f"DROP TABLE {table}_meta")
    await migrate(pg16_server.dsn, table=table)
    admin(pg16_server, f"UPDATE {table}_meta SET value = '{FORMAT_VERSION + 1}'")
    with pytest.raises(StoreFormatError):
        await PostgresBackend(pg16_server.dsn, table=table).start()
    assert admin(pg16_server, f"SELECT count(*) FROM {table}_jobs") == [(0,)]


@pytest.mark.asyncio_only
async def test_least_privilege_role_after_migrate(pg16_server: PgServer, table: str) -> None:
    role = f"app_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    admin(pg16_server, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    role_dsn = pg16_server.server.dsn_for(role, password)
    try:
        missing = PostgresBackend(role_dsn, table=table)
        with pytest.raises(ConfigurationError, match="anarchon migrate") as info:
            await missing.start()
        assert table in str(info.value)
        await migrate(pg16_server.dsn, table=table)
        tables = ", ".join(f"{table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
        admin(pg16_server, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
        backend = PostgresBackend(role_dsn, table=table)
        await backend.start()
        assert (await backend.register_jobs(["j"]))["j"].new
        won = await backend.claim(request_for("j", 1, "t1", history_size=1))
        assert won.status is ClaimStatus.WON
        assert await backend.finish(Lease("j", 1, "t1", 1000), Outcome.COMPLETED)
        await backend.claim(request_for("j", 2, "t2", history_size=1))
        await backend.prune("j", keep=1)  # trims with DELETE
        assert await backend.maintenance_due("app", 60_000)  # upserts a row of _meta
        assert not await backend.maintenance_due("app", 60_000)
        assert [a.slot for a in await backend.history("j")] == [2]
        await backend.close()
    finally:
        await drop_tables(pg16_server.admin_dsn, table)
        admin(pg16_server, f"DROP ROLE {role}")


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_members_share_meta_with_other_rows_and_need_no_more_privileges(
    pg16_server: PgServer, table: str, scheme: str, anyio_backend: str
) -> None:
    # A store as the previous release made it (no table of its own for members), used by
    # a role with SELECT, INSERT, UPDATE and DELETE only, whose _meta holds other rows.
    role = f"app_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    admin(pg16_server, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    role_dsn = pg16_server.server.dsn_for(role, password).replace("postgresql://", scheme, 1)
    try:
        await migrate(pg16_server.dsn.replace("postgresql://", scheme, 1), table=table)
        tables = ", ".join(f"{table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
        admin(pg16_server, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
        backend = PostgresBackend(role_dsn, table=table)
        await backend.start()
        try:
            assert await backend.maintenance_due("app", 60_000)
            await backend.register_workflows({"close": ["a", "b"]})
            now = await backend.now_ms()
            admin(pg16_server, f"INSERT INTO {table}_meta (key, value) VALUES "
                  "('member:ancient', %s), ('member:recent', %s), ('member:junk', 'x y'), "
                  "('member:huge', %s), ('membership', '12'), ('workflow:member:', '[]')",
                  (str(now - 3_600_000 - 60_000), str(now - 1_000), "9" * 30))
            others = f"SELECT key, value FROM {table}_meta WHERE left(key, 7) <> 'member:' " \
                     "ORDER BY key"
            before = admin(pg16_server, others)
            assert await backend.members("app 1", 30_000) == ["app 1"]
            assert await backend.members("app:2|é", 30_000) == ["app 1", "app:2|é"]
            assert admin(pg16_server, others) == before  # no other row touched
            kept = admin(pg16_server, f"SELECT substr(key, 8) FROM {table}_meta "
                         "WHERE left(key, 7) = 'member:' ORDER BY key")
            # ended more than an hour ago, or unreadable: deleted; ended lately: kept
            assert sorted(k for (k,) in kept) == sorted(["app 1", "app:2|é", "recent"])
            (value,) = admin(pg16_server, f"SELECT value FROM {table}_meta "
                             "WHERE key = 'member:app 1'")[0]
            assert now + 30_000 <= int(value) <= await backend.now_ms() + 30_000
            assert not await backend.maintenance_due("app", 60_000)  # its row is intact
        finally:
            await backend.close()
    finally:
        await drop_tables(pg16_server.admin_dsn, table)
        admin(pg16_server, f"DROP ROLE {role}")


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES[:2])
async def test_members_called_together_never_wait_for_each_other(
    pg16_server: PgServer, table: str, scheme: str, anyio_backend: str
) -> None:
    # Every caller's own row ended more than an hour ago, so each statement both renews
    # its own row and would delete the others': row locks are skipped, never waited for.
    dsn = pg16_server.dsn.replace("postgresql://", scheme, 1)
    backends = [PostgresBackend(dsn, table=table, min_size=1, max_size=1) for _ in range(6)]
    for backend in backends:
        await backend.start()
    try:
        names = [f"i{n}" for n in range(len(backends))]

        async def renew(seen: dict[str, list[str]], backend: PostgresBackend, name: str) -> None:
            seen[name] = await backend.members(name, 30_000)

        for _ in range(3):
            ancient = str(await backends[0].now_ms() - 7_200_000)
            admin(pg16_server, f"INSERT INTO {table}_meta (key, value) "
                  "SELECT 'member:' || n, %s FROM unnest(%s::text[]) AS n "
                  "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value", (ancient, names))
            seen: dict[str, list[str]] = {}
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for backend, name in zip(backends, names, strict=True):
                        tg.start_soon(renew, seen, backend, name)
            assert all(name in seen[name] for name in names)
            assert await backends[0].members("i0", 30_000) == names
    finally:
        for backend in backends:
            await backend.close()


@pytest.mark.asyncio_only
async def test_schema_qualified_table_and_missing_schema(pg16_server: PgServer) -> None:
    schema = f"s_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigurationError, match=f"schema '{schema}'.*does not exist"):
        await PostgresBackend(pg16_server.dsn, table=f"{schema}.runs").start()
    admin(pg16_server, f"CREATE SCHEMA {schema}")
    try:
        backend = PostgresBackend(pg16_server.dsn, table=f"{schema}.runs")
        await backend.start()
        assert (await backend.claim(request_for("j", 1, "t"))).status is ClaimStatus.WON
        await backend.close()
        found = admin(pg16_server, "SELECT tablename FROM pg_tables WHERE schemaname = %s",
                      (schema,))
        assert {n for (n,) in found} == {"runs", "runs_attempts", "runs_jobs", "runs_meta"}
    finally:
        admin(pg16_server, f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.parametrize(
    "name", ['runs"; DROP TABLE x; --', "bad name", "a.b.c", "x" * 60, "", "1runs", "s.", 42,
             "runs\n", "s\n.runs"]
)
def test_bad_table_names_are_refused(name: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        PostgresBackend("postgresql://localhost/postgres", table=name)
    assert repr(name)[:40] in str(info.value) or "x" * 40 in str(info.value)


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_unreachable_server_is_reported_clearly(scheme: str, anyio_backend: str) -> None:
    port = find_free_port()
    backend = PostgresBackend(f"{scheme}postgres:pw@127.0.0.1:{port}/postgres", table="t")
    with pytest.raises(BackendUnavailable, match=f"127.0.0.1:{port}"):
        await backend.start()


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_wrong_password_is_reported_without_the_password(
    pg16_server: PgServer, scheme: str, anyio_backend: str
) -> None:
    secret = "wrong-" + uuid.uuid4().hex
    s = pg16_server.server
    backend = PostgresBackend(f"{scheme}postgres:{secret}@{s.host}:{s.port}/postgres", table="t")
    with pytest.raises(BackendUnavailable, match="password") as info:
        await backend.start()
    assert secret not in str(info.value)
    assert secret not in repr(info.value.args)


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_an_application_table_given_as_the_store_is_refused_and_kept(
    pg16_server: PgServer, table: str, scheme: str, anyio_backend: str
) -> None:
    """``table=`` naming a table of the application (here with ``job`` and ``slot``
    columns, as a job table may have) failed start() and ``anarchon migrate`` with the
    server's 'column "status" does not exist', read by the CLI as an unexpected error
    (exit 1). It is a ConfigurationError (exit 2) naming the table and what it lacks; the
    table and its rows are kept, and no table of the store is created beside it."""
    from lease_core.cli import main

    admin(pg16_server, f"CREATE TABLE {table} (id int PRIMARY KEY, job text, slot bigint)")
    admin(pg16_server, f"INSERT INTO {table} VALUES (1, 'a', 1), (2, 'b', 2)")
    url = scheme + pg16_server.dsn.split("://", 1)[1]
    backend = PostgresBackend(url, table=table)
    with pytest.raises(ConfigurationError) as info:
        await backend.start()
    assert str(info.value) == (
        f'table "{table}" exists and is not an anarchon store\'s (it has no column status, '
        "attempt); give the store a table name of its own (table=, --table or "
        f"--namespace), not {table!r}: nothing was changed"), info.value
    await backend.close()
    code = await anyio.to_thread.run_sync(main, ["migrate", "--url", url, "--table", table])
    assert code == 2
    assert admin(pg16_server, f"SELECT * FROM {table} ORDER BY id") == [(1, "a", 1), (2, "b", 2)]
    tables = admin(pg16_server, "SELECT relname FROM pg_class WHERE relname LIKE %s",
                   (table + "%",))
    assert {name for (name,) in tables} == {table, f"{table}_pkey"}


@pytest.mark.asyncio_only
async def test_stale_attempt_cannot_commit_its_fenced_effect(
    pg16_server: PgServer, table: str
) -> None:
    effects = f"{table}_effects"
    admin(pg16_server, f"CREATE TABLE {effects} (job text, slot bigint, PRIMARY KEY (job, slot))")
    old = PostgresBackend(pg16_server.dsn, table=table)
    new = PostgresBackend(pg16_server.dsn, table=table)
    await old.start()
    await new.start()
    try:
        first = await old.claim(request_for("close", 1, "old", lease_ms=200))
        assert first.status is ClaimStatus.WON and first.expires_ms is not None
        await wait_until_expired(new, first.expires_ms)  # the old holder stalls past its lease
        taken = await new.claim(request_for("close", 1, "new"))
        assert (taken.status, taken.reason, taken.attempt) == (
            ClaimStatus.WON, Reason.TAKEOVER, 2)
        insert = f"INSERT INTO {effects} VALUES (%s, %s)"
        with pytest.raises(LeaseLost):
            async with old.transaction(Lease("close", 1, "old", 200)) as tx:
                await tx.execute(insert, ("close", 1))
        # An effect written before an error is rolled back with it.
        with pytest.raises(RuntimeError):
            async with new.transaction(Lease("close", 1, "new", 60_000)) as tx:
                await tx.execute(insert, ("close", 1))
                raise RuntimeError("handler failed")
        assert admin(pg16_server, f"SELECT count(*) FROM {effects}") == [(0,)]
        async with new.transaction(Lease("close", 1, "new", 60_000)) as tx:
            await tx.execute(insert, ("close", 1))
        assert admin(pg16_server, f"SELECT count(*) FROM {effects}") == [(1,)]
        assert not await old.finish(Lease("close", 1, "old", 200), Outcome.COMPLETED)
        with pytest.raises(LeaseLost):
            async with new.transaction(Lease("close", 1, "new", 60_000)):
                pass
        outcomes = [(a.attempt, a.outcome) for a in await new.history("close")]
        assert outcomes == [(2, Outcome.COMPLETED), (1, Outcome.LOST)]
    finally:
        await old.close()
        await new.close()
        admin(pg16_server, f"DROP TABLE {effects}")


@pytest.mark.asyncio_only
async def test_claims_of_different_jobs_do_not_wait_for_each_other(
    pg16_server: PgServer, table: str
) -> None:
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    await backend.register_jobs(["busy", "free"])
    with psycopg.connect(pg16_server.admin_dsn) as holder:
        # Hold the job row lock of "busy", as an in-flight claim would.
        holder.execute(f"UPDATE {table}_jobs SET seq = seq + 1 WHERE job = 'busy'")
        with anyio.fail_after(5):
            free = await backend.claim(request_for("free", 1, "f"))
        assert free.status is ClaimStatus.WON
        blocked: list[Any] = []
        done = anyio.Event()

        async def claim_busy() -> None:
            blocked.append(await backend.claim(request_for("busy", 1, "b")))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim_busy)
            with anyio.move_on_after(0.5):
                await done.wait()
            assert blocked == [], "a claim of the locked job must wait for the lock"
            holder.commit()
        assert blocked[0].status is ClaimStatus.WON
    await backend.close()


@pytest.mark.asyncio_only
async def test_history_is_trimmed_by_size_and_ttl(pg16_server: PgServer, table: str) -> None:
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    for slot in range(1, 7):
        await backend.claim(request_for("j", slot, f"t{slot}", overlap_skip=False,
                                        history_size=3))
        await backend.finish(Lease("j", slot, f"t{slot}", 1000), Outcome.COMPLETED)
    assert await backend.prune("j", keep=3) == 3  # the ticker's trimming, not the claims
    assert [a.slot for a in await backend.history("j")] == [6, 5, 4]
    assert set((await backend.check([("j", s) for s in range(1, 7)])).runs) == {
        ("j", 4), ("j", 5), ("j", 6)}
    now = await backend.now_ms()
    await wait_until_expired(backend, now + 5)
    await backend.claim(request_for("j", 7, "t7", overlap_skip=False, history_ttl_ms=1))
    await backend.prune("j", older_than_ms=1)
    assert [a.slot for a in await backend.history("j")] == [7]
    await backend.close()


@pytest.mark.asyncio_only
async def test_single_async_connection_is_queued_and_never_closed(
    pg16_server: PgServer, table: str
) -> None:
    conn = await psycopg.AsyncConnection.connect(pg16_server.dsn)  # autocommit off
    backend = PostgresBackend(conn, table=table)
    await backend.start()
    results = []

    async def claim(i: int) -> None:
        results.append(await backend.claim(request_for("j", 1, f"t{i}")))

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(claim, i)
    assert sorted(r.status for r in results).count(ClaimStatus.WON) == 1
    await backend.close()
    assert not conn.closed
    await conn.close()


async def test_sync_pool_works_on_both_event_loops(pg16_server: PgServer, table: str) -> None:
    with ConnectionPool(pg16_server.dsn, min_size=1, max_size=2) as pool:
        backend = PostgresBackend(pool, table=table)
        await backend.start()
        assert (await backend.claim(request_for("j", 1, "t"))).status is ClaimStatus.WON
        async with backend.transaction(Lease("j", 1, "t", 1000)) as tx:
            assert await tx.execute("SELECT 1") == [(1,)]
        assert (await backend.check([("j", 1)])).runs[("j", 1)].status is RunStatus.COMPLETED
        await backend.close()
        assert not pool.closed


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_server_restart_mid_lease(scheme: str, anyio_backend: str) -> None:
    server = EmbeddedPostgres()
    server.start()
    try:
        backend = PostgresBackend(server.dsn.replace("postgresql://", scheme, 1),
                                  table="restart_runs")
        await backend.start()
        lease = Lease("j", 1, "t", 120_000)
        assert (await backend.claim(request_for("j", 1, "t", 120_000))).status is ClaimStatus.WON
        await anyio.to_thread.run_sync(lambda: server.stop(remove=False))
        with pytest.raises(BackendUnavailable):
            await backend.heartbeat([lease])
        await anyio.to_thread.run_sync(server.start)
        with anyio.fail_after(30):
            while True:
                try:
                    beat = await backend.heartbeat([lease])
                    break
                except BackendUnavailable:
                    await anyio.sleep(0.05)
        assert beat.held == {"t"}
        assert await backend.finish(lease, Outcome.COMPLETED)
        await backend.close()
    finally:
        server.stop()


def test_dsn_options_are_validated() -> None:
    with pytest.raises(ConfigurationError, match="driver"):
        PostgresBackend("postgresql://localhost/postgres", driver="asyncpg")
    with pytest.raises(ConfigurationError, match="cannot use"):
        PostgresBackend(object())
    with pytest.raises(ConfigurationError, match="postgresql"):
        PostgresBackend("mysql://localhost/db", driver="pg8000")
    assert PostgresBackend.from_url("postgresql://u:p@h/db").table == "anarchon_runs"


class _OwnPool(AsyncConnectionPool[Any]):
    """A user's subclass of psycopg's pool."""


class _OwnConnection(psycopg.AsyncConnection[Any]):
    """A user's subclass of psycopg's connection."""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_subclasses_of_a_drivers_pool_or_connection_are_accepted(
    pg16_server: PgServer, table: str,
) -> None:
    # Their classes live in the user's module, not the driver's: the adapter is chosen
    # by the nearest driver class among their bases.
    pool = _OwnPool(pg16_server.dsn, min_size=1, max_size=2, open=False,
                    kwargs={"autocommit": True})
    await pool.open(wait=True)
    conn = await _OwnConnection.connect(pg16_server.dsn, autocommit=True)
    try:
        for slot, given in enumerate((pool, conn), start=1):
            backend = PostgresBackend(given, table=table)
            await backend.start()
            try:
                won = await backend.claim(ClaimRequest("sub", slot, "i", "t", 10_000))
                assert won.status is ClaimStatus.WON
                assert await backend.finish(Lease("sub", slot, "t", 10_000), Outcome.COMPLETED)
            finally:
                await backend.close()
        assert not pool.closed and not conn.closed  # given, so never closed here
        with pytest.raises(ConfigurationError, match="cannot use"):
            PostgresBackend(type("NotADriver", (), {})())
    finally:
        await conn.close()
        await pool.close()


@pytest.mark.parametrize(("anyio_backend", "driver"), LOOP_DRIVERS)
async def test_nothing_means_localhost_with_pg_variables(
    pg16_server: PgServer, table: str, driver: str, anyio_backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = pg16_server.server
    for name, value in {"PGHOST": s.host, "PGPORT": str(s.port), "PGUSER": "postgres",
                        "PGPASSWORD": s.password}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PGDATABASE", raising=False)
    backend = PostgresBackend(table=table, driver=driver)
    await backend.start()
    assert (await backend.claim(request_for("j", 1, "t"))).status is ClaimStatus.WON
    await backend.close()


class CountingAdapter(CustomPoolAdapter):
    """A user adapter (documented protocol) that counts statements and transactions."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        super().__init__(pool)
        self.statements: list[str] = []
        self.transactions = 0

    async def all(self, sql: str, params: Any) -> list[tuple[Any, ...]]:
        self.statements.append(sql)
        return await super().all(sql, params)

    async def transaction(self, fn: Any) -> Any:
        self.transactions += 1
        return await super().transaction(fn)


@pytest.mark.asyncio_only
async def test_every_claim_outcome_is_one_statement_without_a_transaction(
    pg16_server: PgServer, table: str
) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg16_server.dsn, min_size=1, max_size=2, open=False)
    await pool.open(wait=True)
    counting = CountingAdapter(pool)
    backend = PostgresBackend(counting, table=table)
    await backend.start()
    try:
        async def claim(request: ClaimRequest) -> Any:
            counting.statements.clear()
            counting.transactions = 0
            result = await backend.claim(request)
            assert (len(counting.statements), counting.transactions) == (1, 0), (
                result.status, counting.statements)
            return result.status, result.reason

        assert await claim(request_for("j", 1, "a")) == (ClaimStatus.WON, Reason.SCHEDULED)
        assert await claim(request_for("j", 1, "b")) == (ClaimStatus.RUNNING, None)
        assert await claim(request_for("j", 2, "s")) == (ClaimStatus.SKIPPED, None)
        # A last renewal for a short lease (an absolute expiry), then "a" stalls past it.
        assert (await backend.heartbeat([Lease("j", 1, "a", 150)])).held == {"a"}
        await wait_until_expired(backend, (await backend.check([("j", 1)])).runs[
            ("j", 1)].expires_ms or 0)
        assert await claim(request_for("j", 1, "c", max_attempts=2)) == (
            ClaimStatus.WON, Reason.TAKEOVER)
        assert await backend.hand_over([Lease("j", 1, "c", 60_000)]) == {"c"}
        assert await claim(request_for("j", 1, "d", lease_ms=150, max_attempts=2)) == (
            ClaimStatus.WON, Reason.HAND_OVER)
        expires = (await backend.check([("j", 1)])).runs[("j", 1)].expires_ms or 0
        await wait_until_expired(backend, expires)
        # The first attempt and one takeover: max_attempts=2 is reached (hand-overs do
        # not count).
        assert await claim(request_for("j", 1, "e", max_attempts=2)) == (
            ClaimStatus.ESCALATED, None)
        assert await claim(request_for("j", 1, "f")) == (ClaimStatus.FINISHED, None)
        history = [(a.attempt, a.reason, a.outcome) for a in await backend.history("j")
                   if a.slot == 1]
        assert history == [(3, Reason.HAND_OVER, Outcome.ESCALATED),
                           (2, Reason.TAKEOVER, Outcome.HANDED_OVER),
                           (1, Reason.SCHEDULED, Outcome.LOST)]
    finally:
        await backend.close()
        await pool.close()


@pytest.mark.asyncio_only
async def test_claims_that_write_no_attempt_leave_the_job_row_alone(
    pg16_server: PgServer, table: str
) -> None:
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    # A new row version changes xmin and ctid; a row lock (SELECT ... FOR UPDATE) xmax.
    job_row = f"SELECT xmin::text, ctid::text, xmax::text, last_slot, seq FROM {table}_jobs"
    try:
        assert (await backend.claim(request_for("j", 5, "a"))).status is ClaimStatus.WON
        [won] = admin(pg16_server, job_row)
        assert won[3:] == (5, 1)
        assert (await backend.claim(request_for("j", 5, "b"))).status is ClaimStatus.RUNNING
        assert (await backend.claim(request_for("j", 4, "c", overlap_skip=False))).status \
            is ClaimStatus.WON  # an older slot: last_slot stays, seq grows
        [older] = admin(pg16_server, job_row)
        assert older[3:] == (5, 2) and older[0] != won[0]
        assert (await backend.claim(request_for("j", 4, "d"))).status is ClaimStatus.RUNNING
        assert await backend.finish(Lease("j", 4, "c", 60_000), Outcome.COMPLETED)
        assert (await backend.claim(request_for("j", 4, "e"))).status is ClaimStatus.FINISHED
        assert admin(pg16_server, job_row) == [older]  # not even locked
    finally:
        await backend.close()


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES[:2])
async def test_racing_claimers_elect_one_winner_per_run_and_takeover(
    pg16_server: PgServer, table: str, scheme: str, anyio_backend: str
) -> None:
    """Six claims of one run at once elect one winner, and so again for its takeover.
    Left to timing, the first claim commits before the others arrive, which then answer
    from the read of the committed run and never meet the check made under the job row's
    lock; so for the last slot and the takeover the job row is held locked until all six
    wait for it: each then finds the run its predecessor won, live, under the lock."""
    dsn = pg16_server.dsn.replace("postgresql://", scheme, 1)
    backends = [PostgresBackend(dsn, table=table, min_size=1, max_size=1) for _ in range(6)]
    for backend in backends:
        await backend.start()
    try:
        results: list[Any] = []

        async def claim_all(slot: int, prefix: str, lease_ms: int, *, queued: bool,
                            meanwhile: Any = None) -> None:
            results.clear()

            async def claim(i: int) -> None:
                results.append(await backends[i].claim(request_for(
                    "race", slot, f"{prefix}{slot}-{i}", lease_ms=lease_ms,
                    overlap_skip=False)))

            with contextlib.ExitStack() as stack:
                if queued:  # every claim waits for the job row's lock (60 s lease: 4 s)
                    locker = stack.enter_context(psycopg.connect(pg16_server.admin_dsn))
                    locker.execute(f'SELECT 1 FROM "{table}_jobs" WHERE job = %s FOR UPDATE',
                                   ("race",))
                async with anyio.create_task_group() as tg:
                    for i in range(len(backends)):
                        tg.start_soon(claim, i)
                    if queued:
                        await wait_for(lambda: admin(
                            pg16_server, "SELECT count(*) FROM pg_stat_activity WHERE "
                            "wait_event_type = 'Lock' AND query LIKE %s",
                            (f"%{table}_claim_v%",)) == [(len(backends),)],
                            what="every claim waiting for the job row's lock")
                        if meanwhile is not None:
                            await meanwhile()
                        locker.rollback()

        for slot in (1, 2, 3):
            await claim_all(slot, "s", 3000 if slot < 3 else 60_000, queued=slot == 3)
            statuses = sorted(r.status.value for r in results)
            assert statuses == ["running"] * 5 + ["won"], statuses
        [winner] = [r for r in results if r.status is ClaimStatus.WON]
        token = winner.instance_id.removeprefix("i-")
        # Its last renewal asks for a short lease: it expires when the test means it to.
        beat = await backends[0].heartbeat([Lease("race", 3, token, 300)])
        assert beat.held == {token}
        expires = (await backends[0].check([("race", 3)])).runs[("race", 3)].expires_ms
        await wait_until_expired(backends[0], expires or 0)
        await claim_all(3, "t", 60_000, queued=True)
        won = [r for r in results if r.status is ClaimStatus.WON]
        assert len(won) == 1 and (won[0].reason, won[0].attempt) == (Reason.TAKEOVER, 2)
        assert {r.status for r in results} == {ClaimStatus.WON, ClaimStatus.RUNNING}
        assert admin(pg16_server, f"SELECT seq FROM {table}_jobs") == [(4,)]
        assert len(await backends[0].history("race")) == 4
        # Its lease expires too, and claims queue to take it over; meanwhile its holder
        # fails it with a retry due in a minute: the claims find it waiting, under the lock.
        held = Lease("race", 3, f"t3-{won[0].instance_id.removeprefix('i-t3-')}", 300)
        assert (await backends[0].heartbeat([held])).held == {held.token}
        await wait_until_expired(backends[0], (await backends[0].check(
            [("race", 3)])).runs[("race", 3)].expires_ms or 0)

        async def retry_later() -> None:  # through a pool of its own: the claims hold theirs
            side = PostgresBackend(dsn, table=table, min_size=1, max_size=1)
            await side.start()
            try:
                assert await side.retry_later([(held, Outcome.FAILED, "boom", [60_000])]) == [1]
            finally:
                await side.close()

        await claim_all(3, "u", 60_000, queued=True, meanwhile=retry_later)
        assert [r.status for r in results] == [ClaimStatus.RUNNING] * 6, results
        assert {r.run_status for r in results} == {RunStatus.RETRYING}
    finally:
        for backend in backends:
            await backend.close()


@pytest.mark.asyncio_only
async def test_missing_claim_function_is_created_or_migrate_is_asked(
    pg16_server: PgServer, table: str
) -> None:
    role = f"app_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    admin(pg16_server, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    role_dsn = pg16_server.server.dsn_for(role, password)
    try:
        await migrate(pg16_server.dsn, table=table)
        tables = ", ".join(f"{table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
        admin(pg16_server, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
        # A store made before the claim function existed: the four tables only.
        admin(pg16_server, f"DROP FUNCTION {table}_claim_v{CODE_VERSION}")
        with pytest.raises(ConfigurationError, match="anarchon migrate") as info:
            await PostgresBackend(role_dsn, table=table).start()
        assert f"{table}_claim_v{CODE_VERSION}" in str(info.value)
        privileged = PostgresBackend(pg16_server.dsn, table=table)
        await privileged.start()  # creates the missing function
        await privileged.close()
        backend = PostgresBackend(role_dsn, table=table)
        await backend.start()
        assert (await backend.claim(request_for("j", 1, "t"))).status is ClaimStatus.WON
        await backend.close()
        # A store of an earlier build: the open runs' index of this release is missing.
        admin(pg16_server, f"DROP INDEX {table}_opens")
        with pytest.raises(ConfigurationError, match="open runs' index") as info:
            await PostgresBackend(role_dsn, table=table).start()
        assert "anarchon migrate" in str(info.value)
    finally:
        await drop_tables(pg16_server.admin_dsn, table)
        admin(pg16_server, f"DROP ROLE {role}")


@pytest.mark.asyncio_only
async def test_a_finish_is_one_fenced_call_that_ends_the_attempt_in_place(
    pg16_server: PgServer, table: str
) -> None:
    # Store code v4: the finish function's two updates (the run, then its attempt), and
    # no index of the attempts covers what ending one changes, so that update is HOT.
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    finish = f'SELECT "{table}_end_v{CODE_VERSION}"(%s, %s, %s, %s, %s)'
    counts = ("SELECT pg_stat_get_xact_tuples_updated(%s::regclass), "
              "pg_stat_get_xact_tuples_hot_updated(%s::regclass)")
    try:
        assert (await backend.claim(request_for("j", 1, "a"))).status is ClaimStatus.WON
        assert admin(pg16_server, "SELECT count(*) FROM pg_indexes WHERE tablename = %s "
                     "AND indexname = %s", (f"{table}_attempts", f"{table}_a_fin")) == [(0,)]
        with psycopg.connect(pg16_server.admin_dsn) as conn:  # one transaction
            assert conn.execute(finish, ("j", 1, "stale", "completed", None)).fetchall() == [
                (0,)]
            assert conn.execute(finish, ("j", 1, "a", "failed", "boom")).fetchall() == [(1,)]
            attempts = f"{table}_attempts"
            assert conn.execute(counts, (attempts, attempts)).fetchall() == [(1, 1)]
            assert conn.execute(finish, ("j", 1, "a", "completed", None)).fetchall() == [
                (0,)]
        [attempt] = await backend.history("j")
        assert (attempt.outcome, attempt.error) == (Outcome.FAILED, "boom")
        assert [(r.slot, r.status.value) for r in await backend.runs("j")] == [(1, "failed")]
    finally:
        await backend.close()


#: Texts an array literal must keep exactly: quotes, backslashes, separators, braces, the
#: word NULL, spaces at the ends, an empty string, a newline and non-ASCII letters.
AWKWARD = ['a"b', "c\\d", "e,f", "{g}", "NULL", " h ", "", "i\nj", "ünï", '\\"']


@EVERY_STORE
async def test_batched_calls_keep_every_character_of_their_texts(
    request: pytest.FixtureRequest, spec: Any, anyio_backend: str
) -> None:
    # The batched statements take their arrays as literals built by the backend
    # (statements.text_array): each text comes back as it was sent, on every driver.
    store = await spec.make(request)
    try:
        backend = store.backend()
        await backend.start()
        jobs = [f"job{i}{text}" for i, text in enumerate(AWKWARD)]
        requests = [ClaimRequest(job, 7, f"tok{i}{text}", f"inst{text}", 60_000,
                                 max_attempts=None if i % 2 else 3)
                    for i, (job, text) in enumerate(zip(jobs, AWKWARD, strict=True))]
        claimed = await backend.claim_many(requests)
        assert [c.status for c in claimed] == [ClaimStatus.WON] * len(AWKWARD)
        leases = [Lease(r.job, r.slot, r.token, r.lease_ms) for r in requests]
        beat = await backend.heartbeat(leases)
        assert beat.held == {r.token for r in requests}
        state = await backend.check([(job, 7) for job in jobs])
        assert {job: run.instance_id for (job, _), run in state.runs.items()} == {
            r.job: r.instance_id for r in requests}
        errors = [None if i % 3 == 0 else f"boom {text}" for i, text in enumerate(AWKWARD)]
        assert await backend.hand_over(leases[:1]) == {requests[0].token}
        finished = await backend.finish_many(
            [(lease, Outcome.FAILED, error) for lease, error in zip(leases, errors,
                                                                     strict=True)])
        assert finished == [False] + [True] * (len(AWKWARD) - 1)
        history = {(h.job, h.outcome, h.error) for h in await backend.history(limit=100)}
        assert {(job, Outcome.FAILED, error) for job, error in zip(
            jobs[1:], errors[1:], strict=True)} <= history
        assert (jobs[0], Outcome.HANDED_OVER, None) in history
        await backend.close()
    finally:
        await store.cleanup()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_asyncio_only_driver_under_trio_says_what_to_use(
    pg16_server: PgServer, table: str
) -> None:
    """psycopg's async pool (what a postgresql:// URL opens) needs asyncio: under trio the
    start says so and names what works there, instead of psycopg's "no running event
    loop"; a Lease on it says the same, and nothing is created in the server."""
    backend = PostgresBackend(pg16_server.dsn, table=table)
    message = r"works under asyncio only, and this code runs under trio: use a postgresql\+pg8000"
    with pytest.raises(ConfigurationError, match=message):
        await backend.start()
    with pytest.raises(ConfigurationError, match=message):
        async with NamedLease(backend, "leader", ttl="5s"):
            raise AssertionError("not reached")
    assert admin(pg16_server, "SELECT to_regclass(%s)", (table,)) == [(None,)]


@contextlib.contextmanager
def uncommitted_retry(server: PgServer, table: str, job: str, slot: int) -> Iterator[None]:
    """An operator's retry of ``job``'s run at ``slot``, made in a transaction of its own
    that is committed only as the block ends (its row locks held meanwhile)."""
    from backends.postgres.statements import OPERATE_SUFFIX

    operator = psycopg.connect(server.dsn)
    try:
        refused = operator.execute(
            sql.SQL("SELECT o_refused FROM {}('retry', %s, %s, 'cli', 0)").format(
                sql.Identifier(table + OPERATE_SUFFIX)), (job, slot)).fetchall()
        assert refused == [(None,)]
        yield
        operator.commit()
    finally:
        operator.close()


@pytest.mark.asyncio_only
async def test_a_run_an_operator_reopens_during_a_trimming_keeps_its_attempts(
    pg16_server: PgServer, table: str,
) -> None:
    """An operator's retry reopens a failed run while a trimming runs: the trimming reads
    the run as it is now, not as its snapshot saw it, so the reopened run keeps its
    attempts (its failure, the recovery log the retry follows). It deleted them, and the
    run went on handed over with no history at all."""
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        first = request_for("race", 1, "t1", overlap_skip=False)
        assert (await backend.claim(first)).status is ClaimStatus.WON
        assert await backend.finish(Lease("race", 1, "t1", 60_000), Outcome.FAILED, "boom")
        with uncommitted_retry(pg16_server, table, "race", 1):
            with anyio.fail_after(10):  # the run being changed is skipped, not waited for
                assert await backend.prune("race", keep=0) == 0
        state = (await backend.check([("race", 1)])).runs[("race", 1)]
        assert state.status is RunStatus.HANDED_OVER
        assert [a.error for a in await backend.history("race")] == ["boom"]
        assert await backend.prune("race", keep=0) == 0  # open now: kept
    finally:
        await backend.close()


@pytest.mark.asyncio_only
async def test_a_workflow_step_an_operator_reopens_during_a_trimming_keeps_its_run_whole(
    pg16_server: PgServer, table: str,
) -> None:
    """The same for a workflow run: an operator's retry of its failed second step, not
    committed yet, while the first step's history is trimmed. The trimming reads the other
    steps' runs as they are now, so the first step's attempts stay with the run that goes
    on again (the retried step follows them). It read them from its snapshot, saw the
    workflow run ended, and deleted the first step's run and its attempts."""
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        await backend.register_workflows({"wf": ["one", "two"]})
        for job, outcome in (("wf/one", Outcome.COMPLETED), ("wf/two", Outcome.FAILED)):
            claim = request_for(job, 1, f"t-{job}", overlap_skip=False)
            assert (await backend.claim(claim)).status is ClaimStatus.WON
            assert await backend.finish(Lease(job, 1, f"t-{job}", 60_000), outcome,
                                        None if outcome is Outcome.COMPLETED else "boom")
        with uncommitted_retry(pg16_server, table, "wf/two", 1):
            with anyio.fail_after(10):  # the step being changed is skipped, not waited for
                assert await backend.prune("wf/one", keep=0) == 0
                # and through the statement that trims many jobs at once
                assert await backend.prune_many(["wf/one", "other"], keep=0) == {
                    "wf/one": 0, "other": 0}
        assert [a.slot for a in await backend.history("wf/one")] == [1]
        assert await backend.prune("wf/one", keep=0) == 0  # the workflow run goes on: kept
    finally:
        await backend.close()


@pytest.mark.asyncio_only
async def test_two_trimmings_of_a_workflows_two_steps_at_once_never_deadlock(
    pg16_server: PgServer, table: str,
) -> None:
    """Two trimmings at once (``anarchon prune`` beside the maintenance, or two
    maintenances), one of each step of a workflow whose runs have ended: each read the
    other step's runs FOR SHARE (as they are now) and its own step's runs FOR SHARE, then
    deleted its own step's runs, which the other held shared: each waited for the other,
    and PostgreSQL aborted one of them (deadlock detected). Each must skip a run the
    other holds instead, its attempts kept for a later trimming."""
    first = PostgresBackend(pg16_server.dsn, table=table)
    second = PostgresBackend(pg16_server.dsn, table=table)
    await first.start()
    await second.start()
    slots = 400
    try:
        await first.register_workflows({"wf": ["one", "two"]})
        rounds = 0
        with anyio.fail_after(60):
            while rounds < 15:  # deadlocked in the first few rounds
                rounds += 1
                for job in ("wf/one", "wf/two"):
                    requests = [request_for(job, rounds * 10_000 + i, f"t{rounds}-{job}-{i}",
                                            overlap_skip=False) for i in range(slots)]
                    assert all(r.status is ClaimStatus.WON
                               for r in await first.claim_many(requests))
                    assert all(await first.finish_many(
                        [(Lease(job, r.slot, r.token, 60_000), Outcome.COMPLETED, None)
                         for r in requests]))
                errors: list[BaseException] = []

                async def prune(backend: PostgresBackend, job: str,
                                errors: list[BaseException] = errors) -> None:
                    try:
                        await backend.prune(job, keep=0)
                    except Exception as exc:  # reported below
                        errors.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(prune, first, "wf/one")
                    tg.start_soon(prune, second, "wf/two")
                assert not errors, errors
    finally:
        await first.close()
        await second.close()
