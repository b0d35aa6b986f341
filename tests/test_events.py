"""scheduler.subscribe(): typed events from real scenarios; slow subscribers delay nothing."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

import lease_core.engine.base
from lease_core import (
    AnarchonError,
    AttemptEnded,
    BackendUnavailable,
    Claimed,
    Completed,
    Escalated,
    Event,
    Failed,
    HandedOver,
    Lost,
    MemoryBackend,
    Outcome,
    Reason,
    Retry,
    RunContext,
    Scheduler,
    Skipped,
    StandingBy,
    StoreBack,
    StoreUnreachable,
    TakenOver,
    TimedOut,
)
from lease_core.retry import supports_retries
from lease_core.testing import claim_now, open_event_streams, subscriber_count
from tests.helpers import Unplugged, quiet_offset_now, wait_for, wait_history
from tests.stores import Store

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


class Recorder:
    """An async subscriber that keeps every event."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def current_slot(s: Scheduler, job: str) -> int:
    slot = s.jobs[job].schedule.previous_at_or_before(s.store_now_ms())
    assert slot is not None
    return slot


async def test_claim_stand_by_hand_over_take_over_and_complete(store: Store) -> None:
    seen = {"a": Recorder(), "b": Recorder()}
    schedulers = {}
    for name in ("a", "b"):
        s = Scheduler(store.backend(), instance_id=name, **FAST)

        @s.every("long", "1h", catch_up="none", offset=quiet_offset_now())
        async def long(ctx: RunContext) -> None:
            if ctx.attempt == 1:
                await anyio.sleep_forever()

        s.subscribe(seen[name])
        schedulers[name] = s
    a, b = schedulers["a"], schedulers["b"]
    await a.start()
    await b.start()
    try:
        slot = current_slot(a, "long")
        await claim_now(a, "long", slot)
        await claim_now(b, "long", slot)
        await a.stop(grace=0)
        await wait_for(lambda: seen["b"].of(Completed), what="b completes the run")
    finally:
        await b.stop(grace=0)
    [claimed_a] = seen["a"].of(Claimed)
    assert (claimed_a.instance_id, claimed_a.job, claimed_a.slot, claimed_a.attempt,
            claimed_a.reason) == ("a", "long", slot, 1, Reason.SCHEDULED)
    assert claimed_a.claim_duration >= 0 and claimed_a.scheduled_at.timestamp() * 1000 == slot
    [standing] = seen["b"].of(StandingBy)
    assert (standing.slot, standing.holder) == (slot, "a")
    [handed] = seen["a"].of(HandedOver)
    assert (handed.slot, handed.attempt, handed.outcome) == (slot, 1, Outcome.HANDED_OVER)
    assert [(e.attempt, e.reason) for e in seen["b"].of(Claimed)] == [(2, Reason.HAND_OVER)]
    assert [(e.attempt, e.reason) for e in seen["b"].of(TakenOver)] == [(2, Reason.HAND_OVER)]
    [done] = seen["b"].of(Completed)
    assert (done.slot, done.attempt, done.reason, done.outcome) == (
        slot, 2, Reason.HAND_OVER, Outcome.COMPLETED)
    assert done.duration >= 0


async def test_a_subscribe_while_a_stop_delivers_the_last_events_does_not_hold_it_up() -> None:
    """A callback subscribed by a subscriber as the stop delivered its last events was fed
    through a stream nothing closed, so the stop waited max(1 s, heartbeat) for it."""
    s = Scheduler(MemoryBackend(), instance_id="a", lease="30s", heartbeat="10s")
    late: list[Event] = []
    handed: list[HandedOver] = []

    @s.every("long", "1h", offset=quiet_offset_now())
    async def long(ctx: RunContext) -> None:
        await anyio.sleep_forever()

    async def on_event(event: Event) -> None:
        if isinstance(event, HandedOver):
            handed.append(event)
            await anyio.sleep(0.3)  # so that the stop's delivery of the last events runs
            s.subscribe(late.append)

    s.subscribe(on_event)
    await s.start()
    await claim_now(s, "long", current_slot(s, "long"))
    with anyio.fail_after(5):  # 10 s before
        await s.stop(grace=0)
    assert len(handed) == 1 and subscriber_count(s) == 2 and late == []  # kept, not fed


