"""The status API's overview (``GET /overview``), a job's runs (``GET /runs/{name}``) and a
run with its recovery log in one answer (``GET /jobs/{id}?log=1``), on real stores.

The store is the one ``tests/test_http.py`` seeds (a workflow with a failed and a running
run, a job handed over and completed), plus a job that only completes, one that never ran,
and the schedules a starting scheduler records.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

from backends.memory import MemoryBackend
from lease_core._overview import read_overview
from lease_core.abc import Backend, Lease, Outcome
from lease_core.http import create_app
from lease_core.operations import Admin
from lease_core.schedules import CronSchedule, IntervalSchedule
from tests.helpers import wait_for
from tests.test_http import LEASE, NEXT, SLOT, _claim, _complete, backend_and_loop, client  # noqa: F401

EVERY_MINUTE = json.dumps(IntervalSchedule("1m").spec())
NIGHTLY = json.dumps(CronSchedule("0 2 * * *", tz="Europe/Lisbon").spec())


async def _more(backend: Backend) -> None:
    await backend.register_schedules({"export": EVERY_MINUTE, "close/snapshot": NIGHTLY,
                                      "report": EVERY_MINUTE})
    await _complete(backend, "report", SLOT, "c")
    await backend.register_jobs(["idle"])


@pytest.fixture
def overview(client: TestClient, backend_and_loop: tuple[Backend, str]) -> TestClient:  # noqa: F811
    """The status API over the seeded store, with more jobs and the schedules."""
    assert client.portal is not None
    client.portal.call(_more, backend_and_loop[0])
    return client


def _get(api: TestClient, path: str, status: int = 200) -> Any:
    response = api.get(path)
    assert response.status_code == status, response.text
    return response.json()


def test_the_overview_has_one_row_per_job_and_workflow(overview: TestClient) -> None:
    data = _get(overview, "/overview")
    rows = {row["name"]: row for row in data["rows"]}
    assert sorted(rows) == ["close", "export", "idle", "report"]  # steps fold into "close"
    assert data["total"] == 4 and data["pages"] == 1 and data["page"] == 1
    assert data["counts"] == {"all": 4, "running": 2, "failed": 1, "ok": 2, "never": 1}

    export = rows["export"]
    assert export["kind"] == "job" and export["schedule"] == "every 1m"
    assert export["next_slot"] > data["now_ms"] and export["next_slot"] % 60_000 == 0
    assert export["last"]["status"] == "completed" and export["last"]["slot"] == SLOT
    assert export["last"]["duration_ms"] >= 0
    (handed,) = export["running"]  # export@NEXT: handed over, not claimed yet
    assert handed["slot"] == NEXT and handed["handed_over"] and handed["instance_id"] == "a"
    assert export["state"] == "ok"  # by its last finished run; it also has one running

    close = rows["close"]
    assert close["kind"] == "workflow" and close["schedule"] == "cron 0 2 * * * (Europe/Lisbon)"
    assert close["last"]["slot"] == SLOT and close["last"]["status"] == "failed"
    (held,) = close["running"]
    assert held["step"] == "interest" and held["instance_id"] == "b"
    assert 0 < held["lease_left_ms"] <= 60_000

    assert rows["report"]["state"] == "ok" and rows["report"]["running"] == []
    assert rows["idle"]["state"] == "never" and rows["idle"]["last"] is None
    assert rows["idle"]["schedule"] is None and rows["idle"]["next_slot"] is None


async def _retrying_and_cancelled(backend: Backend) -> None:
    """flaky@SLOT: its attempt failed and its retry waits an hour; report@NEXT cancelled
    (after report@SLOT completed); once@SLOT cancelled, its only run."""
    from lease_core import Admin
    from tests.test_http import LEASE

    request = _claim("flaky", SLOT, "web-1")
    await backend.claim(request)
    assert await backend.retry_later(
        [(Lease("flaky", SLOT, request.token, LEASE), Outcome.FAILED, "boom", [3_600_000])],
    ) == [1]
    admin = Admin(backend, by="ops")
    for job, slot in (("report", NEXT), ("once", SLOT)):
        await backend.claim(_claim(job, slot, "web-2"))
        await admin.cancel(job, slot, grace=0)


def test_a_run_waiting_for_its_retry_is_in_progress_and_a_cancelled_one_ended(
        overview: TestClient, backend_and_loop: tuple[Backend, str]) -> None:  # noqa: F811
    """A retrying run holds no lease: in progress (``status`` retrying, no lease left), its
    failed attempt not the row's last run. A cancelled run is the row's last run."""
    assert overview.portal is not None
    overview.portal.call(_retrying_and_cancelled, backend_and_loop[0])
    rows = {row["name"]: row for row in _get(overview, "/overview")["rows"]}
    (waiting,) = rows["flaky"]["running"]
    assert waiting["status"] == "retrying" and waiting["lease_left_ms"] is None
    assert not waiting["handed_over"] and waiting["slot"] == SLOT
    assert rows["flaky"]["last"] is None and rows["flaky"]["state"] == "never"
    assert rows["report"]["last"]["slot"] == NEXT
    assert rows["report"]["last"]["status"] == "cancelled" and rows["report"]["state"] == "ok"
    assert rows["once"]["last"]["status"] == "cancelled" and rows["once"]["running"] == []
    (held,) = rows["close"]["running"]
    assert held["status"] == "running" and held["lease_left_ms"] > 0


def test_filters_search_and_pages(overview: TestClient) -> None:
    names = lambda path: [r["name"] for r in _get(overview, path)["rows"]]  # noqa: E731
    assert names("/overview?status=failed") == ["close"]
    assert names("/overview?status=running") == ["close", "export"]
    assert names("/overview?status=ok") == ["export", "report"]
    assert names("/overview?status=never") == ["idle"]
    assert names("/overview?q=EXP") == ["export"]
    searched = _get(overview, "/overview?q=o")
    assert [r["name"] for r in searched["rows"]] == ["close", "export", "report"]
    assert searched["counts"]["all"] == 3  # the counts follow the search
    second = _get(overview, "/overview?per_page=1&page=2")
    assert [r["name"] for r in second["rows"]] == ["export"] and second["pages"] == 4
    assert _get(overview, "/overview?per_page=3&page=9")["rows"] == []


@pytest.mark.parametrize(("query", "named"), [
    ("status=bogus", "'bogus'"), ("page=0", "page=0"), ("per_page=500", "per_page=500"),
    ("page=x", "'x'"), ("per_page=-1", "'-1'"),
])
def test_a_bad_overview_query_is_400_naming_it(
        overview: TestClient, query: str, named: str) -> None:
    assert named in _get(overview, f"/overview?{query}", 400)["error"]


def test_a_jobs_runs_and_a_run_with_its_log_in_one_request(overview: TestClient) -> None:
    runs = _get(overview, "/runs/export")
    assert runs["kind"] == "job" and [r["slot"] for r in runs["runs"]] == [NEXT, SLOT]
    workflow = _get(overview, "/runs/close?limit=1")
    assert workflow["kind"] == "workflow" and [r["slot"] for r in workflow["runs"]] == [NEXT]
    assert "no job or workflow 'nope'" in _get(overview, "/runs/nope", 404)["error"]
    assert "limit" in _get(overview, "/runs/export?limit=0", 400)["error"]
    run = _get(overview, f"/jobs/close@{SLOT}?log=1")
    assert run["status"] == "failed"
    assert [e["event"] for e in run["recovery_log"]] == [
        "started", "completed", "started", "escalated"]
    assert "recovery_log" not in _get(overview, f"/jobs/close@{SLOT}")


class _Counting(MemoryBackend):
    """A memory backend that counts the store calls made through it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        if name in ("now_ms", "jobs", "workflows", "schedules", "runs", "history", "check",
                    "paused"):
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_overview_reads_the_store_a_bounded_number_of_times() -> None:
    """Seven reads whatever the number of jobs (paused jobs included): never one per job."""
    backend = _Counting()
    await backend.start()
    for i in range(300):
        job = f"job-{i:03d}"
        await backend.register_schedules({job: EVERY_MINUTE})
        request = _claim(job, SLOT, "a")
        await backend.claim(request)
        if i % 3:
            await backend.finish(Lease(job, SLOT, request.token, 60_000),
                                 Outcome.COMPLETED if i % 3 == 1 else Outcome.FAILED)
    backend.calls.clear()
    data = await read_overview(backend, per_page=200)
    assert data["total"] == 300 and len(data["rows"]) == 200
    assert data["counts"] == {"all": 300, "running": 100, "failed": 100, "ok": 100, "never": 100}
    assert sum(backend.calls.values()) <= 7, backend.calls
    assert backend.calls["paused"] == 1
    await anyio.lowlevel.checkpoint()


