"""The demos on a user's own store: a namespace of their own, nothing of the user's touched.

Each PostgreSQL test gets a database of its own on the embedded server, so the whole
catalog can be compared before and after the demo; each Redis test a database number no
other test uses, so the whole key space can.
"""

from __future__ import annotations

import io
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import psycopg
import pytest
import redis

from backends.embedded.redis import EmbeddedRedis
from lease_core.cli import main
from lease_core.demo import run_demo
from lease_core.demo.namespace import namespace_for
from tests.helpers import run_job_once
from tests.stores.postgres import PgServer

#: Every object of a database outside the system schemas: relations (tables, indexes,
#: sequences, views, TOAST tables), functions with their signatures, types, schemas.
CATALOG = """
SELECT 'relation', n.nspname, c.relname::text, c.relkind::text
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'function', n.nspname, p.oid::regprocedure::text, ''
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'type', n.nspname, t.typname::text, t.typtype::text
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'schema', nspname, '', '' FROM pg_namespace
ORDER BY 1, 2, 3, 4
"""

#: The user's own tables, named like the tables the demos created before they had a
#: namespace (``bank_*``, the store tables ``anarchon_bank`` and ``anarchon_demo``).
USER_TABLES = {
    "bank_accounts": "CREATE TABLE bank_accounts (id int PRIMARY KEY, balance_cents bigint)",
    "bank_statements": "CREATE TABLE bank_statements (note text)",
    "anarchon_bank": "CREATE TABLE anarchon_bank (note text)",
    "anarchon_demo": "CREATE TABLE anarchon_demo (note text)",
}
USER_ROWS = {
    "bank_accounts": "INSERT INTO bank_accounts VALUES (1, 4242)",
    "bank_statements": "INSERT INTO bank_statements VALUES ('my statement')",
    "anarchon_bank": "INSERT INTO anarchon_bank VALUES ('my bank')",
    "anarchon_demo": "INSERT INTO anarchon_demo VALUES ('my demo')",
}


@pytest.fixture
def database(pg16_server: PgServer) -> Iterator[str]:
    """A new, empty database on the embedded PostgreSQL; its superuser URL."""
    name = f"demo_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg16_server.admin_dsn.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def catalog(url: str) -> list[tuple[Any, ...]]:
    """Every object of the database outside the system schemas."""
    with psycopg.connect(url) as conn:
        return conn.execute(CATALOG).fetchall()


def user_data(url: str, tables: list[str] | None = None) -> dict[str, Any]:
    """The user's tables: their columns and rows."""
    found: dict[str, Any] = {}
    with psycopg.connect(url) as conn:
        for table in tables or list(USER_TABLES):
            columns = conn.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = %s ORDER BY ordinal_position", (table,)).fetchall()
            rows = conn.execute(f'SELECT * FROM "{table}" ORDER BY 1').fetchall()
            found[table] = (columns, rows)
    return found


