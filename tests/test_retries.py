"""Retries within a run (issue 19, part 1), through the public API, on every scenario store.

Jobs are hourly (far from "now"); each test starts a run by claiming it at the current
slot with the documented hook, as the schedule would. Every wait has a deadline.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from lease_core import ConfigurationError, Event, Retried, Retry, RunContext, RunStatus, Scheduler
from lease_core._status import workflow_status
from lease_core.retry import supports_retries
from lease_core.testing import claim_now
from tests.helpers import Instance, quiet_offset_now, started, wait_for, wait_history
from tests.stores import Store

pytestmark = pytest.mark.anyio

FAST = {"lease": "0.9s", "heartbeat": "0.2s"}


class Transient(Exception):
    """A failure worth retrying."""


class Fatal(Exception):
    """A failure never retried (``no_retry``)."""


def make(store: Store, name: str, **kw: Any) -> Scheduler:
    s = Scheduler(store.backend(), instance_id=name, **{**FAST, **kw})
    if not supports_retries(s.backend):
        pytest.skip(f"{type(s.backend).__name__} has no retry_later() yet")
    return s


def slot_of(s: Scheduler, job: str) -> int:
    slot = s.jobs[job].schedule.previous_at_or_before(s.store_now_ms())
    assert slot is not None
    return slot


async def run_status(s: Scheduler, job: str, slot: int) -> RunStatus | None:
    async with started(s.backend):
        state = (await s.backend.check([(job, slot)])).runs.get((job, slot))
    return None if state is None else state.status


async def wait_status(s: Scheduler, job: str, slot: int, want: RunStatus) -> None:
    async def done() -> bool:
        return await run_status(s, job, slot) == want

    await wait_for(done, timeout=15, what=f"{job}@{slot} {want}")


async def test_a_transient_failure_is_retried_within_its_run(store: Store) -> None:
    tries: list[tuple[int, str]] = []
    events: list[Event] = []
    s = make(store, "a")
    s.subscribe(events.append)

    @s.every("flaky", "1h", offset=quiet_offset_now(),
             retry=Retry(retries=3, backoff="0.1s", jitter=0))
    async def flaky(ctx: RunContext) -> None:
        tries.append((ctx.attempt, ctx.reason))
        if len(tries) < 3:
            raise Transient(f"try {len(tries)}")

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "flaky")
        await claim_now(s, "flaky", slot)
        await wait_status(s, "flaky", slot, RunStatus.COMPLETED)
        await wait_for(lambda: sum(isinstance(e, Retried) for e in events) == 2,
                       what="two Retried events")
        await i.stop()
    assert tries == [(1, "scheduled"), (2, "retry"), (3, "retry")]
    history = sorted((a for a in await s.history("flaky") if a.slot == slot),
                     key=lambda a: a.attempt)
    assert [(a.attempt, a.reason, a.outcome) for a in history] == [
        (1, "scheduled", "failed"), (2, "retry", "failed"), (3, "retry", "completed")]
    assert "Transient: try 1" in (history[0].error or "")
    retried = [e for e in events if isinstance(e, Retried)]
    assert [(e.attempt, e.retry, e.delay) for e in retried] == [(1, 1, 0.1), (2, 2, 0.2)]
    assert "try 2" in retried[1].error
    log = await s.recovery_log(("flaky", slot))
    assert [(e.attempt, e.event) for e in log] == [
        (1, "started"), (1, "failed"), (2, "retried"), (2, "failed"), (3, "retried"),
        (3, "completed")]
    assert "try 1" in (log[2].detail or "")


async def test_a_retry_never_runs_alongside_a_newer_slot_of_its_job(store: Store) -> None:
    """overlap="skip" (the default): while a failed run waits 1.5 s for its retry, the
    job's next slot (1 s later) is recorded skipped, not run beside the retry."""
    runs: list[tuple[int, int, str]] = []
    s = make(store, "a")

    @s.every("each-second", "1s", retry=Retry(retries=1, backoff="1.5s", jitter=0))
    async def each_second(ctx: RunContext) -> None:
        runs.append((ctx.slot, ctx.attempt, ctx.reason))
        if len(runs) == 1:
            raise Transient("first")

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        await wait_for(lambda: bool(runs), timeout=5, what="the first run")
        first = runs[0][0]
        await wait_for(lambda: any(slot >= first + 2000 for slot, _, _ in runs), timeout=10,
                       what="the slot after the skipped one")
        await i.stop()
    assert (first, 2, "retry") in runs, runs
    assert not [r for r in runs if r[0] == first + 1000], runs
    skipped = [a for a in await s.history("each-second") if a.slot == first + 1000]
    assert [(a.outcome, a.error) for a in skipped] == [
        ("skipped", "an earlier run of the job waits for its retry")]


