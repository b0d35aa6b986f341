"""Connections under cancellation and load: no storm of new connections, heartbeats first.

A caller cancelled while its statement runs (a scheduler's deadline, a lost lease) must
not cost the connection: closing it means, through PgBouncer, a cancel request, a new
login and a new server connection for every cancelled call, which under load feeds
itself. And heartbeats must not queue behind claims and fenced transactions holding
every pooled connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
import psycopg
import pytest

import adapters.base
from adapters.sql import SqlAdapter, adapter_for
from backends.embedded.postgres import EmbeddedPostgres
from backends.postgres import PostgresBackend
from lease_core import Outcome, RunContext, Scheduler
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, RunStatus
from lease_core.errors import BackendUnavailable
from tests.helpers import Instance, stop_all, wait_for
from tests.stores import missing_service
from tests.stores.postgres import PGBOUNCER, PgBouncer, PgServer, drop_tables, unique_table

pytestmark = pytest.mark.anyio

# psycopg's async API needs asyncio; pg8000 runs in worker threads, so on trio too.
LOOP_SCHEMES = [("asyncio", "postgresql://"), ("asyncio", "postgresql+pg8000://"),
                ("trio", "postgresql+pg8000://")]
HAVE_PGBOUNCER = os.path.exists(PGBOUNCER)


@pytest.fixture
async def table(pg16_server: PgServer) -> AsyncIterator[str]:
    """A fresh table name on PostgreSQL 16, dropped afterwards."""
    name = unique_table()
    yield name
    await drop_tables(pg16_server.admin_dsn, name)


async def _one_connection(server: PgServer, scheme: str) -> SqlAdapter:
    adapter = adapter_for(server.dsn.replace("postgresql://", scheme, 1), max_size=1)
    await adapter.open()
    return adapter


async def _pid(adapter: SqlAdapter) -> int:
    [(pid,)] = await adapter.all("SELECT pg_backend_pid()")
    return int(pid)


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_a_cancelled_statement_runs_to_its_end_and_keeps_its_connection(
    pg16_server: PgServer, scheme: str, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = await _one_connection(pg16_server, scheme)
    try:
        pid = await _pid(adapter)
        for _ in range(3):
            started = anyio.current_time()
            with anyio.move_on_after(0.05):
                await adapter.all("SELECT pg_sleep(0.3)")
            # The caller waited for the answer instead of interrupting the statement.
            assert anyio.current_time() - started >= 0.29
            assert await _pid(adapter) == pid, "the cancelled call closed its connection"
        with anyio.move_on_after(0.05) as scope:
            async with adapter.transaction() as tx:
                await tx.all("SELECT pg_sleep(0.3)")
                await anyio.sleep(5)
        assert scope.cancelled_caught
        assert await _pid(adapter) == pid, "the cancelled transaction closed its connection"
        # Rolled back, and the connection is usable.
        assert await adapter.all("SELECT 1") == [(1,)]
        assert not [r for r in caplog.records if "cancellation" in r.getMessage()]
    finally:
        await adapter.close()


@pytest.mark.asyncio_only
async def test_a_statement_still_running_after_the_grace_period_is_given_up(
    pg16_server: PgServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(adapters.base, "CANCEL_GRACE_S", 0.2)  # where settle_scope reads it
    adapter = await _one_connection(pg16_server, "postgresql://")
    try:
        pid = await _pid(adapter)
        started = anyio.current_time()
        with caplog.at_level(logging.WARNING, "anarchon"), \
                pytest.raises(BackendUnavailable, match="did not answer in time"):
            with anyio.move_on_after(0.05):
                await adapter.all("SELECT pg_sleep(5)")
        assert anyio.current_time() - started < 3
        assert "connection closed" in caplog.text
        # The closed connection was replaced.
        with anyio.fail_after(10):
            assert await _pid(adapter) != pid
    finally:
        await adapter.close()


@pytest.mark.asyncio_only
async def test_a_backend_on_one_connection_given_up_says_it_needs_a_new_one(
    pg16_server: PgServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(adapters.base, "CANCEL_GRACE_S", 0.2)
    async with await psycopg.AsyncConnection.connect(pg16_server.dsn, autocommit=True) as conn:
        adapter = adapter_for(conn)
        with pytest.raises(BackendUnavailable, match="needs a new connection"):
            with anyio.move_on_after(0.05):
                await adapter.all("SELECT pg_sleep(5)")
        assert conn.closed


def _request(job: str, slot: int, token: str) -> ClaimRequest:
    return ClaimRequest(job, slot, f"i-{token}", token, 60_000)


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_heartbeats_do_not_queue_behind_a_busy_pool(
    pg16_server: PgServer, table: str, scheme: str, anyio_backend: str
) -> None:
    backend = PostgresBackend(pg16_server.dsn.replace("postgresql://", scheme, 1),
                              table=table, max_size=2, timeout=30)
    await backend.start()
    try:
        leases = [Lease(f"j{n}", 1, f"t{n}", 60_000) for n in range(3)]
        for n in range(3):
            assert (await backend.claim(_request(f"j{n}", 1, f"t{n}"))).status is ClaimStatus.WON
        release = anyio.Event()
        opened: list[Any] = []

        async def hold(lease: Lease) -> None:
            # A fenced transaction holds one of the pool's two connections until released.
            async with backend.transaction(lease, complete=False) as tx:
                opened.append(tx)
                await release.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold, leases[0])
            tg.start_soon(hold, leases[1])
            await wait_for(lambda: len(opened) == 2, what="both pool connections busy")
            with anyio.fail_after(5):
                beat = await backend.heartbeat([leases[2]])
            assert beat.renewed == {"t2"}
            # Both at once (two schedulers sharing the backend): the second one uses the
            # pool, so it waits, but neither fails.
            release.set()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(backend.heartbeat, leases)
    finally:
        await backend.close()


@pytest.mark.parametrize(("anyio_backend", "scheme"), LOOP_SCHEMES)
async def test_a_fleet_behind_pgbouncer_rides_out_a_stall_and_a_database_restart(
    caplog: pytest.LogCaptureFixture, scheme: str, anyio_backend: str
) -> None:
    """The chaos suite's storm, small: 3 schedulers through PgBouncer (transaction mode).

    PgBouncer first holds every query for 2 s (``PAUSE``), longer than the deadlines of
    claims and ticks; then the database restarts. No call may be interrupted mid-flight
    (each one cost a connection, a cancel request and a new login), the clients stay
    within the schedulers' pools, and every slot after the recovery completes.
    """
    async with _database_behind_pgbouncer(caplog) as (server, bouncer):
        jobs = ["j0", "j1", "j2"]
        schedulers = []
        for n in range(3):
            s = Scheduler(PostgresBackend(bouncer.dsn.replace("postgresql://", scheme, 1),
                                          table="storm_runs"),
                          instance_id=f"w{n}", lease="1.5s", heartbeat="0.3s")
            for job in jobs:
                s.every(job, "400ms", _step)
            schedulers.append(s)
        audit = PostgresBackend(server.dsn.replace("postgresql://", scheme, 1),
                                table="storm_runs")  # straight to the server
        most_clients = 0

        async def count_clients() -> None:
            nonlocal most_clients
            while True:
                rows = await anyio.to_thread.run_sync(bouncer.admin, "SHOW CLIENTS")
                most_clients = max(most_clients,
                                   sum(1 for r in rows if r.get("database") == "postgres"))
                await anyio.sleep(0.05)

        async def completed_since(since_ms: int) -> set[tuple[str, int]]:
            runs = await audit.runs(limit=1000)
            return {(r.job, r.slot) for r in runs
                    if r.slot >= since_ms and r.status is RunStatus.COMPLETED}

        async with anyio.create_task_group() as tg:
            instances = [await Instance(s).start(tg) for s in schedulers]
            tg.start_soon(count_clients)
            await audit.start()
            start_ms = await audit.now_ms()
            await wait_for(lambda: _at_least(completed_since(start_ms), 6), timeout=30,
                           what="runs completed before the faults")
            await anyio.to_thread.run_sync(bouncer.admin, "PAUSE")
            await anyio.sleep(2)
            await anyio.to_thread.run_sync(bouncer.admin, "RESUME")
            interrupted = [r.getMessage() for r in caplog.records
                           if "cancellation" in r.getMessage() or "closed" in r.getMessage()]
            assert interrupted == [], "calls were interrupted mid-flight during the stall"
            await audit.close()
            await anyio.to_thread.run_sync(server.restart)
            await audit.start()
            await wait_for(lambda: anyio.to_thread.run_sync(_answers, bouncer.dsn), timeout=30,
                           what="PgBouncer serving queries again")
            recovered_ms = await audit.now_ms()
            # Runs cut off by the restart hold their slot until their lease lapses (and
            # later slots of those jobs are skipped meanwhile), and are then taken over at
            # a backup's next tick; from three leases after the recovery, every slot
            # completes. (Two were not always enough on a loaded machine: in a CI run a
            # slot about 3 s after the recovery was skipped behind a late takeover.)
            first = (recovered_ms // 400 + 12) * 400
            expected = {(job, first + 400 * k) for job in jobs for k in range(5)}
            await wait_for(lambda: _contains(completed_since(first), expected), timeout=30,
                           what="every slot after the restart completed")
            await stop_all(instances)
            tg.cancel_scope.cancel()
        await audit.close()
        # Each scheduler: its pool (max_size 4) and its reserved connection; and the
        # test's own probe of PgBouncer after the restart.
        assert most_clients <= 3 * (4 + 1) + 1, f"{most_clients} clients at PgBouncer"
        assert "query cancellation" not in caplog.text
        assert "max_client_conn" not in caplog.text and "refused the login" not in caplog.text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("scheme", ["postgresql://", "postgresql+pg8000://"])
async def test_pgbouncer_refusing_queries_after_a_failed_login_says_what_to_do(
    scheme: str,
) -> None:
    """After its login to a stopped (or restarting) database failed, PgBouncer refuses every
    query for ``server_login_retry`` seconds, however soon the database is back: the
    error names the setting and says how to shorten that outage, with either driver
    (pg8000 said only "network error": PgBouncer closes the connection after its
    message, and pg8000 dropped the message it had read)."""
    if not HAVE_PGBOUNCER:
        missing_service("pgbouncer")
    server = EmbeddedPostgres()
    await anyio.to_thread.run_sync(server.start)
    bouncer = PgBouncer(server, pool_size=2,
                        extra="server_login_retry = 30\nquery_wait_timeout = 2\n")
    adapter: SqlAdapter | None = None
    try:
        await anyio.to_thread.run_sync(bouncer.start)
        adapter = adapter_for(bouncer.dsn.replace("postgresql://", scheme, 1), max_size=1)
        await adapter.open()
        assert await adapter.all("SELECT 1") == [(1,)]
        await anyio.to_thread.run_sync(lambda: server.stop(remove=False))
        # The first query waits for PgBouncer's login, which fails (query_wait_timeout);
        # from then on PgBouncer refuses queries at once.
        errors: list[str] = []
        with anyio.fail_after(30):
            while not any("server_login_retry" in e for e in errors):
                with pytest.raises(BackendUnavailable) as raised:
                    await adapter.all("SELECT 1")
                errors.append(str(raised.value))
        refused = errors[-1]
        assert "server login has been failing" in refused
        assert "lower server_login_retry in pgbouncer.ini" in refused, refused
        assert len(errors) <= 3, errors
    finally:
        if adapter is not None:
            await adapter.close()
        await anyio.to_thread.run_sync(bouncer.close)
        await anyio.to_thread.run_sync(server.stop)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("scheme", ["postgresql://", "postgresql+pg8000://"])
async def test_pgbouncer_in_statement_mode_is_refused_saying_which_mode_works(
    pg16_server: PgServer, scheme: str,
) -> None:
    """PgBouncer's ``pool_mode = statement`` refuses every transaction (and closes the
    connection), which ``start()`` needs: it fails saying so and naming the mode that
    works (pg8000 said only "network error")."""
    if not HAVE_PGBOUNCER:
        missing_service("pgbouncer")
    bouncer = PgBouncer(pg16_server.server, pool_size=2)
    ini = bouncer.root / "pgbouncer.ini"
    ini.write_text(ini.read_text().replace("pool_mode = transaction", "pool_mode = statement"))
    table = unique_table()
    try:
        await anyio.to_thread.run_sync(bouncer.start)
        backend = PostgresBackend(bouncer.dsn.replace("postgresql://", scheme, 1), table=table)
        with pytest.raises(BackendUnavailable) as raised:
            await backend.start()
        await backend.close()
        assert "statement pooling mode" in str(raised.value), raised.value
        assert "use pool_mode = transaction" in str(raised.value), raised.value
    finally:
        await anyio.to_thread.run_sync(bouncer.close)
        await drop_tables(pg16_server.admin_dsn, table)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_after_each_database_restart_behind_pgbouncer_every_slot_runs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """2 schedulers through PgBouncer (``server_login_retry = 1``), a job every 500 ms; the
    database restarts 3 times. While PgBouncer refuses queries (about server_login_retry
    after each restart) the schedulers' warnings say what to do; once it answers again,
    every slot is claimed and run exactly once."""
    interval = 500
    jobs = ["a", "b"]
    started: list[tuple[str, int, int]] = []  # (job, slot, attempt) of each handler run

    async def handler(ctx: RunContext) -> None:
        started.append((ctx.job, ctx.slot, ctx.attempt))
        await anyio.sleep(0.05)

    async with _database_behind_pgbouncer(caplog) as (server, bouncer):
        schedulers = []
        for n in range(2):
            s = Scheduler(PostgresBackend(bouncer.dsn, table="restart_slots"),
                          instance_id=f"w{n}", lease="1.5s", heartbeat="0.3s")
            for job in jobs:
                # Runs may overlap: a run cut off by a restart does not hold up later slots.
                s.every(job, f"{interval}ms", handler, overlap="allow")
            schedulers.append(s)
        audit = PostgresBackend(server.dsn, table="restart_slots")  # straight to the server
        windows: list[tuple[int, int]] = []
        async with anyio.create_task_group() as tg:
            instances = [await Instance(s).start(tg) for s in schedulers]
            await wait_for(lambda: len(started) >= 4, timeout=20, what="runs before restarts")
            for _ in range(3):
                await anyio.to_thread.run_sync(server.restart)
                await wait_for(lambda: anyio.to_thread.run_sync(_answers, bouncer.dsn),
                               timeout=30, what="PgBouncer serving queries again")
                await audit.start()
                recovered = await audit.now_ms()
                await audit.close()
                # A failed claim is retried at the next tick (0.3 s): from one interval
                # after the recovery, every slot until the next restart is checked.
                windows.append((recovered + interval, recovered + 2500))
                await anyio.sleep(3.0)
            await stop_all(instances)
            tg.cancel_scope.cancel()
        await audit.start()
        history = await audit.history(None, 10_000)
        await audit.close()
        # The slots from low (one interval after the recovery) on: four per window. The
        # first was counted from the slot after low, so a recovery read on a whole
        # interval gave three, and the count below failed (a CI run, 22 of 24).
        expected = {(job, slot) for job in jobs for low, high in windows
                    for slot in range(-(-low // interval) * interval, high, interval)}
        attempts = {(a.job, a.slot, a.attempt): a for a in history
                    if (a.job, a.slot) in expected}
        assert len(expected) >= 3 * 2 * 4
        assert {(j, s) for j, s, _ in attempts} == expected, "slots never claimed"
        assert {(j, s, n) for j, s, n in attempts} == {(j, s, 1) for j, s in expected}
        assert all(a.outcome is Outcome.COMPLETED for a in attempts.values())
        runs = [(j, s) for j, s, _ in started if (j, s) in expected]
        assert sorted(runs) == sorted(expected), "a slot ran twice or never"
        refused = [r.getMessage() for r in caplog.records if r.name == "anarchon"
                   and "server login has been failing" in r.getMessage()]
        assert refused, "PgBouncer never refused a query after a restart"
        assert all("lower server_login_retry in pgbouncer.ini" in m for m in refused)


@contextlib.asynccontextmanager
async def _database_behind_pgbouncer(
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[tuple[EmbeddedPostgres, PgBouncer]]:
    """A database and a PgBouncer before it (``server_login_retry = 1``), both stopped after."""
    if not HAVE_PGBOUNCER:
        missing_service("pgbouncer")
    caplog.set_level(logging.WARNING)
    server = EmbeddedPostgres()
    await anyio.to_thread.run_sync(server.start)
    bouncer = PgBouncer(server, pool_size=4, extra="server_login_retry = 1\n")
    try:
        await anyio.to_thread.run_sync(bouncer.start)
        yield server, bouncer
    finally:
        await anyio.to_thread.run_sync(bouncer.close)
        await anyio.to_thread.run_sync(server.stop)


def _answers(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


async def _step(ctx: RunContext) -> None:
    await ctx.checkpoint.set({"by": ctx.instance_id})
    await anyio.sleep(0.05)


async def _at_least(found: Awaitable[set[Any]], count: int) -> bool:
    return len(await found) >= count


async def _contains(found: Awaitable[set[Any]], expected: set[Any]) -> bool:
    return expected <= await found
