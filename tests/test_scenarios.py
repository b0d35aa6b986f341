"""Scheduler scenarios through the public API, on every store that runs scenarios.

Instances are schedulers running in their own tasks (see tests/helpers.py); slots are one
second apart, leases short, and every wait has a deadline. Tests about one run declare an
hourly job whose next slot is half an hour away (``quiet``) and claim its current slot
themselves, so no slot of the schedule fires while they run.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from lease_core import Attempt, Outcome, Reason, Retry, RunContext, Scheduler, StopRequested
from lease_core._outcome import MAX_ERROR_BYTES
from lease_core.abc import HeartbeatResult, Lease
from lease_core.testing import claim_now
from tests.helpers import (
    Instance,
    quiet_offset,
    started,
    stop_all,
    store_now_ms,
    wait_for,
    wait_history,
    wait_mid_slot,
)
from tests.stores import Store

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


def make(store: Store, name: str, **kw: Any) -> Scheduler:
    options = {**FAST, **kw}
    return Scheduler(store.backend(), instance_id=name, **options)


async def quiet(store: Store) -> float:
    """The offset of an hourly job whose next slot is half an hour from the store's now."""
    return quiet_offset(await store_now_ms(store.backend()))


async def test_three_instances_run_each_slot_exactly_once(store: Store) -> None:
    ran: list[tuple[int, str]] = []
    schedulers = []
    for name in ("a", "b", "c"):
        s = make(store, name)

        async def tick(ctx: RunContext, name: str = name) -> None:
            assert ctx.scheduled_at.tzinfo is not None
            assert ctx.scheduled_at.timestamp() * 1000 == ctx.slot
            ran.append((ctx.slot, name))

        s.every("tick", "1s", tick)
        schedulers.append(s)
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in schedulers]
        await wait_for(lambda: len({slot for slot, _ in ran}) >= 3, timeout=10, what="3 slots")
        # Stop between two slots: a claim in flight would be handed over, not run.
        await wait_mid_slot(schedulers[0])
        await stop_all(instances)
    counts = Counter(slot for slot, _ in ran)
    assert counts and max(counts.values()) == 1, counts
    history = await schedulers[0].history("tick")
    assert {h.slot for h in history} == set(counts)
    assert all(h.attempt == 1 and h.reason == "scheduled" for h in history)
    assert all(h.outcome == "completed" for h in history)
    assert all(h.claimed_at >= h.scheduled_at for h in history)


async def test_crashed_instance_is_taken_over_with_attempt_2(store: Store) -> None:
    offset = await quiet(store)
    started: list[tuple[str, int, int]] = []
    release = anyio.Event()

    def build(name: str) -> Scheduler:
        s = make(store, name)

        @s.every("long", "1h", offset=offset)
        async def long(ctx: RunContext) -> None:
            started.append((name, ctx.attempt, ctx.slot))
            await ctx.checkpoint.set({"by": name, "attempt": ctx.attempt})
            await release.wait()

        return s

    a, b = build("a"), build("b")
    # The job's next slot is half an hour away: claim the current slot directly.
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        slot = a.jobs["long"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "long", slot)
        ib = await Instance(b).start(tg)
        await claim_now(b, "long", slot)
        assert b.watching == [("long", slot)]
        await wait_for(lambda: started, what="first attempt")
        ia.crash()
        await ia.wait_done()
        await wait_for(lambda: len(started) == 2, timeout=10, what="takeover")
        assert started[1][:2] == ("b", 2)

        async def checkpointed() -> bool:
            return await b.backend.get_checkpoint("long", slot) == {"by": "b", "attempt": 2}

        await wait_for(checkpointed, what="attempt 2's checkpoint")
        release.set()
        history = await wait_history(b, lambda h: h and h[0].outcome == "completed", job="long")
        await ib.stop()
    assert [(h.attempt, h.instance_id, h.reason, h.outcome) for h in history] == [
        (2, "b", Reason.TAKEOVER, Outcome.COMPLETED),
        (1, "a", Reason.SCHEDULED, Outcome.LOST),
    ]


