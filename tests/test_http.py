"""The status API (lease_core.http) through Starlette's test client, on real stores.

Each store's backend is made unstarted, so the application's lifespan starts it on the test
client's event loop (asyncio or trio); the runs are seeded on that loop too.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

from backends.memory import MemoryBackend
from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core.abc import Backend, ClaimRequest, ClaimStatus, Lease, Outcome
from lease_core.cli import main
from lease_core.errors import ConfigurationError
from lease_core.http import create_app
from lease_core.operations import Operation, OperationKind
from lease_core.scheduler import Scheduler
from tests.helpers import wait_for
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix

SLOT = 1_764_460_800_000  # 2025-11-30T00:00:00Z
NEXT = SLOT + 86_400_000  # the day after
LEASE = 60_000
STEP_FIELDS = {"name", "job", "status", "store_status", "attempt", "instance_id", "started_at",
               "finished_at", "heartbeat_at", "lease_expires_at", "retry_at"}

STORES = [
    pytest.param(("memory", "asyncio"), id="memory-asyncio"),
    pytest.param(("memory", "trio"), id="memory-trio"),
    pytest.param(("pg16-psycopg", "asyncio"), id="pg16-psycopg-asyncio"),
    pytest.param(("pg16-pg8000", "trio"), id="pg16-pg8000-trio"),
    pytest.param(("redis62", "asyncio"), id="redis62-asyncio"),
    pytest.param(("redis62", "trio"), id="redis62-trio"),
]


def _token() -> str:
    return uuid.uuid4().hex


def _claim(job: str, slot: int, instance: str, lease_ms: int = LEASE,
           max_attempts: int | None = None) -> ClaimRequest:
    return ClaimRequest(job, slot, instance, _token(), lease_ms, overlap_skip=False,
                        max_attempts=max_attempts)


async def _complete(backend: Backend, job: str, slot: int, instance: str) -> None:
    request = _claim(job, slot, instance)
    assert (await backend.claim(request)).status is ClaimStatus.WON
    assert await backend.finish(Lease(job, slot, request.token, LEASE), Outcome.COMPLETED)
    # What comes next happens later on the store's clock, as a workflow's next step does.
    finished = await backend.now_ms()

    async def later() -> bool:
        return await backend.now_ms() > finished

    await wait_for(later, interval=0.001, what="the store's clock to move on")


async def seed(backend: Backend) -> None:
    """A workflow run that failed (a step escalated), one running, and a plain job."""
    await backend.register_workflows({"close": ["snapshot", "interest", "publish"]})
    # close@SLOT: snapshot completed; interest's only allowed attempt let its lease run out
    # (escalated); publish never ran.
    await _complete(backend, "close/snapshot", SLOT, "a")
    first = _claim("close/interest", SLOT, "a", lease_ms=1, max_attempts=1)
    assert (await backend.claim(first)).status is ClaimStatus.WON

    async def escalated() -> bool:
        again = _claim("close/interest", SLOT, "b", max_attempts=1)
        return (await backend.claim(again)).status is ClaimStatus.ESCALATED

    await wait_for(escalated, interval=0.005, what="the expired lease to escalate")
    # close@NEXT: snapshot completed, interest held by b, publish not started.
    await _complete(backend, "close/snapshot", NEXT, "a")
    assert (await backend.claim(_claim("close/interest", NEXT, "b"))).status is ClaimStatus.WON
    # export@SLOT: handed over by a, completed by b; export@NEXT: handed over, unclaimed.
    for slot in (SLOT, NEXT):
        held = _claim("export", slot, "a")
        await backend.claim(held)
        assert await backend.hand_over([Lease("export", slot, held.token, LEASE)])
    await _complete(backend, "export", SLOT, "b")


@pytest.fixture(params=STORES)
def backend_and_loop(request: pytest.FixtureRequest) -> Iterator[tuple[Backend, str]]:
    """An unstarted backend on a fresh table or prefix of a real store, and an event loop."""
    kind, loop = request.param
    if kind == "memory":
        yield MemoryBackend(), loop
    elif kind.startswith("pg16"):
        server = request.getfixturevalue("pg16_server")
        table = unique_table()
        dsn = server.dsn
        if kind == "pg16-pg8000":
            dsn = dsn.replace("postgresql://", "postgresql+pg8000://", 1)
        try:
            yield PostgresBackend(dsn, table=table), loop
        finally:
            anyio.run(drop_tables, server.admin_dsn, table)
    else:
        url = request.getfixturevalue("redis62_server").url
        prefix = f"anarchon_t_{uuid.uuid4().hex[:12]}"
        try:
            yield RedisBackend(url, prefix=prefix), loop
        finally:
            delete_prefix(url, prefix)


@pytest.fixture
def client(backend_and_loop: tuple[Backend, str]) -> Iterator[TestClient]:
    """The status API over the seeded store."""
    backend, loop = backend_and_loop
    with TestClient(create_app(backend), backend=loop) as client:
        assert client.portal is not None
        client.portal.call(seed, backend)
        yield client


def _ok(client: TestClient, path: str) -> Any:
    response = client.get(path)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


def _steps(run: dict[str, Any], field: str) -> list[Any]:
    return [step[field] for step in run["steps"]]


def test_jobs_lists_workflows_with_their_steps_and_plain_jobs(client: TestClient) -> None:
    data = _ok(client, "/jobs")
    assert data["now"].endswith("+00:00")
    assert [(j["name"], j["kind"]) for j in data["jobs"]] == [("close", "workflow"),
                                                              ("export", "job")]
    close, export = data["jobs"]
    assert close["steps"] == ["snapshot", "interest", "publish"]
    assert [(r["id"], r["status"]) for r in close["runs"]] == [
        (f"close@{NEXT}", "running"), (f"close@{SLOT}", "failed")]
    running, failed = close["runs"]
    assert _steps(failed, "status") == ["completed", "escalated", "pending"]
    assert _steps(failed, "attempt") == [1, 1, None]
    assert _steps(failed, "instance_id") == ["a", "a", None]
    assert _steps(running, "status") == ["completed", "running", "pending"]
    assert _steps(running, "instance_id") == ["a", "b", None]
    assert running["steps"][1]["lease_expires_at"] is not None
    assert running["steps"][1]["finished_at"] is None
    assert all(set(step) == STEP_FIELDS for step in running["steps"])

    assert [(r["slot"], r["status"], r["store_status"], r["attempt"], r["instance_id"])
            for r in export["runs"]] == [(NEXT, "running", "handed_over", 1, "a"),
                                         (SLOT, "completed", "completed", 2, "b")]

    assert [len(j["runs"]) for j in _ok(client, "/jobs?limit=1")["jobs"]] == [1, 1]


def test_one_run_by_epoch_or_iso_slot(client: TestClient) -> None:
    run = _ok(client, f"/jobs/close@{SLOT}")
    for slot in ("2025-11-30T00:00:00Z", "2025-11-30T00:00:00.000+00:00",
                 "2025-11-30T01:00:00+01:00", "2025-11-30T00:00:00"):
        assert _ok(client, f"/jobs/close@{slot}") == run
    assert {k: run[k] for k in ("id", "name", "kind", "slot", "scheduled_at", "status")} == {
        "id": f"close@{SLOT}", "name": "close", "kind": "workflow", "slot": SLOT,
        "scheduled_at": "2025-11-30T00:00:00.000+00:00", "status": "failed"}
    assert [(a["step"], a["attempt"], a["outcome"]) for a in run["attempts"]] == [
        ("snapshot", 1, "completed"), ("interest", 1, "escalated")]
    snapshot, interest, publish = run["steps"]
    assert snapshot["started_at"] <= snapshot["finished_at"]
    assert interest["finished_at"] is not None and interest["heartbeat_at"] is None
    assert publish == {"name": "publish", "job": "close/publish", "status": "pending",
                       **dict.fromkeys(STEP_FIELDS - {"name", "job", "status"})}

    export = _ok(client, f"/jobs/export@{SLOT}")
    assert (export["kind"], export["status"], export["attempt"]) == ("job", "completed", 2)
    assert [(a["attempt"], a["instance_id"], a["reason"], a["outcome"])
            for a in export["attempts"]] == [(1, "a", "scheduled", "handed_over"),
                                             (2, "b", "hand-over", "completed")]


def test_recovery_log_oldest_first(client: TestClient) -> None:
    log = _ok(client, f"/jobs/close@{SLOT}/recovery-log")
    assert [(e["step"], e["attempt"], e["event"], e["instance_id"]) for e in log] == [
        ("snapshot", 1, "started", "a"), ("snapshot", 1, "completed", "a"),
        ("interest", 1, "started", "a"), ("interest", 1, "escalated", "a")]
    assert [e["at"] for e in log] == sorted(e["at"] for e in log)
    assert _ok(client, "/jobs/close@2025-11-30T00:00:00Z/recovery-log") == log

    export = _ok(client, f"/jobs/export@{SLOT}/recovery-log")
    assert [(e["step"], e["event"], e["detail"]) for e in export] == [
        (None, "started", "scheduled"), (None, "handed_over", None),
        (None, "started", "hand-over"), (None, "completed", None)]


@pytest.mark.parametrize(("path", "status", "says"), [
    ("/jobs/nosuch@1764460800000", 404, "no job or workflow 'nosuch'"),
    (f"/jobs/close@{SLOT + 1}", 404, f"no run of 'close' at slot {SLOT + 1}"),
    (f"/jobs/export@{SLOT + 1}/recovery-log", 404, "no run of 'export'"),
    ("/jobs/close", 400, "malformed"),
    ("/jobs/close@", 400, "malformed"),
    (f"/jobs/@{SLOT}", 400, "malformed"),
    ("/jobs/close@yesterday", 400, "malformed slot 'yesterday'"),
    ("/jobs/close@99999999999999999999", 400, "malformed slot"),
    ("/jobs/close@2025-13-01T00:00:00Z/recovery-log", 400, "malformed slot"),
    ("/jobs?limit=0", 400, "limit='0'"),
    ("/jobs?limit=many", 400, "limit='many'"),
    ("/jobs?limit=%C2%B2", 400, "limit='\u00b2'"),  # "²".isdigit() is True, int("²") fails
    ("/overview?page=%C2%B2", 400, "page='\u00b2'"),
    ("/runs/close?limit=%C2%B2", 400, "limit='\u00b2'"),
    ("/nosuch", 404, "Not Found"),
    # A NUL no name can hold (PostgreSQL's driver raised its own error: a 500 or 503), a
    # slot given as a time out of range (it answered 404 naming a negative slot).
    ("/jobs/close%00@1764460800000", 400, "NUL character"),
    ("/jobs/close%00@1764460800000/recovery-log", 400, "NUL character"),
    ("/runs/close%00", 400, "NUL character"),
    ("/jobs/close@0001-01-01T00:00:00", 400, "out of range"),
    ("/jobs/close@9999-12-31T23:59:59-12:00", 400, "out of range"),
])
@pytest.mark.parametrize("backend_and_loop", STORES, indirect=True)
def test_errors_are_json(client: TestClient, path: str, status: int, says: str) -> None:
    response = client.get(path)
    assert response.status_code == status
    assert set(response.json()) == {"error"} and says in response.json()["error"]


def test_a_number_longer_than_int_reads_is_a_400() -> None:
    """More digits than int() reads (4300: a ValueError, not a ConfigurationError) in a
    limit, a page or a slot answered 500; each is a 400 naming the value."""
    digits = "9" * 5000
    token = {"Authorization": "Bearer t"}
    with TestClient(create_app(MemoryBackend(), token="t"), headers=token) as client:
        for method, path, says in (
                ("GET", f"/jobs?limit={digits}", "limit='99"),
                ("GET", f"/runs/close?limit={digits}", "limit='99"),
                ("GET", f"/overview?page={digits}", "page='99"),
                ("GET", f"/overview?per_page={digits}", "per_page='99"),
                ("GET", f"/jobs/close@{digits}", "malformed slot '99"),
                ("GET", f"/jobs/close@{digits}/recovery-log", "malformed slot '99"),
                ("POST", f"/jobs/close@{digits}/retry", "malformed slot '99"),
                ("POST", f"/jobs/close@{digits}/cancel", "malformed slot '99")):
            response = client.request(method, path)
            assert response.status_code == 400, (path[:40], response.text[:200])
            assert says in response.json()["error"]
        # Leading zeros are no digits of the number.
        assert client.get(f"/jobs?limit={'0' * 5000}5").status_code == 200
        assert "no job or workflow 'close'" in client.get(
            f"/jobs/close@{'0' * 5000}1000").json()["error"]


def test_the_recovery_log_masks_a_password_in_an_error_stored_unmasked() -> None:
    """An error written unmasked (by an older release, or another client) is masked in
    the run's attempts, and was shown as stored in its recovery log (the page's too)."""
    secret = "pa55-Word"
    backend = MemoryBackend()

    async def failed_and_retried() -> None:
        await backend.register_jobs(["sync"])
        for attempt, outcome in ((1, Outcome.FAILED), (2, Outcome.FAILED)):
            token = f"t{attempt}"
            await backend.claim(ClaimRequest("sync", 1000, "i-1", token, LEASE))
            assert await backend.finish(Lease("sync", 1000, token, LEASE), outcome,
                                        f"cannot reach postgresql://app:{secret}@db/x")
            if attempt == 1:  # the second attempt is a retry: its detail is this error
                await backend.operate(Operation(OperationKind.RETRY, "sync", 1000, "op"))

    with TestClient(create_app(backend)) as client:
        assert client.portal is not None
        client.portal.call(failed_and_retried)
        for path in ("/jobs/sync@1000/recovery-log", "/jobs/sync@1000?log=1"):
            response = client.get(path)
            assert response.status_code == 200, response.text
            assert secret not in response.text, path
            assert "postgresql://app:***@db/x" in response.text
        log = client.get("/jobs/sync@1000/recovery-log").json()
        assert [e["event"] for e in log] == ["started", "failed", "retried", "failed"]


@pytest.mark.parametrize("backend_and_loop", [STORES[0]], indirect=True)
def test_read_only(client: TestClient) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        response = client.request(method, f"/jobs/close@{SLOT}")
        assert response.status_code == 405 and "error" in response.json()


def test_page_is_self_contained() -> None:
    with TestClient(create_app(MemoryBackend())) as client:
        response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert 'id="view"' in page and "fetch(" in page and "$script" not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing from elsewhere
    assert " src=" not in page  # the script is inline: the page needs no other request
    policy = response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'sha256-" in policy


TOKEN = "s3cret-Token"
WRONG = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
         {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN}]


@pytest.mark.parametrize("headers", WRONG, ids=["none", "wrong", "longer", "basic", "bare"])
def test_every_request_without_the_token_gets_401(headers: dict[str, str]) -> None:
    with TestClient(create_app(MemoryBackend(), token=TOKEN), headers=headers) as client:
        for path in ("/jobs", "/overview", "/runs/export", f"/jobs/export@{SLOT}",
                     f"/jobs/export@{SLOT}/recovery-log", "/jobs/malformed", "/nosuch"):
            response = client.get(path)
            assert response.status_code == 401, path
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert "bearer token" in response.json()["error"]
        assert client.post("/jobs").status_code == 401
        # The page answers 401 with itself (it holds no data), and asks for #token=.
        page = client.get("/")
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert "#token=" in page.text


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_the_token_opens_every_route(scheme: str) -> None:
    headers = {"Authorization": f"{scheme} {TOKEN}"}
    with TestClient(create_app(MemoryBackend(), token=TOKEN), headers=headers) as client:
        assert client.get("/jobs").json()["jobs"] == []
        assert client.get(f"/jobs/export@{SLOT}").status_code == 404
        assert client.get("/jobs/malformed").status_code == 400
        assert client.get("/").status_code == 200


def test_a_token_read_with_its_newline_still_opens_the_routes() -> None:
    """A secret read from a file or an environment variable often ends with a newline:
    the header's value is stripped, so the configured token is too (it used to answer
    401 to everyone)."""
    for configured in (f"{TOKEN}\n", f" {TOKEN}"):
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with TestClient(create_app(MemoryBackend(), token=configured),
                        headers=headers) as client:
            assert client.get("/jobs").status_code == 200, repr(configured)


def test_empty_token_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="token is empty"):
        create_app(MemoryBackend(), token=" ")


@pytest.mark.parametrize(("token", "says"), [
    ("t\u00f6k\u00e9n", "U+00F6 at position 2"),  # a browser's fetch throws on it
    ("two words", "U+0020 at position 4"),
    ("tab\tin", "U+0009 at position 4"),
])
def test_a_token_a_browser_cannot_send_is_refused_without_showing_it(
        token: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match="cannot send in a header") as caught:
        create_app(MemoryBackend(), token=token)
    assert says in str(caught.value) and token not in str(caught.value)


class _CountingBackend(MemoryBackend):
    """A memory store with the counted start and close of other backends, counting how
    often its resources are opened and closed."""

    start = Backend.start
    close = Backend.close

    def __init__(self) -> None:
        super().__init__()
        self.opened = self.closed = 0

    async def _open(self) -> None:
        self.opened += 1
        await super()._open()

    async def _close(self) -> None:
        self.closed += 1
        await super()._close()


def test_the_app_starts_an_unstarted_backend_and_closes_only_that() -> None:
    backend = _CountingBackend()
    with TestClient(create_app(backend)) as client:
        assert client.get("/jobs").status_code == 200
        assert (backend.opened, backend.closed) == (1, 0)
    assert (backend.opened, backend.closed) == (1, 1)

    started = _CountingBackend()
    anyio.run(started.start)
    with TestClient(create_app(started)) as client:
        assert client.get("/jobs").status_code == 200
    assert (started.opened, started.closed) == (1, 0)  # the caller's hold stays
    anyio.run(started.close)
    assert started.closed == 1


@pytest.mark.parametrize(("argv", "says"), [
    (["--host", "0.0.0.0"], "'0.0.0.0' is not a loopback address"),
    (["--host", "192.0.2.1", "--port", "8123"], "give a bearer token"),
    (["--token", ""], "token is empty"),
    (["--token", "s\u00e9cret"], "cannot send in a header"),
    (["--port", "70000"], "not a port number"),
    (["--read-timeout", "soon"], "--read-timeout='soon' is not a duration"),
    (["--read-timeout", "0s"], "--read-timeout='0s' must be greater than zero"),
    (["--keep-alive", "2h"], "--keep-alive='2h' is longer than an hour"),
    (["--max-connections", "0"], "--max-connections='0' is not a whole number"),
])
def test_serve_refuses_bad_options(argv: list[str], says: str,
                                   capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANARCHON_TOKEN", raising=False)
    try:
        code = main(["serve", "--url", "memory://", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_mounted_in_fastapi_under_a_prefix() -> None:
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    backend = MemoryBackend()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await backend.start()
        await seed(backend)
        yield
        await backend.close()

    app = FastAPI(lifespan=lifespan)
    app.mount("/status", create_app(backend, token=TOKEN))
    with TestClient(app) as client:
        page = client.get("/status/")
        assert page.status_code == 401 and "#token=" in page.text
        headers = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/status/", headers=headers).status_code == 200
        assert client.get("/status/jobs").status_code == 401
        jobs = client.get("/status/jobs", headers=headers).json()["jobs"]
        assert [j["name"] for j in jobs] == ["close", "export"]
        log = client.get(f"/status/jobs/close@{SLOT}/recovery-log", headers=headers).json()
        assert log[-1]["event"] == "escalated"


@pytest.mark.parametrize(("host", "status"), [
    ("127.0.0.1:8000", 200), ("localhost", 200), ("LOCALHOST:80", 200), ("[::1]:8000", 200),
    ("attacker.example", 400), ("127.0.0.1.attacker.example", 400), ("", 400),
    ("localhost.example:8000", 400), ("[::2]:8000", 400),
    ("[0:0:0:0:0:0:0:1]:8000", 200), ("127.0.0.2:8000", 200), ("127.0.0.3", 400),
])
def test_loopback_host_only_refuses_other_names(host: str, status: int) -> None:
    """What ``anarchon serve`` without a token wraps its application in (DNS rebinding);
    the address it listens on (``--host 127.0.0.2``) is answered too."""
    from lease_core.http import LoopbackHostOnly

    app = LoopbackHostOnly(create_app(MemoryBackend()), hosts=["127.0.0.2"])
    with TestClient(app) as api:
        response = api.get("/jobs", headers={"Host": host})
    assert response.status_code == status, response.text
    assert status == 200 or "127.0.0.1 or localhost" in response.json()["error"]



async def _bury(backend: Backend) -> None:
    """export@SLOT (handed over, then completed), then 1,000 later runs of export: the
    history holds its two attempts behind 1,000 newer ones."""
    await seed(backend)
    later = [_claim("export", SLOT + 60_000 * (i + 1), "c") for i in range(1000)]
    for start in range(0, len(later), 250):
        batch = later[start:start + 250]
        assert all(r.status is ClaimStatus.WON for r in await backend.claim_many(batch))
        assert all(await backend.finish_many([(Lease(r.job, r.slot, r.token, LEASE),
                                               Outcome.COMPLETED, None) for r in batch]))


@pytest.mark.parametrize("backend_and_loop", [STORES[0], STORES[2], STORES[4]], indirect=True)
def test_a_run_behind_1000_newer_attempts_shows_its_attempts(
        backend_and_loop: tuple[Backend, str]) -> None:
    """The API read a job's newest 1,000 attempts only: an older run still in the history
    showed none, and an empty recovery log."""
    backend, loop = backend_and_loop
    with TestClient(create_app(backend), backend=loop) as api:
        assert api.portal is not None
        api.portal.call(_bury, backend)
        run = _ok(api, f"/jobs/export@{SLOT}?log=1")
        # Scheduler.recovery_log read its own window (max(history_size, 100) * 10).
        log = api.portal.call(Scheduler(backend, instance_id="r").recovery_log,
                              ("export", SLOT))
    assert [e.event for e in log] == ["started", "handed_over", "started", "completed"]
    assert [(a["attempt"], a["instance_id"], a["outcome"]) for a in run["attempts"]] == [
        (1, "a", "handed_over"), (2, "b", "completed")]
    assert run["started_at"] == run["attempts"][0]["claimed_at"]
    assert [e["event"] for e in run["recovery_log"]] == [
        "started", "handed_over", "started", "completed"]


def test_a_store_that_cannot_be_read_answers_503_on_every_route(pg16_server: PgServer) -> None:
    """The store's tables dropped under a running server: the overview answered 400, as
    if its query were malformed (the statement the store refused is a
    ConfigurationError), where every other route answers 503."""
    table = unique_table()
    backend = PostgresBackend(pg16_server.dsn, table=table)
    try:
        with TestClient(create_app(backend)) as api:
            assert api.portal is not None
            api.portal.call(seed, backend)
            assert api.get("/overview").status_code == 200
            anyio.run(drop_tables, pg16_server.admin_dsn, table)
            for path in ("/overview", "/jobs", "/runs/export", f"/jobs/export@{SLOT}?log=1"):
                response = api.get(path)
                assert response.status_code == 503, (path, response.text)
                assert response.json()["error"].startswith("cannot read the store: "), path
            assert api.get("/overview?status=nosuch").status_code == 400
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_importing_the_http_module_without_its_extra_names_the_extra() -> None:
    """Without Starlette, ``from lease_core.http import create_app`` raised only "No module
    named 'starlette'", where a missing driver or ``lease_core.otel``'s extra names what
    to install; it names ``anarchon[http]`` now (still a ModuleNotFoundError)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'starlette':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import lease_core.http\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(type(exc).__name__, exc.name, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == (
        "ModuleNotFoundError starlette lease_core.http needs 'starlette'; "
        "install it with: pip install 'anarchon[http]'"), out
