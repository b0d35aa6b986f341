"""A store never drops or rewrites what is not its own, whatever its table is called.

A store's indexes share their schema's names with everything else in it: creation and
upgrades drop the indexes older releases made (``<table>_open``, ``<table>_a_fin``) by
name, and an application's index of that name, on a table of its own, is not one of them.
"""

from __future__ import annotations

import anyio
import psycopg

from lease_core.cli import main
from tests.stores.postgres import PgServer, drop_tables, unique_table


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