@pytest.mark.asyncio_only
async def test_a_subscribe_from_another_thread_while_running_says_where_to_call_it() -> None:
    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    s.every("x", "1h", lambda ctx: None, offset=quiet_offset_now())
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            s.subscribe(lambda e: None)
        except BaseException as exc:
            errors.append(exc)

    async with s:
        before = subscriber_count(s)
        await anyio.to_thread.run_sync(elsewhere)
        assert subscriber_count(s) == before  # nothing registered
    [error] = errors
    assert isinstance(error, AnarchonError) and "event loop's thread" in str(error)


async def test_a_backup_of_a_run_waiting_for_its_retry_names_no_holder(
        store: Store) -> None:
    """A run that waits for its retry holds no lease: a member that finds it so stands by
    naming no holder (it named the failed attempt's instance, this one's own at times)."""
    seen = {"a": Recorder(), "b": Recorder()}
    schedulers = {}
    for name in ("a", "b"):
        s = Scheduler(store.backend(), instance_id=name, **FAST)

        @s.every("flaky", "1h", retry=Retry(retries=1, backoff="1h", max_backoff="1h"),
                 offset=quiet_offset_now())
        async def flaky(ctx: RunContext) -> None:
            raise RuntimeError("boom")

        s.subscribe(seen[name])
        schedulers[name] = s
    a, b = schedulers["a"], schedulers["b"]
    if not supports_retries(a.backend):
        pytest.skip(f"{type(a.backend).__name__} has no retry_later()")
    await a.start()
    await b.start()
    try:
        slot = current_slot(a, "flaky")
        await claim_now(a, "flaky", slot)
        await wait_for(lambda: seen["a"].of(Failed), what="the attempt failed, retry later")
        await claim_now(b, "flaky", slot)
        await wait_for(lambda: seen["b"].of(StandingBy), what="b stands by")
    finally:
        await a.stop(grace=0)
        await b.stop(grace=0)
    [standing] = seen["b"].of(StandingBy)
    assert (standing.slot, standing.holder) == (slot, None)


async def test_failed_timed_out_and_skipped() -> None:
    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    seen = Recorder()
    s.subscribe(seen)

    @s.every("boom", "1h", catch_up="none", offset=quiet_offset_now())
    async def boom(ctx: RunContext) -> None:
        raise ValueError("boom")

    @s.every("slow", "1h", catch_up="none", offset=quiet_offset_now(), timeout="0.3s")
    async def slow(ctx: RunContext) -> None:
        await anyio.sleep_forever()

    async with s:
        for job in ("boom", "slow"):
            await claim_now(s, job, current_slot(s, job))
        # The next slot of "slow" while the current one still holds its lease.
        skipped_slot = current_slot(s, "slow") + 3_600_000
        await claim_now(s, "slow", skipped_slot)
        await wait_for(lambda: seen.of(Failed) and seen.of(TimedOut), what="both ends")
    [failed] = seen.of(Failed)
    assert failed.job == "boom" and isinstance(failed.error, ValueError)
    assert failed.outcome == Outcome.FAILED
    [timed_out] = seen.of(TimedOut)
    assert timed_out.job == "slow" and timed_out.duration >= 0.3
    assert [(e.job, e.slot) for e in seen.of(Skipped)] == [("slow", skipped_slot)]


async def test_store_unreachable_lost_store_back_and_escalated() -> None:
    backend = Unplugged()
    s = Scheduler(backend, instance_id="a", **FAST)
    seen = Recorder()
    s.subscribe(seen)

    @s.every("long", "1h", catch_up="none", offset=quiet_offset_now(), max_attempts=1)
    async def long(ctx: RunContext) -> None:
        await anyio.sleep_forever()

    async with s:
        slot = current_slot(s, "long")
        await claim_now(s, "long", slot)
        await wait_for(lambda: s.running, what="the handler")
        backend.down = True
        await wait_for(lambda: seen.of(Lost), timeout=5, what="the lease lost")
        backend.down = False
        await wait_for(lambda: seen.of(Escalated), timeout=10, what="the run escalated")
    [unreachable] = seen.of(StoreUnreachable)
    assert isinstance(unreachable.error, BackendUnavailable)
    [lost] = seen.of(Lost)
    assert (lost.slot, lost.attempt, lost.why) == (slot, 1, "lease not renewed in time")
    [back] = seen.of(StoreBack)
    assert back.downtime > 0
    assert seen.events.index(unreachable) < seen.events.index(back)
    [escalated] = seen.of(Escalated)
    assert (escalated.slot, escalated.attempt) == (slot, 1)
    history = await backend.history("long")
    assert [h.outcome for h in history] == [Outcome.ESCALATED]


