"""Store outages and unexpected errors seen by the scheduler (memory backend with faults).

A failing store must never end the scheduler's tasks (which would cancel the task that
started it); claims are retried, and after an outage of several slots only the newest
missed slot runs unless the job asked for ``catch_up="all"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest

from lease_core import (
    BackendUnavailable,
    MemoryBackend,
    Outcome,
    Reason,
    Retry,
    RunContext,
    Scheduler,
    SchedulerState,
)
from lease_core._structures import (
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    HeartbeatResult,
    Lease,
)
from lease_core.testing import awaiting_hand_over, backend_users, claim_now
from tests.helpers import (
    Instance,
    Suspend,
    Unplugged,
    fail_once,
    quiet_offset,
    quiet_offset_now,
    wait_for,
    wait_history,
)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("error", [BackendUnavailable, RuntimeError])
async def test_an_outage_longer_than_the_lease_cancels_and_recovers(
    error: type[Exception],
) -> None:
    backend = Unplugged()
    await backend.start()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    cancelled = anyio.Event()
    runs: list[int] = []

    # The next slot is half an hour away: the test claims the current one itself.
    @s.every("work", "1h", offset=quiet_offset(await backend.now_ms()))
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
        await claim_now(s, job, slot)
        await wait_for(lambda: runs, what="attempt 1")
        backend.down = error
        # Heartbeats fail: the handler is cancelled before its lease could expire.
        await wait_for(cancelled.is_set, timeout=3, what="local lease deadline")
        backend.down = False
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
    backend = Unplugged()
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
        backend.down = False
        await wait_for(lambda: any(slot > missed[-1] for slot in ran), timeout=10,
                       what="a slot after the outage")
        await i.stop()
    caught = [slot for slot in ran if slot in missed]
    if expected == 1:
        assert caught == [missed[-1]]
    else:
        # Retried together, their handlers start in one turn, in any order (trio
        # randomises it): each missed slot once.
        assert sorted(caught) == missed


async def test_a_backup_member_follows_the_catch_up_policy_after_an_outage_too() -> None:
    """The member ranked second kept a pending record of every slot of the outage, and
    claimed them all once the store answered, whatever ``catch_up`` said."""
    from lease_core.engine.fleet import rendezvous_rank

    backend = Unplugged()
    job = next(f"j{n}" for n in range(1000)
               if rendezvous_rank(f"j{n}", "a", ("a", "b")) == 0)
    ran: list[tuple[int, str]] = []
    scheds = [Scheduler(backend, instance_id=name, lease="1.2s", heartbeat="0.2s")
              for name in ("a", "b")]
    for s in scheds:
        async def tick(ctx: RunContext) -> None:
            ran.append((ctx.slot, ctx.instance_id))

        s.every(job, "1s", tick, catch_up="latest", overlap="allow")
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in scheds]
        await wait_for(lambda: all(s.health().fleet_size == 2 for s in scheds),
                       timeout=10, what="both members")
        backend.down = BackendUnavailable
        await wait_for(lambda: len(set(backend.failed_claims)) >= 3, timeout=10,
                       what="three slots missed")
        missed = sorted(set(backend.failed_claims))
        backend.down = False
        await wait_for(lambda: any(slot > missed[-1] + 1000 for slot, _ in ran), timeout=10,
                       what="slots after the outage")
        for instance in instances:
            await instance.stop()
    caught = sorted(slot for slot, _ in ran if slot in missed)
    assert caught == [missed[-1]], (missed, sorted(ran))


async def test_scheduler_survives_unexpected_errors_without_cancelling_its_host() -> None:
    backend = Unplugged()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    done: list[int] = []

    async def tick(ctx: RunContext) -> None:
        done.append(ctx.slot)

    s.every("tick", "1s", tick)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        backend.down = ZeroDivisionError
        await wait_for(lambda: backend.failed_claims, timeout=5, what="a failed claim")
        backend.down = False
        await wait_for(lambda: done, timeout=5, what="a run after the errors")
        await i.stop()
    assert done


class SlowAnswer(MemoryBackend):
    """Claims win at once in the store, but their answer arrives ``delay`` later."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.claimed = anyio.Event()
        self.partitioned = False

    def clock_ms(self) -> int:
        """The store's clock now, in epoch milliseconds (callable where nothing may wait)."""
        return self._now()

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        (result,) = await self.claim_many([request])
        return result

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        results = await super().claim_many(requests)
        self.claimed.set()
        await anyio.sleep(self.delay)
        return results

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        if self.partitioned:
            raise BackendUnavailable("partitioned (test)")
        return await super().heartbeat(leases)


