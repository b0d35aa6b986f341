"""Fenced transactions through the scheduler, on PostgreSQL.

A transaction longer than the lease must neither lose its own run nor stall the
instance's other leases: it holds the run's row lock, which keeps backups out, and the
batched heartbeat skips that row instead of waiting for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import anyio
import psycopg
import pytest

from lease_core import LeaseLost, Outcome, PostgresBackend, Reason, RunContext, Scheduler
from lease_core.abc import ClaimRequest, ClaimStatus, Lease, RunStatus
from lease_core.operations import Operation, OperationKind
from lease_core.testing import claim_now
from tests.helpers import Instance, quiet_offset, store_now_ms, wait_for, wait_history
from tests.stores.postgres import PgServer, drop_tables, unique_table

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]


@pytest.fixture
async def table(pg16_server: PgServer) -> AsyncIterator[str]:
    name = unique_table()
    yield name
    await drop_tables(pg16_server.admin_dsn, name)


async def test_a_long_fenced_transaction_keeps_every_lease(
    pg16_server: PgServer, table: str
) -> None:
    a = Scheduler(PostgresBackend(pg16_server.dsn, table=table), instance_id="a",
                  lease="1.5s", heartbeat="0.25s")
    b = Scheduler(PostgresBackend(pg16_server.dsn, table=table), instance_id="b",
                  lease="1.5s", heartbeat="0.25s")
    ends: dict[str, float] = {}
    release_other = anyio.Event()
    # Hourly jobs whose next slot is half an hour away: only the claims below run.
    offset = quiet_offset(await store_now_ms(PostgresBackend(pg16_server.dsn, table=table)))

    for s in (a, b):
        @s.every("tx", "1h", offset=offset)
        async def tx(ctx: RunContext) -> None:
            async with ctx.transaction() as t:
                await t.execute("SELECT pg_sleep(3)")  # twice the lease
            ends["tx"] = time.monotonic()

        @s.every("other", "1h", offset=offset)
        async def other(ctx: RunContext) -> None:
            await release_other.wait()
            ends["other"] = time.monotonic()

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        for job in ("tx", "other"):
            slot = a.jobs[job].schedule.previous_at_or_before(a.store_now_ms())
            assert slot is not None
            await claim_now(a, job, slot)
        ib = await Instance(b).start(tg)  # a backup, ready to take over anything lost
        for job in ("tx", "other"):
            slot = b.jobs[job].schedule.previous_at_or_before(b.store_now_ms())
            assert slot is not None
            await claim_now(b, job, slot)
        history = await wait_history(
            a, lambda h: any(x.job == "tx" and x.outcome for x in h), timeout=15
        )
        release_other.set()
        history = await wait_history(
            a, lambda h: all(x.outcome for x in h) and len(h) >= 2, timeout=10
        )
        await ia.stop()
        await ib.stop()
    assert sorted((h.job, h.attempt, h.instance_id, h.outcome) for h in history) == [
        ("other", 1, "a", Outcome.COMPLETED),
        ("tx", 1, "a", Outcome.COMPLETED),
    ]



def _admin(server: PgServer, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        cur = conn.execute(sql)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


async def test_batches_commit_with_their_progress_and_a_late_attempt_writes_neither(
    pg16_server: PgServer, table: str,
) -> None:
    effects = f"{table}_effects"
    _admin(pg16_server, f"CREATE TABLE {effects} (n int PRIMARY KEY)")
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        await backend.claim(ClaimRequest("batches", 1, "a", "t1", 60_000))
        lease = Lease("batches", 1, "t1", 60_000)
        ctx = RunContext(backend=backend, lease=lease, attempt=1, reason=Reason.SCHEDULED,
                         instance_id="a", logger=logging.getLogger("test"))
        for n in (1, 2):
            async with ctx.transaction(complete=False) as tx:
                await tx.execute(f"INSERT INTO {effects} VALUES (%s)", (n,))
                await ctx.checkpoint.set({"done": n}, tx=tx)
        assert await backend.get_checkpoint("batches", 1) == {"done": 2}
        state = (await backend.check([("batches", 1)])).runs[("batches", 1)]
        assert state.status is RunStatus.RUNNING  # not completed: the run goes on
        # a batch that fails rolls back its effect and its progress together
        with pytest.raises(ZeroDivisionError):
            async with ctx.transaction(complete=False) as tx:
                await tx.execute(f"INSERT INTO {effects} VALUES (%s)", (3,))
                await ctx.checkpoint.set({"done": 3}, tx=tx)
                raise ZeroDivisionError
        assert await backend.get_checkpoint("batches", 1) == {"done": 2}
        # a backup takes the run over: the late attempt's batch is refused, nothing written
        assert await backend.hand_over([lease]) == {"t1"}
        await backend.claim(ClaimRequest("batches", 1, "b", "t2", 60_000))
        with pytest.raises(LeaseLost):
            async with ctx.transaction(complete=False) as tx:
                await tx.execute(f"INSERT INTO {effects} VALUES (%s)", (4,))
        assert await backend.get_checkpoint("batches", 1) == {"done": 2}
        assert _admin(pg16_server, f"SELECT n FROM {effects} ORDER BY n") == [(1,), (2,)]
        # an operator cancels a run with a grace (its holder keeps its token while the
        # grace runs): the holder's next batch is refused too, as the run is over
        late = await _claimed_run(backend, "cancelled")
        cancelled = await backend.operate(
            Operation(OperationKind.CANCEL, "cancelled", 1, "ops", grace_ms=60_000))
        assert cancelled.refused is None, cancelled
        with pytest.raises(LeaseLost):
            async with late.transaction(complete=False) as tx:
                await tx.execute(f"INSERT INTO {effects} VALUES (%s)", (5,))
        assert _admin(pg16_server, f"SELECT n FROM {effects} ORDER BY n") == [(1,), (2,)]
        state = (await backend.check([("cancelled", 1)])).runs[("cancelled", 1)]
        assert state.status is RunStatus.CANCELLED
    finally:
        await backend.close()
        _admin(pg16_server, f"DROP TABLE IF EXISTS {effects}")


async def test_a_cancel_waiting_for_a_fenced_transaction_holds_no_claim_back(
    pg16_server: PgServer, table: str
) -> None:
    """A cancel of a run inside its fenced transaction waits for the transaction's row
    lock: it must not hold the job's lock meanwhile, or every claim of the job's other
    slots would wait (and time out) behind it."""
    from lease_core import Admin, OperationRefused

    s = Scheduler(PostgresBackend(pg16_server.dsn, table=table), instance_id="a",
                  lease="10s", heartbeat="0.25s")
    offset = quiet_offset(await store_now_ms(PostgresBackend(pg16_server.dsn, table=table)))
    inside, leave = anyio.Event(), anyio.Event()

    @s.every("tx", "1h", offset=offset)
    async def tx(ctx: RunContext) -> None:
        async with ctx.transaction():
            inside.set()
            await leave.wait()

    answers: list[str] = []
    admin = Admin(PostgresBackend(pg16_server.dsn, table=table), by="test")

    async def cancel(slot: int) -> None:
        try:
            await admin.cancel("tx", slot)
            answers.append("cancelled")
        except OperationRefused as refused:
            answers.append(refused.kind)

    async def waiting_locks() -> int:
        async with await psycopg.AsyncConnection.connect(pg16_server.dsn) as conn:
            cur = await conn.execute(  # this test's operate call, waiting for a lock
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE %s", (f"%{table}_op_v%",))
            row = await cur.fetchone()
            return 0 if row is None else int(row[0])

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        slot = s.jobs["tx"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "tx", slot)
        with anyio.fail_after(10):
            await inside.wait()
        tg.start_soon(cancel, slot)
        await wait_for(waiting_locks, what="the cancel waiting for the run's row lock")
        with anyio.fail_after(3):  # not the claim's own timeout (half the lease)
            other = await claim_now(s, "tx", slot - 3_600_000)
        assert other is not None and other.status is ClaimStatus.WON
        assert answers == []
        leave.set()
        await wait_for(lambda: answers, what="the cancel's answer")
        await inst.stop()
    # The transaction completed the run before the cancel could act on it.
    assert answers == ["conflict"]


def _for_driver(dsn: str, driver: str) -> str:
    """``dsn`` as a backend reads it to connect through ``driver`` (psycopg or pg8000)."""
    return dsn if driver == "psycopg" else dsn.replace(
        "postgresql://", "postgresql+pg8000://", 1)


async def _claimed_run(backend: PostgresBackend, job: str, slot: int = 1) -> RunContext:
    """Claim ``(job, slot)`` for instance ``a`` on ``backend`` (started), with a lease of
    a minute and the token ``t<slot>``; return the context its handler would be given."""
    token = f"t{slot}"
    await backend.claim(ClaimRequest(job, slot, "a", token, 60_000))
    return RunContext(backend=backend, lease=Lease(job, slot, token, 60_000), attempt=1,
                      reason=Reason.SCHEDULED, instance_id="a",
                      logger=logging.getLogger("test"))


@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
async def test_a_write_of_the_run_inside_its_own_transaction_is_refused_not_hung(
    pg16_server: PgServer, table: str, driver: str,
) -> None:
    """Inside ``ctx.transaction()``, a checkpoint written without ``tx=`` or a nested
    transaction would wait for the open transaction's own lock on the run, which waits
    for them: the handler hung until its timeout (the lease deadline is suspended meanwhile).
    Both are refused at once, the transaction goes on, and outside it they work."""
    from lease_core import ConfigurationError

    backend = PostgresBackend(_for_driver(pg16_server.dsn, driver), table=table)
    await backend.start()
    try:
        ctx = await _claimed_run(backend, "nested")
        with anyio.fail_after(10):
            async with ctx.transaction(complete=False) as tx:
                with pytest.raises(ConfigurationError, match="tx=tx"):
                    await ctx.checkpoint.set({"done": 1})
                with pytest.raises(ConfigurationError, match=r"checkpoint\.delete"):
                    await ctx.checkpoint.delete()
                with pytest.raises(ConfigurationError, match="inside another"):
                    async with ctx.transaction(complete=False):
                        pass  # pragma: no cover - refused
                await ctx.checkpoint.set({"done": 2}, tx=tx)
            assert await backend.get_checkpoint("nested", 1) == {"done": 2}
            await ctx.checkpoint.set({"done": 3})  # outside the block: written at once
            async with ctx.transaction():
                pass
        assert await backend.get_checkpoint("nested", 1) == {"done": 3}
    finally:
        await backend.close()


@pytest.mark.parametrize("server", ["pg16_server", "pgbouncer_server"])
@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
async def test_session_state_a_fenced_block_left_does_not_outlive_its_commit(
    pg16_server: PgServer, table: str, driver: str, server: str,
    request: pytest.FixtureRequest,
) -> None:
    """A plain ``SET`` (not ``SET LOCAL``), a session advisory lock or a ``PREPARE`` in
    the block used to stay on the pooled connection after the commit, where the backend's
    own statements (claims, heartbeats) run next, and through PgBouncer in transaction
    mode on a server connection any client gets next: a ``search_path`` set there even
    broke the run's own completion. On the backend's own pool the session is reset first."""
    url = request.getfixturevalue(server).dsn
    backend = PostgresBackend(_for_driver(url, driver), table=table)
    await backend.start()
    try:
        for slot, complete in ((1, False), (2, True)):
            ctx = await _claimed_run(backend, f"reset{slot}", slot)
            async with ctx.transaction(complete=complete) as tx:
                await tx.execute(f"SET application_name = 'leaked_{table}'")
                await tx.execute("SET search_path TO pg_catalog")
                await tx.execute("SET statement_timeout = '7s'")
                await tx.execute("SELECT pg_advisory_lock(%s)", (4242,))
                await tx.execute(f"PREPARE leaked_{table} AS SELECT 1")
            assert _admin(pg16_server, "SELECT count(*) FROM pg_stat_activity "
                          f"WHERE application_name = 'leaked_{table}'") == [(0,)]
            assert _admin(pg16_server, "SELECT count(*) FROM pg_locks WHERE "
                          "locktype = 'advisory' AND objid = 4242") == [(0,)]
        state = (await backend.check([("reset2", 2)])).runs[("reset2", 2)]
        assert state.status is RunStatus.COMPLETED
        assert await backend.get_checkpoint("reset1", 1) is None  # its statements still work
    finally:
        await backend.close()


async def test_the_session_reset_keeps_the_prepared_statements_of_the_protocol(
    pg16_server: PgServer, table: str,
) -> None:
    """The reset used to run ``DEALLOCATE ALL`` inside its ``DO`` block, which also
    dropped the statements prepared through the protocol, whose owners (the driver, or
    PgBouncer >= 1.21 with ``max_prepared_statements``, which only notices a top-level
    ``DEALLOCATE ALL``) still count them as prepared: psycopg then failed on its next use
    of one with 'prepared statement "_pg3_0" does not exist', and through PgBouncer every
    other client of that server connection did (``review_pgb/r1_deallocate_in_do.py``).
    Only what ``PREPARE`` made is dropped."""
    backend = PostgresBackend(pg16_server.dsn + "?max_size=1", table=table)
    await backend.start()
    try:
        for slot in (1, 2, 3):
            ctx = await _claimed_run(backend, "prepared", slot)
            async with ctx.transaction() as tx:
                conn = tx.connection  # one connection: max_size=1
                conn.prepare_threshold = 0  # (the pool's connections prepare nothing)
                try:
                    cur = await conn.execute("SELECT %s::int + 1", (slot,), prepare=True)
                    assert await cur.fetchone() == (slot + 1,)
                finally:
                    conn.prepare_threshold = None
                await tx.execute(f"PREPARE by_sql_{slot} AS SELECT 1")
                prepared = await tx.execute(
                    "SELECT name FROM pg_prepared_statements WHERE from_sql ORDER BY name")
                assert prepared == [(f"by_sql_{slot}",)]  # the previous block's was dropped
    finally:
        await backend.close()


def _pgbouncer_version() -> tuple[int, ...]:
    import subprocess

    from tests.stores.postgres import PGBOUNCER
    try:
        out = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except OSError:
        return ()
    words = out.split()
    return tuple(int(p) for p in words[1].split(".")[:2]) if len(words) > 1 else ()


@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
async def test_a_fenced_transaction_leaves_pgbouncers_prepared_statements_alone(
    pg16_server: PgServer, table: str, driver: str,
) -> None:
    """PgBouncer >= 1.21 (``max_prepared_statements``) prepares its clients' statements on
    its server connections as ``PGBOUNCER_n``: the reset's ``DEALLOCATE ALL``, inside a
    ``DO`` block PgBouncer does not see, dropped them, and another client of that server
    connection failed on each later use (runs where the installed PgBouncer has it)."""
    from tests.stores.postgres import PgBouncer

    if _pgbouncer_version() < (1, 21):
        pytest.skip("PgBouncer >= 1.21 (max_prepared_statements) is not installed")
    bouncer = PgBouncer(pg16_server.server, pool_size=1,
                        extra="max_prepared_statements = 100\n").start()
    other = await psycopg.AsyncConnection.connect(bouncer.dsn, autocommit=True,
                                                  prepare_threshold=0)
    backend = PostgresBackend(_for_driver(bouncer.dsn, driver), table=table)
    try:
        await backend.start()
        query = "SELECT %s::int + 1"
        assert await (await other.execute(query, (1,))).fetchone() == (2,)
        ctx = await _claimed_run(backend, "bouncer")
        async with ctx.transaction() as tx:
            await tx.execute("SELECT 1")
        for n in range(3):  # one server connection (pool_size=1): the same one
            assert await (await other.execute(query, (n,))).fetchone() == (n + 1,)
    finally:
        await backend.close()
        await other.close()
        bouncer.close()


@pytest.mark.parametrize("server", ["pg16_server", "pgbouncer_server"])
@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
@pytest.mark.parametrize("failed", [False, True], ids=["raised", "aborted"])
async def test_session_state_a_fenced_block_left_does_not_outlive_its_rollback(
    pg16_server: PgServer, table: str, driver: str, server: str, failed: bool,
    request: pytest.FixtureRequest,
) -> None:
    """A session advisory lock and a ``PREPARE`` survive a ROLLBACK in PostgreSQL, and an
    aborted transaction runs no reset: a block that raised (``raised``), or whose
    statement failed (``aborted``), left both on the pooled connection, directly or,
    through PgBouncer in transaction mode, on a server connection. On the backend's own
    pool the session is reset before the rollback, or, aborted, its connection is closed
    instead, which ends that session."""
    url = request.getfixturevalue(server).dsn
    dsn = url if driver == "psycopg" else url.replace("postgresql://", "postgresql+pg8000://", 1)
    key = int(table[-7:], 16)  # unique to the test: its table name ends in hex digits
    name = f"leaked_{table}"
    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        await backend.claim(ClaimRequest("rollback", 1, "a", "t1", 60_000))
        ctx = RunContext(backend=backend, lease=Lease("rollback", 1, "t1", 60_000),
                         attempt=1, reason=Reason.SCHEDULED, instance_id="a",
                         logger=logging.getLogger("test"))
        with pytest.raises(Exception, match=r"boom|division by zero"):
            async with ctx.transaction() as tx:
                await tx.execute("SELECT pg_advisory_lock(%s)", (key,))
                await tx.execute(f"PREPARE {name} AS SELECT 1")
                assert _admin(pg16_server, "SELECT count(*) FROM pg_locks WHERE "
                              f"locktype = 'advisory' AND objid = {key}") == [(1,)]
                if failed:
                    await tx.execute("SELECT 1 / 0")
                raise RuntimeError("boom")

        def unlocked() -> bool:
            return _admin(pg16_server, "SELECT count(*) FROM pg_locks WHERE "
                          f"locktype = 'advisory' AND objid = {key}") == [(0,)]

        await wait_for(unlocked, what="the session advisory lock's release", timeout=5)
        for _ in range(3):  # whichever connection (and server connection) comes next
            async with ctx.transaction(complete=False) as tx:
                assert await tx.execute(
                    "SELECT count(*) FROM pg_prepared_statements WHERE name = %s",
                    (name,)) == [(0,)]
        state = (await backend.check([("rollback", 1)])).runs[("rollback", 1)]
        assert state.status is RunStatus.RUNNING  # the rolled-back block completed nothing
    finally:
        await backend.close()


@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
async def test_a_raising_fenced_block_keeps_its_connection_an_aborted_one_closes_it(
    pg16_server: PgServer, table: str, driver: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A block that raised is reset and rolled back on its connection, which the pool
    lends again (no new connection, no pool warning, for a handler that fails often); a
    block whose statement failed cannot run the reset, so its connection is closed."""
    backend = PostgresBackend(_for_driver(pg16_server.dsn, driver) + "?min_size=1&max_size=1",
                              table=table)
    await backend.start()
    try:
        ctx = await _claimed_run(backend, "reuse")

        async def server_pid() -> object:
            async with ctx.transaction(complete=False) as tx:
                return (await tx.execute("SELECT pg_backend_pid()"))[0][0]

        first = await server_pid()
        with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="boom"):
            async with ctx.transaction() as tx:
                await tx.execute("SELECT 1")
                raise RuntimeError("boom")
        assert await server_pid() == first
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        with pytest.raises(Exception, match="division by zero"):
            async with ctx.transaction() as tx:
                await tx.execute("SELECT 1 / 0")
        assert await server_pid() != first
    finally:
        await backend.close()


