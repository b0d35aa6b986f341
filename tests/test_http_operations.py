"""The status API's operations (``POST``) through Starlette's test client, on real stores.

Memory, PostgreSQL and Redis, on asyncio and trio. Runs are seeded through the backend contract
on the client's event loop; each answer is checked against what the store holds after.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

from backends.memory import MemoryBackend
from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core.abc import Backend, ClaimRequest, Lease, Outcome
from lease_core.http import create_app
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix

TOKEN = "0ps-Token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEASE = 60_000
STORES = [("memory", "asyncio"), ("memory", "trio"), ("pg16-psycopg", "asyncio"),
          ("pg16-pg8000", "trio"), ("redis62", "asyncio"), ("redis62", "trio")]


@pytest.fixture(params=STORES, ids=[f"{k}-{loop}" for k, loop in STORES])
def backend_and_loop(request: pytest.FixtureRequest) -> Iterator[tuple[Backend, str]]:
    kind, loop = request.param
    if kind == "memory":
        yield MemoryBackend(), loop
        return
    if kind == "redis62":
        url = request.getfixturevalue("redis62_server").url
        prefix = f"anarchon_t_{uuid.uuid4().hex[:12]}"
        try:
            yield RedisBackend(url, prefix=prefix), loop
        finally:
            delete_prefix(url, prefix)
        return
    server = request.getfixturevalue("pg16_server")
    table = unique_table()
    dsn = server.dsn
    if kind == "pg16-pg8000":
        dsn = dsn.replace("postgresql://", "postgresql+pg8000://", 1)
    try:
        yield PostgresBackend(dsn, table=table), loop
    finally:
        anyio.run(drop_tables, server.admin_dsn, table)


async def seed(backend: Backend) -> None:
    """export@1000 failed, export@2000 completed, export@3000 running."""
    await backend.register_jobs(["export"])
    for slot, outcome in ((1000, Outcome.FAILED), (2000, Outcome.COMPLETED), (3000, None)):
        token = uuid.uuid4().hex
        await backend.claim(ClaimRequest("export", slot, "i-1", token, LEASE))
        if outcome is not None:
            assert await backend.finish(Lease("export", slot, token, LEASE), outcome, "x")


def client_for(backend_and_loop: tuple[Backend, str], token: str | None = TOKEN,
               headers: dict[str, str] | None = None) -> TestClient:
    backend, loop = backend_and_loop
    return TestClient(create_app(backend, token=token), backend=loop,
                      headers=AUTH if headers is None else headers)


def statuses(client: TestClient) -> dict[int, str]:
    return {r["slot"]: r["store_status"] for r in client.get("/runs/export").json()["runs"]}


def test_operations_answer_and_act(backend_and_loop: tuple[Backend, str]) -> None:
    backend, _ = backend_and_loop
    with client_for(backend_and_loop) as client:
        assert client.portal is not None
        client.portal.call(seed, backend)
        paused = client.post("/jobs/export/pause")
        assert paused.status_code == 200, paused.text
        assert paused.json() == {"operation": "pause", "name": "export", "paused": True,
                                 "by": "http"}
        assert client.portal.call(backend.paused) == {"export": "http"}
        assert client.post("/jobs/export/resume").json()["paused"] is False
        assert client.portal.call(backend.paused) == {}
        triggered = client.post("/jobs/export/trigger")
        assert triggered.status_code == 200, triggered.text
        slot = triggered.json()["slot"]
        assert triggered.json()["id"] == f"export@{slot}"
        # the same time format as every other time of the API
        at = datetime.fromisoformat(triggered.json()["scheduled_at"])
        assert triggered.json()["scheduled_at"].endswith("+00:00")
        assert at == datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=slot)
        assert client.post("/jobs/export@1000/retry").status_code == 200
        cancelled = client.post("/jobs/export@3000/cancel?grace=1s")
        assert cancelled.status_code == 200, cancelled.text
        found = statuses(client)
        assert found[1000] == "handed_over" and found[slot] == "handed_over"
        assert found[3000] == "cancelled" and found[2000] == "completed"
        log = client.get("/jobs/export@3000/recovery-log").json()
        assert log[-1]["event"] == "cancelled" and log[-1]["detail"] == "cancelled by http"


@pytest.mark.parametrize("path, status, says", [
    ("/jobs/nope/trigger", 404, "never seen"),
    ("/jobs/nope/pause", 404, "never seen"),
    ("/jobs/export@5/retry", 404, "no run of 'export'"),
    ("/jobs/export@5/cancel", 404, "no run of 'export'"),
    ("/jobs/export@2000/retry", 409, "it is completed"),
    ("/jobs/export@2000/cancel", 409, "already finished"),
    ("/jobs/export/resume", 409, "it is not paused"),
    ("/jobs/export/cancel", 400, "malformed"),
    ("/jobs/export@3000/cancel?grace=soon", 400, "grace"),
    # A NUL no name can hold (PostgreSQL's driver raised its own error: a 500), a slot
    # before 1970 given as a time.
    ("/jobs/export%00/trigger", 400, "NUL character"),
    ("/jobs/export%00@1000/retry", 400, "NUL character"),
    ("/jobs/export%00@3000/cancel", 400, "NUL character"),
    ("/jobs/export@0001-01-01T00:00:00/cancel", 400, "out of range"),
])
def test_bad_input_gets_a_clear_error_and_changes_nothing(
        backend_and_loop: tuple[Backend, str], path: str, status: int, says: str) -> None:
    backend, _ = backend_and_loop
    with client_for(backend_and_loop) as client:
        assert client.portal is not None
        client.portal.call(seed, backend)
        before = statuses(client)
        response = client.post(path)
        assert response.status_code == status, response.text
        assert says in response.json()["error"]
        assert statuses(client) == before
        assert client.portal.call(backend.paused) == {}


@pytest.mark.parametrize("backend_and_loop", [STORES[0]], indirect=True)
def test_every_post_needs_the_token(backend_and_loop: tuple[Backend, str]) -> None:
    backend, _ = backend_and_loop
    posts = ["/jobs/export/trigger", "/jobs/export/pause", "/jobs/export/resume",
             "/jobs/export@1000/retry", "/jobs/export@3000/cancel"]
    with client_for(backend_and_loop, headers={}) as client:
        assert client.portal is not None
        client.portal.call(seed, backend)
        before = statuses_with(client)
        for path in posts:
            assert client.post(path).status_code == 401, path
        assert statuses_with(client) == before
    # A server without a token refuses every operation, even from 127.0.0.1.
    with client_for(backend_and_loop, token=None, headers={}) as client:
        for path in posts:
            response = client.post(path)
            assert response.status_code == 403, path
            assert "ANARCHON_TOKEN" in response.json()["error"]
        assert client.portal is not None
        assert client.portal.call(backend.paused) == {}
        assert statuses(client) == before


def statuses_with(client: TestClient) -> dict[int, str]:
    return statuses(TestClientWithAuth(client))


class TestClientWithAuth:
    """Reads through ``client`` with the token (the client itself sends none)."""

    __test__ = False

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def get(self, path: str) -> Any:
        return self.client.get(path, headers=AUTH)


@pytest.mark.parametrize("driver", ["psycopg", "pg8000"])
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_an_operation_the_store_refuses_answers_503_and_changes_nothing(
        pg16_server: PgServer, driver: str, anyio_backend: str) -> None:
    """The store's setup refuses the operation, not the request: a store user with only
    SELECT rights (permission denied) and one whose transactions are read-only (as on a
    standby). Both answer 503, naming the store's refusal; before, the first answered 400
    and the second 500."""
    import psycopg

    table = unique_table()
    admin_backend = PostgresBackend(pg16_server.dsn, table=table)
    anyio.run(_seed_started, admin_backend)
    suffix = uuid.uuid4().hex[:8]
    reader, frozen = f"reader_{suffix}", f"frozen_{suffix}"
    try:
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            for role in (reader, frozen):
                conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
            for name in (table, f"{table}_attempts", f"{table}_jobs", f"{table}_meta"):
                conn.execute(f"GRANT SELECT ON {name} TO {reader}")
                conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {name} TO {frozen}")
            conn.execute(f"ALTER ROLE {frozen} SET default_transaction_read_only = on")
        for role, says in ((reader, "permission denied"), (frozen, "takes no writes")):
            dsn = pg16_server.server.dsn_for(role, "pw")
            if driver == "pg8000":
                dsn = dsn.replace("postgresql://", "postgresql+pg8000://", 1)
            backend = PostgresBackend(dsn, table=table)
            with client_for((backend, anyio_backend)) as client:
                before = statuses(client)
                for path in ("/jobs/export/trigger", "/jobs/export/pause",
                             "/jobs/export@1000/retry", "/jobs/export@3000/cancel"):
                    response = client.post(path)
                    assert response.status_code == 503, (role, path, response.text)
                    error = response.json()["error"]
                    assert error.startswith("cannot act on the store") and says in error, error
                assert statuses(client) == before
                assert client.portal is not None
                assert client.portal.call(backend.paused) == {}
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            for role in (reader, frozen):
                conn.execute(f"DROP ROLE IF EXISTS {role}")


async def _seed_started(backend: Backend) -> None:
    await backend.start()
    try:
        await seed(backend)
    finally:
        await backend.close()