async def test_slow_and_failing_subscribers_delay_no_heartbeat(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lease_core.engine.base, "EVENT_BUFFER", 1)
    monkeypatch.setattr(lease_core.engine.base, "EVENTS_PER_JOB", 0)  # 1 event in all
    backend = MemoryBackend()
    s = Scheduler(backend, instance_id="a", **FAST)
    release = threading.Event()
    failures: list[Event] = []

    async def stuck(event: Event) -> None:
        await anyio.sleep(3600)

    def slow(event: Event) -> None:
        release.wait(30)

    def failing(event: Event) -> None:
        failures.append(event)
        time.sleep(0.05)
        raise RuntimeError("subscriber bug (test)")

    for callback in (stuck, slow, failing):
        s.subscribe(callback)
    seen = Recorder()
    unsubscribe = s.subscribe(seen)

    @s.every("long", "1h", catch_up="none", offset=quiet_offset_now())
    async def long(ctx: RunContext) -> None:
        # Several leases long: each must be renewed in time.
        await anyio.sleep(3.0)

    async with s:
        slot = current_slot(s, "long")
        await claim_now(s, "long", slot)
        await claim_now(s, "long", slot + 3_600_000)  # skipped
        history = await wait_history(
            s, lambda h: any(a.slot == slot and a.outcome for a in h), job="long")
        await wait_for(lambda: len(failures) >= 2, what="the failing subscriber called again")
        unsubscribe()
        release.set()
    assert [(h.attempt, h.outcome) for h in history if h.slot == slot] == [
        (1, Outcome.COMPLETED)
    ]
    assert s.events_dropped > 0
    assert [type(e) for e in seen.events] == [Claimed, Skipped, Completed]
    errors = [r for r in caplog.records if "event subscriber" in r.getMessage()]
    assert errors and errors[0].exc_info is not None


async def test_unsubscribing_while_running_releases_the_subscriber() -> None:
    """Subscribing and unsubscribing many times in a running scheduler keeps nothing."""
    s = Scheduler(MemoryBackend(), heartbeat="100ms", lease="1s")
    async with s:
        for _ in range(50):
            unsubscribe = s.subscribe(Recorder())
            unsubscribe()
        await wait_for(lambda: not open_event_streams(s) and not subscriber_count(s),
                       what="every unsubscribed receiver released")


