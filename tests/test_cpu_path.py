"""The cheaper path from wake-up to handler start and from handler end to finish.

A claim batch runs its last won handler in its own task (the others in tasks of their
own), so the handlers of one instant must still run side by side; the memory store's
overlap check reads an index of the job's possibly-running slots, which must follow
every way a run starts and stops running. The dispatcher sleeps on one timer and wakes
slots due within the scheduler's ``timer_slack`` of each other together: they must be
claimed in one call, never before their slot nor later than each slot's own slack allows
(at most a quarter of its job's period), and a slot queued during a long sleep must end
it; a long sleep until a slot is cut in two legs, so that the kernel's slack on a long
timeout (0.1 % of it) does not make the slot late. The workers
that claim and run handlers are reused, so each run must get a fresh context and a busy
worker must never delay another run's start.
"""

from __future__ import annotations

import contextvars
import heapq
import random
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import pytest

from backends.memory import MemoryBackend
from lease_core import ConfigurationError, Outcome, Retry, RunContext, Scheduler
from lease_core._wakeups import (
    PRECISE_FROM,
    Alarm,
    WorkerPool,
    first_leg,
    in_context,
    slot_wait,
)
from lease_core.abc import ClaimRequest, ClaimResult, ClaimStatus, Lease
from lease_core.engine.dispatch import WINDOW_LIMIT, wake_slot
from lease_core.testing import claim_now
from tests.helpers import quiet_offset_now, wait_history

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
    await store.start()
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