async def test_stop_hands_over_well_before_the_lease_expires(store: Store) -> None:
    offset = await quiet(store)
    progress: list[tuple[str, int, Any]] = []

    def build(name: str) -> Scheduler:
        s = make(store, name, lease="20s")

        @s.every("batch", "1h", offset=offset)
        async def batch(ctx: RunContext) -> None:
            done = await ctx.checkpoint.get() or 0
            progress.append((name, ctx.attempt, done))
            for item in range(done, 200):
                ctx.raise_if_stopping()
                await ctx.checkpoint.set(item + 1)
                await anyio.sleep(0.005 if name == "b" else 0.05)

        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        slot = a.jobs["batch"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "batch", slot)
        ib = await Instance(b).start(tg)
        await claim_now(b, "batch", slot)
        await wait_for(lambda: progress, what="a running")
        await wait_for(lambda: b.backend.get_checkpoint("batch", slot), what="some progress")
        stopped_at = time.monotonic()
        await ia.stop(grace=5)
        await wait_for(lambda: len(progress) == 2, timeout=5, what="hand-over")
        took = time.monotonic() - stopped_at
        assert took < 5, f"hand-over took {took:.1f}s; the lease is 20s"
        history = await wait_history(b, lambda h: h[0].outcome == "completed", job="batch",
                                     timeout=30)
        await ib.stop()
    name, attempt, resumed_from = progress[1]
    assert (name, attempt) == ("b", 2)
    assert resumed_from > 0  # the checkpoint carried over
    async with started(b.backend):
        assert await b.backend.get_checkpoint("batch", slot) == 200
    assert [(h.attempt, h.reason, h.outcome) for h in history] == [
        (2, Reason.HAND_OVER, Outcome.COMPLETED),
        (1, Reason.SCHEDULED, Outcome.HANDED_OVER),
    ]


async def test_stop_grace_cancels_a_stubborn_handler_and_hands_it_over(store: Store) -> None:
    offset = await quiet(store)
    cancelled = anyio.Event()
    a = make(store, "a")

    @a.every("stubborn", "1h", offset=offset)
    async def stubborn(ctx: RunContext) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        slot = a.jobs["stubborn"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "stubborn", slot)
        await wait_for(lambda: a.running, what="running")
        await ia.stop(grace=0.2)
    assert cancelled.is_set()
    history = await a.history("stubborn")
    assert [(h.attempt, h.outcome) for h in history] == [(1, Outcome.HANDED_OVER)]


async def test_overlap_skip_records_the_skipped_slot(store: Store) -> None:
    a = make(store, "a")

    @a.every("slow", "1s")
    async def slow(ctx: RunContext) -> None:
        await anyio.sleep(2.5)

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        history = await wait_history(
            a, lambda h: any(x.outcome == "skipped" for x in h), job="slow", timeout=10
        )
        await ia.stop()
    skipped = [h for h in history if h.outcome == "skipped"]
    ran = [h for h in history if h.outcome != "skipped"]
    assert skipped and ran
    assert min(h.slot for h in ran) < min(h.slot for h in skipped)


async def test_overlap_allow_runs_slots_concurrently(store: Store) -> None:
    a = make(store, "a")
    live = 0
    peak = 0

    @a.every("wide", "1s", overlap="allow")
    async def wide(ctx: RunContext) -> None:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        try:
            await anyio.sleep(2.2)
        finally:
            live -= 1

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        await wait_for(lambda: peak >= 2, timeout=10, what="two concurrent runs")
        await ia.stop(grace=5)
    history = await a.history("wide")
    assert not [h for h in history if h.outcome == "skipped"]


async def test_timeout_cancels_and_records_timed_out(store: Store) -> None:
    a = make(store, "a")
    cancelled = anyio.Event()
    reasons: list[str | None] = []

    @a.every("hang", "1s", timeout="0.3s")
    async def hang(ctx: RunContext) -> None:
        try:
            await anyio.sleep_forever()
        finally:  # the cancellation's cleanup knows why (it was None there)
            reasons.append(ctx.stop_reason)
            cancelled.set()

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        # The first run (the oldest attempt) has ended; a later slot may have been skipped.
        history = await wait_history(a, lambda h: h and h[-1].outcome, job="hang")
        await ia.stop()
    assert cancelled.is_set()
    assert reasons[0] == "timed out", reasons
    done = [h for h in history if h.outcome]
    assert done[-1].outcome == Outcome.TIMED_OUT
    assert done[-1].error is not None and "timed out" in done[-1].error


