"""The scheduler's lifecycle: start, stop, run, abort and cancellation, on both event loops."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
from anyio.from_thread import start_blocking_portal

from lease_core import (
    AnarchonError,
    LeaseLost,
    MemoryBackend,
    Outcome,
    Reason,
    RunContext,
    Scheduler,
    SchedulerState,
    StopRequested,
)
from lease_core._outcome import MAX_ERROR_BYTES, Ending, Interruption, decide_outcome
from lease_core.testing import backend_users, claim_now
from tests.helpers import quiet_offset_now, wait_for, wait_history
from tests.stores import Store

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


def make(backend: Any, name: str) -> Scheduler:
    return Scheduler(backend, instance_id=name, **FAST)


def long_job(s: Scheduler, started: list[str] | None = None) -> None:
    """Declare the hourly job ``long`` whose handler runs until cancelled."""

    @s.every("long", "1h", catch_up="none", offset=quiet_offset_now())
    async def long(ctx: RunContext) -> None:
        if started is not None:
            started.append(s.instance_id)
        await anyio.sleep_forever()


async def claim_long(s: Scheduler) -> int:
    """Claim the current slot of ``long`` (its next slot is up to an hour away)."""
    job = s.jobs["long"]
    slot = job.schedule.previous_at_or_before(s.store_now_ms())
    assert slot is not None
    await claim_now(s, job, slot)
    return slot


# ----------------------------------------------------------------- any order, any task


@pytest.mark.anyio
async def test_two_schedulers_stop_in_the_order_they_started(store: Store) -> None:
    a, b = make(store.backend(), "a"), make(store.backend(), "b")
    await a.start()
    await b.start()
    assert (a.state, b.state) == (SchedulerState.RUNNING, SchedulerState.RUNNING)
    await a.stop()
    assert (a.state, b.state) == (SchedulerState.STOPPED, SchedulerState.RUNNING)
    await b.stop()
    assert b.state is SchedulerState.STOPPED


@pytest.mark.anyio
async def test_stop_from_another_task_hands_the_run_over() -> None:
    backend = MemoryBackend()
    s = make(backend, "a")
    started: list[str] = []
    long_job(s, started)
    await s.start()
    await claim_long(s)
    await wait_for(lambda: started, what="the handler")
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.stop, 0)
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0
    assert [(h.attempt, h.outcome) for h in await backend.history("long")] == [
        (1, Outcome.HANDED_OVER)
    ]


@pytest.mark.anyio
async def test_tg_start_run_returns_after_stop() -> None:
    backend = MemoryBackend()
    s = make(backend, "a")
    returned = anyio.Event()

    async def run(*, task_status: Any) -> None:
        await s.run(task_status=task_status)
        returned.set()

    async with anyio.create_task_group() as tg:
        await tg.start(run)
        assert s.state is SchedulerState.RUNNING and backend_users(backend) == 1
        assert not returned.is_set()
        await s.stop()
        assert returned.is_set()
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0


@pytest.mark.anyio
async def test_stop_called_by_a_handler_does_not_wait_for_itself() -> None:
    backend = MemoryBackend()
    s = make(backend, "a")

    @s.every("long", "1h", catch_up="none", offset=quiet_offset_now())
    async def long(ctx: RunContext) -> None:
        await s.stop(grace=5)

    await s.start()
    await claim_long(s)
    await wait_for(lambda: s.state is SchedulerState.STOPPED, what="stopped")
    assert [(h.attempt, h.outcome) for h in await backend.history("long")] == [
        (1, Outcome.COMPLETED)
    ]


# ----------------------------------------------------------------- states and transitions


class GatedBackend(MemoryBackend):
    """A memory backend whose start() waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    async def start(self) -> None:
        await wait_for(self.gate.is_set, what="gate")
        await super().start()


@pytest.mark.anyio
async def test_state_goes_through_starting_running_stopping_stopped() -> None:
    backend = GatedBackend()
    s = make(backend, "a")
    release = anyio.Event()

    @s.every("long", "1h", catch_up="none", offset=quiet_offset_now())
    async def long(ctx: RunContext) -> None:
        await ctx.stopping.wait()
        await release.wait()

    assert s.state is SchedulerState.STOPPED
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.start)
        await wait_for(lambda: s.state is SchedulerState.STARTING, what="starting")
        backend.gate.set()
        await wait_for(lambda: s.state is SchedulerState.RUNNING, what="running")
    await claim_long(s)
    await wait_for(lambda: s.running, what="the handler")
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.stop, 10)
        await wait_for(lambda: s.state is SchedulerState.STOPPING, what="stopping")
        release.set()
    assert s.state is SchedulerState.STOPPED
    assert [h.outcome for h in await backend.history("long")] == [Outcome.COMPLETED]


