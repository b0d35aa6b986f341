"""Store outages and unexpected errors seen by the scheduler (memory backend with faults).

A failing store must never end the scheduler's tasks (which would cancel the task that
started it); claims are retried, and after an outage of several slots only the newest
missed slot runs unless the job asked for ``catch_up="all"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from lease_core import (
    BackendUnavailable,
    MemoryBackend,
    Outcome,
    Reason,
    RunContext,
    Scheduler,
)
from lease_core._structures import ClaimRequest, ClaimResult, HeartbeatResult, Lease
from tests.helpers import Instance, wait_for, wait_history

pytestmark = pytest.mark.anyio


class FlakyBackend(MemoryBackend):
    """A memory backend whose calls fail while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down: type[Exception] | None = None
        self.failed_claims: list[int] = []

    def _fail(self) -> None:
        if self.down is BackendUnavailable:
            raise BackendUnavailable("store unreachable (test)")
        if self.down is not None:
            raise self.down("driver bug (test)")

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        if self.down is not None:
            self.failed_claims.append(request.slot)
        self._fail()
        return await super().claim(request)

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        self._fail()
        return await super().heartbeat(leases)


@pytest.mark.parametrize("error", [BackendUnavailable, RuntimeError])
async def test_an_outage_longer_than_the_lease_cancels_and_recovers(
    error: type[Exception],
) -> None:
    backend = FlakyBackend()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    cancelled = anyio.Event()
    runs: list[int] = []

    @s.every("work", "1h")
    async def work(ctx: RunContext) -> None:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            try:
                await anyio.sleep_forever()
            finally:
                cancelled.set()

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        job = s.jobs["work"]
        slot = job.schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await s._claim(job, slot, Reason.SCHEDULED)
        await wait_for(lambda: runs, what="attempt 1")
        backend.down = error
        # Heartbeats fail: the handler is cancelled before its lease could expire.
        await wait_for(cancelled.is_set, timeout=3, what="local lease deadline")
        backend.down = None
        history = await wait_history(s, lambda h: h and h[0].outcome == "completed",
                                     job="work", timeout=10)
        await i.stop()
    assert runs == [1, 2]
    assert [(h.attempt, h.outcome) for h in history] == [
        (2, Outcome.COMPLETED), (1, Outcome.LOST)
    ]


@pytest.mark.parametrize(("catch_up", "expected"), [("latest", 1), ("all", 3)])
async def test_slots_missed_during_an_outage_follow_the_catch_up_policy(
    catch_up: str, expected: int
) -> None:
    backend = FlakyBackend()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    ran: list[int] = []

    async def tick(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    # Retried claims follow the overlap policy too; "allow" lets every missed slot run.
    s.every("tick", "1s", tick, catch_up=catch_up, overlap="allow")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        backend.down = BackendUnavailable
        await wait_for(lambda: len(set(backend.failed_claims)) >= 3, timeout=10,
                       what="three slots missed")
        missed = sorted(set(backend.failed_claims))
        backend.down = None
        await wait_for(lambda: any(slot > missed[-1] for slot in ran), timeout=10,
                       what="a slot after the outage")
        await i.stop()
    caught = [slot for slot in ran if slot in missed]
    if expected == 1:
        assert caught == [missed[-1]]
    else:
        assert caught == missed


async def test_scheduler_survives_unexpected_errors_without_cancelling_its_host() -> None:
    backend = FlakyBackend()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    done: list[int] = []

    async def tick(ctx: RunContext) -> None:
        done.append(ctx.slot)

    s.every("tick", "1s", tick)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        backend.down = ZeroDivisionError
        await wait_for(lambda: backend.failed_claims, timeout=5, what="a failed claim")
        backend.down = None
        await wait_for(lambda: done, timeout=5, what="a run after the errors")
        await i.stop()
    assert done