async def test_raise_if_stopping_at_the_timeout_records_timed_out(store: Store) -> None:
    """A handler that checks ``ctx.raise_if_stopping()`` between items and has not
    awaited since its timeout passed is stopped by that check ("timed out"), before the
    timeout's cancellation can reach it: the run timed out, it did not fail."""
    a = make(store, "a")
    seen: list[str] = []

    @a.every("items", "1s", timeout="0.3s")
    async def items(ctx: RunContext) -> None:
        await anyio.sleep(0.05)
        try:
            for _ in range(400):  # 2 s of items that never await (CPU work, blocking)
                ctx.raise_if_stopping()
                time.sleep(0.005)  # noqa: ASYNC251 (work that blocks, on purpose)
        except StopRequested as stopped:
            seen.append(str(stopped))
            raise

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        history = await wait_history(a, lambda h: h and h[-1].outcome, job="items")
        await ia.stop()
    assert seen and seen[0].endswith("asked to stop: timed out"), seen
    done = [h for h in history if h.outcome]
    assert done[-1].outcome == Outcome.TIMED_OUT, done[-1]


async def test_failed_handler_records_the_error(store: Store) -> None:
    a = make(store, "a")
    # A huge error text is stored cut to MAX_ERROR_BYTES, its start and end kept, by a
    # finish and by a retry_later alike; a small one as it is.
    huge = "disk full: " + "x" * 200_000 + " at the end"

    @a.every("bad", "1s")
    async def bad(ctx: RunContext) -> None:
        raise RuntimeError("disk full")

    @a.every("huge", "1s", retry=Retry(retries=1, backoff=0))
    async def huge_error(ctx: RunContext) -> None:
        raise RuntimeError(huge)

    def retried(h: list[Attempt]) -> bool:
        return any(x.reason == Reason.RETRY and x.outcome == Outcome.FAILED for x in h)

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        history = await wait_history(a, lambda h: h and h[-1].outcome, job="bad")
        cut = await wait_history(a, retried, job="huge", what="a failed retry of huge")
        await ia.stop()
    failed = [h for h in history if h.outcome][-1]
    assert failed.outcome == Outcome.FAILED
    assert failed.error == "RuntimeError: disk full"
    cut = [x for x in cut if x.outcome == Outcome.FAILED]
    assert len(cut) >= 2, cut
    for attempt in cut:
        error = attempt.error or ""
        assert len(error.encode()) <= MAX_ERROR_BYTES, len(error)
        assert error.startswith("RuntimeError: disk full: xxx"), error[:40]
        assert error.endswith("xxx at the end"), error[-40:]
        assert re.search(r"xxx … \[\d+ characters cut\] … xxx", error), error


async def test_an_error_text_no_store_can_encode_still_fails_the_run_once(
    store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    # The engine logs the error as raised; pytest-xdist cannot send such a log line to
    # its controller, so this test's log is kept to what it needs.
    caplog.set_level(logging.CRITICAL, logger="anarchon")
    a = make(store, "a")
    calls: list[int] = []
    name = os.fsdecode(b"report-\xff.csv")  # a file name that is not UTF-8

    @a.every("bad", "1s")
    async def bad(ctx: RunContext) -> None:
        calls.append(ctx.slot)
        raise ValueError(f"cannot parse {name} at \x00")  # and a NUL from binary data

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        history = await wait_history(a, lambda h: h and h[-1].outcome, job="bad")
        await ia.stop()
    failed = [h for h in history if h.outcome][-1]
    assert (failed.outcome, failed.attempt) == (Outcome.FAILED, 1)
    assert failed.error is not None
    assert "report-\\udcff.csv at \\x00" in failed.error
    assert calls.count(failed.slot) == 1


async def test_escalation_after_max_attempts_stops_takeovers(store: Store) -> None:
    offset = await quiet(store)
    attempts: list[int] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)

        @s.every("fragile", "1h", max_attempts=2, offset=offset)
        async def fragile(ctx: RunContext) -> None:
            attempts.append(ctx.attempt)
            await anyio.sleep_forever()

        return s

    a, b, c = build("a"), build("b"), build("c")
    async with anyio.create_task_group() as tg:
        instances = {}
        slot = None
        for s in (a, b, c):
            instances[s.instance_id] = await Instance(s).start(tg)
            slot = slot or s.jobs["fragile"].schedule.previous_at_or_before(s.store_now_ms())
            assert slot is not None
            await claim_now(s, "fragile", slot)
        await wait_for(lambda: attempts == [1], what="attempt 1")
        instances["a"].crash()
        await wait_for(lambda: attempts == [1, 2], timeout=10, what="attempt 2")
        holder = next(s for s in (b, c) if s.running)
        instances[holder.instance_id].crash()
        history = await wait_history(
            a, lambda h: any(x.outcome == "escalated" for x in h), job="fragile", timeout=10
        )
        for i in instances.values():
            await i.stop()
    assert attempts == [1, 2]
    assert [(h.attempt, h.outcome) for h in history] == [
        (2, Outcome.ESCALATED), (1, Outcome.LOST)
    ]


