"""Versioned store code: a store made by the previous release's SQL, upgraded in place.

``tests/fixtures/store_v1.sql`` is the SQL anarchon 0.1.0 ran to create a store (store
code v1: the four tables and the unversioned ``<table>_claim``). The tests create a store
with it, put runs in flight through that old function (a held lease, a handed-over run,
history, runs taken over and handed over), and upgrade it: ``start()`` by a user who may
not upgrade is refused with a one-line error naming ``anarchon migrate``; ``migrate``
upgrades with every run kept, and the new function (``<table>_claim_v<CODE_VERSION>``) is
the one in use, also by instances of the old release still calling ``<table>_claim``.

``tests/fixtures/store_v2.sql`` is the store as store code v2 made it (whose claim
functions trimmed history on every claim); it is upgraded the same way, and instances
of that release still calling ``<table>_claim_v2`` or ``<table>_batch_v2`` claim with the
current logic, which leaves trimming to ``prune()``.

``tests/fixtures/store_v3.sql`` is the store as store code v3 made it (finishing with a
statement planned on every call, and an index of the attempts by finish time); it is
upgraded to v4 (the finish function ``<table>_end_v4``, that index dropped) with its
history kept, and instances of v3 still claiming through ``<table>_claim_v3`` and
finishing with v3's statement keep working beside the new ones.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import anyio
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from backends import postgres
from backends.postgres import CODE_VERSION, PostgresBackend, migrate, quote_ident, schema
from backends.postgres.statements import BODY_MARKS, CLAIM_SUFFIX, OPERATE_SUFFIX
from backends.postgres.upgrade import migrate_to
from lease_core import Admin
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, Outcome, Reason
from lease_core.cli import main
from lease_core.errors import BackendUnavailable, ConfigurationError, StoreFormatError
from lease_core.operations import Operation, OperationKind
from tests.helpers import wait_for
from tests.stores.postgres import PgServer, drop_tables, unique_table

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]

FIXTURE = Path(__file__).parent / "fixtures" / "store_v1.sql"
SERVERS = ["pg16_server", "pgsys_server", "pgbouncer_server"]
V1_CLAIM = """
SELECT c_status, c_attempt, c_reason, c_expires
FROM {fn}(%s::text, %s::bigint, %s::text, %s::text, %s::bigint, %s::text, false,
          %s::bigint, 100, 86400000, 100)"""
CLOCK = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
NOW = f"SELECT {CLOCK}"


def names(table: str) -> dict[str, str]:
    """The quoted identifiers the fixture's placeholders stand for."""
    return {
        "runs": quote_ident(table), "attempts": quote_ident(table + "_attempts"),
        "jobs": quote_ident(table + "_jobs"), "meta": quote_ident(table + "_meta"),
        "open_idx": quote_ident(table + "_open"), "seq_idx": quote_ident(table + "_a_seq"),
        "claimed_idx": quote_ident(table + "_a_claimed"),
        "job_idx": quote_ident(table + "_a_job"), "fin_idx": quote_ident(table + "_a_fin"),
        "claim_fn": quote_ident(table + "_claim"),
    }


def sql(dsn: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement (or, without parameters, a script) in autocommit."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(text, params, prepare=False)
        return cur.fetchall() if cur.description else []


class OldRelease:
    """What an instance of anarchon 0.1.0 sends: the v1 claim function, same statements."""

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn, self.table = dsn, table
        self.claim_sql = V1_CLAIM.format(fn=quote_ident(table + "_claim"))

    def claim(self, slot: int, token: str, lease_ms: int,
              max_attempts: int | None = None) -> tuple[Any, ...]:
        [row] = sql(self.dsn, self.claim_sql, ("j", slot, f"old-{token}", token, lease_ms,
                                               "scheduled", max_attempts))
        return row

    def hand_over(self, slot: int, token: str) -> None:
        assert sql(self.dsn, f"""
            WITH run AS (
                UPDATE {quote_ident(self.table)} SET status = 'handed_over', token = NULL,
                       expires_ms = {CLOCK}
                WHERE job = 'j' AND slot = %s AND token = %s RETURNING attempt)
            UPDATE {quote_ident(self.table + '_attempts')} a
            SET outcome = 'handed_over', finished_ms = {CLOCK}
            FROM run WHERE a.job = 'j' AND a.slot = %s AND a.attempt = run.attempt
            RETURNING 1""", (slot, token, slot))

    def finish(self, slot: int, token: str) -> None:
        assert sql(self.dsn, f"""
            WITH run AS (
                UPDATE {quote_ident(self.table)} SET status = 'completed', token = NULL,
                       expires_ms = NULL
                WHERE job = 'j' AND slot = %s AND token = %s RETURNING attempt)
            UPDATE {quote_ident(self.table + '_attempts')} a
            SET outcome = 'completed', finished_ms = {CLOCK}
            FROM run WHERE a.job = 'j' AND a.slot = %s AND a.attempt = run.attempt
            RETURNING 1""", (slot, token, slot))

    def wait_expired(self, expires: int) -> Any:
        return wait_for(lambda: sql(self.dsn, NOW)[0][0] > expires, what="lease expiry")


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest) -> PgServer:
    """PostgreSQL 16, the system's PostgreSQL (15) and PgBouncer in front of 16."""
    found: PgServer = request.getfixturevalue(request.param)
    return found


@pytest.fixture
async def v1_table(server: PgServer) -> AsyncIterator[str]:
    """A store created by the previous release's SQL (the fixture), dropped afterwards."""
    table = unique_table()
    sql(server.admin_dsn, FIXTURE.read_text().format(**names(table)))
    yield table
    await drop_tables(server.admin_dsn, table)


