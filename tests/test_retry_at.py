"""When a waiting retry is due (``retry_at``), in every view of a run, on every scenario store.

A run whose attempt failed with retries left waits ``retrying``, holding no lease; the store
keeps when its retry is due as the run's expiry. ``anarchon status`` (text and ``--json``),
the status API's runs, steps and overview show it as ``retry_at`` and show no
``lease_expires_at``: only a running run holds a lease.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import anyio
import pytest

from lease_core import Retry, RunContext, RunStatus
from lease_core._overview import read_overview
from lease_core._status import iso, list_jobs, read_run, read_runs, read_status, render_status
from lease_core.testing import claim_now
from tests.helpers import Instance, quiet_offset_now
from tests.stores import Store
from tests.test_retries import Transient, make, slot_of, wait_status

pytestmark = pytest.mark.anyio


def _ms(text: str | None) -> int:
    assert text is not None
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def _about_30s_after(retry_at: str | None, failed_at: int) -> None:
    """``retry_at`` is the backoff (30 s, 10 % jitter) after the failure, store clock."""
    delay = _ms(retry_at) - failed_at
    assert 27_000 <= delay <= 33_000, (retry_at, failed_at, delay)


async def test_a_waiting_retry_shows_when_it_is_due_and_no_lease(store: Store) -> None:
    s = make(store, "a")

    @s.every("flaky", "1h", offset=quiet_offset_now(), retry=Retry(retries=1, backoff="30s"))
    async def flaky(ctx: RunContext) -> None:
        if ctx.attempt == 1:
            raise Transient("down")

    @s.every("held", "1h", offset=quiet_offset_now())
    async def held(ctx: RunContext) -> None:
        await anyio.sleep_forever()

    close = s.workflow("close", every="1h", offset=quiet_offset_now(),
                       retry=Retry(retries=1, backoff="30s"))
    close.step("snapshot", lambda ctx: 1)

    @close.step("interest")
    async def interest(ctx: RunContext) -> None:
        if ctx.attempt == 1:
            raise Transient("the rates service timed out")

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "flaky")
        await claim_now(s, "flaky", slot)
        await claim_now(s, "held", slot)
        await claim_now(s, "close", slot)
        await wait_status(s, "flaky", slot, RunStatus.RETRYING)
        await wait_status(s, "close/interest", slot, RunStatus.RETRYING)
        await wait_status(s, "held", slot, RunStatus.RUNNING)
        backend = s.backend
        failed = {a.job: a for a in await backend.history(None, 50)
                  if a.slot == slot and a.outcome == "failed"}
        assert failed["flaky"].finished_at is not None
        flaky_failed = _ms(iso(failed["flaky"].finished_at))
        step_failed = _ms(iso(failed["close/interest"].finished_at))

        # anarchon status --json, and its text
        status = await read_status(backend, ["flaky", "held"])
        jobs = {job["name"]: job for job in status.as_json()["jobs"]}
        (waiting,) = jobs["flaky"]["running"]
        assert waiting["status"] == "retrying" and waiting["lease_expires_at"] is None
        _about_30s_after(waiting["retry_at"], flaky_failed)
        retry_at = waiting["retry_at"]
        (running,) = jobs["held"]["running"]
        assert running["retry_at"] is None and _ms(running["lease_expires_at"]) > status.now_ms
        text = render_status(status)
        line = next(line for line in text.splitlines() if line.startswith("flaky"))
        assert f"attempt 1 by a failed; retry at {retry_at} (due in " in line, line
        assert "retrying" in line and "held by" not in line and "lease" not in line

        # the status API: the run, the job's runs, every job, the overview
        run = await read_run(backend, "flaky", slot)
        assert run is not None and run["store_status"] == "retrying"
        assert run["retry_at"] == retry_at and run["lease_expires_at"] is None
        listed = await read_runs(backend, "flaky")
        assert listed is not None
        (shown,) = [r for r in listed["runs"] if r["slot"] == slot]
        assert shown["retry_at"] == retry_at and shown["lease_expires_at"] is None
        every = {j["name"]: j for j in (await list_jobs(backend))["jobs"]}
        assert [r["retry_at"] for r in every["flaky"]["runs"]] == [retry_at]
        assert [r["retry_at"] for r in every["held"]["runs"]] == [None]
        rows = {row["name"]: row for row in (await read_overview(backend))["rows"]}
        (progress,) = rows["flaky"]["running"]
        assert progress["retry_at"] == retry_at and progress["lease_left_ms"] is None
        (progress,) = rows["held"]["running"]
        assert progress["retry_at"] is None and progress["lease_left_ms"] > 0

        # a workflow's step waiting for its retry
        workflow = await read_run(backend, "close", slot)
        assert workflow is not None
        steps: dict[str, Any] = {step["name"]: step for step in workflow["steps"]}
        assert steps["interest"]["store_status"] == "retrying"
        assert steps["interest"]["lease_expires_at"] is None
        _about_30s_after(steps["interest"]["retry_at"], step_failed)
        assert steps["snapshot"]["retry_at"] is None  # completed
        (progress,) = rows["close"]["running"]
        assert progress["step"] == "interest"
        assert progress["retry_at"] == steps["interest"]["retry_at"]
        await i.stop()