async def test_catch_up_after_downtime(store: Store) -> None:
    def build(name: str, catch_up: str) -> Scheduler:
        s = make(store, name)
        s.every("daily", "1s", lambda ctx: None, catch_up=catch_up)
        return s

    first = build("first", "latest")
    async with anyio.create_task_group() as tg:
        i = await Instance(first).start(tg)
        await wait_history(first, lambda h: h, job="daily", what="one run")
        await i.stop()
    last_run = max(h.slot for h in await first.history("daily"))
    # Downtime: three slots pass with no instance up.
    await wait_for(lambda: first.store_now_ms() > last_run + 3500, timeout=10, what="downtime")
    late = build("late", "latest")
    async with anyio.create_task_group() as tg:
        i = await Instance(late).start(tg)
        history = await wait_history(
            late, lambda h: any(x.reason == "catch-up" for x in h), job="daily"
        )
        await i.stop()
    caught = [h for h in history if h.reason == "catch-up"]
    assert len(caught) == 1
    assert caught[0].slot > last_run + 2000  # the latest missed slot, not the oldest


async def test_catch_up_all_and_none(store: Store) -> None:
    """One instance ran both jobs, then none did for over three slots: the next instance
    catches up every missed slot of the ``catch_up="all"`` job and none of the other's."""
    jobs = {"all": "c-all", "none": "c-none"}

    def make_one(name: str) -> Scheduler:
        s = Scheduler(store.backend(), instance_id=name, **FAST)
        for policy, job in jobs.items():
            s.every(job, "0.5s", lambda ctx: None, catch_up=policy)
        return s

    s = make_one("one")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        for job in jobs.values():
            await wait_history(s, lambda h: h, job=job)
        await i.stop()
    last_run = max([h.slot for job in jobs.values() for h in await s.history(job)])
    await wait_for(lambda: s.store_now_ms() > last_run + 1750, timeout=10, what="downtime")
    s2 = make_one("two")
    async with anyio.create_task_group() as tg:
        i = await Instance(s2).start(tg)
        # Wait for one regular slot of each so catch-up (if any) has happened.
        for job in jobs.values():
            await wait_history(
                s2,
                lambda h: any(x.reason == "scheduled" and x.instance_id == "two" for x in h)
                and all(x.outcome for x in h if x.reason == "catch-up"),
                job=job,
            )
        await i.stop()
    results: dict[str, list[int]] = {}
    for policy, job in jobs.items():
        caught = [h for h in await s2.history(job) if h.reason == "catch-up"]
        # Missed slots ran one after another: none was skipped for overlapping. (A slot
        # the loop is still catching up on when the test stops it is handed over.)
        assert not [h for h in caught if h.outcome == Outcome.SKIPPED], caught
        assert any(h.outcome == Outcome.COMPLETED for h in caught) or policy == "none"
        results[policy] = [h.slot for h in caught]
    assert len(results["all"]) >= 3
    assert results["none"] == []