class FinishUnanswered(MemoryBackend):
    """A store whose finishes of the first attempt get no answer (they raise as a dropped
    connection), also when sent again within the lease."""

    token: str | None = None

    async def finish_many(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        if any(self.token in (None, lease.token) for lease, _, _ in items):
            self.token = self.token or items[0][0].token
            raise BackendUnavailable("finish unanswered (test)")
        return await super().finish_many(items, *args, **kwargs)


async def test_an_attempt_whose_finish_is_unanswered_still_reports_its_end() -> None:
    """Its run was backed up before its end was reported, and the report found no
    attempt: Claimed was never followed by an end (and a lease gauge stayed up)."""
    recorder = Recorder()
    s = Scheduler(FinishUnanswered(), instance_id="a", **FAST)
    s.subscribe(recorder)
    s.every("j", "1h", lambda ctx: None, offset=quiet_offset_now())
    async with s:
        slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "j", slot)
        await wait_for(lambda: sum(isinstance(e, Completed) for e in recorder.events) == 2,
                       what="the attempt's end, then the takeover's")
    ends = [(type(e).__name__, e.attempt) for e in recorder.events
            if isinstance(e, (Claimed, Completed, Lost))]
    assert ends == [("Claimed", 1), ("Completed", 1), ("Claimed", 2), ("Completed", 2)], ends


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_subscriber_that_exits_is_logged_and_ends_nothing(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """Its sys.exit() (or a KeyboardInterrupt) used to end the event loop, with every
    scheduler on it; it is logged as a subscriber's failure, and the scheduler goes on."""
    import sys

    seen: list[str] = []

    def sync_bad(event: Event) -> None:
        seen.append(type(event).__name__)
        sys.exit(3)

    async def async_bad(event: Event) -> None:
        seen.append(type(event).__name__)
        raise KeyboardInterrupt

    await run_one_with_subscriber(sync_bad if kind == "sync" else async_bad, seen)
    assert "event subscriber" in caplog.text


async def run_one_with_subscriber(subscriber: Any, seen: list[str]) -> None:
    """Run one run of a job with ``subscriber``, which records the events it gets in
    ``seen`` and fails on each: the run completes and the scheduler runs on, ready."""
    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    s.subscribe(subscriber)
    s.every("j", "1h", lambda ctx: None, offset=quiet_offset_now())
    async with s:
        slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "j", slot)
        await wait_for(lambda: "Completed" in seen, what="both events, each failing")
        assert s.state == "running"
        assert s.health().ready