async def test_the_last_failure_ends_the_run_failed(store: Store) -> None:
    tries: list[int] = []
    s = make(store, "a")

    @s.every("doomed", "1h", offset=quiet_offset_now(), retry=Retry(retries=2, backoff=0))
    async def doomed(ctx: RunContext) -> None:
        tries.append(ctx.attempt)
        raise Transient("always")

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "doomed")
        await claim_now(s, "doomed", slot)
        await wait_status(s, "doomed", slot, RunStatus.FAILED)
        await i.stop()
    assert tries == [1, 2, 3]
    outcomes = [a.outcome for a in await s.history("doomed") if a.slot == slot]
    assert outcomes == ["failed"] * 3


async def test_no_retry_types_and_timeouts(store: Store) -> None:
    fatal: list[int] = []
    slow: list[int] = []
    s = make(store, "a")

    @s.every("fatal", "1h", offset=quiet_offset_now(),
             retry=Retry(retries=3, backoff=0, no_retry=(Fatal,)))
    async def fatal_job(ctx: RunContext) -> None:
        fatal.append(ctx.attempt)
        raise Fatal("do not retry me")

    @s.every("slow", "1h", offset=quiet_offset_now(), timeout="0.1s", retry=1)
    async def slow_job(ctx: RunContext) -> None:
        slow.append(ctx.attempt)
        if len(slow) == 1:
            await anyio.sleep(5)  # a timeout counts as a failure: retried

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "fatal")
        await claim_now(s, "fatal", slot)
        await claim_now(s, "slow", slot)
        await wait_status(s, "fatal", slot, RunStatus.FAILED)
        await wait_status(s, "slow", slot, RunStatus.COMPLETED)
        await i.stop()
    assert fatal == [1]
    assert slow == [1, 2]
    history = sorted((a for a in await s.history("slow") if a.slot == slot),
                     key=lambda a: a.attempt)
    assert [(a.reason, a.outcome) for a in history] == [
        ("scheduled", "timed_out"), ("retry", "completed")]


async def test_a_sync_handler_past_its_timeout_is_retried_only_once_its_thread_returns(
        store: Store) -> None:
    """A thread cannot be cancelled: a timed-out sync handler's retry waits until its
    thread returns (the lease held meanwhile), so the run never runs twice at once, with
    or without max_running. It used to start 0.3 s after the timeout, beside it."""
    import threading
    import time

    lock = threading.Lock()
    spans: list[tuple[int, float, float]] = []
    s = make(store, "a")

    @s.every("stuck", "1h", offset=quiet_offset_now(), timeout="0.2s",
             retry=Retry(retries=1, backoff=0))
    def stuck(ctx: RunContext) -> None:
        began = time.monotonic()
        if ctx.attempt == 1:
            time.sleep(1.2)  # ignores ctx.stopping, as blocking code does
        with lock:
            spans.append((ctx.attempt, began, time.monotonic()))

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "stuck")
        await claim_now(s, "stuck", slot)
        await wait_status(s, "stuck", slot, RunStatus.COMPLETED)
        await i.stop()
    (first, _, ended1), (second, began2, _) = sorted(spans)
    assert (first, second) == (1, 2)
    assert began2 >= ended1, spans  # never both at once
    history = sorted((a for a in await s.history("stuck") if a.slot == slot),
                     key=lambda a: a.attempt)
    assert [(a.reason, a.outcome) for a in history] == [
        ("scheduled", "timed_out"), ("retry", "completed")]


