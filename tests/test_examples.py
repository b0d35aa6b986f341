"""The framework recipes in docs/examples/, each run against a real PostgreSQL store.

Every test gets a fresh schema (the examples' default table ``anarchon_runs`` is created in
it, through the DSN's ``search_path``), runs the example with a one-second job, waits with
a deadline until the store records a completed run, shuts the example down, and checks
that nothing is left running: every attempt completed or was handed over.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from lease_core import Attempt, Outcome, SyncScheduler, backend_from_url
from tests.stores.postgres import PgServer

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"
FINISHED = {Outcome.COMPLETED, Outcome.HANDED_OVER, Outcome.SKIPPED}


def wait_until(predicate: Callable[[], Any], *, timeout: float = 20.0, what: str) -> Any:
    """Poll ``predicate`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def store_url(pg16_server: PgServer) -> Iterator[str]:
    """A DSN whose search_path is a fresh schema, dropped after the test."""
    schema = f"ex_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA {}").format(psycopg.sql.Identifier(schema)))
    try:
        yield f"{pg16_server.dsn}?options={quote(f'-csearch_path={schema}')}"
    finally:
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP SCHEMA {} CASCADE").format(
                psycopg.sql.Identifier(schema)))


@pytest.fixture
def example_env(store_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment an example reads: its store and a one-second job."""
    env = {"ANARCHON_URL": store_url, "REPORT_INTERVAL": "1s"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def history(url: str) -> list[Attempt]:
    """The store's attempts of the examples' job, read by another scheduler."""
    return SyncScheduler(backend_from_url(url)).history("refresh-report")


def completed(url: str) -> list[Attempt]:
    """The attempts that completed."""
    return [a for a in history(url) if a.outcome == Outcome.COMPLETED]


def assert_nothing_left_running(url: str) -> None:
    attempts = history(url)
    assert attempts
    assert all(a.outcome in FINISHED for a in attempts), attempts


def load(path: Path) -> ModuleType:
    """Import an example file as a fresh module."""
    spec = importlib.util.spec_from_file_location(f"example_{uuid.uuid4().hex[:8]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fastapi_lifespan(example_env: dict[str, str]) -> None:
    from fastapi.testclient import TestClient

    module = load(EXAMPLES / "fastapi_app.py")
    with TestClient(module.app) as client:
        runs = wait_until(
            lambda: [r for r in client.get("/runs").json() if r["outcome"] == "completed"],
            what="a completed run through /runs",
        )
        assert runs[0]["job"] == "refresh-report"
        assert runs[0]["instance"] == module.scheduler.instance_id
    assert not module.scheduler.running
    assert_nothing_left_running(example_env["ANARCHON_URL"])


def test_fastapi_under_uvicorn_logs_to_the_console_with_iso_times(
    example_env: dict[str, str],
) -> None:
    """As the Flask recipe's: served by uvicorn, the handler's log line reaches the
    console (uvicorn configures only its own loggers) and /runs shows ISO times."""
    from backends.embedded.postgres import find_free_port

    port = find_free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(EXAMPLES), "fastapi_app:app",
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        runs = wait_until(lambda: _completed_runs(port), timeout=60,
                          what="a completed run through /runs")
        scheduled = datetime.fromisoformat(runs[0]["scheduled_at"])  # ISO, not epoch ms
        assert scheduled.tzinfo is not None and isinstance(runs[0]["slot"], int)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "INFO anarchon" in err and "refreshing the report due at 20" in err, err[-2000:]


def test_flask_app_factory(example_env: dict[str, str]) -> None:
    module = load(EXAMPLES / "flask_app.py")
    app = module.create_app({"TESTING": True})
    scheduler: SyncScheduler = app.extensions["anarchon"]
    try:
        assert scheduler.started
        client = app.test_client()
        runs = wait_until(
            lambda: [r for r in client.get("/runs").json if r["outcome"] == "completed"],
            what="a completed run through /runs",
        )
        assert runs[0]["instance"] == scheduler.instance_id
    finally:
        scheduler.stop()
    assert not scheduler.started
    assert_nothing_left_running(example_env["ANARCHON_URL"])


def test_flask_debug_reloader_starts_one_scheduler(example_env: dict[str, str]) -> None:
    """``flask run --debug``: the reloader's watcher process starts no scheduler."""
    import anyio

    from backends.embedded.postgres import find_free_port

    port = find_free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", str(EXAMPLES / "flask_app.py"), "run",
         "--debug", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        runs = wait_until(lambda: _completed_runs(port), timeout=60,
                          what="a completed run through /runs")
        datetime.fromisoformat(runs[0]["scheduled_at"])  # ISO times, not epoch ms

        async def members() -> list[str]:
            backend = backend_from_url(example_env["ANARCHON_URL"])
            await backend.start()
            try:
                found = await backend.members("probe", 60_000)
            finally:
                await backend.close()
            assert found is not None
            # a member is "<instance id>#<its group>" (the digest of its job names)
            return [m.rpartition("#")[0] for m in found if m != "probe"]

        # the watcher and the server both load the app; only the server's scheduler is
        # a member of the fleet (each scheduler joins at its start)
        assert anyio.run(members) == [runs[0]["instance"]]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "anarchon" in err and "refreshing the report due at 20" in err, err[-2000:]


_WSGI = ("from wsgiref.simple_server import make_server; from flask_app import create_app; "
         "make_server('127.0.0.1', {port}, create_app()).serve_forever()")
_APP_RUN = ("from flask_app import create_app; "
            "create_app().run(port={port}, debug=True, use_reloader=False)")


@pytest.mark.parametrize(("how", "env"), [
    (["-m", "flask", "--app", "flask_app", "run", "--debug", "--no-reload"], {}),
    (["-m", "flask", "--app", "flask_app", "run", "--debug"], {"FLASK_RUN_RELOAD": "false"}),
    (["-c", _APP_RUN], {}),
    (["-c", _WSGI], {"FLASK_DEBUG": "1"}),  # as gunicorn serves it: no `flask run`
], ids=["no-reload", "FLASK_RUN_RELOAD=false", "use_reloader=False", "wsgi-FLASK_DEBUG=1"])
def test_flask_debug_without_the_reloader_starts_the_scheduler(
    example_env: dict[str, str], how: list[str], env: dict[str, str]
) -> None:
    """Debug without the werkzeug reloader is one process: it starts the scheduler (the
    watcher check applies only when the reloader is in use)."""
    from backends.embedded.postgres import find_free_port

    port = find_free_port()
    args = [arg.format(port=port) for arg in how]
    if "flask" in args:
        args += ["--port", str(port)]
    proc = subprocess.Popen([sys.executable, *args], cwd=EXAMPLES, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        runs = wait_until(lambda: _completed_runs(port, proc), timeout=60,
                          what="a completed run through /runs")
        assert runs[0]["job"] == "refresh-report"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)


def _completed_runs(port: int, proc: subprocess.Popen[str] | None = None
                    ) -> list[dict[str, Any]]:
    """The completed runs an example app lists at ``/runs`` (none while it is not up);
    with ``proc``, fail at once when the app's process has exited."""
    if proc is not None and proc.poll() is not None:
        pytest.fail(f"the server exited: {proc.communicate()[1][-2000:]}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/runs", timeout=5) as r:
            rows: list[dict[str, Any]] = json.load(r)
    except OSError:
        return []
    return [row for row in rows if row["outcome"] == "completed"]


def _terminate(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    return out


def _start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(args, cwd=cwd, env={**os.environ, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_django_management_command(example_env: dict[str, str]) -> None:
    project = EXAMPLES / "django_app"
    url = example_env["ANARCHON_URL"]
    proc = _start([sys.executable, "manage.py", "run_scheduler"], project, example_env)
    try:
        run = wait_until(lambda: completed(url), what="a completed run in the store")[0]
        # The project's view reads the same store through Django's test client.
        view = textwrap.dedent("""
            import django, json
            django.setup()
            from django.test import Client
            response = Client().get("/runs/")
            assert response.status_code == 200, response
            print(json.dumps(response.json()))
        """)
        result = subprocess.run(
            [sys.executable, "-c", view], cwd=project, capture_output=True, text=True,
            env={**os.environ, **example_env, "DJANGO_SETTINGS_MODULE": "settings"},
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        runs = json.loads(result.stdout)["runs"]
        assert {"job": run.job, "scheduled_at": run.scheduled_at.isoformat(),
                "slot": run.slot, "instance": run.instance_id, "outcome": "completed"} in runs
    finally:
        out = _terminate(proc)
    assert "started" in out and "stopped" in out
    assert_nothing_left_running(url)


def test_asyncio_service(example_env: dict[str, str]) -> None:
    url = example_env["ANARCHON_URL"]
    proc = _start([sys.executable, "asyncio_service.py"], EXAMPLES, example_env)
    try:
        wait_until(lambda: completed(url), what="a completed run in the store")
    finally:
        out = _terminate(proc)
    assert "started" in out and out.strip().endswith("stopped")
    assert_nothing_left_running(url)
