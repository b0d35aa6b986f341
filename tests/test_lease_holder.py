"""``Lease.current_holder()`` and ``SyncLease.current_holder()``: who holds a name, read
without taking it, on every scenario store (memory, PostgreSQL direct and through
PgBouncer, Redis) and both event loops; and ``anarchon lease NAME``, which prints it.

The backends' ``read_lease`` itself is checked by the conformance suite
(lease_core/testing/lease_checks.py).
"""

from __future__ import annotations

import json
import uuid

import anyio
import psycopg
import pytest
import redis

from backends.embedded.redis import EmbeddedRedis
from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import ConfigurationError, Lease, LeaseHolder, MemoryBackend, SyncLease
from lease_core._named_leases import NamedLeaseStore
from lease_core.abc import Backend
from lease_core.cli import main
from lease_core.testing import Store, backend_users, wait_for
from tests.stores.memory import MemoryStore
from tests.stores.postgres import PgServer, PostgresStore, drop_tables, unique_table
from tests.stores.redis import ClusterStore, RedisStore

pytestmark = pytest.mark.anyio


async def test_an_observer_learns_who_holds_the_name_and_takes_nothing(store: Store) -> None:
    holder = Lease(store.backend(), "leader", ttl="10s", holder="node-a")
    observer = Lease(store.backend(), "leader", ttl="10s", holder="node-b")
    assert await observer.current_holder() is None  # never held
    async with holder:
        seen = await observer.current_holder()
        assert isinstance(seen, LeaseHolder)
        assert (seen.name, seen.holder, seen.token) == ("leader", "node-a", holder.token)
        assert 0 < seen.expires_in <= 10
        own = await holder.current_holder()
        assert own is not None and (own.holder, own.token) == ("node-a", holder.token)
        assert not observer.held  # the read took nothing
        assert await observer.acquire(timeout=0) is False
    assert await observer.current_holder() is None  # released
    assert await observer.acquire(timeout=0) is True
    try:
        mine = await observer.current_holder()
        assert mine is not None and mine.holder == observer.holder == "node-b"
        assert holder.token is not None and mine.token == observer.token > holder.token
    finally:
        await observer.release()


@pytest.mark.server_timing
async def test_a_hold_that_lapsed_reads_as_free(store: Store) -> None:
    backend, watching = store.backend(), store.backend()
    await backend.start()
    await watching.start()  # opened before the hold: the read below is one round trip
    try:  # a holder that took the name and died: it never renews
        dead = await backend.acquire_lease("orphan", "dead holder", 1_000)
        observer = Lease(watching, "orphan", ttl="10s")
        seen = await observer.current_holder()
        assert seen is not None and (seen.holder, seen.token) == ("dead holder", dead.token)
        assert seen.expires_in <= 1.0

        async def freed() -> bool:
            return await observer.current_holder() is None

        await wait_for(freed, timeout=5, what="the lapsed hold to read as free")
        assert await backend.now_ms() >= dead.expires_ms  # by the store's clock
    finally:
        await watching.close()
        await backend.close()


async def test_a_read_starts_and_closes_only_its_own_hold_of_the_backend(
        store: Store) -> None:
    backend = store.backend()
    lease = Lease(backend, "counted", ttl="10s")
    assert await lease.current_holder() is None
    assert backend_users(backend) == 0  # started for the read, closed after it
    async with lease:
        assert (await lease.current_holder()) is not None
        assert backend_users(backend) == 1  # the hold's start only
    assert backend_users(backend) == 0


async def test_a_sync_lease_reads_who_holds_the_name(store: Store) -> None:
    if isinstance(store, MemoryStore):
        backend = store.backend()
        backends = [backend, backend]
    else:  # a backend per SyncLease, from its URL (bound to no event loop)
        backends = [_url_backend(store), _url_backend(store)]
    seen: list[object] = []

    def hold_and_look() -> None:
        holder = SyncLease(backends[0], "sync-leader", ttl="10s", holder="sync-a")
        observer = SyncLease(backends[1], "sync-leader", ttl="10s")
        seen.append(observer.current_holder())
        with holder:
            seen.append(observer.current_holder())
            seen.append(holder.token)
        seen.append(observer.current_holder())

    await anyio.to_thread.run_sync(hold_and_look)
    before, during, token, after = seen
    assert before is None and after is None
    assert isinstance(during, LeaseHolder) and (during.holder, during.token) == ("sync-a",
                                                                                token)


