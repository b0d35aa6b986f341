"""The graceful stop's hand-over: runs won or stopped after its first round, and
handlers still running at its end (on the memory store: the engine's logic, the same
on every store; the store's hand-over itself is tested in the conformance suite)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from lease_core import Admin, MemoryBackend, Outcome, Reason, RunContext, Scheduler
from lease_core import events as ev
from lease_core.recovery import step_job
from lease_core.testing import claim_now
from tests.helpers import FailsOnce, Instance, fail_once, quiet_offset_now, wait_for, wait_history
from tests.helpers import started as started_backend
from tests.stores.memory import MemoryStore
from tests.test_workflows import begin, current_slot, make, wait_workflow

pytestmark = pytest.mark.anyio

DELAY = 0.8


class SlowFinishes:
    """finish/finish_many of each job in ``delays`` take that many seconds longer."""

    def __init__(self, inner: Any, delays: dict[str, float]) -> None:
        self.inner, self.delays = inner, delays

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr not in ("finish", "finish_many"):
            return value

        async def finish(items: Any, *args: Any) -> Any:
            leases = [item[0] for item in items] if attr == "finish_many" else [items]
            await anyio.sleep(max(self.delays.get(lease.job, 0.0) for lease in leases))
            return await value(items, *args)
        return finish


async def test_a_next_step_won_after_the_last_round_is_handed_over() -> None:
    """A step completes in the grace; its finish takes 0.8 s (under the finish's own 10 s
    limit, over the stop's drain of lease/2 = 0.45 s). The agent claims the next step after
    its last hand-over: nobody hands it over, it waits for its lease to lapse."""
    store = MemoryStore()
    started = anyio.Event()
    runs: list[tuple[str, str | None, int, Reason]] = []
    seen: list[ev.Event] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())

        @close.step("snapshot")
        async def snapshot(ctx: RunContext) -> Any:
            runs.append((name, ctx.step, ctx.attempt, ctx.reason))
            started.set()
            await ctx.stopping.wait()
            return 1

        @close.step("interest", max_attempts=1)  # a takeover would escalate it
        async def interest(ctx: RunContext) -> Any:
            runs.append((name, ctx.step, ctx.attempt, ctx.reason))
            return 2

        close.step("publish", lambda ctx: None)
        return s

    a, b = build("a"), build("b")
    a.backend = SlowFinishes(a.backend, {step_job("close", "snapshot"): DELAY})  # type: ignore[assignment]
    a.subscribe(seen.append)
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = current_slot(a)
        await begin(a, slot)
        await begin(b, slot)  # b backs the step up
        with anyio.fail_after(10):
            await started.wait()
        await ia.stop(grace=10)
        await wait_workflow(b, slot, "completed")
        await ib.stop()
    kinds = [(type(e).__name__, getattr(e, "job", None)) for e in seen
             if type(e).__name__ in ("Claimed", "HandedOver", "Lost")]
    assert ("HandedOver", step_job("close", "interest")) in kinds
    interest_runs = [r for r in runs if r[1] == "interest"]
    assert interest_runs == [("b", "interest", 2, Reason.HAND_OVER)], interest_runs


async def test_a_next_step_won_between_the_rounds_is_handed_over_at_once() -> None:
    """The step's next step is won after the first round (its step's finish takes 0.3 s);
    another job (lease 10 s) takes 3 s to finish. The stop waits for that one before the
    second round; the next step (0.9 s lease, not renewed while it waits) is handed over
    at once rather than at that round, when it would have lapsed."""
    store = MemoryStore()
    started = anyio.Event()
    runs: list[tuple[str, str | None, int, Reason]] = []
    seen: list[ev.Event] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())

        @close.step("snapshot")
        async def snapshot(ctx: RunContext) -> Any:
            started.set()
            await ctx.stopping.wait()
            return 1

        @close.step("interest")
        async def interest(ctx: RunContext) -> Any:
            runs.append((name, ctx.step, ctx.attempt, ctx.reason))
            return 2

        close.step("publish", lambda ctx: None)

        async def slow(ctx: RunContext) -> None:
            await ctx.stopping.wait()

        s.every("slow", "1h", slow, lease="10s", offset=quiet_offset_now())
        return s

    a, b = build("a"), build("b")
    a.backend = SlowFinishes(a.backend, {step_job("close", "snapshot"): 0.3,  # type: ignore[assignment]
                                         "slow": 3.0})
    a.subscribe(seen.append)
    from lease_core.testing import claim_now
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = current_slot(a)
        await claim_now(a, "slow", a.jobs["slow"].schedule.previous_at_or_before(a.store_now_ms()))
        await begin(a, slot)
        await begin(b, slot)
        with anyio.fail_after(10):
            await started.wait()
        await ia.stop(grace=10)
        await wait_workflow(b, slot, "completed")
        await ib.stop()
    kinds = [(type(e).__name__, getattr(e, "job", None), getattr(e, "why", None)) for e in seen
             if type(e).__name__ in ("Claimed", "HandedOver", "Lost")]
    assert ("Lost", step_job("close", "interest"), "not handed over") not in kinds
    # Run once, by b, never as a takeover of a lapsed lease: handed over by a (or, when
    # a's claim came later than b's turn, claimed by b as the step's backup).
    interest = [r for r in runs if r[1] == "interest"]
    assert interest in ([("b", "interest", 2, Reason.HAND_OVER)],
                        [("b", "interest", 1, Reason.SCHEDULED)]), interest


async def test_a_run_is_not_handed_over_while_its_handler_still_runs(
        caplog: pytest.LogCaptureFixture) -> None:
    """An async handler in a shielded section outlives the grace and the stop's drain:
    its run is not handed over while it runs (the backup would start it beside the
    handler), and its one ending is reported when it ends."""
    caplog.set_level("WARNING", logger="anarchon")
    store = MemoryStore()
    spans: dict[str, list[float]] = {}
    started, release = anyio.Event(), anyio.Event()

    def build(name: str) -> Scheduler:
        s = make(store, name)

        async def job(ctx: RunContext) -> None:
            spans[name] = [time.monotonic()]
            started.set()
            try:
                with anyio.CancelScope(shield=True), anyio.fail_after(20):
                    await (release.wait() if name == "a" else anyio.sleep(0.1))
            finally:
                spans[name].append(time.monotonic())

        # A lease longer than the stop's drain (half of it): only a hand-over could start
        # the run beside the handler (a takeover comes once the lease lapsed).
        s.every("j", "1h", job, offset=quiet_offset_now(), lease="6s")
        return s

    a, b = build("a"), build("b")
    seen: list[ev.Event] = []
    a.subscribe(seen.append)
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = a.jobs["j"].schedule.previous_at_or_before(a.store_now_ms())
        await claim_now(a, "j", slot)
        await claim_now(b, "j", slot)
        with anyio.fail_after(10):
            await started.wait()
        stopped = anyio.Event()

        async def stop_a() -> None:
            await ia.stop(grace=0)
            stopped.set()

        tg.start_soon(stop_a)
        # the stop's hand-over is over; the handler still runs
        await wait_for(lambda: "ignores its cancellation" in caplog.text, timeout=15,
                       what="the stop waiting for the handler")
        assert not stopped.is_set()
        release.set()
        with anyio.fail_after(10):
            await stopped.wait()
        history = await store.shared.history("j")
        await ib.stop()
    # Never handed over while it ran; it completed the run, never run by the backup.
    assert [(h.attempt, h.outcome, h.instance_id) for h in history] == [
        (1, Outcome.COMPLETED, "a")]
    assert "b" not in spans
    # one ending reported, as the history has it (it was reported Lost, "still running
    # at the end of the stop", and its real ending never)
    assert [type(e).__name__ for e in seen if isinstance(e, ev.AttemptEnded)] == [
        "Completed"], seen


async def test_a_sync_handler_s_run_is_not_handed_over_while_its_thread_runs() -> None:
    """A sync handler that ignores ctx.stopping (blocking code) outlives the grace: its
    thread runs on, so its run is not handed over; its lease lapses instead."""
    store = MemoryStore()
    import threading
    lock = threading.Lock()
    spans: dict[str, list[float]] = {}
    told = threading.Event()

    def build(name: str) -> Scheduler:
        s = make(store, name)

        def job(ctx: RunContext) -> None:
            with lock:
                spans[name] = [time.monotonic()]
            told.set()
            if name == "a":
                time.sleep(2.0)  # blocking code: ignores ctx.stopping
            with lock:
                spans[name].append(time.monotonic())

        # A lease longer than the handler's run: only a hand-over could start the run
        # beside it (a takeover comes once the lease lapsed, as after a crash).
        s.every("j", "1h", job, offset=quiet_offset_now(), lease="6s")
        return s

    from lease_core.testing import claim_now
    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = a.jobs["j"].schedule.previous_at_or_before(a.store_now_ms())
        await claim_now(a, "j", slot)
        await claim_now(b, "j", slot)
        await wait_for(told.is_set, timeout=5, what="a runs")
        await ia.stop(grace=0.2)
        await wait_for(lambda: "b" in spans and len(spans["b"]) == 2, timeout=15, what="b ran")
        await ib.stop()
        await wait_for(lambda: len(spans["a"]) == 2, timeout=5, what="a's thread returned")
    assert spans["b"][0] >= spans["a"][1], "b started the run while a's thread still ran"


class CancelBeforeHandOver:
    """An operator cancels ``job``'s run at ``slot`` just before the stop's hand-over
    reaches the store: after the handler stopped, before its heartbeat could tell."""

    def __init__(self, inner: Any, job: str, slot: int) -> None:
        self.inner, self.job, self.slot = inner, job, slot

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr != "hand_over":
            return value

        async def hand_over(leases: Any) -> Any:
            if any(lease.job == self.job for lease in leases):
                await Admin(self.inner, by="ops").cancel(self.job, self.slot, grace=0)
            return await value(leases)
        return hand_over


async def _stop_during_a_run(wrap: Callable[[Any, int], Any],
                            ) -> tuple[list[ev.AttemptEnded], list[tuple[int, str | None]], int]:
    """Run job ``report`` on a store wrapped by ``wrap(backend, slot)``, and stop while its
    handler runs (cancelled once the stop's grace has passed; then the hand-over); return
    the attempts' endings as reported, the history's (slot, outcome), and the slot."""
    store = MemoryStore()
    started = anyio.Event()
    seen: list[ev.Event] = []
    s = make(store, "a")

    async def report(ctx: RunContext) -> None:
        started.set()
        await anyio.sleep_forever()

    s.every("report", "1h", report, offset=quiet_offset_now())
    slot = s.jobs["report"].schedule.previous_at_or_before(int(time.time() * 1000))
    assert slot is not None
    s.backend = wrap(s.backend, slot)
    s.subscribe(seen.append)
    async with anyio.create_task_group() as tg:
        ia = await Instance(s).start(tg)
        await claim_now(s, "report", slot)
        with anyio.fail_after(10):
            await started.wait()
        await ia.stop(grace=0.2)
    history = await store.backend().history("report")
    return ([e for e in seen if isinstance(e, ev.AttemptEnded)],
            [(a.slot, a.outcome) for a in history], slot)


async def test_a_cancel_that_lands_before_the_hand_over_is_reported_cancelled() -> None:
    """The stop cancelled the handler once its grace had passed; the run waits for its
    hand-over, and an operator cancels it meanwhile. The store refuses the hand-over (the
    run is over): the attempt ended cancelled, not lost."""
    ended, history, slot = await _stop_during_a_run(
        lambda backend, slot: CancelBeforeHandOver(backend, "report", slot))
    assert [(type(e).__name__, e.outcome) for e in ended] == [
        ("Cancelled", Outcome.CANCELLED)], ended
    assert history == [(slot, "cancelled")], history


async def test_a_hand_over_whose_answer_was_lost_is_reported_handed_over() -> None:
    """The store handed the run over and its answer was lost: the store says so when
    asked, and the attempt is reported ``HandedOver`` as the history has it (it was
    reported ``Lost``, "not handed over")."""
    faults: list[FailsOnce] = []
    ended, history, slot = await _stop_during_a_run(
        lambda backend, slot:
        faults.append(fail_once(backend, "hand_over", applied=True)) or backend)
    assert faults[0].failed
    assert [type(e).__name__ for e in ended] == ["HandedOver"], ended
    assert history == [(slot, "handed_over")], history


async def test_a_run_its_handler_hands_over_in_the_grace_goes_at_once() -> None:
    """Job ``quick``'s handler stops at the soft signal (``raise_if_stopping``); job
    ``slow`` goes on through the grace (5 s, longer than the 0.6 s lease) until the
    backup has run ``quick``. ``quick`` is handed over at once, not left unrenewed until
    the grace ends, its lease lapsing and the backup taking it over."""
    store = MemoryStore()
    ran: list[tuple[str, str, Reason]] = []
    b_ran_quick = anyio.Event()
    quick_started = anyio.Event()

    def build(name: str) -> Scheduler:
        s = Scheduler(store.backend(), instance_id=name, lease="0.6s", heartbeat="0.2s")

        async def quick(ctx: RunContext) -> None:
            ran.append((name, ctx.job, ctx.reason))
            if name == "b":
                b_ran_quick.set()
                return
            quick_started.set()
            await ctx.stopping.wait()
            ctx.raise_if_stopping()

        async def slow(ctx: RunContext) -> None:
            ran.append((name, ctx.job, ctx.reason))
            await ctx.stopping.wait()
            await b_ran_quick.wait()

        s.every("quick", "1h", quick, offset=quiet_offset_now())
        s.every("slow", "1h", slow, offset=quiet_offset_now(), lease="10s")
        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = a.jobs["quick"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "quick", slot)
        await claim_now(a, "slow", slot)
        await claim_now(b, "quick", slot)  # b backs quick up
        with anyio.fail_after(10):
            await quick_started.wait()
        with anyio.fail_after(10):
            await ia.stop(grace=5)
        history = await wait_history(b, lambda h: any(
            x.job == "quick" and x.instance_id == "b" and x.outcome for x in h), job="quick")
        await ib.stop()
    assert [(h.attempt, h.instance_id, h.reason, h.outcome) for h in history] == [
        (2, "b", Reason.HAND_OVER, Outcome.COMPLETED),
        (1, "a", Reason.SCHEDULED, Outcome.HANDED_OVER)], history


async def test_a_hand_over_the_store_missed_is_sent_again() -> None:
    """The store did not answer the hand-over (a failover, a connection dropped) and
    answers again a moment later: the run is handed over then, not left for its lease to
    lapse (reported ``Lost``, "not handed over")."""
    faults: list[FailsOnce] = []
    ended, history, slot = await _stop_during_a_run(
        lambda backend, slot: faults.append(fail_once(backend, "hand_over")) or backend)
    assert faults[0].failed
    assert [type(e).__name__ for e in ended] == ["HandedOver"], ended
    assert history == [(slot, "handed_over")], history


class HeartbeatAcrossAHandOver:
    """Once ``armed``, a heartbeat waits in flight until a hand-over was sent;
    ``next_beat`` is set at the heartbeat after that one."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.armed = inner, False
        self.entered, self.handed, self.next_beat = anyio.Event(), anyio.Event(), anyio.Event()

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr not in ("heartbeat", "hand_over"):
            return value

        async def call(leases: Any) -> Any:
            if attr == "hand_over":
                self.handed.set()
            elif self.entered.is_set():
                self.next_beat.set()
            elif self.armed:
                self.entered.set()
                await self.handed.wait()
            return await value(leases)
        return call


async def test_a_heartbeat_in_flight_as_its_run_is_handed_over_goes_on() -> None:
    """Job ``report``'s handler hands its run over (the stop's soft signal) while a
    heartbeat that renews it is in flight; ``slow``'s goes on in the grace. The
    heartbeat's answer is applied to the runs still held, and no store outage is
    reported (it failed on the handed-over run, an unexpected error: ``StoreUnreachable``
    reported, the tick's other renewals and checks skipped)."""
    store = MemoryStore()
    seen: list[ev.Event] = []
    s = make(store, "a")
    wrapped = HeartbeatAcrossAHandOver(s.backend)

    async def report(ctx: RunContext) -> None:
        await ctx.stopping.wait()
        wrapped.armed = True
        await wrapped.entered.wait()
        ctx.raise_if_stopping()

    async def slow(ctx: RunContext) -> None:
        await ctx.stopping.wait()
        await wrapped.next_beat.wait()

    s.every("report", "1h", report, offset=quiet_offset_now())
    s.every("slow", "1h", slow, offset=quiet_offset_now())
    slot = s.jobs["report"].schedule.previous_at_or_before(int(time.time() * 1000))
    assert slot is not None
    s.backend = wrapped  # type: ignore[assignment]
    s.subscribe(seen.append)
    async with anyio.create_task_group() as tg:
        ia = await Instance(s).start(tg)
        await claim_now(s, "report", slot)
        await claim_now(s, "slow", slot)
        await wait_for(lambda: len(s.running) == 2, timeout=5, what="the handlers")
        await ia.stop(grace=5)
    history = await store.backend().history()
    assert sorted((a.job, a.outcome) for a in history) == [
        ("report", "handed_over"), ("slow", "completed")], history
    assert not [e for e in seen if isinstance(e, ev.StoreUnreachable)], seen


async def test_a_sync_handler_cancelled_before_its_thread_started_never_runs() -> None:
    """stop(grace=0) as a sync handler starts, many times over: a run handed over (its
    handler cancelled before its thread started) never has its handler run after all.
    On trio a thread started for the call ran it however late: the handler ran beside
    the backup's attempt, unleased (the asyncio worker skips a cancelled call)."""
    import threading
    release = threading.Event()
    started: set[int] = set()
    outcomes: dict[int, str | None] = {}
    try:
        for i in range(24):
            backend = MemoryBackend()
            s = Scheduler(backend, instance_id="a", lease="3s", heartbeat="0.5s")

            def job(ctx: RunContext, i: int = i) -> None:
                started.add(i)
                release.wait(10)

            s.every("j", "1h", job, offset=quiet_offset_now())
            await s.start()
            slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
            assert slot is not None

            async def stop(s: Scheduler, k: int) -> None:
                for _ in range(k):  # the stop lands at a different step of the start
                    await anyio.lowlevel.checkpoint()
                await s.stop(grace=0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(stop, s, i % 8)
                await claim_now(s, "j", slot)
            async with started_backend(backend):
                outcomes[i] = (await backend.history("j"))[0].outcome
    finally:
        release.set()
    handed = {i for i, outcome in outcomes.items() if outcome == Outcome.HANDED_OVER}
    assert not handed & started, (sorted(handed & started), outcomes)


async def test_a_second_stop_with_a_shorter_grace_shortens_the_one_under_way() -> None:
    """``stop(grace=60)`` under way, then ``stop(grace=0)`` (a second Ctrl-C): the first
    grace was kept, so the second stop waited the whole minute for a handler that ignores
    the soft signal. The handler is cancelled at once and its run handed over."""
    backend = MemoryBackend()
    s = Scheduler(backend, instance_id="a", lease="5s", heartbeat="0.2s")
    started = anyio.Event()

    async def stubborn(ctx: RunContext) -> None:
        started.set()
        await anyio.sleep_forever()  # ignores ctx.stopping; only its cancellation ends it

    s.every("stubborn", "1h", stubborn, offset=quiet_offset_now())
    await s.start()
    slot = s.jobs["stubborn"].schedule.previous_at_or_before(s.store_now_ms())
    assert slot is not None
    await claim_now(s, "stubborn", slot)
    with anyio.fail_after(10):
        await started.wait()
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.stop, 60)
        await wait_for(lambda: s.state == "stopping", timeout=10, what="the first stop")
        with anyio.fail_after(10):  # not the first stop's 60 s
            await s.stop(grace=0)
    await backend.start()
    history = await backend.history("stubborn")
    assert [(h.attempt, h.outcome) for h in history] == [(1, Outcome.HANDED_OVER)], history