@pytest.fixture
async def app_role(server: PgServer, v1_table: str) -> AsyncIterator[str]:
    """A login role with the table privileges the application user has (no CREATE)."""
    role, password = f"app_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    sql(server.admin_dsn, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    tables = ", ".join(f"{v1_table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
    sql(server.admin_dsn, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
    yield server.server.dsn_for(role, password)
    sql(server.admin_dsn, f"DROP OWNED BY {role}")
    sql(server.admin_dsn, f"DROP ROLE {role}")


def upgraded(table: str) -> set[str]:
    """The claim functions of an upgraded store: this release's, and the older names."""
    return {f"{table}_claim", f"{table}_claim_v2", f"{table}_claim_v3",
            f"{table}_claim_v{CODE_VERSION}"}


def functions(server: PgServer, table: str) -> dict[str, str]:
    """The store's claim functions: name -> body."""
    return {str(name): str(body) for name, body in sql(
        server.admin_dsn, "SELECT proname, prosrc FROM pg_proc WHERE proname LIKE %s",
        (table + "_claim%",))}


async def test_migrate_upgrades_a_v1_store_with_runs_in_flight(
    server: PgServer, v1_table: str, app_role: str, anyio_backend: str
) -> None:
    table = v1_table
    old = OldRelease(server.dsn, table)
    # History: a completed run. In flight: a held lease, a handed-over run, a run taken
    # over once (attempt 2, short lease) and one handed over then re-claimed (attempt 2).
    assert old.claim(1, "done", 60_000)[0] == "won"
    old.finish(1, "done")
    assert old.claim(2, "held", 60_000)[0] == "won"
    assert old.claim(3, "leaving", 60_000)[0] == "won"
    old.hand_over(3, "leaving")
    first = old.claim(4, "crashed", 300)
    await old.wait_expired(first[3])
    assert old.claim(4, "taker", 300)[:3] == ("won", 2, "takeover")
    assert old.claim(5, "deploy", 60_000)[0] == "won"
    old.hand_over(5, "deploy")
    assert old.claim(5, "new-pod", 300)[:3] == ("won", 2, "hand-over")
    before = sql(server.admin_dsn, f"SELECT slot, attempt, reason, outcome FROM "
                                   f"{table}_attempts ORDER BY slot, attempt")

    # The application's user may not upgrade: a one-line error naming the command.
    with pytest.raises(ConfigurationError, match="anarchon migrate --url") as info:
        await PostgresBackend(app_role, table=table).start()
    message = str(info.value)
    assert "\n" not in message and "store code v1" in message and f"--table {table}" in message
    assert set(functions(server, table)) == {f"{table}_claim"}

    await migrate(server.dsn, table=table)
    await migrate(server.dsn, table=table)  # again: nothing to do
    assert sql(server.admin_dsn, f"SELECT value FROM {table}_meta WHERE key = 'code'") == [
        (str(CODE_VERSION),)]
    bodies = functions(server, table)
    assert set(bodies) == upgraded(table)
    for old_name in (f"{table}_claim", f"{table}_claim_v2"):  # the old names call v3
        assert f"{table}_claim_v{CODE_VERSION}" in bodies[old_name]
    assert sql(server.admin_dsn, f"SELECT slot, attempt, reason, outcome FROM "
                                 f"{table}_attempts ORDER BY slot, attempt") == before

    backend = PostgresBackend(app_role if server.dsn == server.admin_dsn else server.dsn,
                              table=table)
    await backend.start()  # the application's user now starts without a privilege
    try:
        held = Lease("j", 2, "held", 60_000)
        beat = await backend.heartbeat([held])
        assert beat.held == {"held"} and beat.renewed == {"held"}
        other = await backend.claim(ClaimRequest("j", 2, "new", "t2", 60_000))
        assert (other.status, other.instance_id) == (ClaimStatus.RUNNING, "old-held")
        assert await backend.finish(held, Outcome.COMPLETED)

        handed = await backend.claim(ClaimRequest("j", 3, "new", "t3", 60_000))
        assert (handed.status, handed.attempt, handed.reason) == (
            ClaimStatus.WON, 2, Reason.HAND_OVER)

        # max_attempts=2 counts the first attempt and takeovers, on runs written by v1 too
        # (from their recorded takeovers): slot 4 (one takeover) escalates, slot 5 (one
        # hand-over) is taken over. The v1 function escalated both.
        for slot in (4, 5):
            state = (await backend.check([("j", slot)])).runs[("j", slot)]
            await old.wait_expired(state.expires_ms or 0)
        escalated = await backend.claim(ClaimRequest("j", 4, "new", "t4", 60_000,
                                                     max_attempts=2))
        assert (escalated.status, escalated.attempt) == (ClaimStatus.ESCALATED, 2)
        taken = await backend.claim(ClaimRequest("j", 5, "new", "t5", 60_000, max_attempts=2))
        assert (taken.status, taken.attempt, taken.reason) == (
            ClaimStatus.WON, 3, Reason.TAKEOVER)

        # An instance of the old release still running claims through the new logic.
        assert old.claim(6, "late", 60_000)[:2] == ("won", 1)
        assert sql(server.admin_dsn, f"SELECT takeovers FROM {table} WHERE slot IN (5, 6) "
                                     "ORDER BY slot") == [(1,), (0,)]
        history = {(a.slot, a.attempt): (a.reason, a.outcome) for a in await backend.history("j")}
        assert history[(1, 1)] == (Reason.SCHEDULED, Outcome.COMPLETED)
        assert history[(2, 1)] == (Reason.SCHEDULED, Outcome.COMPLETED)
        assert history[(3, 1)] == (Reason.SCHEDULED, Outcome.HANDED_OVER)
        assert history[(4, 2)] == (Reason.TAKEOVER, Outcome.ESCALATED)
        assert history[(5, 3)] == (Reason.TAKEOVER, None)
        assert len(history) == 10
    finally:
        await backend.close()


async def test_a_start_joining_a_readers_open_upgrades_the_store(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """A reader (``paused()``, ``history()``, a SyncAdmin of a Django view) has the
    backend open with ``start(create=False)``, reading an older store as it is, when a
    scheduler's ``start()`` on the same backend object comes: it only counted itself in,
    so the store was never upgraded and every claim failed ("function ..._claim_v4 does
    not exist") until a restart. The joining start upgrades it."""
    table = unique_table()
    sql(pg16_server.admin_dsn, FIXTURE.read_text().format(**names(table)))
    try:
        backend = PostgresBackend(pg16_server.dsn, table=table)
        await backend.start(create=False)  # the reader, in flight
        try:
            await backend.start()  # the scheduler's
            try:
                assert set(functions(pg16_server, table)) == upgraded(table)
                assert (await backend.claim(ClaimRequest("j", 1, "b", "t", 60_000))
                        ).status is ClaimStatus.WON
            finally:
                await backend.close()
        finally:
            await backend.close()
    finally:
        await drop_tables(pg16_server.admin_dsn, table)


async def test_privileged_start_upgrades_a_v1_store(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    table = unique_table()
    sql(pg16_server.admin_dsn, FIXTURE.read_text().format(**names(table)))
    try:
        old = OldRelease(pg16_server.dsn, table)
        assert old.claim(1, "held", 60_000)[0] == "won"
        backend = PostgresBackend(pg16_server.dsn, table=table)
        await backend.start()
        try:
            assert set(functions(pg16_server, table)) == upgraded(table)
            assert await backend.heartbeat([Lease("j", 1, "held", 60_000)])
            assert (await backend.claim(ClaimRequest("j", 1, "b", "t", 60_000))).status \
                is ClaimStatus.RUNNING
        finally:
            await backend.close()
    finally:
        await drop_tables(pg16_server.admin_dsn, table)


def test_the_migrate_command_named_by_the_error_upgrades(
    pg16_server: PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    table = unique_table()
    sql(pg16_server.admin_dsn, FIXTURE.read_text().format(**names(table)))
    try:
        old = OldRelease(pg16_server.dsn, table)
        assert old.claim(1, "held", 60_000)[0] == "won"
        assert main(["migrate", "--url", pg16_server.admin_dsn, "--table", table]) == 0
        assert f"store code v{CODE_VERSION}" in capsys.readouterr().out
        assert set(functions(pg16_server, table)) == upgraded(table)
        assert sql(pg16_server.admin_dsn, f"SELECT status, token, takeovers FROM {table}") == [
            ("running", "held", None)]
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


async def test_an_upgrade_blocked_by_a_long_transaction_gives_up_and_changes_nothing(
    pg16_server: PgServer, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres.schema, "MIGRATION_LOCK_TIMEOUT_MS", 100)  # read there
    table = unique_table()
    sql(pg16_server.admin_dsn, FIXTURE.read_text().format(**names(table)))
    try:
        old = OldRelease(pg16_server.dsn, table)
        assert old.claim(1, "held", 60_000)[0] == "won"
        with psycopg.connect(pg16_server.admin_dsn) as fenced:  # a long transaction
            fenced.execute(f"SELECT 1 FROM {table} WHERE slot = 1 FOR UPDATE")
            with pytest.raises(BackendUnavailable, match="run `anarchon migrate` again"):
                with anyio.fail_after(30):
                    await migrate(pg16_server.dsn, table=table)
            assert set(functions(pg16_server, table)) == {f"{table}_claim"}
            fenced.rollback()
        await migrate(pg16_server.dsn, table=table)
        assert set(functions(pg16_server, table)) == upgraded(table)
    finally:
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_store_without_the_batched_claim_gets_it_on_start(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    table = unique_table()
    first = PostgresBackend(pg16_server.dsn, table=table)
    await first.start()
    await first.close()
    batch = f"{table}_batch_v{CODE_VERSION}"
    sql(pg16_server.admin_dsn, f"DROP FUNCTION {quote_ident(batch)} CASCADE")
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        won = await backend.claim_many([ClaimRequest("j", 1, "a", "t1", 60_000),
                                        ClaimRequest("j", 1, "b", "t2", 60_000)])
        assert [r.status for r in won] == [ClaimStatus.WON, ClaimStatus.RUNNING]
        assert sql(pg16_server.admin_dsn, "SELECT count(*) FROM pg_proc WHERE proname = %s",
                   (batch,)) == [(1,)]
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_v4_store_of_an_earlier_build_gets_the_claim_that_knows_trimmed_slots(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """A v4 store made by an earlier build of this unreleased version has the claim
    functions without ``p_scheduled`` and the open runs' index without retrying runs: a
    start replaces them (it does not take the store for up to date because functions of
    those names exist), and the overlap check finds retrying runs through the index."""
    table = unique_table()
    first = PostgresBackend(pg16_server.dsn, table=table)
    await first.start()
    await first.close()
    claim = quote_ident(f"{table}_claim_v{CODE_VERSION}")
    batch = quote_ident(f"{table}_batch_v{CODE_VERSION}")
    sql(pg16_server.admin_dsn, f"DROP FUNCTION {claim}, {batch}")
    sql(pg16_server.admin_dsn, f"""
        CREATE FUNCTION {claim}(text, bigint, text, text, bigint, text, boolean, bigint,
                                OUT c_status text) LANGUAGE sql AS $$ SELECT 'won' $$""")
    sql(pg16_server.admin_dsn, f"""
        CREATE FUNCTION {batch}(text[], bigint[], text[], text[], bigint[], text[],
                                boolean[], bigint[], OUT c_status text)
        LANGUAGE sql AS $$ SELECT 'won' $$""")
    sql(pg16_server.admin_dsn, f"DROP INDEX {quote_ident(table + '_opens')}")
    sql(pg16_server.admin_dsn, f"CREATE INDEX {quote_ident(table + '_open')} ON "
                               f"{quote_ident(table)} (job, slot) "
                               "WHERE status IN ('running', 'handed_over')")
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        won = await backend.claim_many([ClaimRequest("j", 1, "a", "t1", 60_000),
                                        ClaimRequest("j", 1, "b", "t2", 60_000)])
        assert [r.status for r in won] == [ClaimStatus.WON, ClaimStatus.RUNNING]
        assert sql(pg16_server.admin_dsn,
                   "SELECT pronargs FROM pg_proc WHERE proname = ANY(%s) ORDER BY proname",
                   ([f"{table}_batch_v{CODE_VERSION}", f"{table}_claim_v{CODE_VERSION}"],)
                   ) == [(9,), (9,)]
        assert sql(pg16_server.admin_dsn,
                   "SELECT indexname FROM pg_indexes WHERE tablename = %s ORDER BY 1",
                   (table,)) == [(f"{table}_opens",), (f"{table}_pkey",)]
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute("SET enable_seqscan = off")
            plan = "\n".join(str(row[0]) for row in conn.execute(
                f"EXPLAIN SELECT 1 FROM {quote_ident(table)} o WHERE o.job = 'j' "
                "AND o.slot < 5 AND o.status IN ('running', 'retrying') "
                "AND (o.status = 'retrying' OR o.expires_ms > 0)"))
        assert f"{table}_opens" in plan, plan
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_v4_store_of_an_earlier_build_gets_the_operations_that_refuse_a_second_pause(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """A v4 store made by an earlier build has the operations function whose pause of a
    paused job overwrote who paused it (its body lacks BODY_MARKS' text): a start makes it
    again, and a second pause is refused."""
    table = unique_table()
    first = PostgresBackend(pg16_server.dsn, table=table)
    await first.start()
    await first.close()
    operate = f"{table}{OPERATE_SUFFIX}"
    mark = BODY_MARKS[OPERATE_SUFFIX]
    [(definition,)] = sql(pg16_server.admin_dsn,
                          "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE proname = %s",
                          (operate,))
    assert mark in definition
    sql(pg16_server.admin_dsn, definition.replace(mark, "an earlier build"))
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        await backend.register_jobs(["j"])
        assert sql(pg16_server.admin_dsn,
                   "SELECT strpos(prosrc, %s) > 0 FROM pg_proc WHERE proname = %s",
                   (mark, operate)) == [(True,)]
        admin = Admin(backend, by="A")
        await admin.pause("j")
        await backend.operate(Operation(OperationKind.PAUSE, "j", None, "B"))
        assert await backend.paused() == {"j": "A"}
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_v4_store_of_an_earlier_build_keeps_claimed_at_and_its_claims_write_it(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """An earlier build of store code v4 made claimed_at a stored generated column (an
    upgrade then rewrote the attempts table under its locks), and its claim function
    lacks BODY_MARKS' text: a start makes the column a plain one, keeping its values,
    and the claims write it."""
    table = unique_table()
    attempts = quote_ident(table + "_attempts")
    first = PostgresBackend(pg16_server.dsn, table=table)
    await first.start()
    try:
        assert (await first.claim(ClaimRequest("j", 1, "i", "t1", 60_000))).status \
            is ClaimStatus.WON
    finally:
        await first.close()
    sql(pg16_server.admin_dsn,
        f"ALTER TABLE {attempts} DROP COLUMN claimed_at, ADD COLUMN claimed_at timestamptz "
        "GENERATED ALWAYS AS (to_timestamp(claimed_ms / 1000.0)) STORED")
    claim, mark = f"{table}{CLAIM_SUFFIX}", BODY_MARKS[CLAIM_SUFFIX]
    [(definition,)] = sql(pg16_server.admin_dsn,
                          "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE proname = %s",
                          (claim,))
    assert mark in definition
    sql(pg16_server.admin_dsn, definition.replace(mark, "an earlier build"))
    generated = ("SELECT attgenerated::text FROM pg_attribute "
                 "WHERE attrelid = %s::regclass AND attname = 'claimed_at'",
                 (table + "_attempts",))
    assert sql(pg16_server.admin_dsn, *generated) == [("s",)]
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        assert (await backend.claim(ClaimRequest("k", 2, "i", "t2", 60_000))).status \
            is ClaimStatus.WON
        assert sql(pg16_server.admin_dsn, *generated) == [("",)]
        assert sql(pg16_server.admin_dsn,
                   f"SELECT job, claimed_at = to_timestamp(claimed_ms / 1000.0) "
                   f"FROM {attempts} ORDER BY job") == [("j", True), ("k", True)]
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_claimed_at_fill_that_fails_keeps_its_batches_and_the_trimming(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """The maintenance winner's fill of an upgrade's claimed_at kept where it got to only
    after its last batch, and its error was maintenance_due's: a batch that failed (here
    a statement timeout behind a row lock) lost the batches before it, and the period's
    trimming did not run. Each batch now moves the mark, and a failed fill is logged."""
    table = unique_table()
    attempts, meta = quote_ident(table + "_attempts"), quote_ident(table + "_meta")
    first = PostgresBackend(pg16_server.dsn, table=table)
    await first.start()
    try:
        for job in ("j", "k"):
            for slot in (1, 2):
                assert (await first.claim(ClaimRequest(
                    job, slot, "i", f"{job}{slot}", 60_000, overlap_skip=False))).status \
                    is ClaimStatus.WON
    finally:
        await first.close()
    sql(pg16_server.admin_dsn, f"UPDATE {attempts} SET claimed_at = NULL")
    sql(pg16_server.admin_dsn, f"INSERT INTO {meta} VALUES ('fill', 'claimed_at')")
    fill_mark = f"SELECT value FROM {meta} WHERE key = 'fill'"
    pool = AsyncConnectionPool(pg16_server.dsn, min_size=1, max_size=2, open=False,
                               kwargs={"options": "-c statement_timeout=300"})
    await pool.open(wait=True)
    backend = PostgresBackend(pool, table=table)
    try:
        await backend.start()
        with psycopg.connect(pg16_server.admin_dsn) as holder, \
                patch.object(schema, "_FILL_BATCH", 2), \
                patch.object(schema, "FILL_BATCHES", 3):
            holder.execute(f"SELECT 1 FROM {attempts} WHERE job = 'k' FOR UPDATE")
            # (j, 1) and (j, 2) are filled; the batch of k's times out behind the lock
            assert await backend.maintenance_due("i", 60_000)
            holder.rollback()
        assert sql(pg16_server.admin_dsn, fill_mark) == [('claimed_at:["j", 2, 1]',)]
        sql(pg16_server.admin_dsn, f"DELETE FROM {meta} WHERE key = 'maintenance'")
        assert await backend.maintenance_due("i", 60_000)
        assert sql(pg16_server.admin_dsn, fill_mark) == []
        assert sql(pg16_server.admin_dsn,
                   f"SELECT count(*) FROM {attempts} WHERE claimed_at IS NULL") == [(0,)]
    finally:
        await backend.close()
        await pool.close()
        await drop_tables(pg16_server.admin_dsn, table)


# -- store code v2 -> v3: the claim stops trimming ----------------------------------------

FIXTURE_V2 = Path(__file__).parent / "fixtures" / "store_v2.sql"
V2_BATCH = """
SELECT c_index, c_status, c_attempt
FROM {fn}(%s::text[], %s::bigint[], %s::text[], %s::text[], %s::bigint[], %s::text[],
          %s::boolean[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint)"""


def names_v2(table: str) -> dict[str, str]:
    """The quoted identifiers the v2 fixture's placeholders stand for."""
    found = names(table)
    found.update(claim_v1=quote_ident(table + "_claim"),
                 claim_v2=quote_ident(table + "_claim_v2"),
                 batch_v2=quote_ident(table + "_batch_v2"))
    return found


def v2_release(dsn: str, table: str) -> OldRelease:
    """What an instance of the v2 release sends: the v2 claim function (same arguments)."""
    old = OldRelease(dsn, table)
    old.claim_sql = V1_CLAIM.format(fn=quote_ident(table + "_claim_v2"))
    return old


def history_of(dsn: str, table: str) -> list[tuple[Any, ...]]:
    return sql(dsn, f"SELECT slot, attempt, reason, outcome FROM {table}_attempts "
                    "ORDER BY slot, attempt")


async def test_migrate_upgrades_a_v2_store_whose_claims_trimmed(
    server: PgServer, anyio_backend: str
) -> None:
    table = unique_table()
    sql(server.admin_dsn, FIXTURE_V2.read_text().format(**names_v2(table)))
    role, password = f"app_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    sql(server.admin_dsn, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    tables = ", ".join(f"{table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
    sql(server.admin_dsn, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
    app = server.server.dsn_for(role, password)
    try:
        old = v2_release(server.dsn, table)
        # In flight through the v2 function (which trimmed on every claim): a completed
        # run, a held lease, a handed-over run.
        assert old.claim(1, "done", 60_000)[0] == "won"
        old.finish(1, "done")
        assert old.claim(2, "held", 60_000)[0] == "won"
        assert old.claim(3, "leaving", 60_000)[0] == "won"
        old.hand_over(3, "leaving")
        before = history_of(server.admin_dsn, table)
        assert len(before) == 3

        with pytest.raises(ConfigurationError, match="anarchon migrate --url") as info:
            await PostgresBackend(app, table=table).start()
        assert "\n" not in str(info.value) and "store code v2" in str(info.value)

        await migrate(server.dsn, table=table)
        await migrate(server.dsn, table=table)  # again: nothing to do
        assert sql(server.admin_dsn, f"SELECT value FROM {table}_meta WHERE key = 'code'"
                   ) == [(str(CODE_VERSION),)]
        bodies = functions(server, table)
        assert set(bodies) == upgraded(table)
        assert "DELETE" in FIXTURE_V2.read_text() and "DELETE" not in bodies[
            f"{table}_claim_v{CODE_VERSION}"]  # the new claim trims nothing
        assert history_of(server.admin_dsn, table) == before

        backend = PostgresBackend(app if server.dsn == server.admin_dsn else server.dsn,
                                  table=table)
        await backend.start()  # the application's user starts without a privilege
        try:
            held = Lease("j", 2, "held", 60_000)
            assert (await backend.heartbeat([held])).renewed == {"held"}
            handed = await backend.claim(ClaimRequest("j", 3, "new", "t3", 60_000))
            assert (handed.status, handed.attempt, handed.reason) == (
                ClaimStatus.WON, 2, Reason.HAND_OVER)
            assert await backend.finish(held, Outcome.COMPLETED)

            # Instances of the v2 release still running claim through the new logic,
            # one claim or a batch at a time: nothing is trimmed on the claim any more.
            assert old.claim(4, "late", 60_000)[:2] == ("won", 1)
            old.finish(4, "late")
            batch = sql(server.dsn, V2_BATCH.format(fn=quote_ident(table + "_batch_v2")), (
                ["j", "j"], [5, 6], ["old-b", "old-b"], ["t5", "t6"], [60_000, 60_000],
                ["scheduled", "scheduled"], [False, False], [None, None], [1, 1], [1, 1], 100))
            assert batch == [(1, "won", 1), (2, "won", 1)]
            assert [a.slot for a in await backend.history("j")] == [6, 5, 4, 3, 3, 2, 1]

            # The ticker's trimming (prune) is what trims now.
            assert await backend.prune("j", keep=3) == 2
            # the open run 3's attempts (the one handed over, the running one) stay beyond
            # the newest three until it ends
            assert [a.slot for a in await backend.history("j")] == [6, 5, 4, 3, 3]
            # the finished runs left without attempts went; the open run 3 stays
            assert sorted(r.slot for r in await backend.runs("j")) == [3, 4, 5, 6]
        finally:
            await backend.close()
    finally:
        await drop_tables(server.admin_dsn, table)
        sql(server.admin_dsn, f"DROP OWNED BY {role}")
        sql(server.admin_dsn, f"DROP ROLE {role}")


# -- store code v3 -> v4: the finish function, no index by finish time ----------------------

FIXTURE_V3 = Path(__file__).parent / "fixtures" / "store_v3.sql"
V3_CLAIM = """
SELECT c_status, c_attempt, c_reason, c_expires
FROM {fn}(%s::text, %s::bigint, %s::text, %s::text, %s::bigint, %s::text, false,
          %s::bigint)"""
#: The finish statement of store code v3 (queries.sql of that release), as it sent it.
V3_FINISH = """
WITH run AS (
    UPDATE {runs} SET status = %(outcome)s::text, token = NULL, expires_ms = NULL
    WHERE job = %(job)s::text AND slot = %(slot)s::bigint AND token = %(token)s::text
      AND status = 'running'
    RETURNING job, slot, attempt),
att AS (
    UPDATE {attempts} a SET outcome = %(outcome)s::text, error = %(error)s::text,
                            finished_ms = {now}
    WHERE (a.job, a.slot, a.attempt) = (SELECT run.job, run.slot, run.attempt FROM run)
      AND a.outcome IS NULL
    RETURNING 1)
SELECT count(*) FROM run"""
#: Seed 004's history query, with the column the attempts table keeps (claimed_ms).
SEED_HISTORY = ("SELECT job, slot, attempt, instance_id, reason, claimed_ms FROM {attempts} "
                "WHERE job = 'j' ORDER BY slot DESC, attempt DESC")


def names_v3(table: str) -> dict[str, str]:
    """The quoted identifiers the v3 fixture's placeholders stand for."""
    found = names_v2(table)
    found.update(claim_v3=quote_ident(table + "_claim_v3"),
                 batch_v3=quote_ident(table + "_batch_v3"))
    return found


def v3_release(dsn: str, table: str) -> OldRelease:
    """What an instance of the v3 release sends: ``<table>_claim_v3`` and v3's finish."""
    old = OldRelease(dsn, table)
    old.claim_sql = V3_CLAIM.format(fn=quote_ident(table + "_claim_v3"))
    finish_sql = V3_FINISH.format(runs=quote_ident(table),
                                  attempts=quote_ident(table + "_attempts"), now=CLOCK)

    def finish(slot: int, token: str) -> None:
        assert sql(dsn, finish_sql, {"outcome": "completed", "job": "j", "slot": slot,
                                     "token": token, "error": None}) == [(1,)]

    old.finish = finish  # type: ignore[method-assign]
    return old


async def test_migrate_upgrades_a_v3_store_keeping_its_history(
    server: PgServer, anyio_backend: str
) -> None:
    table = unique_table()
    sql(server.admin_dsn, FIXTURE_V3.read_text().format(**names_v3(table)))
    role, password = f"app_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    sql(server.admin_dsn, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    tables = ", ".join(f"{table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
    sql(server.admin_dsn, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
    app = server.server.dsn_for(role, password)
    seed_history = SEED_HISTORY.format(attempts=quote_ident(table + "_attempts"))
    fin_index = ("SELECT count(*) FROM pg_indexes WHERE tablename = %s AND indexname = %s",
                 (table + "_attempts", table + "_a_fin"))
    attempts_filenode = ("SELECT pg_relation_filenode(%s::regclass)", (table + "_attempts",))
    claimed_at = (f"SELECT count(*), count(*) FILTER (WHERE claimed_at = "
                  f"to_timestamp(claimed_ms / 1000.0)) FROM {table}_attempts")
    fill_mark = f"SELECT value FROM {table}_meta WHERE key = 'fill'"
    try:
        old = v3_release(server.dsn, table)
        # In flight through v3: a completed run, a run taken over (its first attempt
        # lost), a held lease, a handed-over run.
        assert old.claim(1, "done", 60_000)[0] == "won"
        old.finish(1, "done")
        first = old.claim(2, "stale", 50)
        assert first[0] == "won"
        await old.wait_expired(first[3])
        assert old.claim(2, "taker", 60_000)[:3] == ("won", 2, "takeover")
        assert old.claim(3, "held", 60_000)[0] == "won"
        assert old.claim(4, "leaving", 60_000)[0] == "won"
        old.hand_over(4, "leaving")
        before = sql(server.admin_dsn, seed_history)
        assert [row[1:3] for row in before] == [(4, 1), (3, 1), (2, 2), (2, 1), (1, 1)]
        assert sql(server.admin_dsn, *fin_index) == [(1,)]
        filenode = sql(server.admin_dsn, *attempts_filenode)

        with pytest.raises(ConfigurationError, match="anarchon migrate --url") as info:
            await PostgresBackend(app, table=table).start()
        assert "\n" not in str(info.value) and "store code v3" in str(info.value)

        await migrate(server.dsn, table=table)
        await migrate(server.dsn, table=table)  # again: nothing to do
        assert sql(server.admin_dsn, f"SELECT value FROM {table}_meta WHERE key = 'code'"
                   ) == [(str(CODE_VERSION),)]
        assert set(functions(server, table)) == upgraded(table)
        assert sql(server.admin_dsn, "SELECT count(*) FROM pg_proc WHERE proname = %s",
                   (f"{table}_end_v{CODE_VERSION}",)) == [(1,)]
        assert sql(server.admin_dsn, *fin_index) == [(0,)]
        # The history, read with seed 004's query, is what it was.
        assert sql(server.admin_dsn, seed_history) == before
        # The upgrade did not rewrite the attempts table (its new columns are catalog
        # only), and the attempts it found got claimed_at after its commit.
        assert sql(server.admin_dsn, *attempts_filenode) == filenode
        assert sql(server.admin_dsn, claimed_at) == [(5, 5)]
        assert sql(server.admin_dsn, fill_mark) == []
        # A fill an upgrade by start() left (its mark) goes on at each maintenance, on
        # the app's user, from where it got to.
        sql(server.admin_dsn, f"UPDATE {table}_attempts SET claimed_at = NULL WHERE slot < 3")
        sql(server.admin_dsn, f"INSERT INTO {table}_meta VALUES ('fill', 'claimed_at')")

        backend = PostgresBackend(app if server.dsn == server.admin_dsn else server.dsn,
                                  table=table)
        await backend.start()  # the application's user starts without a privilege
        try:
            assert sql(server.admin_dsn, claimed_at) == [(5, 2)]  # start() does not wait
            with patch.object(schema, "_FILL_BATCH", 2), \
                    patch.object(schema, "FILL_BATCHES", 1):
                # One batch of two: attempts (1, 1) and (2, 1).
                assert await backend.maintenance_due("i", 60_000)
                assert sql(server.admin_dsn, fill_mark) == [('claimed_at:["j", 2, 1]',)]
                assert sql(server.admin_dsn, claimed_at) == [(5, 4)]
                assert not await backend.maintenance_due("i", 60_000)  # not due: nothing
                assert sql(server.admin_dsn, claimed_at) == [(5, 4)]
                sql(server.admin_dsn, f"DELETE FROM {table}_meta WHERE key = 'maintenance'")
                assert await backend.maintenance_due("i", 60_000)  # on after (2, 1)
                assert sql(server.admin_dsn, fill_mark) == [('claimed_at:["j", 3, 1]',)]
                sql(server.admin_dsn, f"DELETE FROM {table}_meta WHERE key = 'maintenance'")
                assert await backend.maintenance_due("i", 60_000)  # (4, 1): the end
            assert sql(server.admin_dsn, claimed_at) == [(5, 5)]
            assert sql(server.admin_dsn, fill_mark) == []
            held = Lease("j", 3, "held", 60_000)
            assert (await backend.heartbeat([held])).renewed == {"held"}
            handed = await backend.claim(ClaimRequest("j", 4, "new", "t4", 60_000))
            assert (handed.status, handed.attempt, handed.reason) == (
                ClaimStatus.WON, 2, Reason.HAND_OVER)
            # The fenced finish through the new function: a stale token ends nothing.
            assert not await backend.finish(Lease("j", 2, "stale", 60_000), Outcome.FAILED)
            assert await backend.finish(held, Outcome.FAILED, "boom")
            assert not await backend.finish(held, Outcome.COMPLETED)
            assert await backend.finish(Lease("j", 2, "taker", 60_000), Outcome.COMPLETED)

            # An instance of v3 still running claims through the new logic and finishes
            # with its own statement.
            assert old.claim(5, "late", 60_000)[:2] == ("won", 1)
            old.finish(5, "late")
            by_slot = {(a.slot, a.attempt): a for a in await backend.history("j")}
            assert [(s, a, by_slot[s, a].outcome) for s, a in sorted(by_slot)] == [
                (1, 1, "completed"), (2, 1, "lost"), (2, 2, "completed"), (3, 1, "failed"),
                (4, 1, "handed_over"), (4, 2, None), (5, 1, "completed")]
            assert by_slot[3, 1].error == "boom"
            assert sql(server.admin_dsn, claimed_at) == [(7, 7)]
            assert sql(server.admin_dsn, fill_mark) == []

            # Trimming by age finds the attempts without the index by finish time.
            # (the open run 4's attempts stay: the one handed over and the running one)
            assert await backend.prune("j", older_than_ms=0) == 5
            assert [(a.slot, a.attempt) for a in await backend.history("j")] == [(4, 2),
                                                                                  (4, 1)]
            assert sorted(r.slot for r in await backend.runs("j")) == [4]
        finally:
            await backend.close()
    finally:
        await drop_tables(server.admin_dsn, table)
        sql(server.admin_dsn, f"DROP OWNED BY {role}")
        sql(server.admin_dsn, f"DROP ROLE {role}")


async def test_an_operation_on_a_v3_store_upgrades_it_and_acts(
    server: PgServer, anyio_backend: str
) -> None:
    """Operations need this release's store code (the operate function, the columns it
    writes): on an older store an operation upgrades it in place, as a privileged start
    does, rather than failing on a function that is not there."""
    from lease_core import Admin, OperationRefused

    table = unique_table()
    sql(server.admin_dsn, FIXTURE_V3.read_text().format(**names_v3(table)))
    try:
        old = v3_release(server.dsn, table)
        assert old.claim(1, "done", 60_000)[0] == "won"  # the store knows job "j"
        admin = Admin(PostgresBackend(server.dsn, table=table), by="test")
        code = f"SELECT value FROM {table}_meta WHERE key = 'code'"
        # A refused operation (a typo) leaves the older store, which older instances
        # still use, as it is.
        with pytest.raises(OperationRefused, match="never seen"):
            await admin.trigger("no-such-job")
        with pytest.raises(OperationRefused, match="no run"):
            await admin.cancel("j", 2)
        assert sql(server.admin_dsn, code) == [("3",)]
        # Nor does a read of the paused jobs (it upgraded the store).
        assert await admin.paused() == {}
        assert sql(server.admin_dsn, code) == [("3",)]
        await admin.pause("j")
        assert sql(server.admin_dsn, code) != [("3",)]  # made: upgraded, then made
        assert await admin.paused() == {"j": "test"}
        await admin.resume("j")
        assert await admin.paused() == {}
    finally:
        await drop_tables(server.admin_dsn, table)


async def test_two_spellings_of_one_table_create_it_under_one_lock(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """``t`` (through the search_path) and ``public.t`` are one store: their creations and
    upgrades wait for each other (their lock keys differed, so concurrent ones both
    created the tables and one failed with a unique violation). The key of ``public.t``
    is the one releases before took for that spelling: a creation of ``t`` waits for it."""
    async def start(name: str) -> None:
        backend = PostgresBackend(pg16_server.dsn, table=name)
        await backend.start()
        await backend.close()

    for _ in range(3):  # each round failed before
        table = unique_table()
        try:
            async with anyio.create_task_group() as tg:
                for name in (table, "public." + table):
                    tg.start_soon(functools.partial(migrate, pg16_server.dsn, table=name))
                tg.start_soon(start, table)
            assert set(functions(pg16_server, table)) == upgraded(table)
        finally:
            await drop_tables(pg16_server.admin_dsn, table)
    table = unique_table()
    digest = hashlib.sha256(f"anarchon:public.{table}".encode()).digest()
    key = int.from_bytes(digest[:8], "big", signed=True)
    done = anyio.Event()

    async def create() -> None:
        await migrate(pg16_server.dsn, table=table)
        done.set()

    try:
        with psycopg.connect(pg16_server.admin_dsn) as holder:
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (key,))

            def waiting() -> bool:
                [(n,)] = holder.execute(  # a bigint key is (classid, objid), objsubid 1
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    " AND classid = %s::bigint::oid AND objid = %s::bigint::oid"
                    " AND objsubid = 1", ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF)
                ).fetchall()
                return done.is_set() or n > 0

            async with anyio.create_task_group() as tg:
                tg.start_soon(create)
                await wait_for(waiting, what="the creation of the unqualified table waits")
                assert not done.is_set()  # it waited for the key of public.<table>
                holder.rollback()
                with anyio.fail_after(30):
                    await done.wait()
        assert set(functions(pg16_server, table)) == upgraded(table)
    finally:
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_store_of_newer_store_code_is_used_as_it_is_and_never_rewritten(
    pg16_server: PgServer, anyio_backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newer release keeps this release's function names as calls of its own (as this
    one keeps v1 to v3's): a start or a migrate of this release on its store uses them as
    they are. It made them again with this release's bodies (its marks missing), so an
    instance of this release restarted during a rolling deploy put the older logic back
    under every instance still calling these names. A newer store without them is
    refused, with nothing changed."""
    table = unique_table()
    await migrate(pg16_server.dsn, table=table)
    claim = f"{table}{CLAIM_SUFFIX}"
    mark = BODY_MARKS[CLAIM_SUFFIX]
    try:
        sql(pg16_server.admin_dsn, f"UPDATE {quote_ident(table + '_meta')} SET value = %s "
            "WHERE key = 'code'", (str(CODE_VERSION + 1),))
        [(definition,)] = sql(pg16_server.admin_dsn,
                              "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE proname = %s",
                              (claim,))
        sql(pg16_server.admin_dsn, definition.replace(mark, "a newer release's call"))
        body = functions(pg16_server, table)[claim]
        await migrate(pg16_server.dsn, table=table)
        # migrate says the store code the store has, not this release's
        assert await migrate_to(pg16_server.dsn, table=table) == (table, CODE_VERSION + 1)
        capsys.readouterr()
        assert await anyio.to_thread.run_sync(
            main, ["migrate", "--url", pg16_server.dsn, "--table", table]) == 0
        assert (f"(store code v{CODE_VERSION + 1}; v{CODE_VERSION + 1} is a newer "
                f"release's, used as it is (this release's is v{CODE_VERSION}))"
                ) in capsys.readouterr().out
        backend = PostgresBackend(pg16_server.dsn, table=table)
        await backend.start()
        await backend.close()
        assert functions(pg16_server, table)[claim] == body
        sql(pg16_server.admin_dsn, f"DROP FUNCTION {quote_ident(claim)}")
        before = functions(pg16_server, table)
        with pytest.raises(StoreFormatError, match=f"store code v{CODE_VERSION + 1}, newer"):
            await PostgresBackend(pg16_server.dsn, table=table).start()
        assert functions(pg16_server, table) == before
        assert sql(pg16_server.admin_dsn, f"SELECT value FROM {quote_ident(table + '_meta')} "
                   "WHERE key = 'code'") == [(str(CODE_VERSION + 1),)]
    finally:
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_user_who_may_not_create_a_store_in_a_schema_is_told_its_tables(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """The error of a start that may not create the store names the tables to grant on
    with their schema: it named ``t, t_attempts, ...``, which a GRANT resolves through
    the search_path (another schema's tables, or none)."""
    schema_name, role = f"s_{uuid.uuid4().hex[:8]}", f"app_{uuid.uuid4().hex[:8]}"
    sql(pg16_server.admin_dsn, f"CREATE SCHEMA {schema_name}")
    sql(pg16_server.admin_dsn, f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    sql(pg16_server.admin_dsn, f"GRANT USAGE ON SCHEMA {schema_name} TO {role}")
    try:
        backend = PostgresBackend(pg16_server.server.dsn_for(role, "pw"),
                                  table=f"{schema_name}.runs")
        with pytest.raises(ConfigurationError) as raised:
            await backend.start()
        assert (f"on {schema_name}.runs, {schema_name}.runs_attempts, {schema_name}.runs_jobs,"
                f" {schema_name}.runs_meta (") in str(raised.value)
    finally:
        sql(pg16_server.admin_dsn, f"DROP SCHEMA {schema_name} CASCADE")
        sql(pg16_server.admin_dsn, f"DROP OWNED BY {role}")
        sql(pg16_server.admin_dsn, f"DROP ROLE {role}")


async def test_a_table_named_without_its_schema_is_the_one_the_search_path_finds(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """Every statement names the tables without a schema, so PostgreSQL finds them through
    the search_path; the store looked for them in the current schema only. A user whose
    own schema comes first (``"$user", public``, PostgreSQL's secure schema pattern),
    given the tables a privileged user made in ``public``, was told they were missing
    (``start()`` tried to make a second store in its schema; ``status`` exited 3)."""
    table, own = unique_table(), f"s_{uuid.uuid4().hex[:8]}"
    await migrate(pg16_server.dsn, table=table)
    sql(pg16_server.admin_dsn, f"CREATE SCHEMA {own}")
    url = f"{pg16_server.dsn}?options=-csearch_path%3D{own},public"
    try:
        backend = PostgresBackend(url, table=table)
        await backend.start()
        try:
            await backend.register_jobs(["j"])
        finally:
            await backend.close()
        reader = PostgresBackend(url, table=table)
        await reader.start(create=False)
        try:
            assert await reader.jobs() == ["j"]
        finally:
            await reader.close()
        assert sql(pg16_server.admin_dsn, "SELECT count(*) FROM pg_class c JOIN pg_namespace n"
                   " ON n.oid = c.relnamespace WHERE n.nspname = %s", (own,)) == [(0,)]
        assert await anyio.to_thread.run_sync(
            main, ["status", "--url", url, "--table", table]) == 0
    finally:
        sql(pg16_server.admin_dsn, f"DROP SCHEMA {own} CASCADE")
        await drop_tables(pg16_server.admin_dsn, table)


async def test_a_store_found_later_in_the_search_path_is_upgraded_where_it_is(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """The store a table named without its schema finds later in the search_path (in
    ``public``, a schema of the connection's own first) is upgraded in its own schema:
    the statements that make its functions name them without a schema too, so they were
    made in the first schema of the path, beside an empty one, and every later start
    found the store's own still missing and made them there again."""
    table, own = unique_table(), f"s_{uuid.uuid4().hex[:8]}"
    await migrate(pg16_server.dsn, table=table)
    batch = f"{table}_batch_v{CODE_VERSION}"
    sql(pg16_server.admin_dsn, f"DROP FUNCTION {quote_ident(batch)} CASCADE")
    sql(pg16_server.admin_dsn, f"CREATE SCHEMA {own}")
    url = f"{pg16_server.dsn}?options=-csearch_path%3D{own},public"
    try:
        backend = PostgresBackend(url, table=table)
        await backend.start()
        await backend.close()
        assert sql(pg16_server.admin_dsn, "SELECT n.nspname FROM pg_proc p JOIN pg_namespace n"
                   " ON n.oid = p.pronamespace WHERE p.proname = %s", (batch,)) == [("public",)]
        assert sql(pg16_server.admin_dsn, "SELECT count(*) FROM pg_class c JOIN pg_namespace n"
                   " ON n.oid = c.relnamespace WHERE n.nspname = %s", (own,)) == [(0,)]
    finally:
        sql(pg16_server.admin_dsn, f"DROP SCHEMA {own} CASCADE")
        await drop_tables(pg16_server.admin_dsn, table)



async def test_an_operation_through_a_store_opened_as_it_is_upgrades_it_and_acts(
    server: PgServer, anyio_backend: str
) -> None:
    """``anarchon serve`` opens its backend with ``start(create=False)``: an older store
    is read as it is, and the application's own start is a counted no-op. An operation
    (POST) then called the operations function a v3 store does not have: the driver's
    "function ... does not exist" raised out of the application (a 500). It upgrades the
    store in place and acts, as an operation of the CLI does."""
    from lease_core.http import create_app

    table = unique_table()
    sql(server.admin_dsn, FIXTURE_V3.read_text().format(**names_v3(table)))
    code = f"SELECT value FROM {table}_meta WHERE key = 'code'"
    try:
        old = v3_release(server.dsn, table)
        assert old.claim(1, "done", 60_000)[0] == "won"  # the store knows job "j"
        # An application user who may not upgrade: 503, naming anarchon migrate.
        role, password = f"app_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        sql(server.admin_dsn, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        try:
            tables = ", ".join(f"{table}{s}" for s in ("", "_attempts", "_jobs", "_meta"))
            sql(server.admin_dsn, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
            user = PostgresBackend(server.server.dsn_for(role, password), table=table)
            await user.start(create=False)
            try:
                app = create_app(user, token="t0ken")
                for _ in range(2):  # the same answer again, not the missing function
                    status, body = await asgi_request(app, "POST", "/jobs/j/pause", "t0ken")
                    assert status == 503 and b"anarchon migrate" in body, (status, body)
            finally:
                await user.close()
            assert sql(server.admin_dsn, code) == [("3",)]
        finally:
            sql(server.admin_dsn, f"DROP OWNED BY {role}")
            sql(server.admin_dsn, f"DROP ROLE {role}")
        backend = PostgresBackend(server.dsn, table=table)
        await backend.start(create=False)  # as anarchon serve does
        try:
            app = create_app(backend, token="t0ken")  # its lifespan is not run here
            assert (await asgi_request(app, "GET", "/jobs", "t0ken"))[0] == 200
            assert sql(server.admin_dsn, code) == [("3",)]  # a read changes nothing
            status, body = await asgi_request(app, "POST", "/jobs/j/pause", "t0ken")
            assert status == 200, body
            assert await backend.paused() == {"j": "http"}
        finally:
            await backend.close()
        assert sql(server.admin_dsn, code) == [(str(CODE_VERSION),)]
    finally:
        await drop_tables(server.admin_dsn, table)


async def asgi_request(app: Any, method: str, path: str, token: str) -> tuple[int, bytes]:
    """One request to the ASGI application ``app`` on this event loop (the backend's);
    its status and body."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
               "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
               "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1),
               "server": ("127.0.0.1", 80),
               "headers": [(b"host", b"127.0.0.1"),
                           (b"authorization", f"Bearer {token}".encode())]},
              receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_two_operations_at_once_through_a_store_opened_as_it_is_both_act(
    server: PgServer, anyio_backend: str
) -> None:
    """Two operations at once through one backend opened with ``start(create=False)`` on
    a v3 store (two POSTs to ``anarchon serve``): the second must wait for the first's
    upgrade, not call the operations function before the upgrade made it (it found the
    store marked upgraded as soon as the first began: "function ... does not exist")."""
    table = unique_table()
    sql(server.admin_dsn, FIXTURE_V3.read_text().format(**names_v3(table)))
    try:
        old = v3_release(server.dsn, table)
        assert old.claim(1, "done", 60_000)[0] == "won"  # the store knows job "j"
        backend = PostgresBackend(server.dsn, table=table)
        await backend.start(create=False)  # as anarchon serve does
        try:
            results: list[Any] = []

            async def pause(job: str) -> None:
                results.append(await backend.operate(
                    Operation(OperationKind.PAUSE, job, None, "test")))

            async with anyio.create_task_group() as tg:
                tg.start_soon(pause, "j")
                tg.start_soon(pause, "j")
            assert sorted(str(r.refused) for r in results) == ["None", "conflict"]
            assert await backend.paused() == {"j": "test"}
        finally:
            await backend.close()
        code = f"SELECT value FROM {table}_meta WHERE key = 'code'"
        assert sql(server.admin_dsn, code) == [(str(CODE_VERSION),)]
    finally:
        await drop_tables(server.admin_dsn, table)


async def test_serves_lifespan_joins_its_readers_open_without_upgrading(
    pg16_server: PgServer, anyio_backend: str
) -> None:
    """``anarchon serve`` opens the backend with ``start(create=False)`` (an older store
    read as it is, with SELECT rights only too); the status application's lifespan then
    starts it again. That start joins the reader's as a reader: it neither upgrades the
    store nor, for a user who may not, fails (a start that may create, joining a reader's,
    upgrades: a scheduler's must)."""
    from lease_core.http import create_app

    table = unique_table()
    sql(pg16_server.admin_dsn, FIXTURE_V3.read_text().format(**names_v3(table)))
    code = f"SELECT value FROM {table}_meta WHERE key = 'code'"
    try:
        backend = PostgresBackend(pg16_server.dsn, table=table)
        await backend.start(create=False)  # as anarchon serve does
        try:
            app = create_app(backend, token="t0ken")
            async with app.router.lifespan_context(app):
                assert sql(pg16_server.admin_dsn, code) == [("3",)]
        finally:
            await backend.close()
        assert sql(pg16_server.admin_dsn, code) == [("3",)]
    finally:
        await drop_tables(pg16_server.admin_dsn, table)
