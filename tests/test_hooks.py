"""lease_core.testing's hooks into a running scheduler, on the memory backend."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest

from lease_core import (
    Claimed,
    Event,
    MemoryBackend,
    Reason,
    RunContext,
    Scheduler,
    StandingBy,
    SyncScheduler,
)
from lease_core._structures import ClaimRequest, ClaimResult, ClaimStatus
from lease_core.testing import (
    awaiting_hand_over,
    backend_users,
    claim_now,
    claim_now_sync,
    close_backend,
    open_event_streams,
    subscriber_count,
)
from tests.helpers import Instance, quiet_offset_now, wait_for, wait_history

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


def make(backend: MemoryBackend, name: str, started: list[RunContext],
         lease: str = "1.2s") -> Scheduler:
    s = Scheduler(backend, instance_id=name, **{**FAST, "lease": lease})

    @s.every("job", "1h", catch_up="none", offset=quiet_offset_now())
    async def job(ctx: RunContext) -> None:
        started.append(ctx)
        await anyio.sleep(0.3)

    workflow = s.workflow("close", every="1h", offset=quiet_offset_now())
    workflow.step("one", lambda ctx: started.append(ctx))
    return s


def slot_of(s: Scheduler, job: str = "job") -> int:
    slot = s.jobs[job].schedule.previous_at_or_before(s.store_now_ms())
    assert slot is not None
    return slot


async def test_claim_now_claims_runs_and_backs_up_as_the_schedule_would() -> None:
    backend, started = MemoryBackend(), []
    a, b = make(backend, "a", started), make(backend, "b", started)
    events: list[Event] = []
    b.subscribe(events.append)
    async with anyio.create_task_group() as tg:
        ia, ib = await Instance(a).start(tg), await Instance(b).start(tg)
        slot = slot_of(a)
        won = await claim_now(a, "job", slot)
        assert won is not None and (won.status, won.reason) == (ClaimStatus.WON,
                                                                 Reason.SCHEDULED)
        await wait_for(lambda: started, what="the handler")
        assert [(c.job, c.slot, c.instance_id) for c in started] == [("job", slot, "a")]
        assert a.running == [("job", slot)]
        # The same run from another instance: it stands by, as after a scheduled claim.
        standing = await claim_now(b, b.jobs["job"], slot, "scheduled")
        assert standing is not None and standing.status is ClaimStatus.RUNNING
        assert b.watching == [("job", slot)]
        await wait_for(lambda: any(isinstance(e, StandingBy) for e in events),
                       what="StandingBy")
        # A workflow's name claims its first step.
        step = await claim_now(a, "close", slot_of(a, "close/one"))
        assert step is not None and step.status is ClaimStatus.WON
        await wait_history(a, lambda h: h and h[0].outcome == "completed", job="close/one")
        await ia.stop()
        await ib.stop()
    assert not any(isinstance(e, Claimed) for e in events)


async def test_claim_now_refuses_jobs_the_scheduler_does_not_declare() -> None:
    backend, started = MemoryBackend(), []
    a, b = make(backend, "a", started), make(backend, "b", started)
    async with a:
        with pytest.raises(ValueError, match="declares no job or workflow 'nope'"):
            await claim_now(a, "nope", 0)
        with pytest.raises(ValueError, match="'job' is not declared on scheduler 'a'"):
            await claim_now(a, b.jobs["job"], slot_of(a))
        with pytest.raises(ValueError):
            await claim_now(a, "job", slot_of(a), "whenever")
    assert started == []


async def test_claim_now_claims_nothing_when_the_scheduler_is_not_running() -> None:
    backend, started = MemoryBackend(), []
    s = make(backend, "a", started)
    assert await claim_now(s, "job", 0) is None
    assert await backend.runs() == []


class SlowClaims(MemoryBackend):
    """Claims win at once in the store, but their answer arrives half a second later."""

    def __init__(self) -> None:
        super().__init__()
        self.claimed = anyio.Event()

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        (result,) = await self.claim_many([request])  # a lone claim is sent with claim()
        return result

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        results = await super().claim_many(requests)
        self.claimed.set()
        await anyio.sleep(0.5)
        return results


async def test_a_claim_answered_while_stopping_awaits_its_hand_over() -> None:
    backend, started = SlowClaims(), []
    # stop() waits up to half a lease for the claim's answer (0.5s here).
    s = make(backend, "a", started, lease="3s")
    await s.start()
    assert awaiting_hand_over(s) == []
    slot = slot_of(s)

    async def stop_once_claimed() -> None:
        await backend.claimed.wait()
        await s.stop(grace=0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_once_claimed)
        won = await claim_now(s, "job", slot)
        # Won in the store after the stop began: to be handed over, never run.
        assert won is not None and won.status is ClaimStatus.WON
        assert [(lease.job, lease.slot) for lease in awaiting_hand_over(s)] == [("job", slot)]
    assert awaiting_hand_over(s) == []
    assert started == []
    assert [(r.job, r.slot, r.status) for r in await backend.runs()] == [
        ("job", slot, "handed_over")]


async def test_subscribers_and_their_streams_are_counted() -> None:
    s = Scheduler(MemoryBackend(), **FAST)
    unsubscribe = s.subscribe(lambda event: None)
    assert (subscriber_count(s), open_event_streams(s)) == (1, 0)
    async with s:
        assert (subscriber_count(s), open_event_streams(s)) == (1, 1)
        second = s.subscribe(lambda event: None)
        assert (subscriber_count(s), open_event_streams(s)) == (2, 2)
        second()
        assert subscriber_count(s) == 1
        await wait_for(lambda: open_event_streams(s) == 1, what="the stream released")
    assert (subscriber_count(s), open_event_streams(s)) == (1, 0)
    unsubscribe()
    assert subscriber_count(s) == 0


async def test_backend_users_are_counted_and_all_released_by_close_backend() -> None:
    backend = MemoryBackend()
    assert backend_users(backend) == 0
    await backend.start()
    await backend.start()
    assert backend_users(backend) == 2
    await backend.close()
    assert backend_users(backend) == 1
    await close_backend(backend)
    assert backend_users(backend) == 0
    await close_backend(backend)  # closed already: nothing to do
    assert backend_users(backend) == 0


def test_claim_now_sync_claims_through_the_sync_scheduler_s_loop() -> None:
    started: list[RunContext] = []
    s = SyncScheduler(MemoryBackend(), instance_id="sync", **FAST)
    s.every("job", "1h", started.append, catch_up="none", offset=quiet_offset_now())
    with pytest.raises(RuntimeError, match="not running"):
        claim_now_sync(s, "job", 0)
    with s:
        slot = slot_of(s.scheduler)
        won = claim_now_sync(s, "job", slot)
        assert won is not None and won.status is ClaimStatus.WON
        deadline = time.monotonic() + 10
        while not started:
            assert time.monotonic() < deadline, "the handler never ran"
            time.sleep(0.02)
    assert [(c.job, c.slot) for c in started] == [("job", slot)]