@pytest.mark.parametrize("kind", ["lambda", "wrapper"])
async def test_a_sync_handler_that_returns_a_coroutine_fails_its_run(kind: str) -> None:
    """``every("j", "1h", lambda ctx: work(ctx))`` with ``async def work``: the lambda is a
    plain function, so it ran in a worker thread and returned ``work``'s coroutine, which
    nobody awaited; the run was recorded ``completed`` and ``work`` never ran."""
    ran: list[int] = []

    async def work(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    def wrapper(ctx: RunContext) -> Any:
        return work(ctx)

    recorder = Recorder()
    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    s.subscribe(recorder)
    s.every("j", "1h", (lambda ctx: work(ctx)) if kind == "lambda" else wrapper,
            offset=quiet_offset_now())
    async with s:
        await claim_now(s, "j", current_slot(s, "j"))
        await wait_for(lambda: recorder.of(Failed) or recorder.of(Completed),
                       what="the attempt's end")
        history = await s.history("j")
    assert not recorder.of(Completed), "recorded completed, its coroutine never run"
    [failed] = recorder.of(Failed)
    assert "returned a coroutine of " in str(failed.error), failed.error
    assert "work without running it" in str(failed.error) and "'async def'" in str(failed.error)
    assert [a.outcome for a in history] == [Outcome.FAILED]
    assert ran == []


@pytest.mark.parametrize("kind", ["generator", "async generator"])
async def test_a_sync_handler_that_returns_a_generator_fails_its_run(kind: str) -> None:
    """A plain wrapper of a function with ``yield`` (``lambda ctx: export(ctx)``) returned a
    generator in its worker thread, whose body nobody ran; the run was recorded
    ``completed``. It fails, naming the generator and the ``yield``."""
    ran: list[int] = []

    def export(ctx: RunContext) -> Any:
        ran.append(ctx.slot)
        yield 1

    async def export_async(ctx: RunContext) -> Any:
        ran.append(ctx.slot)
        yield 1

    work = export if kind == "generator" else export_async
    recorder = Recorder()
    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    s.subscribe(recorder)
    s.every("j", "1h", lambda ctx: work(ctx), offset=quiet_offset_now())
    async with s:
        await claim_now(s, "j", current_slot(s, "j"))
        await wait_for(lambda: recorder.of(Failed) or recorder.of(Completed),
                       what="the attempt's end")
        history = await s.history("j")
    assert not recorder.of(Completed), "recorded completed, its body never run"
    [failed] = recorder.of(Failed)
    assert f"returned a {'generator' if kind == 'generator' else 'async_generator'} of " \
        f"{work.__qualname__} without running it" in str(failed.error), failed.error
    assert "a function with 'yield' runs none of its body" in str(failed.error)
    assert [a.outcome for a in history] == [Outcome.FAILED]
    assert ran == []


async def test_checkpoint_calls_of_the_other_kind_fail_the_run_naming_the_right_one() -> None:
    """A sync handler's ``ctx.checkpoint.set(5)`` (the coroutine method, not ``set_sync``)
    made a coroutine nobody awaited: nothing was stored, and the run was recorded
    ``completed``. An async handler's ``set_sync(5)`` raised anyio's "Not running inside an
    AnyIO worker thread". Each fails the run with a message that names the call to make."""
    backend = MemoryBackend()
    recorder = Recorder()
    s = Scheduler(backend, instance_id="a", **FAST)
    s.subscribe(recorder)

    def sync_handler(ctx: RunContext) -> None:
        ctx.checkpoint.set(5)  # type: ignore[unused-coroutine]

    async def async_handler(ctx: RunContext) -> None:
        ctx.checkpoint.set_sync(5)

    s.every("sync", "1h", sync_handler, offset=quiet_offset_now())
    s.every("async", "1h", async_handler, offset=quiet_offset_now())
    async with s:
        for job in ("sync", "async"):
            await claim_now(s, job, current_slot(s, job))
        await wait_for(lambda: len(recorder.of(Failed)) + len(recorder.of(Completed)) == 2,
                       what="both attempts' ends")
        slots = {job: current_slot(s, job) for job in ("sync", "async")}
    assert not recorder.of(Completed)
    errors = {e.job: str(e.error) for e in recorder.of(Failed)}
    assert errors == {
        "sync": "ctx.checkpoint.set() returns a coroutine, which a sync handler (it runs in a "
                "worker thread) cannot await: call ctx.checkpoint.set_sync(value) there, or "
                "declare the handler 'async def' and await ctx.checkpoint.set()",
        "async": "ctx.checkpoint.set_sync() is for sync handlers, which run in worker "
                 "threads; in an async handler, await ctx.checkpoint.set(value)"}, errors
    for job, slot in slots.items():  # (the memory store answers outside start() too)
        assert await backend.get_checkpoint(job, slot) is None


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_subscriber_letting_out_a_stray_cancellation_is_logged_and_ends_nothing(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """A subscriber that let out a CancelledError it was not cancelled by (a task or
    future it awaited was cancelled) stopped the scheduler silently (stopped, nothing
    logged). It is logged as the subscriber's failure; it stays subscribed and the
    scheduler runs."""
    import asyncio

    seen: list[str] = []

    def sync_bad(event: Event) -> None:
        seen.append(type(event).__name__)
        raise asyncio.CancelledError

    async def async_bad(event: Event) -> None:
        seen.append(type(event).__name__)
        raise asyncio.CancelledError

    await run_one_with_subscriber(sync_bad if kind == "sync" else async_bad, seen)
    assert seen == ["Claimed", "Completed"]
    failures = [r for r in caplog.records if "event subscriber" in r.getMessage()]
    assert len(failures) == 2, caplog.text


@pytest.mark.parametrize("kind", ["coroutine", "generator"])
async def test_a_plain_subscriber_that_returns_a_coroutine_is_logged_as_failing(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """``subscribe(lambda event: record(event))`` with ``async def record``: the lambda is a
    plain function, run in a worker thread, which returned ``record``'s coroutine; nobody
    awaited it, so no event was ever recorded, and nothing but a RuntimeWarning at its
    collection said so. It is logged as the subscriber's failure at each event, naming
    the coroutine (or the generator, of a function with ``yield``)."""
    seen: list[str] = []

    async def record(event: Event) -> None:
        seen.append(type(event).__name__)

    def export(event: Event) -> Any:
        seen.append(type(event).__name__)
        yield event

    def failures() -> list[str]:
        return [str(r.exc_info[1]) for r in caplog.records
                if "event subscriber" in r.getMessage() and r.exc_info]

    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    s.subscribe((lambda e: record(e)) if kind == "coroutine" else (lambda e: export(e)))
    s.every("j", "1h", lambda ctx: None, offset=quiet_offset_now())
    async with s:
        await claim_now(s, "j", current_slot(s, "j"))
        await wait_for(lambda: len(failures()) == 2,
                       what="Claimed and Completed logged as the subscriber's failures")
        assert s.health().ready
    made = ("returned a coroutine of " if kind == "coroutine"
            else "returned a generator of ")
    ran = ".record without running it" if kind == "coroutine" else ".export without running it"
    hint = "'async def'" if kind == "coroutine" else "'yield'"
    assert all(made in error and ran in error and hint in error
               for error in failures()), failures()
    assert seen == []


@pytest.mark.parametrize("then", ["completes", "is-cancelled"])
async def test_a_frozen_holder_whose_run_was_taken_over_reports_its_attempt_lost(
        then: str) -> None:
    """A holder frozen past its lease (as the store sees it) whose run a backup took over
    finishes, and the store refuses the finish: its attempt is ``lost`` in the history.
    It was reported as the handler ended (a second Completed for the run, counted twice
    in anarchon.attempts), or Cancelled when an operator had cancelled the backup's
    attempt meanwhile (another instance's attempt, not this one)."""
    release = anyio.Event()

    async def j(ctx: RunContext) -> None:
        if ctx.attempt == 1:
            await release.wait()
        elif then == "is-cancelled":
            await anyio.sleep_forever()

    pair = FrozenHolder(j)
    a, b = pair.schedulers
    async with a, b:
        slot = await pair.take_over()
        if then == "is-cancelled":
            async with b.admin as admin:
                await admin.cancel("j", slot, grace=0)
        release.set()
        await wait_for(lambda: pair.seen["a"].of(AttemptEnded), what="the end of a's attempt")
        await pair.check_lost("lease lost before finishing")


async def test_a_frozen_holder_whose_hand_over_is_refused_reports_its_attempt_lost() -> None:
    """As above, at a stop: the hand-over of a run a backup took over and an operator
    then cancelled is refused; the holder's attempt was reported Cancelled (the backup's
    attempt was cancelled, not this one, which the history has lost)."""
    async def j(ctx: RunContext) -> None:
        await anyio.sleep_forever()

    pair = FrozenHolder(j)
    a, b = pair.schedulers
    async with b:
        await a.start()
        try:
            slot = await pair.take_over()
            async with b.admin as admin:
                await admin.cancel("j", slot, grace=0)
        finally:
            await a.stop(grace=0)
        await pair.check_lost("not handed over")


class FrozenHolder:
    """Two schedulers, ``a`` and ``b``, running ``handler`` as job ``j`` on one memory
    store whose clock can jump ahead; a long heartbeat, so that a holder learns of a
    takeover only by its refused finish or hand-over."""

    def __init__(self, handler: Any) -> None:
        self.jump = 0.0
        backend = MemoryBackend(clock=lambda: time.time() + self.jump)
        self.seen = {"a": Recorder(), "b": Recorder()}
        self.schedulers = []
        for name in ("a", "b"):
            s = Scheduler(backend, instance_id=name, lease="30s", heartbeat="5s")
            s.every("j", "1h", handler, catch_up="none", offset=quiet_offset_now())
            s.subscribe(self.seen[name])
            self.schedulers.append(s)

    async def take_over(self) -> int:
        """``a`` claims the current slot and runs it; then, ``a`` frozen as the store sees
        it (its lease expired), ``b`` takes the run over. Returns the slot."""
        a, b = self.schedulers
        slot = current_slot(a, "j")
        await claim_now(a, "j", slot)
        await wait_for(lambda: a.health().runs_held == 1, what="a runs the handler")
        self.jump = 31.0
        await claim_now(b, "j", slot)
        await wait_for(lambda: self.seen["b"].of(Claimed), what="b takes the run over")
        return slot

    async def check_lost(self, why: str) -> None:
        """``a``'s attempt is ``lost`` in the history, and was reported ``Lost`` (``why``),
        once, as the only end of its attempt."""
        history = await self.schedulers[1].history("j")
        assert [(h.attempt, h.instance_id, h.outcome) for h in history][-1] == (
            1, "a", Outcome.LOST)
        assert [(type(e).__name__, e.attempt) for e in self.seen["a"].of(AttemptEnded)] == [
            ("Lost", 1)]
        [lost] = self.seen["a"].of(Lost)
        assert lost.why == why
