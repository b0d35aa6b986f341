"""The cheaper path from wake-up to handler start and from handler end to finish.

A claim batch runs its last won handler in its own task (the others in tasks of their
own), so the handlers of one instant must still run side by side; the memory store's
overlap check reads an index of the job's possibly-running slots, which must follow
every way a run starts and stops running.
"""

from __future__ import annotations

import anyio
import pytest

from backends.memory import MemoryBackend
from lease_core import Outcome, RunContext, Scheduler
from lease_core.abc import ClaimRequest, ClaimStatus, Lease
from tests.helpers import wait_history

pytestmark = pytest.mark.anyio

JOBS = 4


async def test_the_handlers_of_one_instant_run_side_by_side() -> None:
    # Every handler waits for all of them to have started: run one after another, the
    # first would time out (and fail) before the next started.
    scheduler = Scheduler(MemoryBackend(), instance_id="side-by-side")
    started: list[str] = []
    all_started = anyio.Event()

    async def handler(ctx: RunContext) -> None:
        started.append(ctx.job)
        if len(started) == JOBS:
            all_started.set()
        with anyio.fail_after(3):
            await all_started.wait()

    for i in range(JOBS):
        scheduler.every(f"together-{i}", "1s", handler, timeout="5s")
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        history = await wait_history(
            scheduler, lambda h: len({a.job for a in h if a.outcome is not None}) >= JOBS,
            timeout=10, what=f"a run of each of the {JOBS} jobs ended")
        await scheduler.stop(grace=1)
    first = {}
    for attempt in sorted(history, key=lambda a: a.slot):
        first.setdefault(attempt.job, attempt)
    assert {a.job for a in first.values()} == {f"together-{i}" for i in range(JOBS)}
    assert len({a.slot for a in first.values()}) == 1  # due at one instant
    assert all(a.outcome is Outcome.COMPLETED for a in first.values()), first


def _request(slot: int, token: str, lease_ms: int = 10_000) -> ClaimRequest:
    return ClaimRequest("job", slot, "me", token, lease_ms)


async def test_the_memory_overlap_check_follows_runs_that_stop_and_start_running() -> None:
    now = [1000.0]
    store = MemoryBackend(clock=lambda: now[0])
    # Other jobs' runs in the store do not matter to this job's overlap check.
    for i in range(50):
        await store.claim(ClaimRequest(f"other-{i}", 1_000_000, "me", f"o{i}", 10_000))
    first = await store.claim(_request(1_000_000, "t1"))
    assert first.status is ClaimStatus.WON
    assert (await store.claim(_request(1_001_000, "t2"))).status is ClaimStatus.SKIPPED
    # Handed over: no longer running, so a later slot runs...
    assert await store.hand_over([Lease("job", 1_000_000, "t1", 10_000)]) == {"t1"}
    later = await store.claim(_request(1_002_000, "t3"))
    assert later.status is ClaimStatus.WON
    assert await store.finish(Lease("job", 1_002_000, "t3", 10_000), Outcome.COMPLETED)
    # ... and once the handed-over run is claimed again, it is running again.
    again = await store.claim(_request(1_000_000, "t4"))
    assert again.status is ClaimStatus.WON and again.attempt == 2
    assert (await store.claim(_request(1_003_000, "t5"))).status is ClaimStatus.SKIPPED
    # Its lease expired without renewal: it no longer holds later slots back.
    now[0] += 11
    assert (await store.claim(_request(1_004_000, "t6"))).status is ClaimStatus.WON
    # Finished: nothing holds the job back either.
    assert await store.finish(Lease("job", 1_004_000, "t6", 10_000), Outcome.COMPLETED)
    assert (await store.claim(_request(1_005_000, "t7"))).status is ClaimStatus.WON