async def test_local_deadline_counts_from_when_the_claim_was_sent() -> None:
    """A slow claim answer, then a partition: the handler stops before the store's expiry."""
    backend = SlowAnswer(delay=0.6)
    await backend.start()
    backend.partitioned = True
    s = Scheduler(backend, instance_id="a", lease="1.5s", heartbeat="0.5s")
    stopped_at: list[int] = []

    @s.every("j", "1h", offset=quiet_offset(await backend.now_ms()))
    async def j(ctx: RunContext) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopped_at.append(backend.clock_ms())

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "j", slot)
        await wait_for(lambda: stopped_at, timeout=5, what="local deadline")
        await i.stop()
    claimed = (await backend.history("j"))[-1].claimed_at.timestamp() * 1000
    assert stopped_at[0] < claimed + 1500, (stopped_at[0] - claimed)


class FrozenReader(MemoryBackend):
    """Claims win at once in the store; then the process freezes for ``freeze`` seconds
    (its loop blocked, as under SIGSTOP) before it reads the answer, once."""

    def __init__(self, freeze: float) -> None:
        super().__init__()
        self.freeze = freeze

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        (result,) = await self.claim_many([request])
        return result

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        results = await super().claim_many(requests)
        if self.freeze:
            time.sleep(self.freeze)  # noqa: ASYNC251 (the freeze: nothing else runs)
            self.freeze = 0
        return results


async def test_a_win_read_after_the_local_deadline_starts_no_handler() -> None:
    # Local deadline: sent + 1 s - 0.2 s / 2 = 0.9 s; the answer is read after 1.3 s,
    # when the store's lease has expired. No handler code of attempt 1 may run (a
    # backup could own the run); the run is taken over (here by the same instance).
    backend = FrozenReader(1.3)
    await backend.start()
    s = Scheduler(backend, instance_id="a", lease="1s", heartbeat="0.2s")
    started: list[int] = []

    @s.every("j", "1h", offset=quiet_offset(await backend.now_ms()))
    async def j(ctx: RunContext) -> None:
        started.append(ctx.attempt)  # before any checkpoint: runs if the handler starts
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        won = await claim_now(s, "j", slot)
        assert won is not None and (won.status, won.attempt) == (ClaimStatus.WON, 1)
        await wait_for(lambda: started, timeout=5, what="the takeover's handler")
        await i.stop()
    assert started == [2]
    attempts = {a.attempt: a for a in await backend.history("j")}
    assert attempts[1].outcome is Outcome.LOST
    assert attempts[2].reason is Reason.TAKEOVER


async def test_stop_with_a_claim_in_flight_hands_the_run_over() -> None:
    backend = SlowAnswer(delay=0.5)
    await backend.start()
    s = Scheduler(backend, instance_id="a", lease="3s", heartbeat="0.2s")

    @s.every("j", "1s", catch_up="none")
    async def j(ctx: RunContext) -> None:
        await anyio.sleep(10)

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        await backend.claimed.wait()
        await i.stop(grace=0)
    states = await backend.check([(r.job, r.slot) for r in await backend.runs(limit=10_000)])
    assert states.runs and all(r.status == "handed_over" for r in states.runs.values())
    assert awaiting_hand_over(s) == []


async def test_stop_requested_inside_a_task_group_is_a_hand_over() -> None:
    backend = MemoryBackend()
    await backend.start()
    s = Scheduler(backend, instance_id="a", lease="3s", heartbeat="0.2s")
    started = anyio.Event()

    # One run, claimed below: the job's next slot is half an hour away, so no later slot
    # can be recorded as skipped, however long the stop takes to begin.
    @s.every("j", "1h", offset=quiet_offset(await backend.now_ms()))
    async def j(ctx: RunContext) -> None:
        started.set()

        async def worker() -> None:
            while True:
                ctx.raise_if_stopping()
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker)

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "j", slot)
        await started.wait()
        await i.stop(grace=2)
    assert [(a.attempt, a.outcome) for a in await backend.history("j")] == [
        (1, Outcome.HANDED_OVER)
    ]