async def test_a_stop_while_a_timed_out_sync_handler_still_runs_starts_no_retry_beside_it(
        store: Store) -> None:
    """A stop's grace ends with the timed-out thread still running: the run is neither
    retried nor handed over (either would start it again beside the thread); its lease
    lapses and the backup takes it over. A retry used to start at the stop."""
    import threading
    import time

    lock, told = threading.Lock(), threading.Event()
    spans: list[tuple[int, str, float, float]] = []
    a, b = make(store, "a"), make(store, "b")
    a_events: list[str] = []
    a.subscribe(lambda e: a_events.append(type(e).__name__))
    for s in (a, b):
        @s.every("stuck", "1h", offset=quiet_offset_now(), timeout="0.2s",
                 retry=Retry(retries=1, backoff=0))
        def stuck(ctx: RunContext) -> None:
            began = time.monotonic()
            if ctx.attempt == 1:
                while not ctx.stopping.is_set() and time.monotonic() < began + 5:
                    time.sleep(0.01)
                told.set()  # timed out, and asked to stop: it goes on all the same
                time.sleep(0.8)
            with lock:
                spans.append((ctx.attempt, ctx.instance_id, began, time.monotonic()))

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = slot_of(a, "stuck")
        await claim_now(a, "stuck", slot)
        await claim_now(b, "stuck", slot)  # b backs the run up
        await wait_for(told.is_set, timeout=5, what="a's handler timed out")
        await ia.stop(grace=0)
        await wait_status(b, "stuck", slot, RunStatus.COMPLETED)
        await ib.stop()
    history = sorted((x.attempt, x.instance_id, str(x.reason))
                     for x in await b.history("stuck") if x.slot == slot)
    assert history == [(1, "a", "scheduled"), (2, "b", "takeover")], (spans, history)
    (first, who1, _, ended1), (second, who2, began2, _) = sorted(spans)
    assert (first, who1, second, who2) == (1, "a", 2, "b")
    assert began2 >= ended1, spans  # never both at once
    # a's attempt ends with an event (it had none: Claimed was never followed by an end)
    assert [e for e in a_events if e in ("Claimed", "Lost", "TimedOut", "Retried")] == [
        "Claimed", "Lost"], a_events


async def test_a_crash_while_a_retry_waits_loses_nothing(store: Store) -> None:
    tries: list[tuple[str, int, str]] = []
    failed = anyio.Event()

    def build(name: str) -> Scheduler:
        s = make(store, name)

        @s.every("bank", "1h", offset=quiet_offset_now(), retry=Retry(backoff="0.6s"))
        async def bank(ctx: RunContext) -> None:
            tries.append((name, ctx.attempt, ctx.reason))
            if name == "a":
                failed.set()
                raise Transient("the ledger is busy")

        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = slot_of(a, "bank")
        await claim_now(a, "bank", slot)
        await claim_now(b, "bank", slot)  # held by a: b backs it up
        with anyio.fail_after(10):
            await failed.wait()
        await wait_status(a, "bank", slot, RunStatus.RETRYING)
        ia.crash()  # while the retry waits: nothing is held, nothing is lost
        await wait_status(b, "bank", slot, RunStatus.COMPLETED)
        await ib.stop()
    assert tries == [("a", 1, "scheduled"), ("b", 2, "retry")]
    history = await wait_history(b, lambda h: len(h) == 2, job="bank")
    assert {(h.attempt, h.instance_id, h.outcome) for h in history} == {
        (1, "a", "failed"), (2, "b", "completed")}


async def test_a_workflow_retries_the_failed_step_only(store: Store) -> None:
    ran: list[tuple[str | None, int, str]] = []
    s = make(store, "a")
    close = s.workflow("close", every="1h", offset=quiet_offset_now(),
                       retry=Retry(retries=2, backoff="0.1s"))

    @close.step("snapshot")
    async def snapshot(ctx: RunContext) -> Any:
        ran.append((ctx.step, ctx.attempt, ctx.reason))
        return [1, 2]

    @close.step("interest")
    async def interest(ctx: RunContext) -> Any:
        ran.append((ctx.step, ctx.attempt, ctx.reason))
        if ctx.attempt == 1:
            raise Transient("the rates service timed out")
        return sum(ctx.results["snapshot"])

    @close.step("publish", retry=0)
    async def publish(ctx: RunContext) -> None:
        ran.append((ctx.step, ctx.attempt, ctx.reason))

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "close/snapshot")
        await claim_now(s, "close", slot)
        await wait_status(s, "close/publish", slot, RunStatus.COMPLETED)
        await i.stop()
    assert ran == [("snapshot", 1, "scheduled"), ("interest", 1, "scheduled"),
                   ("interest", 2, "retry"), ("publish", 1, "scheduled")]
    assert s.jobs["close/publish"].retry is None
    log = await s.recovery_log(("close", slot))
    assert [(e.step, e.event) for e in log if e.step == "interest"] == [
        ("interest", "started"), ("interest", "failed"), ("interest", "retried"),
        ("interest", "completed")]