@pytest.mark.anyio
async def test_start_twice_is_an_error_and_stop_before_start_a_no_op() -> None:
    backend = MemoryBackend()
    s = make(backend, "a")
    await s.stop()
    await s.abort()
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0
    await s.start()
    with pytest.raises(AnarchonError, match="already running"):
        await s.start()
    async with anyio.create_task_group() as tg:
        with pytest.raises(AnarchonError, match="already running"):
            await tg.start(s.run)
    assert s.state is SchedulerState.RUNNING
    await s.stop()
    await s.stop()
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0
    await s.start()  # and it starts again
    await s.stop()


@pytest.mark.anyio
async def test_a_failed_start_leaves_it_stopped() -> None:
    class Unreachable(MemoryBackend):
        async def now_ms(self) -> int:
            raise LeaseLost("unreachable (test)")

    backend = Unreachable()
    s = make(backend, "a")
    with pytest.raises(LeaseLost):
        await s.start()
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0
    async with anyio.create_task_group() as tg:
        with pytest.raises(LeaseLost):
            await tg.start(s.run)
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0


# ----------------------------------------------------------------- crashes


@pytest.mark.anyio
@pytest.mark.parametrize("entry", ["async-with", "run", "abort"])
async def test_cancellation_from_outside_is_a_crash_not_a_hand_over(
    store: Store, entry: str
) -> None:
    started: list[str] = []
    a, b = make(store.backend(), "a"), make(store.backend(), "b")
    long_job(a, started)
    long_job(b, started)
    async with anyio.create_task_group() as tg:
        await b.start()
        crash: Any
        if entry == "async-with":
            scope = anyio.CancelScope()

            async def hosted(*, task_status: Any) -> None:
                with scope:
                    async with a:
                        task_status.started()
                        await anyio.sleep_forever()

            await tg.start(hosted)
            crash = scope.cancel
        elif entry == "run":
            async def owner(*, task_status: Any) -> None:
                async with anyio.create_task_group() as inner:
                    await inner.start(a.run)
                    task_status.started(inner.cancel_scope)

            crash = (await tg.start(owner)).cancel
        else:
            await a.start()
            crash = a.abort
        slot = await claim_long(a)
        await claim_long(b)
        assert b.watching == [("long", slot)]
        await wait_for(lambda: started == ["a"], what="a's handler")
        result = crash()
        if result is not None:
            await result
        await wait_for(lambda: a.state is SchedulerState.STOPPED, what="a stopped")
        history = await b.backend.history("long")
        assert [(h.attempt, h.outcome) for h in history] == [(1, None)]
        history = await wait_history(b, lambda h: len(h) == 2, job="long", what="takeover")
        # The takeover is in the store before b's handler task has started.
        await wait_for(lambda: started == ["a", "b"], what="b's handler")
        await b.stop(grace=0)
    assert started == ["a", "b"]
    assert [(h.attempt, h.reason, h.outcome) for h in history] == [
        (2, Reason.TAKEOVER, None),
        (1, Reason.SCHEDULED, Outcome.LOST),
    ]


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_an_event_loop_ending_without_stop_is_a_crash(loop: str) -> None:
    backend = MemoryBackend()
    s = make(backend, "a")
    started: list[str] = []
    long_job(s, started)

    async def main() -> None:
        await s.start()
        await claim_long(s)
        await wait_for(lambda: started, what="the handler")

    anyio.run(main, backend=loop)
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0
    history = anyio.run(backend.history, "long")
    assert [(h.attempt, h.outcome) for h in history] == [(1, None)]


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_blocking_portal_drives_start_and_stop(loop: str) -> None:
    backend = MemoryBackend()
    s = make(backend, "a")
    started: list[str] = []
    long_job(s, started)
    with start_blocking_portal(loop) as portal:
        portal.call(s.start)
        assert s.state is SchedulerState.RUNNING
        portal.call(claim_long, s)
        portal.call(lambda: wait_for(lambda: started, what="the handler"))
        portal.call(s.stop, 0)
        assert s.state is SchedulerState.STOPPED
    assert backend_users(backend) == 0
    history = anyio.run(backend.history, "long")
    assert [(h.attempt, h.outcome) for h in history] == [(1, Outcome.HANDED_OVER)]