async def test_a_job_the_store_never_saw_starts_at_its_next_slot(store: Store) -> None:
    s = make(store, "fresh")
    s.every("brand-new", "1s", lambda ctx: None, catch_up="all")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        history = await wait_history(s, lambda h: h, job="brand-new")
        await i.stop()
    assert all(h.reason == "scheduled" for h in await s.history("brand-new"))
    assert history[-1].claimed_at >= history[-1].scheduled_at


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
async def test_local_clock_skew_changes_nothing(store: Store, skew: float) -> None:
    ran: list[tuple[int, str, float]] = []

    def build(name: str, clock_skew: float) -> Scheduler:
        s = Scheduler(
            store.backend(), instance_id=name, clock=lambda: time.monotonic() + clock_skew,
            **FAST,
        )

        @s.every("skewed", "1s")
        async def skewed(ctx: RunContext) -> None:
            ran.append((ctx.slot, name, await s.backend.now_ms()))

        return s

    a, b = build("honest", 0.0), build("skewed", skew)
    async with anyio.create_task_group() as tg:
        ia, ib = await Instance(a).start(tg), await Instance(b).start(tg)
        await wait_for(lambda: len({r[0] for r in ran}) >= 3, timeout=10, what="3 slots")
        # Stop between two slots: a run cancelled mid-handler would run again elsewhere.
        await wait_mid_slot(a)
        await stop_all([ia, ib])
    counts = Counter(slot for slot, _, _ in ran)
    assert max(counts.values()) == 1
    # No slot fired early by the store's clock, nor was claimed more than a second late
    # (the store's claim time, not the handler's start, which a loaded machine delays).
    for slot, _, store_now in ran:
        assert slot <= store_now, (slot, store_now)
    claimed = {h.slot: h.claimed_at.timestamp() * 1000 for h in await a.history("skewed")}
    assert set(counts) <= set(claimed)
    for slot in counts:
        assert slot <= claimed[slot] < slot + 1000, (slot, claimed[slot])
    assert abs(a.store_now_ms() - b.store_now_ms()) < 1000


async def test_sync_handler_runs_in_a_thread_without_blocking_heartbeats(store: Store) -> None:
    offset = await quiet(store)
    threads: list[int] = []
    a, b = make(store, "a"), make(store, "b")

    def blocking(ctx: RunContext) -> None:
        threads.append(threading.get_ident())
        # Longer than the lease: heartbeats must keep it alive meanwhile.
        time.sleep(2.0)
        ctx.checkpoint.set_sync({"thread": True})

    a.every("sync", "1h", blocking, offset=offset)
    b.every("sync", "1h", blocking, offset=offset)
    async with anyio.create_task_group() as tg:
        ia, ib = await Instance(a).start(tg), await Instance(b).start(tg)
        slot = a.jobs["sync"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "sync", slot)
        await claim_now(b, "sync", slot)
        history = await wait_history(a, lambda h: h and h[0].outcome, job="sync", timeout=10)
        await ia.stop()
        await ib.stop()
    assert threads and threads[0] != threading.get_ident()
    assert [(h.attempt, h.outcome) for h in history] == [(1, Outcome.COMPLETED)]
    other = store.backend()
    await other.start()
    try:
        assert await other.get_checkpoint("sync", slot) == {"thread": True}
    finally:
        await other.close()


async def test_lease_loss_cancels_the_handler_at_once(store: Store) -> None:
    offset = await quiet(store)
    a = make(store, "a", lease="20s")
    tokens: list[Lease] = []
    cancelled = anyio.Event()
    beats = 0  # heartbeats a sent
    beats_at_cancel: list[int] = []

    @a.every("victim", "1h", offset=offset)
    async def victim(ctx: RunContext) -> None:
        tokens.append(Lease(ctx.job, ctx.slot, ctx.token, 20_000))
        try:
            await anyio.sleep_forever()
        finally:
            beats_at_cancel.append(beats)
            cancelled.set()

    inner_heartbeat = a.backend.heartbeat

    async def counted_heartbeat(leases: Sequence[Lease]) -> HeartbeatResult:
        nonlocal beats
        beats += 1
        return await inner_heartbeat(leases)

    a.backend.heartbeat = counted_heartbeat  # type: ignore[method-assign]

    other = store.backend()
    await other.start()
    try:
        async with anyio.create_task_group() as tg:
            ia = await Instance(a).start(tg)
            slot = a.jobs["victim"].schedule.previous_at_or_before(a.store_now_ms())
            assert slot is not None
            await claim_now(a, "victim", slot)
            await wait_for(lambda: tokens, what="running")
            # Someone else (an operator, a takeover) ends the lease in the store.
            beats_at_hand_over = beats
            assert await other.hand_over(tokens)
            # Long before the 20s lease could run out:
            await wait_for(cancelled.is_set, timeout=10, what="cancellation")
            # by the first heartbeat sent after the hand-over (or one in flight during it),
            # however slowly the machine runs.
            assert beats_at_cancel[0] - beats_at_hand_over <= 1, (beats_at_hand_over,
                                                                   beats_at_cancel)
            # The instance itself picks the handed-over run up again as its own backup.
            history = await wait_history(a, lambda h: len(h) == 2, job="victim")
            await ia.stop()
    finally:
        await other.close()
    assert history[0].reason == Reason.HAND_OVER and history[0].attempt == 2


