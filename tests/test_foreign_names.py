"""A store never drops or rewrites what is not its own, whatever its table is called.

A store's indexes share their schema's names with everything else in it: creation and
upgrades drop the indexes older releases made (``<table>_open``, ``<table>_a_fin``) by
name, and an application's index of that name, on a table of its own, is not one of them.
Its tables too: an application's tables of the store's names, with the columns the
store's have, are not a store without the store's format in ``<table>_meta``; nor are
an application's Redis keys of the store's names (``{P}:members``) without ``{P}:meta``.
"""

from __future__ import annotations

import re
import time
import uuid
from functools import partial

import anyio
import psycopg
import pytest
import redis

from backends.embedded.redis import EmbeddedRedis
from backends.postgres import migrate
from lease_core import backend_from_url
from lease_core.cli import main
from lease_core.errors import ConfigurationError, StoreFormatError
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix


def sql(dsn: str, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def test_creating_a_store_keeps_an_applications_indexes_of_an_old_store_index_name(
    pg16_server: PgServer,
) -> None:
    """An application's unique index named like an index older releases made (``<table>_open``,
    ``<table>_a_fin``) was dropped by creating the store: its uniqueness went with it."""
    table = unique_table()
    items = f"{table}_items"
    sql(pg16_server.admin_dsn, f"CREATE TABLE {items} (id int, code text)")
    sql(pg16_server.admin_dsn, f"INSERT INTO {items} VALUES (1, 'a'), (2, 'b')")
    sql(pg16_server.admin_dsn, f"CREATE UNIQUE INDEX {table}_open ON {items} (code)")
    sql(pg16_server.admin_dsn, f"CREATE UNIQUE INDEX {table}_a_fin ON {items} (id)")
    try:
        assert main(["migrate", "--url", pg16_server.admin_dsn, "--table", table]) == 0
        assert main(["migrate", "--url", pg16_server.admin_dsn, "--table",
                     f"public.{table}"]) == 0  # again, the table spelled with its schema
        assert sql(pg16_server.admin_dsn,
                   "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = "
                   "%s::regclass ORDER BY 1", (items,)) == [(f"{table}_a_fin",),
                                                           (f"{table}_open",)]
        assert sql(pg16_server.admin_dsn, f"SELECT id, code FROM {items} ORDER BY id") == [
            (1, "a"), (2, "b")]
    finally:
        sql(pg16_server.admin_dsn, f"DROP TABLE {items}")
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_a_store_is_never_made_over_an_applications_tables_of_its_names(
    pg16_server: PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """An application's ``<table>_meta (key, value)`` (a settings table) and ``<table>_jobs
    (job)`` have the columns the store's have: the store was made around them, its
    'code' row overwrote the application's, and the fleet's membership cleanup deletes
    every row whose key starts with 'member:' and whose value is no number. Tables of the
    store's names without a store's format are refused, and nothing is changed."""
    table = unique_table()
    sql(pg16_server.admin_dsn,
        f"CREATE TABLE {table}_meta (key text PRIMARY KEY, value text NOT NULL)")
    sql(pg16_server.admin_dsn, f"INSERT INTO {table}_meta VALUES ('code', 'blue'), "
        "('member:alice', 'gold')")
    sql(pg16_server.admin_dsn, f"CREATE TABLE {table}_jobs (job text PRIMARY KEY)")
    try:
        for command in (["migrate", "--url", pg16_server.admin_dsn, "--table", table],
                        ["demo", "--url", pg16_server.admin_dsn, "--namespace", table]):
            assert main(command) == 2, command
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{table}_meta" in err, err
            assert "nothing" in err and ("--table" in err or "--namespace" in err), err
        with pytest.raises(ConfigurationError, match=f"{table}_jobs"):
            anyio.run(lambda: migrate(pg16_server.dsn, table=table))
        assert sql(pg16_server.admin_dsn, f"SELECT key, value FROM {table}_meta ORDER BY key"
                   ) == [("code", "blue"), ("member:alice", "gold")]
        assert sql(pg16_server.admin_dsn, "SELECT relname FROM pg_class WHERE relname IN "
                   "(%s, %s)", (table, f"{table}_attempts")) == []
    finally:
        sql(pg16_server.admin_dsn, f"DROP TABLE {table}_meta, {table}_jobs")
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_a_redis_store_is_never_made_over_an_applications_keys_of_its_names(
    valkey8_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    """An application's zset ``{P}:members`` (members by the time they joined) under a
    prefix with no store: the store was made around it, and the first membership renewal
    deleted every member whose score was over an hour before now, in ms. A members key
    without ``{P}:meta``, whose entries that renewal deletes, are refused, and
    nothing is changed."""
    prefix = "app_" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(valkey8_server.url)
    members, jobs = "{" + prefix + "}:members", "{" + prefix + "}:jobs"
    try:
        client.zadd(members, {"alice": 1_600_000_000, "bob": 1_700_000_000})
        client.sadd(jobs, "import")
        before = {key: client.dump(key) for key in (members, jobs)}
        url = f"{valkey8_server.url}?prefix={prefix}"

        async def run_once() -> None:
            backend = backend_from_url(url)
            await backend.start()
            await backend.close()

        refused = re.escape(members) + " exists but .* a prefix of its own"
        with pytest.raises(StoreFormatError, match=refused):
            anyio.run(run_once)
        assert main(["demo", "--url", valkey8_server.url, "--namespace", prefix]) == 2
        assert "in use" in capsys.readouterr().err
        assert {key: client.dump(key) for key in (members, jobs)} == before
        assert sorted(client.keys("{" + prefix + "*")) == sorted(
            k.encode() for k in (members, jobs))
    finally:
        delete_prefix(valkey8_server.url, prefix)
        client.close()


def test_a_redis_store_whose_meta_was_lost_after_its_fleet_was_down_says_how_to_go_on(
    valkey8_server: EmbeddedRedis,
) -> None:
    """A fleet's own ``{P}:members`` holds a killed member's entry, aged past the hour the
    renewals keep while the fleet was down; its ``{P}:meta`` then lost (evicted under an
    allkeys-* policy, deleted). Refused (nothing written), the message said only that
    "something else keeps keys under this prefix": it names this case and the way on
    (delete the members key), which then opens the store."""
    prefix = "lost_" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(valkey8_server.url)
    members, meta = "{" + prefix + "}:members", "{" + prefix + "}:meta"
    url = f"{valkey8_server.url}?prefix={prefix}"

    async def run_once() -> None:
        backend = backend_from_url(url)
        await backend.start()
        await backend.close()

    try:
        anyio.run(run_once)
        client.zadd(members, {"killed": int(time.time() * 1000) - 2 * 3_600_000})
        client.delete(meta)
        with pytest.raises(StoreFormatError, match="down for over an hour") as refused:
            anyio.run(run_once)
        assert f"delete {members}" in str(refused.value)
        assert not client.exists(meta)
        client.delete(members)
        anyio.run(run_once)
        assert client.exists(meta)
    finally:
        delete_prefix(valkey8_server.url, prefix)
        client.close()


def test_a_redis_store_is_never_made_in_an_applications_hash_of_its_meta_s_name(
    valkey8_server: EmbeddedRedis,
) -> None:
    """An application's hash ``{P}:meta`` (its settings, no store format): the store was
    made in it, its format and creation time written among the application's fields. It
    is refused, and nothing is written; a hash of the fields a store keeps there (the
    workflows' steps and schedules written again after its format was lost) opens."""
    prefix = "app_" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(valkey8_server.url)
    meta = "{" + prefix + "}:meta"
    url = f"{valkey8_server.url}?prefix={prefix}"

    async def run_once() -> None:
        backend = backend_from_url(url)
        await backend.start()
        await backend.close()

    try:
        client.hset(meta, mapping={"owner": "me", "theme": "dark"})
        with pytest.raises(StoreFormatError, match=re.escape(meta) + " .*owner.*: not an "
                           "anarchon store's"):
            anyio.run(run_once)
        assert client.hgetall(meta) == {b"owner": b"me", b"theme": b"dark"}
        assert sorted(client.keys("{" + prefix + "*")) == [meta.encode()]
        client.delete(meta)
        client.hset(meta, mapping={"workflow:close": '["a", "b"]', "schedule:j": "every 1m",
                                   "created": "1"})
        anyio.run(run_once)
        assert client.hget(meta, "format") is not None
    finally:
        delete_prefix(valkey8_server.url, prefix)
        client.close()


@pytest.mark.parametrize("spelled", ["search_path", "table"])
def test_a_store_in_the_sessions_temporary_schema_is_refused(
        pg16_server: PgServer, spelled: str) -> None:
    """A ``search_path`` of ``pg_temp`` (or a table ``pg_temp.t``) put the store in the
    session's temporary schema, gone at disconnect: it failed with "unexpected error:
    UndefinedFunction". It is refused, naming the schema and the way out, nothing made."""
    table = unique_table()
    url = (f"{pg16_server.admin_dsn}?options=-csearch_path%3Dpg_temp"
           if spelled == "search_path" else pg16_server.admin_dsn)
    name = table if spelled == "search_path" else f"pg_temp.{table}"
    with pytest.raises(ConfigurationError, match=r"temporary schema.*qualify the table"):
        anyio.run(partial(migrate, url, table=name))
    assert main(["migrate", "--url", url, "--table", name]) == 2
    assert sql(pg16_server.admin_dsn, "SELECT count(*) FROM pg_class WHERE relname LIKE %s",
               (f"{table}%",)) == [(0,)]
