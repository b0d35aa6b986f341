"""``anarchon status``'s reading and rendering, on every store."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta

import pytest

from lease_core._status import read_status, render_status
from lease_core.abc import ClaimRequest, Lease, Outcome
from tests.stores import Store
from tests.stores.memory import MemoryStore

pytestmark = pytest.mark.anyio

SLOT = 1_764_460_800_000  # 2025-11-30T00:00:00Z


def _req(job: str, slot: int, instance: str) -> ClaimRequest:
    return ClaimRequest(job, slot, instance, uuid.uuid4().hex, 60_000, overlap_skip=False)


async def test_status_shows_jobs_runs_in_progress_and_last_outcomes(store: Store) -> None:
    backend = store.backend()
    await backend.start()
    try:
        empty = await read_status(backend)
        assert empty.jobs == [] and "no jobs recorded yet" in render_status(empty)

        done, failed, held = (_req("export", SLOT, "a"), _req("report", SLOT, "b"),
                              _req("export", SLOT + 60_000, "c"))
        for r in (done, failed, held):
            await backend.claim(r)
        await backend.finish(Lease(done.job, done.slot, done.token, 60_000), Outcome.COMPLETED)
        await backend.finish(Lease(failed.job, failed.slot, failed.token, 60_000),
                             Outcome.FAILED, "boom")

        status = await read_status(backend)
        data = status.as_json()
        assert [j["name"] for j in data["jobs"]] == ["export", "report"]
        export, report = data["jobs"]
        assert export["last"]["status"] == "completed"
        assert export["last"]["scheduled_at"] == "2025-11-30T00:00:00.000+00:00"
        assert [r["instance_id"] for r in export["running"]] == ["c"]
        assert export["running"][0]["slot"] == SLOT + 60_000
        assert export["running"][0]["lease_expires_at"].endswith("+00:00")
        assert report["last"]["status"] == "failed" and report["running"] == []
        json.dumps(data)  # JSON-ready

        text = render_status(status)
        lines = text.splitlines()
        assert lines[2].split()[:4] == ["JOB", "LAST", "OUTCOME", "LAST"]
        export_line = next(line for line in lines if line.startswith("export"))
        assert "completed" in export_line and "held by c" in export_line
        assert "lease" in export_line and "left" in export_line
        assert next(line for line in lines if line.startswith("report")).rstrip().endswith("-")
    finally:
        await backend.close()


async def test_status_shows_a_paused_job_and_who_paused_it(store: Store) -> None:
    """``anarchon pause export`` then ``anarchon status`` showed the job as it was, with
    nothing in progress: the page marks it paused, the command said nothing of it."""
    from lease_core import Admin

    backend = store.backend()
    await backend.start()
    try:
        for job in ("export", "report"):
            await backend.claim(_req(job, SLOT, "a"))
        await Admin(backend, by="ops-console").pause("export")
        status = await read_status(backend)
        assert {j["name"]: j["paused"] for j in status.as_json()["jobs"]} == {
            "export": "ops-console", "report": None}
        lines = render_status(status).splitlines()
        export = next(line for line in lines if line.startswith("export"))
        assert "paused by ops-console; slot 2025-11-30T00:00:00.000+00:00 attempt 1 held by a" \
            in export, export
        report = next(line for line in lines if line.startswith("report"))
        assert "paused" not in report, report
    finally:
        await backend.close()


async def test_only_a_running_run_shows_a_lease_and_a_retrying_one_its_retry(
        store: Store) -> None:
    """``anarchon status --json`` showed a retrying run's due time, and a handed-over
    run's past expiry, as ``lease_expires_at``: neither holds a lease. A retrying run
    shows ``retry_at``; a run cancelled in its holder's grace shows no lease either."""
    from lease_core import Admin

    backend = store.backend()
    await backend.start()
    try:
        requests = {job: _req(job, SLOT, "a") for job in ("held", "handed", "waiting", "gone")}
        for r in requests.values():
            await backend.claim(r)
        lease = {job: Lease(job, SLOT, r.token, 60_000) for job, r in requests.items()}
        assert await backend.hand_over([lease["handed"]])
        assert await backend.retry_later(
            [(lease["waiting"], Outcome.FAILED, "boom", [90_000])]) == [1]
        (failed,) = await backend.history("waiting", 1)
        assert failed.finished_at is not None
        await Admin(backend, by="ops").cancel("gone", SLOT, grace="30s")

        status = await read_status(backend)
        jobs = {j["name"]: j for j in status.as_json()["jobs"]}
        held, handed, waiting = (jobs[j]["running"][0] for j in ("held", "handed", "waiting"))
        assert held["retry_at"] is None
        assert datetime.fromisoformat(held["lease_expires_at"]).timestamp() * 1000 \
            > status.now_ms
        assert (handed["status"], handed["lease_expires_at"], handed["retry_at"]) == (
            "handed_over", None, None)
        assert waiting["status"] == "retrying" and waiting["lease_expires_at"] is None
        due = datetime.fromisoformat(waiting["retry_at"]) - failed.finished_at
        # On the store's clock (PostgreSQL reads it more than once in the statement).
        assert abs(due - timedelta(seconds=90)) < timedelta(seconds=1), due
        gone = jobs["gone"]["last"]
        assert (gone["status"], gone["lease_expires_at"], gone["retry_at"]) == (
            "cancelled", None, None)

        line = next(line for line in render_status(status).splitlines()
                    if line.startswith("waiting"))
        assert f"attempt 1 by a failed; retry at {waiting['retry_at']} (due in " in line
        assert "s, retrying)" in line and "lease" not in line and "held by" not in line
    finally:
        await backend.close()


