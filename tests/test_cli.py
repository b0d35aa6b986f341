"""The ``anarchon`` command line and the demo on the memory backend."""

from __future__ import annotations

import io
import subprocess
import sys

import anyio
import psycopg
import pytest

from backends.embedded.redis import EmbeddedRedis
from lease_core.cli import main
from lease_core.demo import run_demo
from tests.stores.postgres import PgServer, drop_tables, unique_table


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "lease_core.cli", "--help"],
                         capture_output=True, text=True, check=True)
    for command in ("demo", "migrate", "history"):
        assert command in out.stdout


def test_memory_demo_shows_takeover_hand_over_and_a_verdict() -> None:
    out = io.StringIO()
    assert run_demo("memory", out=out)
    text = out.getvalue()
    assert "stand by" in text
    assert "attempt 2 (takeover)" in text
    assert "attempt 2 (hand-over)" in text
    assert "VERDICT: OK" in text


def test_history_command_reads_a_store() -> None:
    assert main(["history", "--url", "memory://"]) == 0


def test_errors_are_reported_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["history", "--url", "nosuch://x"])
    assert code == 2
    err = capsys.readouterr().err
    assert "anarchon:" in err and "'nosuch'" in err and "Traceback" not in err


def test_postgres_demo_with_processes(pg16_server: PgServer) -> None:
    """`anarchon demo --dsn URL`: three OS processes, SIGKILL, SIGTERM, a verdict."""
    out = io.StringIO()
    assert run_demo("postgres", url=pg16_server.dsn, out=out), out.getvalue()
    text = out.getvalue()
    assert "attempt 2 (takeover)" in text and "attempt 2 (hand-over)" in text
    assert pg16_server.server.password not in text


def test_migrate_command_creates_the_tables(pg16_server: PgServer) -> None:
    table = unique_table()
    try:
        assert main(["migrate", "--dsn", pg16_server.admin_dsn, "--table", table]) == 0
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT count(*) FROM pg_tables WHERE tablename LIKE %s", (table + "%",)
            ).fetchone()
        assert rows is not None and rows[0] == 4
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_migrate_reports_a_bad_table_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "--dsn", "postgresql://127.0.0.1:1/x", "--table", 'bad"name']) == 2
    err = capsys.readouterr().err
    assert 'bad"name' in err and "Traceback" not in err


def test_redis_demo_with_processes(valkey8_server: EmbeddedRedis) -> None:
    """`anarchon demo --backend redis --url URL`: the same fleet on Redis."""
    out = io.StringIO()
    assert run_demo("redis", url=valkey8_server.url, out=out), out.getvalue()
    assert "attempt 2 (takeover)" in out.getvalue()