def make_user_tables(url: str, tables: dict[str, str], rows: dict[str, str]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in [*tables.values(), *rows.values()]:
            conn.execute(statement)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lease_core.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def namespace_of(out: str) -> str:
    """The namespace the demo printed, checked to come before its timeline."""
    found = re.search(r"^Namespace: (anarchon_demo_[0-9a-f]{8}) ", out, re.MULTILINE)
    assert found, out
    assert out.index("Namespace:") < out.index("Timeline:"), out
    return found.group(1)


def objects_named(objects: list[tuple[Any, ...]], namespace: str) -> bool:
    """True when every object is the namespace's (or a TOAST table or array type of one)."""
    def ours(name: str) -> bool:
        name = name.split("(")[0].lstrip("_")
        return name == namespace or name.startswith(namespace + "_")

    return all(ours(row[2]) or row[1] == "pg_toast" for row in objects)


# --------------------------------------------------------------------------- PostgreSQL


def _signal_at(proc: subprocess.Popen[str], at: Callable[[str], bool],
               signum: int) -> tuple[str, str]:
    """Read the demo's output, send ``signum`` at each line ``at`` accepts, wait for its
    end (killed if it has not ended); its stdout and stderr."""
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if at(line):
                proc.send_signal(signum)
        proc.wait(timeout=60)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return "".join(lines), err


def test_bank_close_leaves_the_users_tables_and_nothing_of_its_own(database: str) -> None:
    """Also: a driver-qualified URL with pool options, as the backend accepts it (the
    demo's own statements went to psycopg as written, which refused both)."""
    make_user_tables(database, USER_TABLES, USER_ROWS)
    before, data = catalog(database), user_data(database)
    url = database.replace("postgresql://", "postgresql+pg8000://", 1) + "?max_size=4"
    done = run_cli("demo", "--workflow", "bank-close", "--url", url)
    assert user_data(database) == data
    assert catalog(database) == before
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: OK" in done.stdout
    namespace = namespace_of(done.stdout)
    assert f"Removed namespace {namespace}: 10 tables" in done.stdout, done.stdout


def test_bank_close_keep_keeps_its_namespace_and_says_how_to_remove_it(
    database: str, capsys: pytest.CaptureFixture[str],
) -> None:
    make_user_tables(database, {"bank_accounts": USER_TABLES["bank_accounts"]},
                     {"bank_accounts": USER_ROWS["bank_accounts"]})
    before, data = catalog(database), user_data(database, ["bank_accounts"])
    done = run_cli("demo", "--workflow", "bank-close", "--url", database, "--keep")
    assert done.returncode == 0, done.stdout + done.stderr
    namespace = namespace_of(done.stdout)
    kept = catalog(database)
    added = [row for row in kept if row not in before]
    assert set(before) <= set(kept)
    assert objects_named(added, namespace), added
    tables = {row[2] for row in added if row[3] == "r"}
    assert {namespace, *(f"{namespace}_{t}" for t in ("accounts", "opening", "snapshot",
                                                      "interest", "statements", "demo"))} <= tables
    with psycopg.connect(database) as conn:
        statements = conn.execute(f'SELECT count(*) FROM "{namespace}_statements"').fetchone()
    assert statements == (3000,)
    shown = shlex.quote(
        database.replace(database.split("//")[1].split("@")[0].split(":")[1], "***"))
    assert f"Kept namespace {namespace}" in done.stdout
    assert f"anarchon status --url {shown} --namespace {namespace}" in done.stdout
    assert f"anarchon demo --url {shown} --remove {namespace}" in done.stdout
    assert "Removed namespace" not in done.stdout
    capsys.readouterr()
    assert main(["status", "--url", database, "--namespace", namespace]) == 0
    assert "bank-close/interest  completed" in capsys.readouterr().out
    assert main(["demo", "--url", database, "--remove", namespace]) == 0
    assert f"removed namespace {namespace}: 10 tables" in capsys.readouterr().out
    assert catalog(database) == before
    assert user_data(database, ["bank_accounts"]) == data


def test_bank_close_interrupted_removes_its_namespace(database: str) -> None:
    """Ctrl-C while the interest step runs: the workers end, then the namespace goes."""
    make_user_tables(database, USER_TABLES, USER_ROWS)
    before, data = catalog(database), user_data(database)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lease_core.cli", "demo", "--workflow", "bank-close",
         "--url", database], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A child started in the background may inherit SIGINT ignored; Ctrl-C's default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, err = _signal_at(proc, lambda line: "*** SIGKILL" in line, signal.SIGINT)
    assert proc.returncode == 130, out + err
    assert "anarchon demo: interrupted" in err
    assert "VERDICT" not in out
    namespace = namespace_of(out)
    assert f"Removed namespace {namespace}" in out, out
    assert catalog(database) == before
    assert user_data(database) == data
    # The workers are gone: no session of theirs is left on the database.
    name = database.rsplit("/", 1)[1]
    deadline = time.monotonic() + 10
    with psycopg.connect(database, autocommit=True) as conn:
        while True:
            others = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                  "AND pid <> pg_backend_pid()", (name,)).fetchone()
            if others == (0,) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert others == (0,)