@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
async def test_a_fenced_statement_takes_named_parameters_from_a_mapping(
    pg16_server: PgServer, table: str, driver: str,
) -> None:
    """``tx.execute`` turned a mapping into the tuple of its keys: ``%(name)s`` was
    refused and ``%s`` got the key's name as its value, silently."""
    backend = PostgresBackend(_for_driver(pg16_server.dsn, driver), table=table)
    await backend.start()
    try:
        ctx = await _claimed_run(backend, "named")
        async with ctx.transaction() as tx:
            assert await tx.execute("SELECT %(n)s::int + %(n)s::int, %(s)s::text",
                                    {"n": 2, "s": "x%"}) == [(4, "x%")]
            assert await tx.execute("SELECT %s::int", [7]) == [(7,)]
    finally:
        await backend.close()


async def test_two_tasks_transactions_of_one_run_keep_the_lease_deadline_suspended(
    pg16_server: PgServer, table: str
) -> None:
    """Two tasks of one handler each open a fenced transaction (complete=False): the
    second waits for the first's lock on the run, then holds it past the lease. The lease
    deadline stays suspended while either is open; when the first closed, it applied
    again and cancelled the second mid-transaction (its lease not renewable, locked)."""
    s = Scheduler(PostgresBackend(pg16_server.dsn, table=table), instance_id="a",
                  lease="1.5s", heartbeat="0.25s")
    offset = quiet_offset(await store_now_ms(PostgresBackend(pg16_server.dsn, table=table)))
    first_open = anyio.Event()
    done: list[str] = []

    @s.every("two", "1h", offset=offset, max_attempts=1)
    async def two(ctx: RunContext) -> None:
        async def first() -> None:
            async with ctx.transaction(complete=False) as t:
                first_open.set()
                await t.execute("SELECT pg_sleep(0.3)")
            done.append("first")

        async def second() -> None:
            await first_open.wait()
            async with ctx.transaction(complete=False) as t:  # waits for the first's lock
                await t.execute("SELECT pg_sleep(3)")  # twice the lease
            done.append("second")

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(second)

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        slot = s.jobs["two"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "two", slot)
        history = await wait_history(s, lambda h: h and h[0].outcome, timeout=15,
                                     what="the run's end")
        await inst.stop()
    assert done == ["first", "second"]
    assert [(h.attempt, h.outcome) for h in history] == [(1, Outcome.COMPLETED)]

