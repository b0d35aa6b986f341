"""The command line is safe on a user's own store.

Read-only commands never create or change anything (with SELECT-only rights too), a
closed pipe is quiet, ``$ANARCHON_URL`` replaces ``--url``, URL options are checked in one
place that names the accepted ones, and ``serve`` fails in one line on a taken port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx2
import psycopg
import pytest
import redis

from backends.embedded.redis import EmbeddedRedis
from lease_core import StoreNotFound, backend_from_url
from lease_core.cli import EXIT_NO_STORE, main
from tests.helpers import run_job_once
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix

ANARCHON = str(Path(sys.executable).parent / "anarchon")


def _tables_like(admin_dsn: str, name: str) -> list[str]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE %s",
                            (name + "%",)).fetchall()
    return sorted(row[0] for row in rows)


# --- read-only commands write nothing -------------------------------------------------


@pytest.mark.parametrize("command", [["status"], ["history"], ["history", "--json"],
                                     ["prune", "--older-than", "1d"]])
def test_a_read_only_command_on_a_missing_postgres_store_creates_nothing(
    pg16_server: PgServer, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    table = unique_table()
    code = main([*command, "--url", pg16_server.dsn, "--namespace", table])
    err = capsys.readouterr().err
    assert code == EXIT_NO_STORE == 3, err
    assert "no anarchon store at" in err and repr(table) in err
    assert "***" in err or "@" not in err  # the URL shown is redacted
    assert _tables_like(pg16_server.admin_dsn, table) == []


def test_a_read_only_command_on_a_missing_redis_store_writes_no_key(
    valkey8_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = "typo_" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(valkey8_server.url)
    before = client.dbsize()
    for command in (["status"], ["history"], ["prune", "--older-than", "1d"]):
        assert main([*command, "--url", valkey8_server.url, "--namespace", prefix]) == 3
        err = capsys.readouterr().err
        assert "no anarchon store at" in err and repr(prefix) in err
    assert client.keys(f"*{prefix}*") == [] and client.dbsize() == before
    client.close()


def test_status_and_history_work_with_select_only_rights(
    pg16_server: PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    table = unique_table()
    role = "reader_" + uuid.uuid4().hex[:8]

    async def seed() -> None:
        backend = backend_from_url(pg16_server.dsn, namespace=table)
        await backend.start()
        await backend.close()

    anyio.run(seed)
    try:
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
            for suffix in ("", "_attempts", "_jobs", "_meta"):
                conn.execute(f"GRANT SELECT ON {table}{suffix} TO {role}")
        reader = psycopg.conninfo.make_conninfo(pg16_server.dsn, user=role, password="pw")
        for command in (["status"], ["history"], ["status", "--json"]):
            assert main([*command, "--url", reader, "--namespace", table]) == 0, \
                capsys.readouterr().err
        capsys.readouterr()
        # the same user may not create a store: read-only commands never try
        other = unique_table()
        assert main(["status", "--url", reader, "--namespace", other]) == 3
        assert "no anarchon store" in capsys.readouterr().err
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS {role}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def _serving(url: str, namespace: str, tmp_path: Path) -> Iterator[str]:
    """``anarchon serve`` over ``url``'s ``namespace`` on a free port: its base URL, once it
    answers (within 30 s)."""
    port = _free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("ANARCHON_TOKEN", "ANARCHON_URL")}
    with log.open("w") as out:
        server = subprocess.Popen([ANARCHON, "serve", "--url", url, "--namespace", namespace,
                                   "--port", str(port)], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx2.get(f"{base}/jobs").status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"anarchon serve did not answer: {log.read_text()}")
                time.sleep(0.1)
            yield base
        finally:
            server.terminate()
            server.wait(10)


def test_serve_on_a_missing_postgres_store_exits_3_and_creates_nothing(
    pg16_server: PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    table = unique_table()
    code = main(["serve", "--url", pg16_server.dsn, "--namespace", table,
                 "--port", str(_free_port())])
    err = capsys.readouterr().err
    assert code == EXIT_NO_STORE, err
    assert "no anarchon store at" in err and repr(table) in err
    assert _tables_like(pg16_server.admin_dsn, table) == []


def test_serve_on_a_missing_redis_store_exits_3_and_writes_no_key(
    valkey8_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = "typo_" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(valkey8_server.url)
    before = client.dbsize()
    code = main(["serve", "--url", valkey8_server.url, "--namespace", prefix,
                 "--port", str(_free_port())])
    err = capsys.readouterr().err
    assert code == EXIT_NO_STORE, err
    assert "no anarchon store at" in err and repr(prefix) in err
    assert client.keys(f"*{prefix}*") == [] and client.dbsize() == before
    client.close()


def test_serve_answers_with_select_only_rights(pg16_server: PgServer, tmp_path: Path) -> None:
    table = unique_table()
    role = "reader_" + uuid.uuid4().hex[:8]
    anyio.run(_seed_store, pg16_server.dsn, table)
    try:
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
            for suffix in ("", "_attempts", "_jobs", "_meta"):
                conn.execute(f"GRANT SELECT ON {table}{suffix} TO {role}")
        reader = psycopg.conninfo.make_conninfo(pg16_server.dsn, user=role, password="pw")
        with _serving(reader, table, tmp_path) as base:
            overview = httpx2.get(f"{base}/overview")
            assert overview.status_code == 200, overview.text
            assert [row["name"] for row in overview.json()["rows"]] == ["report"]
            page = httpx2.get(f"{base}/")
            assert page.status_code == 200 and "<html" in page.text.lower()
            # Served without a token: a page elsewhere whose name was rebound to
            # 127.0.0.1 (DNS rebinding) sends its own name as Host, and reads nothing.
            rebound = httpx2.get(f"{base}/overview", headers={"Host": "attacker.example"})
            assert rebound.status_code == 400 and "report" not in rebound.text
            assert "127.0.0.1 or localhost" in rebound.json()["error"]
            local = httpx2.get(f"{base}/overview",
                               headers={"Host": base.removeprefix("http://").replace(
                                   "127.0.0.1", "localhost")})
            assert local.status_code == 200
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS {role}")


async def _seed_store(url: str, namespace: str) -> None:
    """A store with one job, ``report``: one completed run and one in progress."""
    from lease_core.abc import ClaimRequest, ClaimStatus, Lease, Outcome

    backend = backend_from_url(url, namespace=namespace)
    await backend.start()
    try:
        done = await backend.claim(ClaimRequest("report", 60_000, "a", "t-1", 60_000))
        assert done.status is ClaimStatus.WON
        assert await backend.finish(Lease("report", 60_000, "t-1", 60_000), Outcome.COMPLETED)
        running = await backend.claim(ClaimRequest("report", 120_000, "a", "t-2", 600_000))
        assert running.status is ClaimStatus.WON
    finally:
        await backend.close()


def _keyspace(client: redis.Redis) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key of the server: its DUMP and whether it has a time to live."""
    return {key: (client.dump(key), client.pttl(key) >= 0)  # type: ignore[misc]
            for key in client.scan_iter(count=1000)}