# ----------------------------------------------------------------- how a run ended

BOOM = ValueError("boom")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, Ending(Outcome.COMPLETED)),
        ({"raised": BOOM}, Ending(Outcome.FAILED, "ValueError: boom")),
        ({"timed_out": True, "timeout": 2.5}, Ending(Outcome.TIMED_OUT, "timed out after 2.5s")),
        ({"raised": StopRequested("s")}, Ending(Outcome.FAILED, "lease_core.errors."
                                                 "StopRequested: s")),
        ({"raised": StopRequested("s"), "stopping": True}, Ending(Outcome.HANDED_OVER)),
        ({"raised": ExceptionGroup("g", [StopRequested("s")]), "stopping": True},
         Ending(Outcome.HANDED_OVER)),
        ({"interrupted": Interruption.STOPPED, "stopping": True}, Ending(Outcome.HANDED_OVER)),
        ({"interrupted": Interruption.STOPPED, "lost": True}, Ending(Outcome.LOST, "lease lost")),
        ({"interrupted": Interruption.LEASE_LOST, "lost": True},
         Ending(Outcome.LOST, "lease lost")),
        ({"interrupted": Interruption.DEADLINE},
         Ending(Outcome.LOST, "lease not renewed in time")),
        ({"raised": LeaseLost("taken")}, Ending(Outcome.LOST, "taken")),
        ({"raised": StopRequested("s"), "lost": True, "stopping": True},
         Ending(Outcome.LOST, "lease lost")),
        ({"raised": BOOM, "lost": True}, Ending(Outcome.LOST, "lease lost")),
        ({"raised": BOOM, "stopping": True}, Ending(Outcome.FAILED, "ValueError: boom")),
        ({"raised": BOOM, "crashed": True}, Ending(None)),
        ({"interrupted": Interruption.STOPPED, "crashed": True}, Ending(None)),
        # cancel(grace=): whatever the handler did, the operator's cancel ended the run
        ({"cancelled": True}, Ending(Outcome.CANCELLED, "cancelled")),
        ({"cancelled": True, "raised": BOOM}, Ending(Outcome.CANCELLED, "cancelled")),
        ({"cancelled": True, "interrupted": Interruption.CANCELLED, "stopping": True},
         Ending(Outcome.CANCELLED, "cancelled")),
        ({"cancelled": True, "raised": LeaseLost("x"), "lost": True},
         Ending(Outcome.CANCELLED, "cancelled")),
        ({"cancelled": True, "crashed": True}, Ending(None)),
    ],
)
def test_decide_outcome(given: dict[str, Any], expected: Ending) -> None:
    assert decide_outcome(**given) == expected


@pytest.mark.parametrize("fill", ["x", "é", "😀", "a€😀"])
def test_a_huge_error_is_cut_after_its_password_is_masked(fill: str) -> None:
    """Stored as its start and end, at most MAX_ERROR_BYTES of UTF-8 cut between whole
    characters, with a password across the cut masked (masked first, then cut)."""
    secret = "s3cr3t-" * 40
    # About 6,000 bytes: the cut (at about 6,100) falls in the password.
    start = "disk full: " + fill * (6000 // len(fill.encode()))
    message = f"{start} postgresql://app:{secret}@db/x " + fill * 50_000 + " the end"
    error = decide_outcome(raised=ValueError(message)).error or ""
    assert len(error.encode()) <= MAX_ERROR_BYTES
    assert "s3cr3t" not in error and "postgresql://app" in error
    head, marker, tail = error.partition(" … [")
    count, _, tail = tail.partition(" characters cut] … ")
    masked = f"ValueError: {message.replace(secret, '***')}"
    assert marker and masked.startswith(head) and masked.endswith(tail), error
    assert len(head) + int(count) + len(tail) == len(masked)
    assert head.startswith("ValueError: disk full") and tail.endswith(" the end")
    small = decide_outcome(raised=ValueError(fill * 100)).error
    assert small == f"ValueError: {fill * 100}"