def _url_backend(store: Store) -> object:
    from backends.postgres import PostgresBackend
    from backends.redis import RedisBackend

    if isinstance(store, PostgresStore):
        return PostgresBackend(store.server.dsn, table=store.table)
    assert isinstance(store, RedisStore)
    return RedisBackend(store.url, prefix=store.prefix)


async def test_a_backend_without_reads_says_what_to_implement() -> None:
    class NoReads(MemoryBackend):
        read_lease = NamedLeaseStore.read_lease  # the contract's default

    lease = Lease(NoReads(), "x", ttl="10s")
    with pytest.raises(ConfigurationError, match=r"NoReads cannot read a lease .*read_lease"):
        await lease.current_holder()
    assert backend_users(lease.backend) == 0


@pytest.mark.asyncio_only
async def test_the_cli_prints_who_holds_a_lease(store: Store,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    if isinstance(store, MemoryStore):
        pytest.skip("memory:// is a store inside one process; the CLI has its own")
    url, option = ((store.server.dsn, ["--table", store.table])
                   if isinstance(store, PostgresStore)
                   else (store.url, ["--prefix", store.prefix]))  # type: ignore[attr-defined]

    def cli(*args: str) -> int:
        return main(["lease", *args, "--url", url, *option])

    assert await anyio.to_thread.run_sync(cli, "leader") == 3  # no store there: none made
    assert "no anarchon store" in capsys.readouterr().err
    backend = store.backend()
    await backend.start()  # the store, made as a service's first start makes it
    await backend.close()
    assert await anyio.to_thread.run_sync(cli, "leader") == 0
    assert capsys.readouterr().out == "lease 'leader': free\n"
    async with Lease(store.backend(), "leader", ttl="10s", holder="node-a") as held:
        assert await anyio.to_thread.run_sync(cli, "leader") == 0
        out = capsys.readouterr().out
        assert out.startswith(f"lease 'leader': held by 'node-a', token {held.token}, "
                              "expires in "), out
        assert await anyio.to_thread.run_sync(cli, "leader", "--json") == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["name"] == "leader" and shown["holder"] == "node-a"
        assert shown["token"] == held.token and 0 < shown["expires_in"] <= 10
    assert await anyio.to_thread.run_sync(cli, "leader", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"name": "leader", "holder": None,
                                                   "token": None, "expires_in": None,
                                                   "quarantine": None}
    assert await anyio.to_thread.run_sync(cli, "") == 2
    assert "lease name=''" in capsys.readouterr().err


@pytest.mark.asyncio_only
async def test_a_read_makes_no_store_and_needs_only_select_rights(
        pg16_server: PgServer, valkey8_server: EmbeddedRedis) -> None:
    """``current_holder()`` only reads: where there is no store it answers None and makes
    none (it created the store, tables or keys, as an acquire does: a watcher given a
    typo'd namespace made a store there), and a role with SELECT rights only reads who
    holds a name."""
    missing = unique_table()
    try:
        assert await Lease(PostgresBackend(pg16_server.dsn, table=missing),
                           "leader").current_holder() is None
        assert _tables_like(pg16_server.admin_dsn, missing) == []
    finally:
        await drop_tables(pg16_server.admin_dsn, missing)
    prefix = "nostore_" + uuid.uuid4().hex[:8]
    assert await Lease(RedisBackend(valkey8_server.url, prefix=prefix),
                       "leader").current_holder() is None
    client = redis.Redis.from_url(valkey8_server.url)
    try:
        assert client.keys(f"*{prefix}*") == []
    finally:
        client.close()

    table, role = unique_table(), "watcher_" + uuid.uuid4().hex[:8]
    try:
        async with Lease(PostgresBackend(pg16_server.dsn, table=table), "leader",
                         ttl="10s", holder="node-a") as held:
            with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
                conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
                for suffix in ("", "_attempts", "_jobs", "_meta"):
                    conn.execute(f"GRANT SELECT ON {table}{suffix} TO {role}")
            reader = psycopg.conninfo.make_conninfo(pg16_server.dsn, user=role, password="pw")
            backend = PostgresBackend(reader, table=table)
            seen = await Lease(backend, "leader").current_holder()
            assert seen is not None and (seen.holder, seen.token) == ("node-a", held.token)
            assert backend_users(backend) == 0
    finally:
        await drop_tables(pg16_server.admin_dsn, table)
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS {role}")


def _tables_like(admin_dsn: str, name: str) -> list[str]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE %s",
                            (name + "%",)).fetchall()
    return [row[0] for row in rows]