async def _taken_over(backend: Backend) -> None:
    """slow@SLOT: attempt 1 by a lets its lease run out, attempt 2 by b takes the run over
    and completes it."""
    from lease_core.abc import ClaimStatus

    first = _claim("slow", SLOT, "a", lease_ms=30)
    assert (await backend.claim(first)).status is ClaimStatus.WON

    async def taken() -> bool:
        return (await backend.claim(second)).status is ClaimStatus.WON

    second = _claim("slow", SLOT, "b")
    await wait_for(taken, interval=0.005, what="the expired lease to be taken over")
    assert await backend.finish(Lease("slow", SLOT, second.token, 60_000), Outcome.COMPLETED)


def test_a_taken_over_runs_time_is_from_its_first_attempt(
        overview: TestClient, backend_and_loop: tuple[Backend, str]) -> None:  # noqa: F811
    """"took" was the last attempt's time only, where the run's view starts the run at its
    first attempt (and a workflow's row counts from its first step's claim)."""
    assert overview.portal is not None
    overview.portal.call(_taken_over, backend_and_loop[0])
    rows = {row["name"]: row for row in _get(overview, "/overview?q=slow")["rows"]}
    run = _get(overview, f"/jobs/slow@{SLOT}")
    assert [a["attempt"] for a in run["attempts"]] == [1, 2]
    started, finished = (datetime.fromisoformat(run[k]) for k in ("started_at", "finished_at"))
    assert run["started_at"] == run["attempts"][0]["claimed_at"]
    assert rows["slow"]["last"]["duration_ms"] == (finished - started) // timedelta(milliseconds=1)
    assert rows["slow"]["last"]["duration_ms"] >= 30  # attempt 1's lease ran out first