def test_an_existing_redis_store_is_unchanged_by_status_history_and_serve(
    valkey8_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prefix = "ro_" + uuid.uuid4().hex[:8]
    anyio.run(_seed_store, valkey8_server.url, prefix)
    client = redis.Redis.from_url(valkey8_server.url)
    try:
        before = _keyspace(client)
        assert any(prefix.encode() in key for key in before)
        for command in (["status"], ["status", "--json"], ["history"], ["history", "--json"]):
            assert main([*command, "--url", valkey8_server.url, "--namespace", prefix]) == 0
            assert "report" in capsys.readouterr().out
        with _serving(valkey8_server.url, prefix, tmp_path) as base:
            for path in ("/", "/overview", "/jobs", "/runs/report",
                         "/jobs/report@1970-01-01T00:01:00Z?log=1"):
                response = httpx2.get(base + path)
                assert response.status_code == 200, (path, response.text)
        assert _keyspace(client) == before
    finally:
        client.close()
        delete_prefix(valkey8_server.url, prefix)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the drivers' own loop
async def test_start_without_create_raises_store_not_found_and_a_later_start_creates(
    pg16_server: PgServer,
) -> None:
    table = unique_table()
    backend = backend_from_url(pg16_server.dsn, namespace=table)
    with pytest.raises(StoreNotFound, match="no anarchon store"):
        await backend.start(create=False)
    assert _tables_like(pg16_server.admin_dsn, table) == []
    try:
        await backend.start()  # a scheduler's start still creates the store
        await backend.close()
        await backend.start(create=False)  # and now it is found
        await backend.close()
        assert len(_tables_like(pg16_server.admin_dsn, table)) == 4
    finally:
        await drop_tables(pg16_server.admin_dsn, table)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_redis_start_without_create_finds_a_store_once_created(
    valkey8_server: EmbeddedRedis,
) -> None:
    prefix = "ro_" + uuid.uuid4().hex[:8]
    backend = backend_from_url(valkey8_server.url, namespace=prefix)
    with pytest.raises(StoreNotFound, match=prefix):
        await backend.start(create=False)
    try:
        await backend.start()
        await backend.close()
        await backend.start(create=False)
        await backend.close()
    finally:
        delete_prefix(valkey8_server.url, prefix)


# --- a closed pipe, the environment ---------------------------------------------------


def test_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """``anarchon history --json | head`` ends quietly, with exit 0."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        done = subprocess.run([ANARCHON, "history", "--json", "--url", "memory://"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_anarchon_url_replaces_the_flag(
    pg16_server: PgServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    table = unique_table()
    monkeypatch.setenv("ANARCHON_URL", f"{pg16_server.dsn}?table={table}")
    assert main(["status"]) == 3  # read from the variable: the table it names is missing
    assert repr(table) in capsys.readouterr().err
    assert main(["status", "--url", "memory://"]) == 0  # the flag wins over the variable
    capsys.readouterr()
    monkeypatch.setenv("ANARCHON_URL", "")
    assert main(["history"]) == 2
    assert "$ANARCHON_URL" in capsys.readouterr().err


def test_anarchon_url_serves_prune_serve_migrate_and_operations(
    pg16_server: PgServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every subcommand reads the store from ``$ANARCHON_URL``: each of these reaches the
    table the variable names, without --url."""
    table = unique_table()
    monkeypatch.setenv("ANARCHON_URL", f"{pg16_server.dsn}?table={table}")
    monkeypatch.delenv("ANARCHON_TOKEN", raising=False)
    try:
        for command in (["prune", "--older-than", "1d"], ["serve", "--port", str(_free_port())]):
            assert main(command) == EXIT_NO_STORE, command
            assert repr(table) in capsys.readouterr().err
        assert _tables_like(pg16_server.admin_dsn, table) == []
        assert main(["migrate"]) == 0
        assert repr(table) in capsys.readouterr().out
        assert len(_tables_like(pg16_server.admin_dsn, table)) == 4
        assert main(["pause", "report"]) == 2  # the store in the variable never saw it
        assert "'report'" in capsys.readouterr().err
        anyio.run(_seed_store, pg16_server.dsn, table)
        assert main(["pause", "report"]) == 0
        capsys.readouterr()

        async def paused() -> dict[str, str]:
            backend = backend_from_url(pg16_server.dsn, namespace=table)
            await backend.start()
            try:
                return await backend.paused()
            finally:
                await backend.close()

        assert list(anyio.run(paused)) == ["report"]
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_an_empty_anarchon_token_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ANARCHON_TOKEN=""`` is a mistake (a secret that did not arrive), not "no token"."""
    monkeypatch.setenv("ANARCHON_TOKEN", "  ")
    assert main(["serve", "--url", "memory://", "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "$ANARCHON_TOKEN" in err and "empty" in err


def test_a_port_of_more_digits_than_int_reads_is_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    """More than 4300 digits: int()'s ValueError made argparse say "invalid _port value"."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--url", "memory://", "--port", "9" * 5000])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "is not a port number from 1 to 65535" in err and "_port" not in err


# --- one validation of URL options ------------------------------------------------------


@pytest.mark.parametrize(("url", "named"), [
    ("postgresql://u:pw@127.0.0.1:1/db?prefix=x", ["'prefix'", "table", "sslmode"]),
    ("host=127.0.0.1 bogus=1", ["'bogus'", "table", "sslmode"]),
    ("redis://127.0.0.1:1/0?bogus=1", ["'bogus'", "prefix", "max_connections"]),
    ("redis://127.0.0.1:1/0?max_connections=-1", ["max_connections='-1'", "at least 1"]),
    ("postgresql://u@127.0.0.1:1/db?max_size=0", ["max_size='0'", "at least 1"]),
    ("postgres://u:pw@h:notaport/db", ["'notaport'", "1 to 65535"]),
    ("redis://h:99999/0", ["'99999'", "1 to 65535"]),
    ("redis://h:\u00b9\u00b2/0", ["'\u00b9\u00b2'", "1 to 65535"]),
    ("postgresql://u@127.0.0.1:1/db?min_size=5&max_size=2", ["min_size=5", "max_size=2"]),
])
def test_a_bad_url_option_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], url: str, named: list[str]
) -> None:
    assert main(["status", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pw" not in err.replace("***", "")
    for text in named:
        assert text in err, err


# --- serve ----------------------------------------------------------------------------


def test_serve_on_a_taken_port_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--url", "memory://", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"127.0.0.1:{port}" in err and "--port" in err


def test_serve_with_an_empty_token_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--url", "memory://", "--token", ""]) == 2
    err = capsys.readouterr().err
    assert "--token" in err and "None" not in err


def serving(*options: str,
            preexec: Callable[[], None] | None = None) -> subprocess.Popen[str]:
    """`anarchon serve` on a memory store and a free port, once uvicorn says it listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([ANARCHON, "serve", "--url", "memory://", "--port", str(port),
                               *options], stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    assert server.stderr is not None
    lines: list[str] = []
    for line in server.stderr:  # until uvicorn says it listens; bounded by the caller's wait
        lines.append(line)
        if "running on" in line:
            break
    assert lines and "running on" in lines[-1], lines
    return server


def _closed_by_server(conn: socket.socket) -> bytes:
    """What the server sent on ``conn`` until it closed it (failing after 10 s)."""
    received, deadline = b"", time.monotonic() + 10
    while time.monotonic() < deadline:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return received
        received += chunk
    pytest.fail(f"the server left the connection open; it sent {received!r}")


def test_serve_closes_slow_and_idle_connections() -> None:
    """uvicorn kept a connection that sent nothing, or a request a byte at a time (once
    a first response was sent), open for ever: a few slow clients held the process."""
    server = serving("--read-timeout", "0.3s", "--keep-alive", "0.3s")
    port = int(server.args[server.args.index("--port") + 1])
    request = b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        partial, silent, slow_next, idle = (
            socket.create_connection(("127.0.0.1", port)) for _ in range(4))
        partial.sendall(request[:-2])  # a head without its end
        for kept_alive in (slow_next, idle):
            kept_alive.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += kept_alive.recv(65536)
            head, body = answer.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(body) < length:  # the whole response: the server is done with it
                body += kept_alive.recv(65536)
            assert head.startswith(b"HTTP/1.1 200 ") and len(body) == length
        slow_next.sendall(b"G")  # a next request's first byte, and no more
        assert _closed_by_server(partial).startswith(b"HTTP/1.1 408 ")
        assert _closed_by_server(silent) == b""
        assert _closed_by_server(slow_next).startswith(b"HTTP/1.1 408 ")
        assert _closed_by_server(idle) == b""
        for conn in (partial, silent, slow_next, idle):
            conn.close()
    finally:
        server.terminate()
        server.wait(30)


def test_serve_answers_503_beyond_its_connections_then_serves_again() -> None:
    """A connection beyond --max-connections is answered 503 at once, unread; once the
    slow clients are gone (closed by the read timeout), requests are served again."""
    server = serving("--max-connections", "2", "--read-timeout", "0.3s")
    port = int(server.args[server.args.index("--port") + 1])
    try:
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        with socket.create_connection(("127.0.0.1", port)) as beyond:
            answer = _closed_by_server(beyond)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"at most 2 at a time" in answer
        for conn in slow:
            assert _closed_by_server(conn) == b""
            conn.close()
        assert httpx2.get(f"http://127.0.0.1:{port}/jobs").status_code == 200
    finally:
        server.terminate()
        server.wait(30)


def test_serve_stops_gracefully_on_sigterm_and_dies_of_it() -> None:
    """The documented 143 (128 + SIGTERM): a graceful shutdown, then the signal's exit."""
    server = serving()
    server.send_signal(signal.SIGTERM)
    rest = server.communicate(timeout=30)[1]
    assert server.returncode == -signal.SIGTERM, (server.returncode, rest)
    assert "Shutting down" in rest and "Traceback" not in rest


@pytest.mark.parametrize("background", [False, True])
def test_serve_stops_gracefully_on_sigint_and_exits_130(background: bool) -> None:
    """The documented 130 for SIGINT, also when started in the background by a shell,
    which ignores SIGINT in its children: uvicorn still stops on it, and exited 0."""
    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    server = serving(preexec=ignore_sigint if background else None)
    server.send_signal(signal.SIGINT)
    rest = server.communicate(timeout=30)[1]
    assert server.returncode == 130, (server.returncode, rest)
    assert "Shutting down" in rest and "Traceback" not in rest


@pytest.mark.parametrize("argv", [
    ["prune", "--url", "postgresql://u@127.0.0.1:1/x", "--table", "", "--older-than", "1d"],
    ["status", "--url", "redis://127.0.0.1:1/0", "--prefix", ""],
    ["history", "--url", "postgresql://u@127.0.0.1:1/x", "--namespace", ""],
])
def test_an_empty_store_name_is_a_usage_error_not_the_default_store(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """`prune --table "$T"` with T unset must not prune the default store."""
    assert main(argv) == 2
    assert "''" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["history", "--url", "memory://", "--limit", "99999999999999999999"], "--limit"),
    (["prune", "--url", "memory://", "--older-than", "999999999999d"], "--older-than"),
])
def test_a_count_or_duration_beyond_any_store_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    assert says in capsys.readouterr().err


def test_status_and_prune_of_a_job_the_store_never_saw_are_usage_errors(
    capsys: pytest.CaptureFixture[str], valkey8_server: EmbeddedRedis
) -> None:
    """A typo in --job read as "nothing to show" (status) or "deleted 0 ... from 1 job"
    (prune), both exit 0; the operations already refused it."""
    url, prefix = valkey8_server.url, f"typo{uuid.uuid4().hex[:8]}"
    run_job_once(url, "nightly", prefix=prefix)
    for argv in (["status", "--url", url, "--prefix", prefix, "--job", "nigthly"],
                 ["prune", "--url", url, "--prefix", prefix, "--job", "nigthly",
                  "--older-than", "1s"]):
        assert main(argv) == 2
        assert "never seen job 'nigthly'" in capsys.readouterr().err
    assert main(["status", "--url", url, "--prefix", prefix, "--job", "nightly"]) == 0
    assert "nightly" in capsys.readouterr().out