@pytest.mark.parametrize("server", ["pg16_server", "pgbouncer_server"])
@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_cancelled_fenced_block_leaves_no_session_state_and_its_pool_lends(
    pg16_server: PgServer, table: str, driver: str, server: str, how: str,
    request: pytest.FixtureRequest,
) -> None:
    """A fenced block cancelled (a deadline, as the handler's timeout, or a cancel) on the
    backend's own pool of one connection: its connection is closed in the transaction,
    so the session advisory lock it took dies with it, the run stays held, and the pool
    replaces the connection and lends it again, three times over."""
    url = request.getfixturevalue(server).dsn
    sep = "&" if "?" in url else "?"
    dsn = _for_driver(url, driver) + f"{sep}min_size=1&max_size=1&timeout=5"
    key = int(table[-7:], 16)
    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        for round_ in range(3):
            ctx = await _claimed_run(backend, f"cancel{round_}", round_ + 1)
            with anyio.CancelScope() as scope:
                if how == "timeout":
                    scope.deadline = anyio.current_time() + 0.5
                async with ctx.transaction() as tx:
                    await tx.execute("SELECT pg_advisory_lock(%s)", (key,))
                    if how == "cancel":
                        scope.cancel()
                    await tx.execute("SELECT pg_sleep(1)")
                    await anyio.sleep(5)
            assert scope.cancelled_caught

            def unlocked() -> bool:
                return _admin(pg16_server, "SELECT count(*) FROM pg_locks WHERE "
                              f"locktype = 'advisory' AND objid = {key}") == [(0,)]

            await wait_for(unlocked, what="the advisory lock's release", timeout=5)
            with anyio.fail_after(8):
                state = (await backend.check([(f"cancel{round_}", round_ + 1)])).runs[
                    (f"cancel{round_}", round_ + 1)]
            assert state.status is RunStatus.RUNNING
            with anyio.fail_after(8):  # the pool still lends its one connection
                async with ctx.transaction(complete=True) as tx:
                    assert await tx.execute("SELECT 1") == [(1,)]
    finally:
        await backend.close()