async def test_history_of_a_job_name_no_store_can_hold_is_refused_alike(store: Store) -> None:
    """``scheduler.history(job=...)`` passed the name to the backend unchecked: a number
    read as "no history" on PostgreSQL and in memory but raised redis-py's
    "quote_from_bytes() expected bytes"; a NUL character raised psycopg's DataError, and
    a ConfigurationError through pg8000. Every store refuses both, naming the value."""
    from lease_core import ConfigurationError, Scheduler

    scheduler = Scheduler(store.backend())
    with pytest.raises(ConfigurationError, match=r"^job=5 must be a job name \(a string\)"):
        await scheduler.history(job=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="holds a NUL character"):
        await scheduler.history(job="a\x00b")
    assert await scheduler.history(job="never-ran") == []


async def test_status_shows_a_jobs_open_run_past_ten_thousand_open_runs() -> None:
    """The open runs come from one listing of at most 10,000, newest slot first: a job
    whose only open run was older than 10,000 others showed nothing in progress. The
    jobs' own open runs are read when the listing is full. The memory store."""
    backend = MemoryStore().backend()
    await backend.start()
    try:
        await backend.claim_many([_req("elsewhere", SLOT + 60_000 + i, "ghost")
                                  for i in range(10_000)])
        await backend.claim(_req("report", SLOT, "a"))
        status = await read_status(backend)
        running = {j.name: [r.instance_id for r in j.open] for j in status.jobs}
        assert running["report"] == ["a"], running["report"]
        assert len(running["elsewhere"]) == 10_000
    finally:
        await backend.close()


async def test_the_jobs_list_reads_the_stores_jobs_once_for_every_workflow() -> None:
    """GET /jobs reads the store's jobs once, not once more for each workflow (to find
    its steps a deploy removed): a full read of the jobs per workflow listed."""
    from lease_core import MemoryBackend
    from lease_core._status import list_jobs

    backend = MemoryBackend()
    reads: list[int] = []
    real = backend.jobs

    async def jobs() -> list[str]:
        reads.append(1)
        return await real()

    backend.jobs = jobs  # type: ignore[method-assign]
    await backend.start()
    try:
        await backend.register_jobs(["report", *(f"wf{i}/{s}" for i in range(5)
                                                  for s in ("a", "b"))])
        await backend.register_workflows({f"wf{i}": ["a", "b"] for i in range(5)})
        reads.clear()
        listed = await list_jobs(backend)
    finally:
        await backend.close()
    assert len(listed["jobs"]) == 6
    assert len(reads) == 1