def test_fleet_demo_on_postgres_leaves_nothing(database: str) -> None:
    """`anarchon demo --url URL`: three OS processes, SIGKILL, SIGTERM, a verdict."""
    make_user_tables(database, USER_TABLES, USER_ROWS)
    before, data = catalog(database), user_data(database)
    out = io.StringIO()
    ok = run_demo("postgres", url=database, out=out)
    assert user_data(database) == data
    assert catalog(database) == before
    assert ok, out.getvalue()
    text = out.getvalue()
    assert "attempt 2 (takeover)" in text and "attempt 2 (hand-over)" in text
    assert database.split(":")[2].split("@")[0] not in text  # the password
    namespace = namespace_of(text)
    assert f"Removed namespace {namespace}: 5 tables" in text, text


@pytest.mark.parametrize("taken", ["mine", "mine_accounts", "mine_meta", "mine_demo"])
@pytest.mark.parametrize("workflow", [[], ["--workflow", "bank-close"]])
def test_a_namespace_in_use_is_refused_and_nothing_changes(
    database: str, capsys: pytest.CaptureFixture[str], taken: str, workflow: list[str],
) -> None:
    """`--namespace mine` where a table of the names the demo would create exists."""
    make_user_tables(database, {taken: f"CREATE TABLE {taken} (note text)"},
                     {taken: f"INSERT INTO {taken} VALUES ('mine')"})
    before, data = catalog(database), user_data(database, [taken])
    assert main(["demo", *workflow, "--url", database, "--namespace", "mine"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "namespace mine is in use" in err and f"table {taken}" in err
    assert "changed nothing" in err
    assert catalog(database) == before
    assert user_data(database, [taken]) == data


def test_remove_refuses_a_namespace_a_demo_did_not_make(
    database: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """`--remove bank` would otherwise drop the user's bank_accounts, even beside a table
    of the user's named like the marker (``bank_demo``, with the marker's columns)."""
    tables = {**USER_TABLES, "bank_demo": "CREATE TABLE bank_demo (namespace text, demo text)"}
    rows = {**USER_ROWS, "bank_demo": "INSERT INTO bank_demo VALUES ('bank', 'bank-close')"}
    make_user_tables(database, tables, rows)
    before, data = catalog(database), user_data(database, list(tables))
    assert main(["demo", "--url", database, "--remove", "bank"]) == 2
    err = capsys.readouterr().err
    assert "no demo marker" in err and "bank_accounts" in err and "nothing was removed" in err
    assert main(["demo", "--url", database, "--remove", "anarchon_demo"]) == 2
    assert catalog(database) == before
    assert user_data(database, list(tables)) == data


def test_a_store_of_yours_later_in_the_search_path_is_refused(
    database: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """A store finds its tables where the search_path does: a namespace named like a
    store of yours in ``public``, with a schema of the connection's own first in the path
    (``"$user", public``), would have run the demo in your store. It is refused."""
    assert main(["migrate", "--url", database, "--table", "yours"]) == 0
    make_user_tables(database, {"own": "CREATE SCHEMA own"}, {})
    before = catalog(database)
    url = f"{database}?options=-csearch_path%3Down,public"
    assert main(["demo", "--url", url, "--namespace", "yours"]) == 2
    err = capsys.readouterr().err
    assert "namespace yours is in use" in err and "table public.yours" in err, err
    assert catalog(database) == before


def test_a_url_naming_a_table_is_refused(database: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    make_user_tables(database, USER_TABLES, USER_ROWS)
    before, data = catalog(database), user_data(database)
    assert main(["demo", "--workflow", "bank-close", "--url",
                 f"{database}?table=bank_accounts"]) == 2
    assert "must not name them (table=bank_accounts)" in capsys.readouterr().err
    assert main(["demo", "--workflow", "bank-close", "--keep"]) == 2
    assert "--keep needs --url" in capsys.readouterr().err
    assert catalog(database) == before
    assert user_data(database) == data


# --------------------------------------------------------------------------- Redis


@pytest.fixture
def redis_url(valkey8_server: EmbeddedRedis) -> Iterator[str]:
    """Database 7 of the Valkey server, which no other test uses, emptied afterwards."""
    url = valkey8_server.url.rsplit("/", 1)[0] + "/7"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
        yield url
    finally:
        client.flushdb()
        client.close()


def keys(url: str) -> dict[bytes, Any]:
    """Every key of the database with its type and value (hashes and strings)."""
    client = redis.Redis.from_url(url)
    try:
        found: dict[bytes, Any] = {}
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            found[key] = (kind, client.hgetall(key) if kind == b"hash"
                          else client.get(key) if kind == b"string" else None)
        return found
    finally:
        client.close()


def seed_user_keys(url: str) -> None:
    """Keys of the user's, in the key layout of the old demo's fixed prefix and of ``mine``."""
    client = redis.Redis.from_url(url)
    try:
        client.hset("{anarchon_demo}:meta", "owner", "me")
        client.set("{anarchon_demo/report}:job", "mine")
        client.set("{mine}:x", "mine")
        client.set("{mine}:demo", '{"demo": "fleet", "namespace": "not mine"}')
        client.hset("{anarchon_demo}:demo", "demo", "fleet")
    finally:
        client.close()


def test_fleet_demo_on_redis_leaves_nothing(redis_url: str) -> None:
    """`anarchon demo --backend redis --url URL`: the same fleet on Redis."""
    seed_user_keys(redis_url)
    before = keys(redis_url)
    out = io.StringIO()
    ok = run_demo("redis", url=redis_url, out=out)
    assert keys(redis_url) == before
    assert ok, out.getvalue()
    text = out.getvalue()
    assert "attempt 2 (takeover)" in text
    namespace = namespace_of(text)
    assert re.search(rf"Removed namespace {namespace}: \d+ keys", text), text


def test_fleet_demo_on_redis_keep(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    seed_user_keys(redis_url)
    before = keys(redis_url)
    assert main(["demo", "--url", redis_url, "--keep"]) == 0
    out = capsys.readouterr().out
    namespace = namespace_of(out)
    kept = keys(redis_url)
    added = set(kept) - set(before)
    assert {key: kept[key] for key in before} == before
    assert f"{{{namespace}}}:demo".encode() in added and f"{{{namespace}}}:meta".encode() in added
    assert all(key.startswith((f"{{{namespace}}}:".encode(), f"{{{namespace}/".encode()))
               for key in added), added
    assert f"Kept namespace {namespace}" in out
    assert f"anarchon demo --url {redis_url} --remove {namespace}" in out
    assert main(["history", "--url", redis_url, "--namespace", namespace]) == 0
    assert "export" in capsys.readouterr().out
    assert main(["demo", "--url", redis_url, "--remove", namespace]) == 0
    assert keys(redis_url) == before


def test_redis_namespace_in_use_is_refused(redis_url: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    seed_user_keys(redis_url)
    before = keys(redis_url)
    assert main(["demo", "--url", redis_url, "--namespace", "mine"]) == 2
    err = capsys.readouterr().err
    assert "namespace mine is in use" in err and "{mine}:x" in err, err
    assert main(["demo", "--url", redis_url, "--remove", "mine"]) == 2
    assert "no demo marker" in capsys.readouterr().err
    assert main(["demo", "--url", redis_url, "--remove", "anarchon_demo"]) == 2
    assert keys(redis_url) == before


def test_the_demo_stopped_by_sigterm_removes_its_namespace_and_exits_143(
        redis_url: str) -> None:
    """`kill PID` (or a supervisor's stop) killed the demo at once: no cleanup, its
    worker processes left running on the user's store, its namespace left behind."""
    before = keys(redis_url)
    proc = subprocess.Popen([sys.executable, "-m", "lease_core.cli", "demo", "--url",
                             redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    # at "Timeline:" the namespace is claimed and the workers are starting
    out, err = _signal_at(proc, lambda line: line.startswith("Timeline:"), signal.SIGTERM)
    assert proc.returncode == -signal.SIGTERM, out + err  # 143 in a shell, as serve's
    assert err == "anarchon demo: terminated (SIGTERM)\n", err
    assert f"Removed namespace {namespace_of(out)}" in out, out
    assert keys(redis_url) == before


def test_a_demo_worker_ends_when_its_demo_is_gone(redis_url: str) -> None:
    """A demo SIGKILLed left its workers running on the user's store for ever: a worker
    now stops once the process that started it has ended (here a shell, killed)."""
    import os

    parent = subprocess.Popen(
        ["bash", "-c", '"$0" -m lease_core.demo worker - A orphaned & echo $!; wait',
         sys.executable], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "ANARCHON_DEMO_URL": redis_url})
    assert parent.stdout is not None
    with parent.stdout:
        worker = int(parent.stdout.readline())
        assert parent.stdout.readline() == "started\n"
        parent.kill()
        parent.wait()

    def running() -> bool:
        try:  # (a zombie no one has reaped yet has ended)
            with open(f"/proc/{worker}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if running():  # pragma: no cover - the failure's own cleanup
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived the process that started it")


# --------------------------------------------------------------------------- removal edges


def test_remove_leaves_a_store_of_yours_named_with_the_namespace_as_prefix(
    database: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """A demo kept under namespace ``anarchon``, then the default store ``anarchon_runs``
    made beside it: removing the demo drops the demo's store, not the user's."""
    namespace_for(database, "anarchon").claim("fleet")  # as the fleet demo does, kept
    run_job_once(database, "report", namespace="anarchon")
    run_job_once(database, "nightly")  # the default store: anarchon_runs
    before = catalog(database)
    mine = [row for row in before if "anarchon_runs" in row[2]]
    assert len(mine) >= 5, mine
    assert main(["demo", "--url", database, "--remove", "anarchon"]) == 0
    out = capsys.readouterr().out
    assert "removed namespace anarchon:" in out
    assert "left anarchon_runs" in out and "which no demo makes (not removed)" in out, out
    after = catalog(database)
    assert [row for row in after if "anarchon_runs" in row[2]] == mine
    assert not any(row[2] in ("anarchon", "anarchon_demo", "anarchon_meta") for row in after)
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM anarchon_runs_attempts "
                           "WHERE job = 'nightly'").fetchone()
    assert row is not None and row[0] >= 1


def test_remove_leaves_your_tables_named_like_the_demo_store_s_functions_and_indexes(
    database: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """A demo kept under namespace ``jobs``, then tables of yours ``jobs_open`` and
    ``jobs_claim`` made beside it: names of the demo store's index (an older release's)
    and function, never of a table of its. Removing the demo dropped them with its own."""
    namespace_for(database, "jobs").claim("fleet")  # as the fleet demo does, kept
    run_job_once(database, "report", namespace="jobs")
    mine = {"jobs_open": "CREATE TABLE jobs_open (id int PRIMARY KEY, note text)",
            "jobs_claim": "CREATE TABLE jobs_claim (id int PRIMARY KEY, note text)"}
    make_user_tables(database, mine, {name: f"INSERT INTO {name} VALUES (1, 'mine')"
                                      for name in mine})
    before = user_data(database, list(mine))
    assert main(["demo", "--url", database, "--remove", "jobs"]) == 0
    out = capsys.readouterr().out
    assert "removed namespace jobs:" in out and "which no demo makes (not removed)" in out
    assert "jobs_open" in out and "jobs_claim" in out, out
    assert user_data(database, list(mine)) == before
    assert not any(row[2] in ("jobs", "jobs_demo", "jobs_meta", "jobs_claim_v4(text,bigint,"
                                                                 "text,text,bigint,text,"
                                                                 "boolean,bigint,boolean)")
                   for row in catalog(database))


def test_remove_of_a_fleet_demo_leaves_your_table_named_like_a_bank_close_table(
    database: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """A fleet demo kept under namespace ``bank``, then a table of yours
    ``bank_accounts``: a name the bank-close demo gives a table of its, never the fleet
    demo. Removing the fleet demo dropped it."""
    namespace_for(database, "bank").claim("fleet")  # as the fleet demo does, kept
    run_job_once(database, "report", namespace="bank")
    mine = {"bank_accounts": "CREATE TABLE bank_accounts (id int PRIMARY KEY, cents int)"}
    make_user_tables(database, mine, {"bank_accounts": "INSERT INTO bank_accounts "
                                                       "VALUES (1, 4242)"})
    before = user_data(database, list(mine))
    assert main(["demo", "--url", database, "--remove", "bank"]) == 0
    out = capsys.readouterr().out
    assert "removed namespace bank:" in out and "left bank_accounts" in out, out
    assert user_data(database, list(mine)) == before


def test_remove_on_redis_leaves_keys_of_yours_in_the_namespace_s_hash_tag(
    redis_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """A demo kept under namespace ``tagged``, then keys of yours with its hash tag but in
    no shape a store or a demo writes (``{tagged}:queue``): removing the demo deleted
    every key of the pattern ``{tagged}*``, yours too."""
    namespace_for(redis_url, "tagged").claim("fleet")  # as the fleet demo does, kept
    run_job_once(redis_url, "report", namespace="tagged")
    client = redis.Redis.from_url(redis_url)
    try:
        client.set("{tagged}:queue", "mine")
        client.set("{tagged}", "mine")
        client.hset("{tagged/cart}", "item", "mine")
        client.set("{tagged/report}:mine", "mine")
        mine = {key: value for key, value in keys(redis_url).items()
                if key in (b"{tagged}:queue", b"{tagged}", b"{tagged/cart}",
                           b"{tagged/report}:mine")}
        assert len(mine) == 4
        assert client.exists("{tagged}:meta", "{tagged/report}:job") == 2
        assert main(["demo", "--url", redis_url, "--remove", "tagged"]) == 0
        out = capsys.readouterr().out
        assert "removed namespace tagged:" in out and "left 4 keys" in out, out
        assert keys(redis_url) == mine
    finally:
        client.close()


def test_remove_refuses_a_demo_namespace_a_scheduler_of_yours_uses(
    database: str, capsys: pytest.CaptureFixture[str],
) -> None:
    namespace_for(database, "shared").claim("fleet")  # as the fleet demo does, kept
    run_job_once(database, "report", namespace="shared")
    run_job_once(database, "nightly", namespace="shared")
    before = catalog(database)
    assert main(["demo", "--url", database, "--remove", "shared"]) == 2
    err = capsys.readouterr().err
    assert "jobs no demo declares (nightly)" in err and "nothing was removed" in err, err
    assert catalog(database) == before


def test_remove_on_redis_refuses_a_demo_namespace_a_scheduler_of_yours_uses(
    redis_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    namespace_for(redis_url, "shared").claim("fleet")  # as the fleet demo does, kept
    run_job_once(redis_url, "report", namespace="shared")
    run_job_once(redis_url, "nightly", namespace="shared")
    before = keys(redis_url)
    assert main(["demo", "--url", redis_url, "--remove", "shared"]) == 2
    err = capsys.readouterr().err
    assert "jobs no demo declares (nightly)" in err and "nothing was removed" in err, err
    assert keys(redis_url) == before


@pytest.mark.anyio
async def test_demo_workers_get_the_url_without_showing_its_password_in_ps(
    database: str,
) -> None:
    import anyio

    from lease_core.demo.fleet import ProcessFleet

    password = psycopg.conninfo.conninfo_to_dict(database)["password"]
    assert isinstance(password, str) and password
    ns = namespace_for(database, "psdemo")
    ns.claim("fleet")
    fleet = ProcessFleet(database, ns.name)
    try:
        await fleet.start("A")  # returns once the worker's scheduler has started
        (proc,) = fleet.procs.values()
        cmdline = (await anyio.Path(f"/proc/{proc.pid}/cmdline").read_bytes()).decode()
        assert "psdemo" in cmdline and password not in cmdline, cmdline
    finally:
        fleet.close()


def test_bank_close_takes_a_key_value_dsn(capsys: pytest.CaptureFixture[str]) -> None:
    """It was refused as "runs on PostgreSQL only"; here it gets as far as connecting."""
    code = main(["demo", "--workflow", "bank-close", "--url",
                 "host=127.0.0.1 port=1 dbname=x user=u connect_timeout=2"])
    err = capsys.readouterr().err
    assert code == 1 and "could not connect to 'host=127.0.0.1 port=1" in err, (code, err)


def test_a_backend_the_url_contradicts_is_refused(
    database: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--backend memory` with $ANARCHON_URL set ran the fleet demo on the user's store
    (its tables created there), and `--backend redis --url postgresql://...` on PostgreSQL."""
    before = catalog(database)
    monkeypatch.setenv("ANARCHON_URL", database)
    assert main(["demo", "--backend", "memory"]) == 2
    err = capsys.readouterr().err
    assert "--backend memory contradicts $ANARCHON_URL" in err and "unset" in err, err
    assert database.split(":")[2].split("@")[0] not in err  # the password
    monkeypatch.delenv("ANARCHON_URL")
    assert main(["demo", "--backend", "redis", "--url", database]) == 2
    assert "--backend redis contradicts --url" in capsys.readouterr().err
    assert catalog(database) == before
    # --remove ignored --backend: `--backend redis --remove NS` removed NS on PostgreSQL.
    namespace_for(database, "kept").claim("fleet")
    kept = catalog(database)
    assert main(["demo", "--backend", "redis", "--url", database, "--remove", "kept"]) == 2
    assert "leave out --backend" in capsys.readouterr().err
    assert catalog(database) == kept
    assert main(["demo", "--url", database, "--remove", "kept"]) == 0
    assert catalog(database) == before


def test_the_demo_gives_up_on_a_postgres_server_that_never_answers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The demo's own connection (to claim or remove its namespace) had no connect_timeout,
    and libpq's default is to wait for ever: `anarchon demo --url` and `--remove` on a
    server that accepts and never answers hung without bound (the other commands give up
    after 10 s). Its wait is cut to libpq's least, 2 s, here."""
    import socket
    import threading

    from lease_core.demo import namespace

    monkeypatch.setattr(namespace, "CONNECT_TIMEOUT", 1)
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    with socket.socket() as silent:  # the kernel accepts; nothing ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"postgresql://u:pw@127.0.0.1:{silent.getsockname()[1]}/db?sslmode=disable"
        codes: list[int] = []  # (--remove connects the same way)
        waiting = threading.Thread(target=lambda: codes.append(main(
            ["demo", "--url", url, "--namespace", "x"])), daemon=True)
        waiting.start()
        waiting.join(60)
        assert codes == [1]
        assert "could not connect" in capsys.readouterr().err


def test_the_psql_command_a_kept_namespace_prints_is_one_psql_reads() -> None:
    """psql refused the URL as given to the demo: a driver in its scheme, or anarchon's
    own parameters in its query ("invalid URI query parameter")."""
    for url in ("postgresql+pg8000://app:***@db/app?min_size=2&sslmode=require",
                "host=db user=app password=*** max_size=3 sslmode=require"):
        psql = namespace_for(url, "kept").look_commands(url)[2]
        assert psql.startswith("psql ") and "pg8000" not in psql and "_size" not in psql
        assert "sslmode=require" in psql, psql


def test_a_kept_namespace_says_how_to_remove_it_when_the_demo_fails(redis_url: str) -> None:
    """`--keep` and a demo that fails (or is stopped): the namespace was kept without a
    word of it, nor of how to remove it."""
    from lease_core.demo.namespace import claimed

    out = io.StringIO()
    with pytest.raises(RuntimeError), claimed(namespace_for(redis_url, "failed"), "fleet",
                                              out, keep=True, shown_url=redis_url):
        raise RuntimeError("the demo failed")
    assert f"anarchon demo --url {redis_url} --remove failed" in out.getvalue(), out.getvalue()
    assert main(["demo", "--url", redis_url, "--remove", "failed"]) == 0


@pytest.mark.parametrize("server", ["database", "redis_url"])
def test_remove_refuses_a_namespace_schedulers_are_running_on(
    server: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str],
) -> None:
    """`--remove` of a kept demo's namespace while that demo still ran dropped the store
    under its workers (which then wrote keys again, left behind): refused while the
    namespace's fleet has a live member, removed once it left."""
    from lease_core import backend_from_url

    url = request.getfixturevalue(server)
    namespace_for(url, "busy").claim("fleet")  # as the fleet demo does, kept
    backend = backend_from_url(url, namespace="busy")

    async def member(leave: bool) -> None:
        await backend.start()
        try:
            await (backend.leave("worker-2") if leave else backend.members("worker-2", 60_000))
        finally:
            await backend.close()

    anyio.run(member, False)
    assert main(["demo", "--url", url, "--remove", "busy"]) == 2
    err = capsys.readouterr().err
    assert "in use: schedulers are running on it now (worker-2)" in err, err
    assert "nothing was removed" in err
    anyio.run(member, True)  # the worker stopped: its membership ended
    assert main(["demo", "--url", url, "--remove", "busy"]) == 0
    assert "removed namespace busy" in capsys.readouterr().out