async def test_a_step_s_last_failure_fails_the_workflow(store: Store) -> None:
    ran: list[tuple[str | None, int]] = []
    s = make(store, "a")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    close.step("snapshot", lambda ctx: ran.append((ctx.step, ctx.attempt)))

    @close.step("interest", retry=Retry(retries=1, backoff=0))
    async def interest(ctx: RunContext) -> None:
        ran.append((ctx.step, ctx.attempt))
        raise Transient("still down")

    close.step("publish", lambda ctx: ran.append((ctx.step, ctx.attempt)))
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "close/snapshot")
        await claim_now(s, "close", slot)
        await wait_status(s, "close/interest", slot, RunStatus.FAILED)
        await i.stop()
    assert ran == [("snapshot", 1), ("interest", 1), ("interest", 2)]
    assert await run_status(s, "close/publish", slot) is None
    steps = [await run_status(s, job.name, slot) for job in close.jobs]
    assert workflow_status(steps) == "failed"


async def test_trimming_history_mid_retries_allows_no_extra_retry(store: Store) -> None:
    """The retry count lives in the run, not in its history (PostgreSQL too): trimming
    the attempts of the retries already made grants no extra retry."""
    from lease_core.abc import ClaimRequest, Lease, Outcome

    backend = store.backend()
    if not supports_retries(backend):
        pytest.skip(f"{type(backend).__name__} has no retry_later() yet")
    await backend.start()
    try:
        await backend.register_jobs(["trimmed"])
        delays = [0, 0]  # two retries, each due at once
        answers = []
        for attempt in (1, 2, 3):
            won = await backend.claim(
                ClaimRequest("trimmed", 1000, "i-1", f"t{attempt}", 30_000))
            assert (won.status, won.attempt) == ("won", attempt)
            if attempt == 3:
                # the retention path keeps every attempt of an open run (its recovery
                # log): trimming to the newest one deletes none of the two failures
                assert await backend.prune("trimmed", keep=1) == 0
                assert sorted(h.attempt for h in await backend.history("trimmed")) == [1, 2, 3]
            lease = Lease("trimmed", 1000, f"t{attempt}", 30_000)
            answers.append(await backend.retry_later([(lease, Outcome.FAILED, "boom", delays)]))
        assert answers == [[1], [2], [0]]  # the third failure ends the run: no third retry
        state = (await backend.check([("trimmed", 1000)])).runs[("trimmed", 1000)]
        assert state.status is RunStatus.FAILED
        late = await backend.claim(ClaimRequest("trimmed", 1000, "i-2", "t4", 30_000))
        assert (late.status, late.run_status) == ("finished", RunStatus.FAILED)
    finally:
        await backend.close()


async def test_a_retrying_run_shows_no_lease_and_a_cancelled_workflow_is_cancelled(
    store: Store,
) -> None:
    from lease_core import Admin
    from lease_core._status import read_run

    s = make(store, "a")

    @s.every("sync", "1h", offset=quiet_offset_now(), retry=Retry(3, backoff="60s"))
    async def sync(ctx: RunContext) -> None:
        raise Transient("down")

    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    close.step("one", lambda ctx: 1)

    @close.step("two")
    async def two(ctx: RunContext) -> None:
        await anyio.sleep_forever()

    close.step("three", lambda ctx: 3)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "sync")
        await claim_now(s, "sync", slot)
        await wait_status(s, "sync", slot, RunStatus.RETRYING)
        shown = await read_run(s.backend, "sync", slot)
        assert shown is not None and shown["store_status"] == "retrying"
        assert shown["lease_expires_at"] is None  # the retry's due time is not a lease
        wslot = slot_of(s, "close/one")
        await claim_now(s, "close", wslot)
        await wait_status(s, "close/two", wslot, RunStatus.RUNNING)
        await Admin(s.backend).cancel("close", wslot, grace=0)
        await wait_status(s, "close/two", wslot, RunStatus.CANCELLED)
        shown = await read_run(s.backend, "close", wslot)
        assert shown is not None and shown["status"] == "cancelled", shown
        await i.stop()