class SlowFinish(MemoryBackend):
    """A memory backend whose finishes of ``job``'s runs take ``delay`` seconds."""

    def __init__(self, job: str, delay: float) -> None:
        super().__init__()
        self.job, self.delay = job, delay
        self.finishing = anyio.Event()

    async def finish(self, lease: Lease, outcome: Outcome, error: str | None = None) -> bool:
        (done,) = await self.finish_many([(lease, outcome, error)])
        return done

    async def finish_many(
            self, items: Sequence[tuple[Lease, Outcome, str | None]]) -> list[bool]:
        if any(lease.job == self.job for lease, _, _ in items):
            self.finishing.set()
            await anyio.sleep(self.delay)
        return await super().finish_many(items)


async def test_a_stop_hands_a_short_lease_over_before_waiting_for_slower_endings() -> None:
    """The stop waits for its runs' endings (a finish, a workflow's next step) before the
    hand-over of what they give; a run that already waits for its hand-over goes first,
    so that its lease, shorter than that wait, does not lapse: its backup starts it at
    once, as a hand-over, instead of taking it over once it expired."""
    backend = SlowFinish("slow", delay=3)
    await backend.start()
    started: list[tuple[str, str]] = []

    def build(name: str) -> Scheduler:
        s = Scheduler(backend, instance_id=name, lease="30s", heartbeat="0.2s")

        @s.every("short", "1h", offset=offset, lease="1s")
        async def short(ctx: RunContext) -> None:
            started.append((name, ctx.job))
            if name == "a":
                await anyio.sleep(100)  # cancelled by the stop: its run is handed over

        @s.every("slow", "1h", offset=offset)
        async def slow(ctx: RunContext) -> None:
            started.append((name, ctx.job))
            await ctx.stopping.wait()  # completes when asked to stop; its finish is slow
        return s

    offset = quiet_offset(await backend.now_ms())
    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = a.jobs["short"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        for job in ("short", "slow"):
            await claim_now(a, job, slot)
        await claim_now(b, "short", slot)  # b backs the short run up
        await wait_for(lambda: len(started) == 2, timeout=5, what="both handlers in a")
        await ia.stop(grace=0.5)
        assert backend.finishing.is_set()
        await wait_for(lambda: ("b", "short") in started, timeout=5, what="b's short run")
        await ib.stop()
    assert [(x.attempt, x.reason, x.outcome) for x in await backend.history("short")] == [
        (2, Reason.HAND_OVER, Outcome.COMPLETED), (1, Reason.SCHEDULED, Outcome.HANDED_OVER)]
    assert [(x.attempt, x.outcome) for x in await backend.history("slow")] == [
        (1, Outcome.COMPLETED)]


async def test_a_cancelled_stop_still_cleans_up() -> None:
    backend = MemoryBackend()
    s = Scheduler(backend, instance_id="a", lease="3s", heartbeat="0.5s")
    started = anyio.Event()

    @s.every("j", "1s", catch_up="none")
    async def j(ctx: RunContext) -> None:
        started.set()
        await anyio.sleep(100)

    with anyio.CancelScope() as shutdown:
        await s.start()
        await started.wait()
        # An overall shutdown deadline, shorter than the grace: it cancels stop() itself,
        # however long the start and the first slot took.
        shutdown.deadline = anyio.current_time() + 0.5
        await s.stop(grace="5s")
    assert shutdown.cancelled_caught
    assert s.state is SchedulerState.STOPPED and backend_users(backend) == 0 and not s.running
    await s.start()  # and it can start again
    await s.stop(grace=0)


async def test_a_takeover_that_failed_during_an_outage_is_not_forgotten() -> None:
    backend = Unplugged()
    await backend.start()
    now = await backend.now_ms()
    first = now - now % 1000
    # A dead instance holds slot `first`; its lease expires in half a second.
    await backend.claim(ClaimRequest("j", first, "dead", "tok-dead", 500))
    s = Scheduler(backend, instance_id="b", lease="0.7s", heartbeat="0.2s")
    s.every("j", "1s", lambda ctx: None, catch_up="none", overlap="allow")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        backend.down = BackendUnavailable
        await wait_for(lambda: len(set(backend.failed_claims)) >= 2, timeout=10,
                       what="a failed takeover and a failed new slot")
        backend.down = False

        async def first_finished() -> bool:
            state = (await backend.check([("j", first)])).runs.get(("j", first))
            return state is not None and state.status.finished

        await wait_for(first_finished, timeout=10, what="the dead holder's run to end")
        await i.stop()


async def test_an_outage_leaves_a_bounded_record_and_a_lost_win_is_still_taken_over() -> None:
    """Through an outage of many slots, the older slots whose claims went unanswered are
    not each kept backed up (a record per job and slot for as long as it lasts, all read
    by the first check after it); a claim the store applied without its answer arriving
    is still found once the store answers (an open run under this instance's id) and
    taken over."""
    backend = Unplugged()
    s = Scheduler(backend, instance_id="a", lease="0.5s", heartbeat="0.1s", timer_slack=0)
    for n in range(20):
        s.every(f"j{n}", "0.01s", lambda ctx: None, catch_up="none", overlap="allow")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        backend.down = True
        # The claim of a slot due soon got through, its answer lost (Unplugged fails the
        # scheduler's own claim of it): the store holds the run under this instance's id.
        now = await MemoryBackend.now_ms(backend)
        won = now - now % 10 + 50
        await MemoryBackend.claim_many(backend, [ClaimRequest("j0", won, "a", "lost", 300)])
        await wait_for(lambda: len({slot for slot in backend.failed_claims if slot > won}) >= 80,
                       timeout=10, what="the claims of 80 slots failed")
        watched = s.health().runs_watched
        backend.down = False

        async def taken_over() -> bool:
            state = (await backend.check([("j0", won)])).runs.get(("j0", won))
            return state is not None and state.status.finished

        await wait_for(taken_over, timeout=10, what="the lost win taken over")
        await i.stop()
    assert watched < 900, watched  # about 140; some 1,600 when each slot was kept


async def test_slots_whose_claims_failed_while_the_store_answered_are_all_claimed() -> None:
    """The store answered (heartbeats, checks) while claims failed for several slots:
    none of them was missed while the store was unreachable, so each is claimed once
    claims get through again, not only the newest (sentinelfix)."""
    # Claims fail while ``down`` is set; every other call answers (as when a client's
    # pool was exhausted: the store answered, a claim did not get through).
    backend = Unplugged(fails={"claim_many"}, message="claims fail (test)")
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    ran: list[int] = []

    async def tick(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    s.every("tick", "0.5s", tick)  # catch_up="latest", overlap="skip"
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        await wait_for(lambda: ran, timeout=10, what="a first run")
        backend.down = True
        await wait_for(lambda: len(set(backend.failed_claims)) >= 3, timeout=10,
                       what="three slots' claims failed")
        failed = sorted(set(backend.failed_claims))
        backend.down = False
        await wait_for(lambda: any(slot > failed[-1] for slot in ran), timeout=10,
                       what="a slot after the failures")
        history = await s.history("tick")
        await i.stop()
    recorded = {a.slot for a in history}
    # each one run, or recorded skipped behind a run of an earlier one
    assert all(slot in recorded for slot in failed), (failed, sorted(recorded))


@pytest.mark.parametrize("applied", [False, True])
async def test_a_finish_the_store_did_not_answer_is_sent_again_within_the_lease(
    applied: bool,
) -> None:
    """Backed up at once, a completed run whose finish met a blip of the store was taken
    over when its lease ran out, and its handler ran again (with max_attempts=1, the run
    was escalated). The finish is sent again a check interval later: one attempt, one
    handler call, reported Completed."""
    backend = MemoryBackend()
    lost = fail_once(backend, "finish_many", applied=applied)
    s = Scheduler(backend, instance_id="a", lease="0.9s", heartbeat="0.2s")
    calls: list[int] = []
    ended: list[str] = []
    s.every("export", "1h", lambda ctx: calls.append(ctx.attempt), max_attempts=1,
            offset=quiet_offset_now())
    s.subscribe(lambda e: ended.append(type(e).__name__)
                if type(e).__name__ in ("Completed", "Lost", "Failed") else None)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["export"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "export", slot)
        history = await wait_history(s, lambda h: any(x.outcome for x in h), job="export")
        await wait_for(lambda: ended, timeout=5, what="the attempt's end reported")
        await i.stop()
    assert lost.failed
    assert [(x.attempt, x.outcome) for x in history] == [(1, Outcome.COMPLETED)]
    assert calls == [1]
    assert ended == ["Completed"]


class ClaimHangsOnce(MemoryBackend):
    """A store whose first claim never answers (a hung connection)."""

    hung = False

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        if not self.hung:
            self.hung = True
            await anyio.sleep(30)
        return await super().claim_many(requests)


async def test_a_claim_the_store_never_answers_is_reported_and_made_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """A claim given up for want of an answer within half the lease was made again at
    the next tick, with no log and no StoreUnreachable: a hung store went unseen."""
    s = Scheduler(ClaimHangsOnce(), instance_id="a", lease="0.9s", heartbeat="0.2s")
    calls: list[int] = []
    seen: list[str] = []
    s.every("export", "1h", lambda ctx: calls.append(ctx.attempt), offset=quiet_offset_now())
    s.subscribe(lambda e: seen.append(type(e).__name__)
                if type(e).__name__ in ("StoreUnreachable", "StoreBack") else None)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["export"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "export", slot)
        await wait_for(lambda: calls and seen[-1:] == ["StoreBack"], timeout=10,
                       what="the run claimed again and the store back")
        await i.stop()
    assert calls == [1] and seen == ["StoreUnreachable", "StoreBack"]
    assert any("did not answer within 0.45s" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio_only  # engine timing; the loops are covered elsewhere
async def test_a_catch_up_of_a_job_faster_than_the_heartbeat_gets_back_on_time() -> None:
    """``catch_up="all"`` runs every missed slot one after another; each waited a whole
    check interval (1 s) for the one before, so a job every 250 ms fell further behind
    than it caught up, for good, after one freeze of the process."""
    s = Scheduler(MemoryBackend(), instance_id="a", lease="4s", heartbeat="1s")
    ran: list[tuple[int, float]] = []
    s.every("fast", "250ms", lambda ctx: ran.append((ctx.slot, time.time())),
            catch_up="all")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        await wait_for(lambda: ran, timeout=5, what="a first run")
        time.sleep(2.5)  # the process froze: 10 slots missed  # noqa: ASYNC251
        frozen = time.time()

        def on_time() -> bool:  # a slot due after the freeze started at its time
            return any(slot / 1000 > frozen + 1 and started - slot / 1000 < 0.2
                       for slot, started in ran)

        await wait_for(on_time, timeout=10, what="runs on time again")
        await i.stop()
    missed = [slot for slot, _ in ran if frozen - 2.5 < slot / 1000 < frozen]
    assert len(missed) >= 8, missed  # every missed slot ran (catch_up="all")


@pytest.mark.asyncio_only  # engine timing; the loops are covered elsewhere
async def test_catch_up_none_runs_no_slot_a_freeze_missed() -> None:
    """After the process froze past several slots, ``catch_up="none"`` ran the newest
    of them late (half a second here, over twice the check interval), recorded
    ``scheduled``. No slot the freeze missed runs; the next one runs at its time. The
    freeze is a jump of the clocks both sides read, landing mid-way between two slots."""
    shift = [0.0]
    backend = MemoryBackend(clock=lambda: time.time() + shift[0])
    s = Scheduler(backend, instance_id="a", lease="20s", heartbeat="0.2s",
                  clock=lambda: time.monotonic() + shift[0])
    ran: list[int] = []
    s.every("tick", "1s", lambda ctx: ran.append(ctx.slot), catch_up="none")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        await wait_for(lambda: ran, timeout=5, what="a first run")
        # A quarter second after a slot (its run done), the clocks jump 5.3 s: the
        # dispatcher wakes 0.55-0.8 s after the newest missed slot (last + 5 s).
        await wait_for(lambda: 250 < s.store_now_ms() % 1000 < 400, timeout=3,
                       what="a quarter second after a slot")
        last = ran[-1]
        shift[0] += 5.3
        await wait_for(lambda: ran[-1] >= last + 6000, timeout=5,
                       what="the first slot after the freeze")
        await i.stop()
    assert next(slot for slot in ran if slot > last) == last + 6000, ran
    history = await s.history("tick")
    assert all(h.reason == "scheduled" for h in history)


@pytest.mark.asyncio_only  # engine timing; the loops are covered elsewhere
async def test_a_store_clock_stepping_back_is_followed_at_its_next_answer() -> None:
    """The estimate of the store's clock kept the best of its last eight samples: after
    the store's clock stepped back 10 minutes, slots were claimed up to 10 minutes early
    for several seconds. A sample that cannot agree with the estimate resets it."""
    shift = [0.0]
    backend = MemoryBackend(clock=lambda: time.time() + shift[0])
    s = Scheduler(backend, instance_id="a", lease="4s", heartbeat="1s")
    s.every("tick", "1s", lambda ctx: None)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        await wait_history(s, lambda h: len(h) >= 2, job="tick")
        shift[0] -= 600

        def followed() -> bool:
            return abs(s.store_now_ms() - (time.time() + shift[0]) * 1000) < 500

        await wait_for(followed, timeout=3, what="the estimate following the store")
        await i.stop()
    # early by the store's own clock when it was claimed (a claim sent just before the
    # step is not early, even if its handler started after it)
    early = [a.slot for a in await s.history("tick", limit=1000)
             if a.slot > a.claimed_at.timestamp() * 1000 + 500]
    assert len(early) <= 1, early  # the claim made before the store's first answer


@pytest.mark.asyncio_only  # engine timing; the loops are covered elsewhere
async def test_a_handler_is_cancelled_soon_after_the_machine_resumes_from_a_suspend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine was suspended for longer than the lease (a laptop's lid closed, a VM
    paused): the store's clock ran on, and a backup may hold the run by now, but the
    event loop's clock (``CLOCK_MONOTONIC``), on which the handler's local lease deadline
    is, did not count the suspend. The handler ran on until the next tick (up to a
    heartbeat, 20 s here); it is cancelled within a few seconds of the resume. The
    suspend is stood in for by shifting ``time.clock_gettime`` (``CLOCK_BOOTTIME``) and
    the store's clock."""
    suspend = Suspend(monkeypatch)
    backend = MemoryBackend(clock=suspend.store_clock)
    await backend.start()
    s = Scheduler(backend, instance_id="a", lease="60s", heartbeat="20s")
    started, cancelled = anyio.Event(), anyio.Event()

    @s.every("work", "1h", offset=quiet_offset(await backend.now_ms()))
    async def work(ctx: RunContext) -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        job = s.jobs["work"]
        slot = job.schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, job, slot)
        await wait_for(started.is_set, what="the handler")
        suspend.slept = 120.0  # resumed: two leases passed on the store's clock
        await wait_for(cancelled.is_set, timeout=4, what="the handler cancelled")
        await i.stop()
    history = await s.history("work")  # (attempt 2: its own backup took the run over)
    assert [h.outcome for h in history if h.attempt == 1] == [Outcome.LOST]


async def test_a_stop_does_not_wait_for_a_finish_the_store_does_not_answer() -> None:
    """A finish is sent again while the lease is the attempt's, but not once the
    scheduler stops: the stop waited up to the job's lease (a minute here)."""

    class FinishDown(MemoryBackend):
        async def finish_many(self, items: Sequence[tuple[Lease, Outcome, str | None]]
                              ) -> list[bool]:
            raise BackendUnavailable("the store does not answer finishes (test)")

    s = Scheduler(FinishDown(), instance_id="a", lease="60s", heartbeat="0.5s")
    done: list[int] = []
    s.every("export", "1h", lambda ctx: done.append(ctx.attempt), offset=quiet_offset_now())
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["export"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "export", slot)
        await wait_for(lambda: done, timeout=5, what="the handler ran")
        with anyio.fail_after(20):  # the finish is tried once more at most (10 s)
            await i.stop()
    assert done == [1]


@pytest.mark.parametrize("applied", [False, True])
async def test_a_retry_the_store_did_not_answer_is_sent_again_within_the_lease(
    applied: bool,
) -> None:
    """As a finish: a failed attempt whose retry_later met a blip was backed up at once,
    and taken over (not retried) once its lease ran out."""
    backend = MemoryBackend()
    lost = fail_once(backend, "retry_later", applied=applied)
    s = Scheduler(backend, instance_id="a", lease="0.9s", heartbeat="0.2s")
    calls: list[int] = []

    def flaky(ctx: RunContext) -> None:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("transient")

    s.every("export", "1h", flaky, offset=quiet_offset_now(),
            retry=Retry(retries=1, backoff="0.3s", jitter=0))
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["export"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "export", slot)
        history = await wait_history(
            s, lambda h: any(x.outcome == Outcome.COMPLETED for x in h), job="export")
        await i.stop()
    assert lost.failed
    assert sorted((x.attempt, x.reason, x.outcome) for x in history) == [
        (1, Reason.SCHEDULED, Outcome.FAILED), (2, Reason.RETRY, Outcome.COMPLETED)]
    assert calls == [1, 2]


async def test_a_last_failure_whose_answer_was_lost_is_logged_as_the_run_s_end(
        caplog: pytest.LogCaptureFixture) -> None:
    """The re-sent retry_later of the last failure is refused, and the store has the run
    ended by that attempt: logged as the run failed after its retries (it was logged
    "retry recorded", for a run with no retry left)."""
    caplog.set_level("INFO", logger="anarchon")
    backend = MemoryBackend()
    # the retry_later ending the run (no retry left) is applied, its answer lost
    lost = fail_once(backend, "retry_later", applied=True, when=lambda answers: answers == [0])
    s = Scheduler(backend, instance_id="a", lease="0.9s", heartbeat="0.2s")

    def doomed(ctx: RunContext) -> None:
        raise RuntimeError(f"down {ctx.attempt}")

    s.every("export", "1h", doomed, offset=quiet_offset_now(),
            retry=Retry(retries=1, backoff="0.1s", jitter=0))
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["export"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "export", slot)
        await wait_for(lambda: lost.failed and any(
            "failed after" in r.getMessage() or "retry recorded" in r.getMessage()
            for r in caplog.records), timeout=10, what="the run's end logged")
        await i.stop()
    history = await s.history("export")
    assert sorted((a.attempt, a.outcome) for a in history) == [
        (1, Outcome.FAILED), (2, Outcome.FAILED)]
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "retry recorded" in m], messages
    assert any("export slot" in m and "failed after 1 retries" in m for m in messages)


class CheckpointsUnread(MemoryBackend):
    """A memory backend whose checkpoint reads fail, as through an outage, while
    ``down`` is set (its other calls answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.failed_reads = 0

    async def get_checkpoint(self, job: str, slot: int) -> object:
        if self.down:
            self.failed_reads += 1
            raise BackendUnavailable("the connection dropped (test)")
        return await super().get_checkpoint(job, slot)


async def test_a_step_that_cannot_read_the_results_before_it_is_lost_not_failed() -> None:
    """A later step whose read of the earlier steps' results met a store that did not
    answer (three tries over two heartbeats) failed, and so ended its workflow run,
    although no handler of it had run: it is lost, and taken over once the store
    answers, as after a failed renewal."""
    backend = CheckpointsUnread()
    s = Scheduler(backend, instance_id="a", lease="0.9s", heartbeat="0.2s")
    flow = s.workflow("close", every="1h", offset=quiet_offset_now())
    ran: list[str] = []

    @flow.step("snapshot")
    async def snapshot(ctx: RunContext) -> int:
        ran.append("snapshot")
        return 7

    @flow.step("interest")
    async def interest(ctx: RunContext) -> None:
        ran.append(f"interest {ctx.results['snapshot']}")

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = s.jobs["close/snapshot"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "close/snapshot", slot)
        await wait_for(lambda: backend.failed_reads >= 3, timeout=10,
                       what="the results' reads given up")
        backend.down = False
        history = await wait_history(
            s, lambda h: any(a.outcome == Outcome.COMPLETED for a in h),
            job="close/interest", what="the step taken over and completed")
        await i.stop()
    assert ran == ["snapshot", "interest 7"], ran
    assert [(a.attempt, a.outcome) for a in sorted(history, key=lambda a: a.attempt)] == [
        (1, Outcome.LOST), (2, Outcome.COMPLETED)], history
