"""Reaching the primary through a multi-host URL: psycopg tries the hosts in order; pg8000,
which connects to one host, refuses such a URL in one line naming what to use instead."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from backends.embedded.postgres import find_free_port
from lease_core import ConfigurationError, PostgresBackend
from lease_core.abc import ClaimRequest, ClaimStatus
from tests.stores.postgres import PgServer, drop_tables, unique_table

pytestmark = pytest.mark.anyio


def _with_dead_host_first(dsn: str) -> str:
    parts = urlsplit(dsn)
    user, _, live = parts.netloc.rpartition("@")
    dead = f"127.0.0.1:{find_free_port()}"  # nothing listens there
    return urlunsplit((parts.scheme, f"{user}@{dead},{live}", parts.path, parts.query,
                       parts.fragment))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_psycopg_reaches_the_live_host_of_a_multi_host_url(pg16_server: PgServer) -> None:
    joiner = "&" if "?" in pg16_server.dsn else "?"
    url = _with_dead_host_first(pg16_server.dsn) + joiner + "target_session_attrs=read-write"
    table = unique_table()
    backend = PostgresBackend(url, table=table)
    await backend.start()
    try:
        request = ClaimRequest("j", 1_000, "a", "t1", 60_000)
        assert (await backend.claim(request)).status is ClaimStatus.WON
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


def test_pg8000_refuses_a_multi_host_url_naming_psycopg() -> None:
    url = "postgresql+pg8000://app:pw@db1:5432,db2:5432/app?target_session_attrs=read-write"
    with pytest.raises(ConfigurationError, match="one host") as info:
        PostgresBackend(url)
    assert "psycopg" in str(info.value) and "pw" not in str(info.value)