async def test_a_pause_leaves_a_waiting_retry_to_run_and_a_cancel_ends_it(store: Store) -> None:
    """A run waiting for its retry is in progress: a pause of its job does not stop its
    retries (as the guide says); a cancel ends it, with no retry after."""
    from lease_core import Admin

    tries: list[tuple[int, str]] = []
    s = make(store, "a")

    @s.every("sync", "1h", offset=quiet_offset_now(),
             retry=Retry(retries=3, backoff="0.4s", jitter=0))
    async def sync(ctx: RunContext) -> None:
        tries.append((ctx.attempt, ctx.reason))
        raise Transient(f"down {ctx.attempt}")

    admin = Admin(s.backend, by="ops")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = slot_of(s, "sync")
        await claim_now(s, "sync", slot)
        await wait_status(s, "sync", slot, RunStatus.RETRYING)
        await admin.pause("sync")
        await wait_for(lambda: len(tries) == 2, timeout=15, what="the retry, while paused")
        await wait_status(s, "sync", slot, RunStatus.RETRYING)  # the second one waits 0.8s
        await admin.cancel("sync", slot)
        await anyio.sleep(1.5)  # past the second retry's due time, and a backup check
        assert await run_status(s, "sync", slot) == RunStatus.CANCELLED
        await admin.resume("sync")
        await i.stop()
    assert tries == [(1, "scheduled"), (2, "retry")]
    log = await s.recovery_log(("sync", slot))
    assert [(e.attempt, e.event) for e in log] == [
        (1, "started"), (1, "failed"), (2, "retried"), (2, "failed"), (3, "cancelled")]
    assert log[-1].detail == "cancelled by ops before any instance claimed it (retry)"


async def test_a_no_retry_error_raised_through_a_task_group_is_not_retried(
        store: Store) -> None:
    """anyio's task groups raise exception groups: a ``no_retry`` type inside one is still
    not retried (it was, until the retries ran out)."""
    tries: list[int] = []
    s = make(store, "a")

    @s.every("grouped", "1h", offset=quiet_offset_now(),
             retry=Retry(retries=3, backoff=0, no_retry=(Fatal,)))
    async def grouped(ctx: RunContext) -> None:
        tries.append(ctx.attempt)

        async def part() -> None:
            raise Fatal("a bug: never retried")

        async with anyio.create_task_group() as tg:
            tg.start_soon(part)

    async with anyio.create_task_group() as tg:
        instance = await Instance(s).start(tg)
        slot = slot_of(s, "grouped")
        await claim_now(s, "grouped", slot)
        await wait_status(s, "grouped", slot, RunStatus.FAILED)
        await instance.stop()
    assert tries == [1]


async def test_a_step_whose_result_cannot_be_stored_is_not_run_again(store: Store) -> None:
    """Its handler ran to its end (its effects applied): a retry would apply them again."""
    effects: list[int] = []
    s = make(store, "a")
    flow = s.workflow("w", every="1h", offset=quiet_offset_now(), retry=Retry(2, backoff=0))

    @flow.step("pay")
    async def pay(ctx: RunContext) -> object:
        effects.append(ctx.attempt)  # a payment sent
        return object()  # not JSON

    async with anyio.create_task_group() as tg:
        instance = await Instance(s).start(tg)
        slot = slot_of(s, "w/pay")
        await claim_now(s, "w", slot)
        await wait_status(s, "w/pay", slot, RunStatus.FAILED)
        await instance.stop()
    assert effects == [1]
    history = await s.history("w/pay")
    assert history[0].error is not None and "the step's result" in history[0].error


