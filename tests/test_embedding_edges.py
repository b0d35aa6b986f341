"""Edges of embedding a scheduler: stop from a subscriber or a handler, blocked worker
threads, subscriptions from other threads, an unexpected end (memory backend)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import anyio
import anyio.to_thread
import pytest

from lease_core import AnarchonError, MemoryBackend, Scheduler, SchedulerState
from lease_core import events as ev
from lease_core._outcome import classify
from lease_core.abc import HeartbeatResult, Lease
from lease_core.errors import LeaseLost, StopRequested
from lease_core.sync import SyncScheduler
from tests.helpers import wait_for


class _Boom(BaseException):
    """Not an Exception: nothing in a subscriber's loop may catch it."""


@pytest.mark.anyio
async def test_stop_from_an_async_subscriber_only_requests_it() -> None:
    s = Scheduler(MemoryBackend(), lease="3s", heartbeat="0.2s")

    @s.every("j", "0.2s")
    async def job(ctx: object) -> None:
        pass

    returned = anyio.Event()

    async def subscriber(event: ev.Event) -> None:
        if isinstance(event, ev.Completed) and not returned.is_set():
            await s.stop(grace="0s")
            returned.set()

    s.subscribe(subscriber)
    await s.start()
    with anyio.fail_after(10):
        await returned.wait()
        await wait_for(lambda: s.state is SchedulerState.STOPPED, timeout=10,
                       what="the requested stop")
        await s.stop()  # and a later stop() from outside returns at once


class _ThreadedStore(MemoryBackend):
    """A store whose heartbeat takes a default worker thread, like the blocking drivers."""

    beats = 0

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        await anyio.to_thread.run_sync(time.sleep, 0.001)
        self.beats += 1
        return await super().heartbeat(leases)


@pytest.mark.anyio
async def test_blocked_sync_subscribers_and_handlers_leave_threads_for_the_store() -> None:
    store = _ThreadedStore()
    s = Scheduler(store, lease="1s", heartbeat="0.1s")
    release = threading.Event()

    @s.every("j", "0.5s")
    def job(ctx: object) -> None:
        release.wait(20)

    for _ in range(50):  # more than anyio's 40 default threads, all blocked
        s.subscribe(lambda event: release.wait(20))
    seen: list[str] = []

    async def watch(event: ev.Event) -> None:
        seen.append(type(event).__name__)

    s.subscribe(watch)
    try:
        await s.start()
        await wait_for(lambda: "Claimed" in seen, timeout=10, what="a claim")
        first = store.beats
        # heartbeats go on through a lease's worth and more (20 of them, 2 s at 0.1 s)
        await wait_for(lambda: store.beats >= first + 20, timeout=15,
                       what="heartbeats while every other thread is blocked")
        assert "Lost" not in seen
        assert s.health().runs_held >= 1
    finally:
        release.set()
        await s.abort()


@pytest.mark.anyio
async def test_an_unexpected_end_is_raised_by_stop() -> None:
    s = Scheduler(MemoryBackend(), lease="3s", heartbeat="0.2s")

    @s.every("j", "0.2s")
    async def job(ctx: object) -> None:
        pass

    async def subscriber(event: ev.Event) -> None:
        raise _Boom("a bug")

    s.subscribe(subscriber)
    await s.start()
    await wait_for(lambda: s.state is SchedulerState.STOPPED, timeout=10,
                   what="the scheduler to end")
    with pytest.raises(AnarchonError, match="ended unexpectedly") as info:
        await s.stop()
    assert isinstance(info.value.__cause__, BaseExceptionGroup)
    assert info.value.__cause__.subgroup(_Boom) is not None
    await s.stop()  # reported once


def test_sync_scheduler_subscribe_from_the_caller_thread_and_stop_from_a_handler() -> None:
    s = SyncScheduler(MemoryBackend(), lease="3s", heartbeat="0.2s")
    stopped_in = []

    @s.every("j", "0.2s")
    def job(ctx: object) -> None:
        began = time.monotonic()
        s.stop(grace="5s")  # from its own handler: requests and returns
        stopped_in.append(time.monotonic() - began)

    seen: list[str] = []
    s.start()
    try:
        off = s.subscribe(lambda event: seen.append(type(event).__name__))
        deadline = time.monotonic() + 10
        while "Completed" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "Completed" in seen
        assert stopped_in and stopped_in[0] < 1.0
        off()
    finally:
        s.stop()
    assert not s.started


def test_a_sync_scheduler_that_ended_on_its_own_says_stopped_and_stop_raises_why() -> None:
    s = SyncScheduler(MemoryBackend(), lease="3s", heartbeat="0.2s")
    runs: list[int] = []

    @s.every("j", "0.2s")
    def job(ctx: object) -> None:
        runs.append(1)

    async def subscriber(event: ev.Event) -> None:
        if isinstance(event, ev.Completed):
            raise _Boom("a bug")

    off = s.scheduler.subscribe(subscriber)
    s.start()
    try:
        deadline = time.monotonic() + 10
        while s.state is not SchedulerState.STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.state is SchedulerState.STOPPED
        assert not s.started
        with pytest.raises(AnarchonError, match=r"ended on its own.*call stop\(\) first"):
            s.start()
        with pytest.raises(AnarchonError, match="ended unexpectedly"):
            s.stop()
        assert s.state is SchedulerState.STOPPED
        s.stop()  # reported once
    finally:
        s.stop()
    off()
    done = len(runs)
    assert done >= 1
    s.start()  # and it starts again
    try:
        deadline = time.monotonic() + 10
        while len(runs) == done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(runs) > done
        assert s.state is SchedulerState.RUNNING
    finally:
        s.stop()


def test_a_group_of_lease_lost_and_stop_requested_is_lease_lost() -> None:
    group = BaseExceptionGroup("both", [StopRequested("stop"), LeaseLost("lost")])
    assert classify(group) is LeaseLost
    assert classify(BaseExceptionGroup("s", [StopRequested("a"), StopRequested("b")])) is \
        StopRequested
    assert classify(BaseExceptionGroup("x", [LeaseLost("a"), ValueError("b")])) is None