@pytest.mark.asyncio_only
async def test_the_cli_given_a_cluster_nodes_url_answers_or_names_the_cluster(
        redis_cluster_store: ClusterStore, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``redis://`` URL of one node of a Cluster reaches that node's slots only: ``anarchon
    lease`` (and ``status``) answers where the keys are on that node, else exits 2 saying
    it is a Cluster node. On the nodes without the store's ``{P}:meta`` it exited 1,
    calling the redirection "not a hash: ... something else keeps keys under this
    prefix"."""
    store = redis_cluster_store
    async with Lease(store.backend(), "leader", ttl="10s", holder="node-a") as held:
        for url in store.cluster.urls:
            for command in (["lease", "leader"], ["lease", "b"], ["status"]):
                code = await anyio.to_thread.run_sync(
                    main, [*command, "--url", url, "--prefix", store.prefix])
                out, err = capsys.readouterr()
                assert code in (0, 2), (url, command, code, err)
                if code == 2:
                    assert "is a Redis Cluster node" in err and "not a hash" not in err
                elif command == ["lease", "leader"]:
                    assert out.startswith(f"lease 'leader': held by 'node-a', token "
                                          f"{held.token}, "), out


@pytest.mark.asyncio_only
async def test_a_read_during_a_failover_quarantine_says_when_the_name_can_be_taken(
        pg16_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    """After a detected promotion PostgreSQL ends every hold and lets nobody take a name
    until its quarantine ends. The read then answers no holder, with the name taken no
    earlier than the quarantine's end (as an acquire answers), and ``anarchon lease``
    says so: it printed "free" while every acquire was refused for up to a ttl."""
    table = unique_table()
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        held = await backend.acquire_lease("leader", "node-a", 10_000)
        assert held.held
        # The store last wrote on another timeline: the next acquire detects a promotion
        # (as after pg_promote; see postgres_sql/failover_v4.sql).
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {table}_meta SET value = 'FFFFFFFF 0 0' "
                         "WHERE key = 'failover'")
        refused = await backend.acquire_lease("leader", "node-b", 10_000)
        assert not refused.held and refused.expires_ms > refused.now_ms  # quarantined
        seen = await backend.read_lease("leader")
        assert (seen.held, seen.holder, seen.token) == (False, None, held.token)
        assert seen.now_ms < seen.expires_ms <= refused.expires_ms  # not before its end
        assert await Lease(backend, "leader").current_holder() is None  # nobody holds it
        code = await anyio.to_thread.run_sync(
            main, ["lease", "leader", "--url", pg16_server.dsn, "--table", table])
        out = capsys.readouterr().out
        assert code == 0 and out.startswith("lease 'leader': free, but ") and \
            "quarantine" in out, out
        code = await anyio.to_thread.run_sync(
            main, ["lease", "leader", "--url", pg16_server.dsn, "--table", table, "--json"])
        shown = json.loads(capsys.readouterr().out)  # (it said only: nobody holds it)
        assert code == 0 and shown["holder"] is None and 0 < shown["quarantine"] <= 10
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


@pytest.mark.parametrize("server", ["valkey8_server", "pg16_server"])
def test_a_lease_left_held_when_its_loop_ended_reads_on_the_next_loop(
        server: str, request: pytest.FixtureRequest) -> None:
    """A Lease (its backend made from a URL) left held when its ``asyncio.run`` ended,
    asked ``current_holder()`` on the next loop: it lets go of that hold's start of the
    backend first, as its next acquire does, and reads through a client of this loop (it
    read through the ended loop's client: RuntimeError, "attached to a different loop"
    or "Event loop is closed", on Redis). The hold, unreleased, is in the store still."""
    import asyncio
    import gc

    table = unique_table()
    found = request.getfixturevalue(server)
    backend: Backend = (RedisBackend(found.url, prefix=table)
                        if isinstance(found, EmbeddedRedis)
                        else PostgresBackend(found.dsn, table=table))
    lease = Lease(backend, "cli", ttl="10s", holder="cli-run")

    async def take(lease: Lease) -> None:
        assert await lease.acquire(timeout=5)

    try:
        asyncio.run(take(lease))  # held when the loop ends: lost
        gc.collect()  # (the closed loop's sockets reported here, not in a later test)
        seen = asyncio.run(lease.current_holder())
        assert seen is None or (seen.holder, seen.token) == ("cli-run", lease.token)
        assert backend_users(backend) == 0 and not lease.held
        asyncio.run(take(lease))  # and the next acquire takes it back
        asyncio.run(lease.release())
        assert backend_users(backend) == 0
    finally:
        if not isinstance(found, EmbeddedRedis):
            asyncio.run(drop_tables(found.admin_dsn, table))
        del lease, backend
        gc.collect()