def test_the_policy_with_groups_zero_backoff_and_jitter_at_the_cap() -> None:
    fatal = Retry(retries=1, no_retry=(Fatal,))
    assert not fatal.retries_error(ExceptionGroup("g", [Transient("x"), Fatal("y")]))
    assert fatal.retries_error(ExceptionGroup("g", [Transient("x")]))
    assert fatal.retries_error(None) and not fatal.retries_error(Fatal("y"))
    # no backoff stays none, even once factor ** n overflows
    assert max(Retry(retries=1000, backoff=0, factor=3, jitter=0).delays_ms()) == 0
    with pytest.raises(ConfigurationError, match="factor=inf"):
        Retry(factor=float("inf"))
    # jitter never takes a wait past max_backoff
    capped = Retry(retries=1, backoff="5m", max_backoff="5m", jitter=0.1)
    assert max(capped.delay_ms(1) for _ in range(500)) <= 300_000
    spread = {Retry(retries=1, backoff="1s", jitter=0.5).delay_ms(1) for _ in range(50)}
    assert len(spread) > 1 and all(500 <= d <= 1_500 for d in spread)
    # a zero cap under a backoff is refused, named (it was taken: every wait was 0)
    with pytest.raises(ConfigurationError, match=r"max_backoff=0 caps every wait at 0"):
        Retry(backoff="10s", max_backoff=0)
    assert Retry(backoff=0, max_backoff=0).delays_ms() == (0, 0, 0)


async def _fails_twice_and_runs_on(handlers: dict[str, Callable[[RunContext], Any]]) -> None:
    """Run each of ``handlers`` (a job name each, a retry after 0.1 s) on one scheduler:
    every job's two attempts fail with a CancelledError, and the scheduler runs on."""
    from lease_core import MemoryBackend, SchedulerState

    tries: list[tuple[str, int]] = []
    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    policy = Retry(retries=1, backoff="0.1s", jitter=0)
    for job, handler in handlers.items():
        if inspect.iscoroutinefunction(handler):  # stays async: awaited on the loop
            async def tried(ctx: RunContext, handler: Any = handler) -> None:
                tries.append((ctx.job, ctx.attempt))
                await handler(ctx)
        else:  # stays sync: run in a worker thread
            def tried(ctx: RunContext, handler: Any = handler) -> None:  # type: ignore[misc]
                tries.append((ctx.job, ctx.attempt))
                handler(ctx)
        s.every(job, "1h", tried, offset=quiet_offset_now(), retry=policy)

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        for job in handlers:
            await claim_now(s, job, slot_of(s, job))
        for job in handlers:
            await wait_status(s, job, slot_of(s, job), RunStatus.FAILED)
        assert s.state is SchedulerState.RUNNING
        await i.stop()
    assert sorted(tries) == sorted((job, n) for job in handlers for n in (1, 2))
    for job in handlers:
        errors = [a.error or "" for a in await s.history(job)]
        assert len(errors) == 2 and all("CancelledError" in e for e in errors), errors


def _raise_cancelled(ctx: RunContext) -> None:
    import asyncio

    raise asyncio.CancelledError


async def test_an_asyncio_cancelled_error_on_trio_fails_the_run() -> None:
    """On trio, asyncio's CancelledError cancels nothing (trio's cancellation is its own
    exception): a handler raising it fails its attempt (and is retried) on either loop;
    on trio it used to end the scheduler's task group, the scheduler with it."""
    import asyncio

    async def raises(ctx: RunContext) -> None:
        raise asyncio.CancelledError("from a library of asyncio's")

    await _fails_twice_and_runs_on({"raises": raises, "raises-sync": _raise_cancelled})


@pytest.mark.asyncio_only
async def test_a_stray_cancelled_error_fails_the_run_and_the_scheduler_runs_on() -> None:
    """A handler that lets out the CancelledError of a task it awaited (cancelled by
    someone else) is not cancelled itself: its attempt fails (and is retried), where it
    used to stop the whole scheduler silently, leaving the run to a backup that stopped
    alike."""
    import asyncio

    async def stray(ctx: RunContext) -> None:
        task = asyncio.ensure_future(asyncio.sleep(10))
        task.cancel()
        await task

    await _fails_twice_and_runs_on({"stray": stray, "stray-sync": _raise_cancelled})


def test_an_asyncio_cancelled_error_is_stray_on_trio_in_guest_mode() -> None:
    """trio run as a guest of an asyncio loop (``trio.lowlevel.start_guest_run``): a loop
    runs but no asyncio task does, and trio cancels with its own exception; the handler's
    asyncio CancelledError cancels nothing there either (it ended the task group)."""
    import asyncio

    import trio

    from lease_core.engine.execution import _stray

    async def on_trio() -> bool:
        return _stray(asyncio.CancelledError())

    async def host() -> bool:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(on_trio, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                                      done_callback=done.set_result)
        return bool((await done).unwrap())

    assert asyncio.run(host()) is True