async def test_cron_job_fires_on_its_seconds_field(store: Store) -> None:
    a = make(store, "a")
    seen: list[int] = []

    @a.cron("every-second", "* * * * * *", tz="Europe/Lisbon")
    async def tick(ctx: RunContext) -> None:
        seen.append(ctx.slot)

    def consecutive() -> bool:
        return any(b - a == 1000 for a, b in itertools.pairwise(seen))

    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        # Two slots one second apart (a loop that a loaded machine held up for a second
        # claims only the newest slot, so the first two alone could be two seconds apart).
        await wait_for(consecutive, timeout=10, what="two consecutive cron slots")
        await ia.stop()
    assert all(s % 1000 == 0 for s in seen)
    assert all(b > a for a, b in itertools.pairwise(seen))


async def test_history_size_and_ttl_are_applied(store: Store) -> None:
    a = Scheduler(store.backend(), instance_id="a", history_size=2, prune_every="0.5s",
                  **FAST)
    a.every("short-memory", "0.5s", lambda ctx: None)
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        await wait_for(
            lambda: _count_distinct(a, "short-memory", 4, 500), timeout=10, what="4 runs"
        )

        async def trimmed() -> bool:  # by the ticker's trimming, not by the claims
            return 1 <= len(await a.backend.history("short-memory")) <= 3

        await wait_for(trimmed, timeout=10, what="history trimmed")
        await ia.stop()
    history = await a.history("short-memory")
    assert 1 <= len(history) <= 3


async def _count_distinct(s: Scheduler, job: str, n: int, interval_ms: int) -> bool:
    # The job's last_slot advances with every claim even when history is trimmed.
    info = await s.backend.register_jobs([job])
    first = info[job].first_seen_ms
    last = info[job].last_slot
    return last is not None and last - first >= n * interval_ms


async def test_one_heartbeat_and_one_check_per_tick_whatever_the_number_of_jobs(
    store: Store,
) -> None:
    """Twenty held runs and twenty watched runs cost one call of each per tick."""
    offset = await quiet(store)
    calls: Counter[str] = Counter()

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            attr = getattr(self.inner, name)
            if name in ("heartbeat", "check"):
                async def counted(*args: Any) -> Any:
                    calls[name] += 1
                    calls[f"{name}-items"] += len(args[0])
                    return await attr(*args)
                return counted
            return attr

    release = anyio.Event()

    async def wait(ctx: RunContext) -> None:
        await release.wait()

    def build(name: str) -> Scheduler:
        s = make(store, name, lease="2s", heartbeat="0.25s")
        for i in range(20):
            s.every(f"job{i}", "1h", wait, offset=offset)
        return s

    holder, backup = build("holder"), build("backup")
    async with anyio.create_task_group() as tg:
        ih = await Instance(holder).start(tg)
        ib = await Instance(backup).start(tg)
        for s in (holder, backup):
            for job in s.jobs.values():
                slot = job.schedule.previous_at_or_before(s.store_now_ms())
                assert slot is not None
                await claim_now(s, job, slot)
        assert len(holder.running) == 20 and len(backup.watching) == 20
        # Count calls made by each instance over a few ticks.
        backup.backend = Counting(backup.backend)  # type: ignore[assignment]
        holder.backend = Counting(holder.backend)  # type: ignore[assignment]
        await wait_for(lambda: calls["heartbeat"] >= 4 and calls["check"] >= 4,
                       what="four ticks of each instance")
        release.set()
        await ih.stop()
        await ib.stop()
    # Every call carried all twenty runs: one call per tick, never one per job.
    assert calls["heartbeat-items"] == 20 * calls["heartbeat"], calls
    assert calls["check-items"] == 20 * calls["check"], calls