def test_a_rare_job_retried_behind_20000_newer_attempts_keeps_its_last_run() -> None:
    """The overview reads the newest 20,000 attempts at once, and a job missing from them
    on its own. A rare job whose only attempt in that window is the failed one of a run
    retried now (in progress) was not read on its own: its row said it never ran, in the
    'never' filter, though the store holds its completed run before."""
    backend = MemoryBackend()

    async def seed() -> None:
        await backend.register_jobs(["nightly", "busy"])
        await _complete(backend, "nightly", 1000, "c")
        for slot in range(2000, 22_000):  # newer than it: the window is full
            request = _claim("busy", slot, "c")
            await backend.claim(request)
            assert await backend.finish(Lease("busy", slot, request.token, LEASE),
                                        Outcome.COMPLETED)
        request = _claim("nightly", 100_000, "c")
        await backend.claim(request)
        assert await backend.finish(Lease("nightly", 100_000, request.token, LEASE),
                                    Outcome.FAILED, "boom")
        await Admin(backend, by="t").retry("nightly", 100_000)

    with TestClient(create_app(backend)) as api:
        assert api.portal is not None
        api.portal.call(seed)
        rows = {row["name"]: row for row in _get(api, "/overview")["rows"]}
        nightly = rows["nightly"]
        assert [r["status"] for r in nightly["running"]] == ["handed_over"]
        assert nightly["last"] is not None and nightly["last"]["id"] == "nightly@1000", nightly
        assert nightly["state"] == "ok"
        assert _get(api, "/overview?status=never")["total"] == 0
