"""pg8000 through PgBouncer in transaction mode, under concurrency; literals it sends."""

from __future__ import annotations

import uuid

import anyio
import pg8000.native
import pytest

from adapters.pg8000 import inline_parameters, sql_literal
from backends.postgres import PostgresBackend
from lease_core.abc import ClaimRequest, ClaimStatus, Lease, Outcome
from lease_core.errors import ConfigurationError
from tests.stores.postgres import PgServer, drop_tables, unique_table

SLOT = 1_700_000_000_000


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_concurrent_statements_through_pgbouncer_keep_their_rows(
    pgbouncer_server: PgServer, anyio_backend: str
) -> None:
    """Many tasks on one pool: each gets the answer to its own statement."""
    table = unique_table()
    url = pgbouncer_server.dsn.replace("postgresql://", "postgresql+pg8000://", 1)
    backend = PostgresBackend(f"{url}?max_size=8", table=table)
    await backend.start()
    errors: list[BaseException] = []
    try:
        async def worker(n: int) -> None:
            try:
                for i in range(15):
                    job = f"job-{n}"
                    token = uuid.uuid4().hex
                    won = await backend.claim(
                        ClaimRequest(job, SLOT + i, f"i{n}", token, 60_000, overlap_skip=False))
                    assert (won.status, won.job, won.slot) == (ClaimStatus.WON, job, SLOT + i)
                    assert await backend.set_checkpoint(Lease(job, SLOT + i, token, 60_000),
                                                        {"n": n, "i": i})
                    assert await backend.get_checkpoint(job, SLOT + i) == {"n": n, "i": i}
                    state = (await backend.check([(job, SLOT + i)])).runs[(job, SLOT + i)]
                    assert (state.instance_id, state.attempt) == (f"i{n}", 1)
                    assert await backend.finish(Lease(job, SLOT + i, token, 60_000),
                                                Outcome.COMPLETED)
            except BaseException as exc:
                errors.append(exc)
                raise

        async with anyio.create_task_group() as tg:
            for n in range(12):
                tg.start_soon(worker, n)
        assert errors == []
        assert len(await backend.history(None, 1000)) == 12 * 15
    finally:
        await backend.close()
        await drop_tables(pgbouncer_server.admin_dsn, table)


def test_literals_round_trip_through_the_server(pg16_server: PgServer) -> None:
    srv = pg16_server.server
    conn = pg8000.native.Connection("postgres", host=srv.host, port=srv.port,
                                    password=srv.password, database="postgres")
    try:
        for setting in ("on", "off"):
            conn.run(f"SET standard_conforming_strings = {setting}")
            nasty = "it's a \\ back'slash\\'; DROP TABLE x; --\n\tü 空"
            sql = ("SELECT %s::text, %s::bigint, %s::boolean, %s::text[], %s::bigint[], "
                   "%s::text, %s::float8, '100%%'")
            params = (nasty, -42, True, ["a'b", None, "c\\d"], [], None, 1.5)
            row = conn.execute_simple(inline_parameters(sql, params)).rows[0]
            assert row == [nasty, -42, True, ["a'b", None, "c\\d"], [], None, 1.5, "100%"]
    finally:
        conn.close()


def test_values_without_a_literal_are_refused() -> None:
    with pytest.raises(TypeError):
        sql_literal(object())
    with pytest.raises(ConfigurationError, match="NUL"):
        sql_literal("a\x00b")
    with pytest.raises(ConfigurationError, match=r"1 placeholder\(s\) but 2 parameter"):
        inline_parameters("SELECT %s", (1, 2))
    assert sql_literal(float("nan")) == "'nan'"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_each_store_call_is_one_worker_thread_call(
    pgbouncer_server: PgServer, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim, a batched claim, a finish: one thread call each, a new connection included."""
    table = unique_table()
    url = pgbouncer_server.dsn.replace("postgresql://", "postgresql+pg8000://", 1)
    backend = PostgresBackend(f"{url}?max_size=2", table=table)
    await backend.start()
    hops = 0
    run_sync = anyio.to_thread.run_sync

    async def counting(*args: object, **kwargs: object) -> object:
        nonlocal hops
        hops += 1
        return await run_sync(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    try:
        requests = [ClaimRequest(f"j{n}", SLOT, "i", f"t{n}", 60_000) for n in range(3)]
        async with anyio.create_task_group() as tg:  # two at once: the second connects
            for r in requests[:2]:
                tg.start_soon(backend.claim, r)
        assert hops == 2
        won = await backend.claim_many(requests)
        assert [r.status for r in won] == [ClaimStatus.WON] * 3  # resent tokens answer WON
        assert hops == 3
        assert await backend.finish(Lease("j0", SLOT, "t0", 60_000), Outcome.COMPLETED)
        assert hops == 4
    finally:
        monkeypatch.undo()
        await backend.close()
        await drop_tables(pgbouncer_server.admin_dsn, table)


@pytest.mark.anyio
async def test_a_transaction_begins_in_one_message(
    pgbouncer_server: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BEGIN goes by the simple protocol: pg8000's extended protocol syncs between parse
    and bind, and outside a transaction PgBouncer may give the two halves to different
    server connections ("bind message supplies 0 parameters, but prepared statement
    requires 5", seen under load). Inside the transaction the extended protocol is safe."""
    from adapters._pg8000_params import pg8000_params
    from adapters.pg8000 import Pg8000PoolAdapter

    extended: list[str] = []
    simple: list[str] = []
    core = pg8000.core.CoreConnection
    unnamed, whole = core.execute_unnamed, core.execute_simple

    def spy_unnamed(self: object, statement: str, *args: object, **kwargs: object) -> object:
        extended.append(statement.strip())
        return unnamed(self, statement, *args, **kwargs)

    def spy_simple(self: object, statement: str, *args: object, **kwargs: object) -> object:
        simple.append(statement.strip())
        return whole(self, statement, *args, **kwargs)

    monkeypatch.setattr(core, "execute_unnamed", spy_unnamed)
    monkeypatch.setattr(core, "execute_simple", spy_simple)
    adapter = Pg8000PoolAdapter(pg8000_params(pgbouncer_server.dsn), max_size=2)
    try:
        async with adapter.transaction() as tx:
            assert await tx.all("SELECT %s::int + 1", (41,)) == [(42,)]
    finally:
        await adapter.close()
    assert "BEGIN" in simple and "BEGIN" not in extended
    assert "SELECT $1::int + 1" in extended  # inside the transaction: the extended protocol