class _Batches(MemoryBackend):
    """A memory store that records the slots of each claim call it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[str, int]]] = []

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        self.batches.append([(r.job, r.slot) for r in requests])
        return await super().claim_many(requests)


async def test_slots_due_within_the_timer_slack_are_claimed_in_one_wake_up() -> None:
    # Three jobs whose slots lie within the default timer_slack (50 ms) of the first, and
    # a fourth 300 ms later.
    store = _Batches()
    await store.start()
    scheduler = Scheduler(store, instance_id="coalesce")

    async def handler(ctx: RunContext) -> None:
        pass

    scheduler.every("near-a", "1s", handler, offset="100ms")
    scheduler.every("near-b", "1s", handler, offset="101ms")
    scheduler.every("near-c", "1s", handler, offset="140ms")
    scheduler.every("far", "1s", handler, offset="400ms")
    started = await store.now_ms()
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await wait_history(
            scheduler, lambda h: len({a.job for a in h if a.outcome is not None}) >= 4
            and sum(a.job == "near-b" and a.outcome is not None for a in h) >= 2,
            timeout=10, what="two runs of near-b, one of each other job")
        await scheduler.stop(grace=1)
    # A start inside a window (after near-a's slot, say) claims only the rest of that
    # window (earlier slots are not caught up): only windows begun after the start count.
    near = [sorted(job for job, _ in batch) for batch in store.batches
            if any(job.startswith("near") for job, _ in batch)
            and min(slot for _, slot in batch) // 1000 * 1000 + 100 >= started]
    assert near and all(jobs == ["near-a", "near-b", "near-c"] for jobs in near), store.batches
    assert all(len(batch) == 1 for batch in store.batches if ("far", batch[0][1]) in batch)
    # Never early: each claim is made at or after its slot (store time).
    history = await store.history()
    assert all(a.claimed_at >= a.scheduled_at for a in history), history


def _brute_wake_slot(entries: list[tuple[int, int]]) -> int:
    # The latest slot W such that every slot at or before W may wait until W.
    slots = sorted({slot for slot, _ in entries})
    return max(w for w in slots
               if all(w - slot <= slack for slot, slack in entries if slot <= w))


@pytest.mark.parametrize("seed", range(200))
def test_the_wake_up_is_the_latest_slot_every_earlier_slot_may_wait_for(seed: int) -> None:
    rng = random.Random(seed)
    due: list[tuple[int, int, None, int, int]] = []
    for order in range(rng.randint(1, 60)):
        slot = rng.randint(0, 300)
        slack = rng.choice((0, 1, 5, 25, 50, 50, 50))
        heapq.heappush(due, (slot, order, None, slot, slack))
    wake = wake_slot(due)
    assert wake == _brute_wake_slot([(e[0], e[4]) for e in due]), due
    assert wake >= due[0][0]  # never before the next slot: nothing is claimed early


def test_a_window_of_more_slots_than_the_limit_wakes_at_the_next_slot() -> None:
    due = [(1000, i, None, 0, 50) for i in range(WINDOW_LIMIT)] + [(1040, -1, None, 0, 50)]
    heapq.heapify(due)
    assert wake_slot(due) == 1000
    assert wake_slot([*due[:WINDOW_LIMIT - 1], (1040, -1, None, 0, 50)]) == 1040


def test_a_zero_slack_wakes_every_slot_at_its_own_instant() -> None:
    due = [(1000, 0, None, 0, 0), (1001, 1, None, 0, 0), (1002, 2, None, 0, 50)]
    assert wake_slot(due) == 1000
    # A slot with no slack inside the window ends it at its own instant, and the first
    # slot's slack bounds it whatever the later slots' are.
    assert wake_slot([(1000, 0, None, 0, 50), (1010, 1, None, 0, 0),
                      (1030, 2, None, 0, 50)]) == 1010
    assert wake_slot([(1000, 0, None, 0, 20), (1010, 1, None, 0, 50),
                      (1030, 2, None, 0, 50)]) == 1010


async def test_the_slack_never_exceeds_a_quarter_of_the_period_or_heartbeat() -> None:
    # every="100ms": at most 25 ms late, whatever timer_slack says; the job must run every
    # slot (a slot claimed past the next one would be caught up, not run on time).
    store = _Batches()
    scheduler = Scheduler(store, instance_id="fast", timer_slack="90ms", heartbeat="1s",
                          lease="3s")

    async def handler(ctx: RunContext) -> None:
        pass

    scheduler.every("fast", "100ms", handler)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await wait_history(scheduler, lambda h: sum(a.outcome is not None for a in h) >= 10,
                           timeout=10, what="ten runs of a 100 ms job")
        await scheduler.stop(grace=1)
    slots = sorted(slot for batch in store.batches for _, slot in batch)
    assert slots == list(range(slots[0], slots[-1] + 1, 100)), slots
    assert all(a.reason.value == "scheduled" for a in await store.history())
    with pytest.raises(ConfigurationError, match="timer_slack='1s' must be shorter"):
        Scheduler(store, timer_slack="1s", heartbeat="1s", lease="3s")


async def test_a_slot_queued_while_the_dispatcher_sleeps_long_wakes_it() -> None:
    # The heartbeat (the dispatcher's longest sleep) is 5 s and the only other job is an
    # hour away: while a fast job's claim is in flight, the dispatcher sleeps for seconds.
    # The fast job's next slot, queued then, must end that sleep: otherwise it would run
    # once per heartbeat.
    scheduler = Scheduler(MemoryBackend(), instance_id="early-wake", heartbeat="5s",
                          lease="30s")
    runs: list[int] = []
    five = anyio.Event()

    async def handler(ctx: RunContext) -> None:
        runs.append(ctx.slot)
        if len(runs) >= 5:
            five.set()

    scheduler.every("hourly", "1h", handler)
    scheduler.every("fast", "200ms", handler)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        with anyio.fail_after(4):
            await five.wait()
        await scheduler.stop(grace=1)
    assert len(set(runs)) >= 5


async def test_a_slot_due_just_before_a_heartbeats_sleep_ends_is_claimed_on_time() -> None:
    # After each claim the dispatcher sleeps a whole heartbeat (500 ms: the only other job
    # is an hour away). The job's next slot, 20 ms before that sleep ends and so within
    # its 50 ms slack, must end the sleep: a slack is for slots that share a wake-up at
    # a slot, and that sleep ends at none (each slot was claimed 20 ms late).
    scheduler = Scheduler(MemoryBackend(), instance_id="heartbeat-sleep", heartbeat="0.5s",
                          lease="2s")

    async def handler(ctx: RunContext) -> None:
        pass

    scheduler.every("hourly", "1h", handler)
    scheduler.every("often", "480ms", handler)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await wait_history(
            scheduler, lambda h: sum(a.job == "often" and a.outcome is not None
                                     for a in h) >= 7, timeout=10, what="seven runs")
        await scheduler.stop(grace=1)
    late_ms = sorted((a.claimed_at - a.scheduled_at).total_seconds() * 1000
                     for a in await scheduler.history("often", 100)
                     if a.reason.value == "scheduled")
    assert late_ms[len(late_ms) // 2] < 12, late_ms


LEAK: contextvars.ContextVar[str] = contextvars.ContextVar("leak", default="unset")


async def test_a_handler_does_not_see_what_an_earlier_handler_set_in_a_context_variable() -> None:
    # Handlers run in reused workers; each run gets a fresh copy of the worker's context,
    # as a new task would.
    scheduler = Scheduler(MemoryBackend(), instance_id="contextvars")
    seen: list[str] = []
    enough = anyio.Event()

    async def handler(ctx: RunContext) -> None:
        seen.append(LEAK.get())
        LEAK.set(f"set by slot {ctx.slot}")
        if len(seen) >= 6:
            enough.set()

    scheduler.every("cv", "200ms", handler)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        with anyio.fail_after(5):
            await enough.wait()
        await scheduler.stop(grace=1)
    assert seen and set(seen) == {"unset"}, seen


async def test_a_next_step_or_a_retry_does_not_see_what_the_handler_before_it_set() -> None:
    # The next step of a workflow run, and a retry, are claimed from the task of the
    # handler that just ended: their handlers inherited what it set in context variables
    # (a logging context bound in the handler, a tracing span left current), as the
    # next run of the same worker did before it got a fresh copy.
    scheduler = Scheduler(MemoryBackend(), instance_id="contextvars", lease="2s",
                          heartbeat="200ms")
    seen: dict[str, str] = {}

    async def handler(ctx: RunContext) -> None:
        seen[f"{ctx.job} attempt {ctx.attempt}"] = LEAK.get()
        LEAK.set(f"set by {ctx.job} attempt {ctx.attempt}")
        if ctx.job == "retried" and ctx.attempt == 1:
            raise ValueError("retried (test)")

    close = scheduler.workflow("close", every="1h", offset=quiet_offset_now())
    close.step("first", handler)
    close.step("second", handler)
    scheduler.every("retried", "1h", handler, catch_up="none", offset=quiet_offset_now(),
                    retry=Retry(retries=1, backoff=0))
    async with scheduler:
        now = scheduler.store_now_ms()
        for name, schedule in (("close", scheduler.workflows["close"].schedule),
                               ("retried", scheduler.jobs["retried"].schedule)):
            slot = schedule.previous_at_or_before(now)
            assert slot is not None
            await claim_now(scheduler, name, slot)
        await wait_history(scheduler, lambda h: sum(
            a.outcome is Outcome.COMPLETED for a in h) == 3)
    assert seen == {"close/first attempt 1": "unset", "close/second attempt 1": "unset",
                    "retried attempt 1": "unset", "retried attempt 2": "unset"}, seen


async def test_the_worker_pool_reuses_idle_workers_and_starts_one_when_none_is_idle() -> None:
    release = anyio.Event()
    done: list[str] = []

    async def work(item: str) -> None:
        if item == "slow":
            await release.wait()
        done.append(item)

    pool: WorkerPool[str] = WorkerPool(work)
    async with anyio.create_task_group() as tg:
        for i in range(5):  # one after another: one worker does them all
            pool.submit(tg, f"quick-{i}")
            with anyio.fail_after(2):
                while pool.idle < 1:
                    await anyio.lowlevel.checkpoint()
        assert pool.started == 1
        pool.submit(tg, "slow")  # takes the idle worker...
        pool.submit(tg, "other")  # ... so this one starts a worker, and is not delayed
        with anyio.fail_after(2):
            while "other" not in done:
                await anyio.lowlevel.checkpoint()
        assert pool.started == 2 and "slow" not in done
        release.set()
        with anyio.fail_after(2):
            while "slow" not in done:
                await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()  # idle workers end with their task group
    assert done == [f"quick-{i}" for i in range(5)] + ["other", "slow"]


async def test_in_context_runs_each_step_in_the_context_and_passes_cancellation_on() -> None:
    context = contextvars.copy_context()
    steps: list[str] = []

    async def inner() -> str:
        LEAK.set("inside")
        await anyio.lowlevel.checkpoint()
        steps.append(LEAK.get())
        with anyio.CancelScope() as scope:
            scope.cancel()
            await anyio.sleep_forever()
        steps.append(f"cancelled {scope.cancelled_caught}")
        return "result"

    assert await in_context(inner(), context) == "result"
    assert steps == ["inside", "cancelled True"]
    assert LEAK.get() == "unset" and context[LEAK] == "inside"
    with anyio.move_on_after(0.05) as outer:  # cancelled from outside, while awaiting
        await in_context(anyio.sleep_forever(), contextvars.copy_context())
    assert outer.cancelled_caught


async def test_the_alarm_ends_at_its_timeout_or_when_woken() -> None:
    alarm = Alarm()
    start = anyio.current_time()
    await alarm.sleep(0.05)
    assert anyio.current_time() - start >= 0.04
    woken = anyio.Event()

    async def sleeper() -> None:
        await alarm.sleep(30)
        woken.set()

    with anyio.fail_after(5):  # a 30 s sleep, ended by wake()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sleeper)
            while not woken.is_set():
                alarm.wake()
                await anyio.lowlevel.checkpoint()


@pytest.mark.parametrize("wait", [0.0, 0.001, 0.05, 0.499, 0.5, 1.0, 5.0, 60.0, 3600.0])
def test_a_long_wait_for_a_slot_ends_early_enough_for_a_short_exact_rest(wait: float) -> None:
    first = first_leg(wait)
    if wait < PRECISE_FROM:
        assert first == wait  # slept whole: one wake-up, as before
        return
    rest = wait - first
    assert 0 < first < wait
    # The first leg ends early by more than its own slack (0.5 % of it in a niced
    # process, whose factor the kernel divides by 5; at most 100 ms) plus the
    # millisecond of rounding, so it never ends after the slot ...
    assert rest > min(first * 0.005, 0.1) + 0.001
    # ... and the rest is short, so it is slept whole
    assert rest <= 0.152 + 1e-9 and rest < PRECISE_FROM
    assert rest == pytest.approx(0.002 + min(wait * 0.006, 0.15))


@pytest.mark.parametrize("heartbeat", [0.2, 1.0, 5.0, 60.0])
@pytest.mark.parametrize("until_slot", [-0.01, 0.0, 0.001, 0.3, 0.5, 0.999, 1.0, 1.003, 5.0,
                                        5.001, 5.003, 5.02, 5.04, 60.2, 3600.0])
def test_a_slot_at_any_distance_is_not_overshot_by_the_sleep_before_it(
        heartbeat: float, until_slot: float) -> None:
    """The dispatcher's next sleep: never past a heartbeat, and, for a slot half a second
    or more away, short enough that even its latest end (0.5 % of it late in a niced
    process, at most 100 ms, plus a millisecond of rounding) comes before the slot. A
    slot just over a heartbeat away included: a whole heartbeat's sleep would overshoot
    it (5.003 s away, a 5 s sleep may end 26 ms later)."""
    wait = slot_wait(until_slot, heartbeat)
    if until_slot <= 0:
        assert wait == until_slot  # due now
        return
    assert 0 < wait <= min(heartbeat, until_slot)
    if until_slot >= PRECISE_FROM:
        assert wait + min(wait * 0.005, 0.1) + 0.001 < until_slot
    else:
        assert wait == min(heartbeat, until_slot)  # a short wait is slept whole

