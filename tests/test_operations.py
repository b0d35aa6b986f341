"""Fleet-wide operations (DESIGN 4c): trigger, pause, resume, retry and cancel.

Through the public API (``Admin``, ``scheduler.admin``) on every store that runs scenarios
and implements operations, on asyncio and trio. Jobs are hourly with their next slot half
an hour away, so only the operations (and the tests' own claims) make runs; every wait
has a deadline.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import anyio
import pytest

from adapters.sql import TransientError, adapter_for
from backends.memory import MemoryBackend
from backends.postgres import PostgresBackend
from lease_core import (
    Admin,
    AttemptEnded,
    Cancelled,
    ConfigurationError,
    OperationRefused,
    Retried,
    Retry,
    RunContext,
    RunStatus,
    Scheduler,
)
from lease_core._structures import ClaimRequest
from lease_core.abc import Backend
from lease_core.errors import BackendUnavailable
from lease_core.operations import Operation, OperationResult, _slot
from lease_core.retry import supports_retries
from lease_core.testing import claim_now, renew_membership
from tests.helpers import (
    Instance,
    quiet_offset,
    quiet_offset_now,
    started,
    stop_all,
    store_now_ms,
    wait_for,
    wait_history,
)
from tests.stores import Store
from tests.stores.memory import MemoryStore
from tests.stores.postgres import PgServer, drop_tables, unique_table

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


def make(store: Store, name: str, **kw: Any) -> Scheduler:
    return Scheduler(store.backend(), instance_id=name, **{**FAST, **kw})


def admin_for(store: Store, by: str = "cli") -> Admin:
    backend = store.backend()
    if type(backend).operate is Backend.operate:
        pytest.skip(f"{type(backend).__name__} has no operations")
    return Admin(backend, by=by)


async def quiet(store: Store) -> float:
    return quiet_offset(await store_now_ms(store.backend()))


async def status_of(backend: Backend, job: str, slot: int) -> RunStatus | None:
    await backend.start()
    try:
        runs = {r.slot: r.status for r in await backend.runs(job, limit=1000)}
    finally:
        await backend.close()
    return runs.get(slot)


async def test_trigger_runs_once_within_a_heartbeat_with_reason_manual(store: Store) -> None:
    admin = admin_for(store)
    offset = await quiet(store)
    ran: list[tuple[str, int]] = []
    schedulers = [make(store, name) for name in ("a", "b")]
    for s in schedulers:
        async def work(ctx: RunContext, name: str = s.instance_id) -> None:
            ran.append((name, ctx.slot))
        s.every("report", "1h", work, offset=offset)
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in schedulers]
        slot = await admin.trigger("report")
        history = await wait_history(
            schedulers[0], lambda h: any(a.slot == slot and a.outcome == "completed" for a in h),
            job="report", what="the triggered run completed")
        await stop_all(instances)
    mine = [a for a in history if a.slot == slot]
    assert len(mine) == 1, mine
    assert (mine[0].reason, mine[0].requested_by, mine[0].attempt) == ("manual", "cli", 1)
    assert [s for _, s in ran] == [slot]
    log = await schedulers[0].recovery_log(("report", slot))
    assert [e.event for e in log] == ["started", "completed"]
    assert "manual" in log[0].detail and "cli" in log[0].detail
    from lease_core._status import read_run

    backend = store.backend()
    await backend.start()
    try:
        shown = await read_run(backend, "report", slot)
    finally:
        await backend.close()
    assert shown is not None
    assert [(a["reason"], a["requested_by"]) for a in shown["attempts"]] == [("manual", "cli")]


async def test_pause_skips_new_slots_until_resume(store: Store) -> None:
    admin = admin_for(store, by="ops-1")
    ran: list[int] = []
    s = make(store, "a")

    async def tick(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    s.every("tick", "1s", tick)
    async with anyio.create_task_group() as tg:
        instance = await Instance(s).start(tg)
        await admin.pause("tick")
        assert await admin.paused() == {"tick": "ops-1"}
        first_paused = len(ran)
        history = await wait_history(
            s, lambda h: sum(a.outcome == "skipped" for a in h) >= 2, job="tick",
            what="two slots skipped while paused")
        skipped = [a for a in history if a.outcome == "skipped"]
        assert all(a.error == "job paused by ops-1" for a in skipped)
        # a run already claimed when the pause came may have run; none after the skips
        assert not any(slot > min(a.slot for a in skipped) for slot in ran[first_paused:])
        await admin_for(store, by="ops-2").resume("tick")
        assert await admin.paused() == {}
        after = max(a.slot for a in skipped)
        await wait_for(lambda: any(slot > after for slot in ran), what="a run after resume")
        await stop_all([instance])
    # slots skipped while paused are not caught up
    assert not {a.slot for a in skipped} & set(ran)
    # the resume left its record, with who resumed, on the slots the pause skipped
    paused_slots = {a.slot for a in skipped}
    recorded = {a.slot: a.error for a in await s.history("tick") if a.slot in paused_slots}
    assert set(recorded.values()) == {"job paused by ops-1; resumed by ops-2"}, recorded
    log = await s.recovery_log(("tick", max(paused_slots)))
    assert [(e.event, e.detail) for e in log][-1] == (
        "skipped", "job paused by ops-1; resumed by ops-2")


async def test_retry_runs_a_failed_run_again_with_reason_retry(store: Store) -> None:
    admin = admin_for(store, by="http")
    offset = await quiet(store)
    calls: list[int] = []
    s = make(store, "a")

    async def flaky(ctx: RunContext) -> None:
        calls.append(ctx.attempt)
        if len(calls) == 1:
            raise RuntimeError("disk full")

    s.every("flaky", "1h", flaky, offset=offset)
    async with anyio.create_task_group() as tg:
        instance = await Instance(s).start(tg)
        slot = await store_now_ms(store.backend()) - 1000
        assert await claim_now(s, "flaky", slot) is not None
        await wait_history(s, lambda h: any(a.outcome == "failed" for a in h), job="flaky",
                           what="the run failed")
        await admin.retry("flaky", slot)
        history = await wait_history(
            s, lambda h: any(a.outcome == "completed" for a in h), job="flaky",
            what="the retried run completed")
        with pytest.raises(OperationRefused, match="completed; only failed") as refused:
            await admin.retry("flaky", slot)
        assert refused.value.kind == "conflict"
        await stop_all([instance])
    mine = sorted((a for a in history if a.slot == slot), key=lambda a: a.attempt)
    assert [(a.attempt, a.reason, a.outcome) for a in mine] == [
        (1, "scheduled", "failed"), (2, "retry", "completed")]
    assert mine[1].requested_by == "http" and mine[0].error and "disk full" in mine[0].error
    assert calls == [1, 2]


async def test_cancel_stops_the_holder_and_nobody_takes_over(store: Store) -> None:
    admin = admin_for(store, by="ops")
    offset = await quiet(store)
    stopped = anyio.Event()
    entered = anyio.Event()
    holder, backup = make(store, "holder"), make(store, "backup")

    async def slow(ctx: RunContext) -> None:
        entered.set()
        try:
            await anyio.sleep(60)
        finally:
            if ctx.stopping.is_set():
                stopped.set()

    for s in (holder, backup):
        s.every("slow", "1h", slow, offset=offset)
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in (holder, backup)]
        slot = await store_now_ms(store.backend()) - 1000
        assert await claim_now(holder, "slow", slot) is not None
        with anyio.fail_after(10):
            await entered.wait()
        await claim_now(backup, "slow", slot)
        await wait_for(lambda: ("slow", slot) in backup.watching, what="backup watches")
        await admin.cancel("slow", slot, grace="1s")
        with anyio.fail_after(10):
            await stopped.wait()
        assert await status_of(store.backend(), "slow", slot) == "cancelled"
        # the backup sees the run finished and stops watching it, claiming nothing
        await wait_for(lambda: ("slow", slot) not in backup.watching and not holder.running,
                       what="nobody holds or watches the cancelled run")
        with pytest.raises(OperationRefused, match="cancelled") as refused:
            await admin.cancel("slow", slot)
        assert refused.value.kind == "conflict"
        await stop_all(instances)
    history = [a for a in await holder.history("slow") if a.slot == slot]
    assert [(a.attempt, a.outcome, a.error) for a in history] == [
        (1, "cancelled", "cancelled by ops")]
    log = await holder.recovery_log(("slow", slot))
    assert log[-1].event == "cancelled"


async def _cancel_while_running(store: Store, handler: Any, grace: str,
                                entered: anyio.Event) -> tuple[Scheduler, int, list[Any]]:
    """Run ``handler`` (job "graced") on a holder with a backup, cancel it with ``grace``
    once it runs, and wait until nobody holds or watches the run any more."""
    admin = admin_for(store, by="ops")
    offset = await quiet(store)
    holder, backup = make(store, "holder"), make(store, "backup")
    events: list[Any] = []
    holder.subscribe(events.append)
    for s in (holder, backup):
        s.every("graced", "1h", handler, offset=offset)
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in (holder, backup)]
        slot = await store_now_ms(store.backend()) - 1000
        assert await claim_now(holder, "graced", slot) is not None
        with anyio.fail_after(10):
            await entered.wait()
        await claim_now(backup, "graced", slot)
        await wait_for(lambda: ("graced", slot) in backup.watching, what="backup watches")
        await admin.cancel("graced", slot, grace=grace)
        assert await status_of(store.backend(), "graced", slot) == "cancelled"
        await wait_for(lambda: ("graced", slot) not in backup.watching and not holder.running,
                       what="nobody holds or watches the cancelled run", timeout=20)
        await stop_all(instances)
    return holder, slot, events


async def test_cancel_lets_a_cooperative_handler_finish_within_its_grace(
        store: Store) -> None:
    entered = anyio.Event()
    seen: list[str | None] = []

    async def cooperative(ctx: RunContext) -> str:
        entered.set()
        with anyio.fail_after(30):  # a long grace: the handler returns well within it
            await ctx.stopping.wait()
        seen.append(ctx.stop_reason)
        await anyio.sleep(0.3)  # some cleanup, still within the grace
        seen.append("returned")
        return "done"

    holder, slot, events = await _cancel_while_running(store, cooperative, "60s", entered)
    assert seen == ["run cancelled by an operator", "returned"]
    history = [a for a in await holder.history("graced") if a.slot == slot]
    assert [(a.attempt, a.outcome, a.error) for a in history] == [
        (1, "cancelled", "cancelled by ops")]  # not completed, and nobody took it over
    assert await status_of(store.backend(), "graced", slot) == "cancelled"
    ended = [e for e in events if isinstance(e, AttemptEnded) and e.slot == slot]
    assert [type(e) for e in ended] == [Cancelled], ended


async def test_cancel_cancels_a_stubborn_handler_once_its_grace_has_passed(
        store: Store) -> None:
    entered = anyio.Event()
    marks: dict[str, float] = {}

    async def stubborn(ctx: RunContext) -> None:
        entered.set()

        async def note_stop() -> None:
            await ctx.stopping.wait()
            marks["stopping"] = anyio.current_time()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(note_stop)
                await anyio.sleep(60)  # ignores ctx.stopping
        except anyio.get_cancelled_exc_class():
            marks["cancelled"] = anyio.current_time()
            raise

    holder, slot, events = await _cancel_while_running(store, stubborn, "1.5s", entered)
    assert set(marks) == {"stopping", "cancelled"}, marks
    # asked to stop first, cancelled only once the grace had passed
    assert 1.3 <= marks["cancelled"] - marks["stopping"] < 10, marks
    history = [a for a in await holder.history("graced") if a.slot == slot]
    assert [(a.attempt, a.outcome) for a in history] == [(1, "cancelled")]
    ended = [e for e in events if isinstance(e, AttemptEnded) and e.slot == slot]
    assert [type(e) for e in ended] == [Cancelled], ended


@pytest.mark.parametrize("goes", ["crashes", "stops"])
async def test_an_operations_run_is_taken_over_when_its_holder_goes(
        store: Store, goes: str) -> None:
    """A triggered run is known only to the member that claimed it (no other member has
    its slot on a schedule): when that member crashes, or stops and hands it over, the
    others learn of it from the membership's change and take it over. Before, it stayed
    ``running`` with its lease long expired until an instance started."""
    admin = admin_for(store)
    offset = await quiet(store)
    ran: list[tuple[str, int, int, str]] = []
    schedulers = [make(store, name) for name in ("a", "b")]
    for s in schedulers:
        async def work(ctx: RunContext, name: str = s.instance_id) -> None:
            ran.append((name, ctx.slot, ctx.attempt, ctx.reason))
            if len(ran) == 1:
                await anyio.sleep_forever()  # the first holder hangs until it goes
        s.every("report", "1h", work, offset=offset)
    async with anyio.create_task_group() as tg:
        instances = dict(zip("ab", [await Instance(s).start(tg) for s in schedulers],
                             strict=True))
        await wait_for(lambda: all(s.health().fleet_size == 2 for s in schedulers),
                       timeout=10, what="both members known")
        slot = await admin.trigger("report")
        await wait_for(lambda: len(ran) == 1, timeout=10, what="the triggered run started")
        holder = ran[0][0]
        if goes == "crashes":
            instances[holder].crash()
            await instances[holder].wait_done()
        else:
            await instances[holder].stop()
        other = next(s for s in schedulers if s.instance_id != holder)
        history = await wait_history(
            other, lambda h: any(a.slot == slot and a.outcome == "completed" for a in h),
            job="report", timeout=20, what="the triggered run completed by the other")
        await stop_all([i for name, i in instances.items() if name != holder])
    assert [(name, s) for name, s, _, _ in ran] == [(holder, slot), (other.instance_id, slot)]
    reason = {"crashes": "takeover", "stops": "hand-over"}[goes]
    assert ran[1][2:] == (2, reason), ran
    last = max((a for a in history if a.slot == slot), key=lambda a: a.attempt)
    assert (last.instance_id, last.attempt, last.outcome) == (other.instance_id, 2, "completed")


class SlowFirstListing:
    """A backend whose first listing of every open run (``runs(None, open_only=True)``)
    answers only after ``delay`` seconds, as a slow store's would."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay, self.slowed = inner, delay, False

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr != "runs":
            return value

        async def runs(job: str | None = None, **kw: Any) -> Any:
            if job is None and kw.get("open_only") and not self.slowed:
                self.slowed = True
                await anyio.sleep(self.delay)
            return await value(job, **kw)
        return runs


@pytest.mark.parametrize("seen_by", ["a tick cut short", "renew_membership"])
async def test_the_runs_of_a_member_that_went_are_backed_up_however_its_going_was_seen(
        store: Store, seen_by: str) -> None:
    """A member that went is looked for among the open runs until a listing of them
    answers: a listing the tick's deadline cut short (a slow store) is made again at the
    next tick, and a departure that a test's ``renew_membership`` saw is looked for too.
    Both were forgotten, so a run only its claimer knew was never taken over."""
    offset = await quiet(store)
    ran: list[tuple[str, int, str]] = []
    # The backup renews its membership every 15s by itself: only the hook sees the holder go.
    backup_lease = "30s" if seen_by == "renew_membership" else FAST["lease"]
    schedulers = [make(store, "a"), make(store, "b", lease=backup_lease)]
    for s in schedulers:
        async def work(ctx: RunContext, name: str = s.instance_id) -> None:
            ran.append((name, ctx.attempt, ctx.reason))
            if len(ran) == 1:
                await anyio.sleep_forever()  # the holder hangs until it crashes
        s.every("report", "1h", work, offset=offset, lease="1.2s")
    holder, backup = schedulers
    if seen_by == "a tick cut short":  # the tick's deadline: the job's lease less 0.2s
        backup.backend = SlowFirstListing(backup.backend, delay=3)  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in schedulers]
        assert await renew_membership(backup) == ("a", "b")
        slot = await store_now_ms(store.backend()) - 7 * 60_000  # on no schedule
        assert await claim_now(holder, "report", slot) is not None
        await wait_for(lambda: len(ran) == 1, timeout=10, what="the run started")
        instances[0].crash()
        await instances[0].wait_done()
        if seen_by == "renew_membership":
            await anyio.sleep(2)  # the holder's membership (1.2s) lapses
            assert await renew_membership(backup) == ("b",)
        await wait_for(lambda: len(ran) == 2, timeout=10, what="the run taken over")
        await stop_all(instances[1:])
    assert ran == [("a", 1, "scheduled"), ("b", 2, "takeover")], ran


class SlowJobListings:
    """A backend whose listings of one job's open runs (``runs(job, open_only=True)``)
    answer only after ``delay`` seconds each, as a slow store's would."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr != "runs":
            return value

        async def runs(job: str | None = None, **kw: Any) -> Any:
            if job is not None and kw.get("open_only"):
                await anyio.sleep(self.delay)
            return await value(job, **kw)
        return runs


@pytest.mark.parametrize("store_answers", ["at once", "slowly"])
async def test_a_run_of_a_member_that_went_is_backed_up_past_ten_thousand_open_runs(
        store_answers: str) -> None:
    """A departed member's open runs are found in one listing of the store's open runs,
    newest slot first, of at most 10,000: a run older than 10,000 others (of jobs that run
    long, or of other groups) was never taken over. The declared jobs' own open runs are
    now read too when the listing is full; on a slow store, for half a tick at a time
    (read all in one tick, they were cut short by the tick's deadline at every tick, and
    the checks after them with them). The memory store: 10,001 claims elsewhere."""
    store = MemoryStore()
    backend = store.backend()
    now = await store_now_ms(backend)
    await backend.start()
    try:
        await backend.claim_many([
            ClaimRequest("elsewhere", now - 60_000 + i, "ghost", uuid.uuid4().hex,
                         3_600_000, overlap_skip=False, history_size=20_000)
            for i in range(10_001)])
        assert len(await backend.runs(None, open_only=True, limit=10_001)) == 10_001
    finally:
        await backend.close()
    ran: list[tuple[str, int, str]] = []
    schedulers = [make(store, "a"), make(store, "b")]
    for s in schedulers:
        async def work(ctx: RunContext, name: str = s.instance_id) -> None:
            ran.append((name, ctx.attempt, ctx.reason))
            if len(ran) == 1:
                await anyio.sleep_forever()  # the holder hangs until it crashes
        s.every("report", "1h", work, offset=quiet_offset(now), lease="1.2s")
        for other in ("audit", "backup", "cleanup"):  # read before "report"'s runs
            s.every(other, "1h", lambda ctx: None, offset=quiet_offset(now))
    holder, backup = schedulers
    if store_answers == "slowly":  # 4 jobs, 0.4 s each: beyond a tick's 1 s
        backup.backend = SlowJobListings(backup.backend, delay=0.4)  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in schedulers]
        await wait_for(lambda: all(s.health().fleet_size == 2 for s in schedulers),
                       timeout=10, what="both members known")
        assert await claim_now(holder, "report", now - 7 * 60_000) is not None
        await wait_for(lambda: len(ran) == 1, timeout=10, what="the run started")
        instances[0].crash()
        await instances[0].wait_done()
        await wait_for(lambda: len(ran) == 2, timeout=45, what="the run taken over")
        await stop_all(instances[1:])
    assert ran == [("a", 1, "scheduled"), ("b", 2, "takeover")], ran


@pytest.mark.parametrize("goes", ["crashes", "stops"])
async def test_a_run_is_taken_over_from_a_member_of_another_group(
        store: Store, goes: str) -> None:
    """During a rolling deploy that adds a job, the instances of the old release and the
    new ones form two groups (they declare different jobs). A run of a job both declare,
    known only to the old member that claimed it, is taken over by a new member when the
    old one crashes, or stops and hands it over: the members watched only their own
    group's going, so it stayed running, or handed over, until an instance started."""
    offset = await quiet(store)
    ran: list[tuple[str, int, str]] = []
    old, new = make(store, "old"), make(store, "new")
    for s in (old, new):
        async def work(ctx: RunContext, name: str = s.instance_id) -> None:
            ran.append((name, ctx.attempt, ctx.reason))
            if len(ran) == 1:
                await anyio.sleep_forever()  # the old member's attempt hangs
        s.every("report", "1h", work, offset=offset)
    new.every("added", "1h", lambda ctx: None, offset=offset)
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in (old, new)]
        assert await renew_membership(new) == ("new",)  # another group: not ranked with it
        slot = await store_now_ms(store.backend()) - 7 * 60_000  # on no schedule
        assert await claim_now(old, "report", slot) is not None
        await wait_for(lambda: len(ran) == 1, timeout=10, what="the run started")
        if goes == "crashes":
            instances[0].crash()
            await instances[0].wait_done()
        else:
            await instances[0].stop()
        await wait_for(lambda: len(ran) == 2, timeout=10, what="the run taken over")
        await stop_all(instances[1:])
    reason = {"crashes": "takeover", "stops": "hand-over"}[goes]
    assert ran == [("old", 1, "scheduled"), ("new", 2, reason)], ran


async def test_a_trigger_does_not_move_the_catch_up_watermark(store: Store) -> None:
    """A job's last slot is where a starting scheduler catches up from: a trigger made
    while no instance runs (its run is not a slot of the schedule) must not make the
    slots missed meanwhile vanish from the catch-up."""
    admin = admin_for(store)
    backend = store.backend()
    offset = await quiet(store)
    s = make(store, "a")

    async def work(ctx: RunContext) -> None:
        pass

    s.every("watermark", "1h", work, offset=offset)
    async with s:
        slot = await store_now_ms(backend) - 1000
        assert await claim_now(s, "watermark", slot) is not None
        await wait_history(s, lambda h: any(a.outcome == "completed" for a in h),
                           job="watermark", what="the scheduled run")
    triggered = await admin.trigger("watermark")  # no instance runs the job now
    assert triggered > slot
    await backend.start()
    try:
        info = (await backend.register_jobs(["watermark"]))["watermark"]
    finally:
        await backend.close()
    assert info.last_slot == slot, (info.last_slot, slot, triggered)
    assert triggered in info.open_slots


async def test_a_trigger_of_a_job_that_skips_overlaps_runs_beside_its_run_in_progress(
        store: Store) -> None:
    """overlap="skip" applies to the schedule's slots: an operator's trigger runs even
    while a run of the job is in progress (as the operations guide says)."""
    admin = admin_for(store)
    offset = await quiet(store)
    s = make(store, "a")
    started: list[int] = []
    release = anyio.Event()

    async def work(ctx: RunContext) -> None:
        started.append(ctx.slot)
        await release.wait()

    s.every("busy", "1h", work, offset=offset, overlap="skip")
    async with s:
        slot = await store_now_ms(store.backend()) - 1000
        assert await claim_now(s, "busy", slot) is not None
        await wait_for(lambda: started == [slot], timeout=10, what="the scheduled run")
        triggered = await admin.trigger("busy")
        await wait_for(lambda: triggered in started, timeout=10,
                       what="the triggered run, beside the one in progress")
        assert started == [slot, triggered]
        release.set()
        await wait_history(s, lambda h: sum(a.outcome == "completed" for a in h) == 2,
                           job="busy", what="both runs completed")


async def test_bad_input_is_refused_and_changes_nothing(store: Store) -> None:
    admin = admin_for(store)
    offset = await quiet(store)
    s = make(store, "a")

    async def work(ctx: RunContext) -> None:
        pass

    s.every("known", "1h", work, offset=offset)
    async with s:
        done = await claim_now(s, "known", await store_now_ms(store.backend()) - 1000)
        assert done is not None
        await wait_history(s, lambda h: any(a.outcome == "completed" for a in h),
                           job="known", what="one completed run")
        for call, kind, text in (
                (admin.trigger("nope"), "unknown_job", "never seen"),
                (admin.pause("nope"), "unknown_job", "'nope'"),
                (admin.retry("known", 12345), "no_run", "known@12345"),
                (admin.cancel("known", 12345), "no_run", "no run"),
                (admin.retry("known", done.slot), "conflict", "it is completed"),
                (admin.cancel("known", done.slot), "conflict", "already finished")):
            with pytest.raises(OperationRefused, match=text) as refused:
                await call
            assert refused.value.kind == kind
        assert await admin.paused() == {}
        assert [r.slot for r in await s.backend.runs("known")] == [done.slot]
        with pytest.raises(ValueError, match="grace"):
            await admin.cancel("known", done.slot, grace="-1s")
        with pytest.raises(ValueError, match="slot 'soon'"):
            await admin.retry("known", "soon")
        # Not digits to int(): "²".isdigit() is true; and slots past year 9999 or before
        # 1970, which the stores cannot hold, are refused by name too.
        for bad in ("²", "--5", 2**63, -1):
            with pytest.raises(ValueError, match=f"slot {bad!r}"):
                await admin.retry("known", bad)
        # More digits than int() reads (4300): a bare ValueError of int()'s own before.
        with pytest.raises(ConfigurationError, match="out of range"):
            await admin.retry("known", "9" * 5000)
        with pytest.raises(ValueError, match="grace='999999h' is longer than 30 days"):
            await admin.cancel("known", done.slot, grace="999999h")
        assert [r.slot for r in await s.backend.runs("known")] == [done.slot]


class AnswerLost(MemoryBackend):
    """Makes each operation, then loses its answer (a connection cut after it ran)."""

    async def operate(self, op: Operation) -> OperationResult:
        await super().operate(op)
        raise BackendUnavailable("cannot reach the store: server closed the connection")


async def test_an_operation_whose_answer_was_lost_says_it_may_have_been_made() -> None:
    """The store made the operation and its answer was lost: the error said only that
    the store could not be reached (the HTTP API's 503 documented "changing nothing"),
    so an operator sent the trigger again and got a second run."""
    backend = AnswerLost()
    await backend.start()
    try:
        await backend.register_jobs(["report"])
        admin = Admin(backend, by="cli")
        with pytest.raises(BackendUnavailable, match=(
                "closed the connection; if the trigger of 'report' reached the store, it may "
                r"have been made .* \(a second trigger makes a second run\)")):
            await admin.trigger("report")
        [run] = await backend.runs("report")
        with pytest.raises(BackendUnavailable, match=(
                rf"the cancel of run report@{run.slot} \(.*\) reached the store, it may have "
                "been made")):
            await admin.cancel("report", run.slot)
        assert (await backend.runs("report"))[0].status is RunStatus.CANCELLED
        with pytest.raises(OperationRefused, match="already finished"):  # sent again
            await admin.cancel("report", run.slot)
    finally:
        await backend.close()


@pytest.mark.asyncio_only  # (psycopg's async pool; the store code is the same)
async def test_an_operation_postgresql_aborted_is_made_again(pg16_server: PgServer) -> None:
    """PostgreSQL aborts one of the transactions of a lock cycle (operate_v4.sql: a retry
    or cancel racing a resume or takeover and a trim), writing nothing: the operation is
    made again, as a claim is. It raised "PostgreSQL aborted the transaction" to the
    operator (a 503 of the HTTP API). Aborted every time, it fails saying so, not that it
    may have been made (nothing was)."""
    adapter = adapter_for(pg16_server.dsn)
    real = adapter.all
    aborts = [2]  # the sends still to abort
    aborted: list[str] = []

    async def all_(sql: str, params: Any = ()) -> Any:
        if "o_refused" in sql and aborts[0] > 0:
            aborts[0] -= 1
            aborted.append(sql)
            raise TransientError("PostgreSQL aborted the transaction: deadlock detected")
        return await real(sql, params)

    adapter.all = all_  # type: ignore[method-assign]
    table = unique_table()
    backend = PostgresBackend(adapter, table=table)
    await backend.start()
    try:
        await backend.register_jobs(["report"])
        admin = Admin(backend, by="cli")
        slot = await admin.trigger("report")
        assert len(aborted) == 2
        assert [r.slot for r in await backend.runs("report")] == [slot]
        aborts[0] = 100
        with pytest.raises(BackendUnavailable) as raised:
            await admin.pause("report")
        assert "aborted the transaction" in str(raised.value)
        assert "may have been made" not in str(raised.value)
        assert await admin.paused() == {}
    finally:
        await backend.close()
        await adapter.close()
        await drop_tables(pg16_server.dsn, table)


async def test_heartbeat_at_of_a_running_run_is_its_last_renewal(store: Store) -> None:
    from lease_core._status import read_run

    backend = store.backend()
    if type(backend).heartbeats is Backend.heartbeats:
        pytest.skip(f"{type(backend).__name__} keeps no heartbeat record")
    offset = await quiet(store)
    entered, release = anyio.Event(), anyio.Event()
    s = make(store, "a")

    async def slow(ctx: RunContext) -> None:
        entered.set()
        await release.wait()

    s.every("slow", "1h", slow, offset=offset)
    async with s:
        slot = await store_now_ms(store.backend()) - 1000
        assert await claim_now(s, "slow", slot) is not None
        with anyio.fail_after(10):
            await entered.wait()
        await backend.start()
        try:
            first = await read_run(backend, "slow", slot)
            assert first is not None and first["status"] == "running"
            assert first["heartbeat_at"] >= first["started_at"]  # the claim, or a renewal

            async def renewed() -> Any:
                run = await read_run(backend, "slow", slot)
                assert run is not None
                return run if run["heartbeat_at"] > run["started_at"] else None

            later = await wait_for(renewed, what="a renewal after the claim")
            assert later["heartbeat_at"] < later["lease_expires_at"]
        finally:
            release.set()
            await backend.close()


async def test_retry_of_a_failed_workflow_resumes_at_the_step_that_failed(
        store: Store) -> None:
    admin = admin_for(store, by="ops")
    ran: list[str] = []
    s = make(store, "a")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())

    @close.step("snapshot")
    async def snapshot(ctx: RunContext) -> int:
        ran.append("snapshot")
        return 3

    @close.step("interest")
    async def interest(ctx: RunContext) -> int:
        ran.append("interest")
        if ran.count("interest") == 1:
            raise RuntimeError("rates missing")
        return ctx.results["snapshot"] * 2

    @close.step("publish")
    async def publish(ctx: RunContext) -> None:
        ran.append(f"publish {ctx.results['interest']}")

    async with anyio.create_task_group() as tg:
        instance = await Instance(s).start(tg)
        slot = close.schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "close", slot)
        await wait_history(s, lambda h: any(a.outcome == "failed" for a in h),
                           job="close/interest", what="the interest step failed")
        await admin.retry("close", slot)
        await wait_for(lambda: "publish 6" in ran, what="the workflow resumed and finished")
        await stop_all([instance])
    assert ran == ["snapshot", "interest", "interest", "publish 6"]
    log = await s.recovery_log(f"close@{slot}")
    assert [(e.step, e.attempt, e.event) for e in log] == [
        ("snapshot", 1, "started"), ("snapshot", 1, "completed"),
        ("interest", 1, "started"), ("interest", 1, "failed"),
        ("interest", 2, "retried"), ("interest", 2, "completed"),
        ("publish", 1, "started"), ("publish", 1, "completed")]
    assert log[4].detail is not None and "rates missing" in log[4].detail
    assert log[4].detail.endswith(", requested by ops")


async def test_queued_lists_triggered_and_retried_runs_not_plain_hand_overs(
        store: Store) -> None:
    from lease_core.abc import ClaimRequest, Lease, Outcome

    admin = admin_for(store)
    backend = store.backend()
    await backend.start()
    try:
        await backend.register_jobs(["q"])
        for slot, end in ((1000, "hand_over"), (2000, "fail")):
            await backend.claim(ClaimRequest("q", slot, "i-1", f"t{slot}", 30_000))
            lease = Lease("q", slot, f"t{slot}", 30_000)
            if end == "hand_over":
                assert await backend.hand_over([lease])
            else:
                assert await backend.finish(lease, Outcome.FAILED, "boom")
        assert await backend.queued(["q"]) == []  # the backups claim a hand-over
        triggered = await admin.trigger("q")
        assert triggered % 1000 != 0
        await admin.retry("q", 2000)
        assert await backend.queued(["other"]) == []
        await backend.register_jobs(["other"])
        other = await admin.trigger("other")
        # Sorted by job, then slot, whatever the order the jobs are asked in.
        assert await backend.queued(["q", "other"]) == sorted([
            ("q", triggered), ("q", 2000), ("other", other)])
        won = await backend.claim(ClaimRequest("q", 2000, "i-2", "t-retry", 30_000))
        assert (won.status, won.reason, won.attempt) == ("won", "retry", 2)
        assert await backend.queued(["q"]) == [("q", triggered)]
    finally:
        await backend.close()


async def test_trigger_of_a_workflow_by_its_name_runs_it_from_its_first_step(
        store: Store) -> None:
    admin = admin_for(store, by="ops")
    ran: list[tuple[str, int]] = []
    s = make(store, "a")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())

    @close.step("snapshot")
    async def snapshot(ctx: RunContext) -> int:
        ran.append(("snapshot", ctx.slot))
        return 3

    @close.step("publish")
    async def publish(ctx: RunContext) -> None:
        ran.append((f"publish {ctx.results['snapshot']}", ctx.slot))

    async with anyio.create_task_group() as tg:
        instance = await Instance(s).start(tg)
        slot = await admin.trigger("close")
        await wait_for(lambda: len(ran) == 2, what="the triggered workflow ran both steps")
        await stop_all([instance])
    assert ran == [("snapshot", slot), ("publish 3", slot)]
    first = [a for a in await s.history("close/snapshot") if a.slot == slot]
    assert [(a.attempt, a.reason, a.requested_by, a.outcome) for a in first] == [
        (1, "manual", "ops", "completed")]
    log = await s.recovery_log(f"close@{slot}")
    assert [(e.step, e.event) for e in log] == [
        ("snapshot", "started"), ("snapshot", "completed"),
        ("publish", "started"), ("publish", "completed")]


async def test_a_job_that_takes_a_former_workflow_s_name_is_acted_on_as_the_job(
        store: Store) -> None:
    """A new release declares a plain job named as the old release's workflow: from its
    start, the store no longer describes the name as a workflow, so a trigger runs the
    job (not the former workflow's first step); other workflows keep their record."""
    old = make(store, "old")
    for name in ("close", "sync"):
        wf = old.workflow(name, every="1h", offset=quiet_offset_now())
        for step in ("first", "second"):
            wf.step(step)(lambda ctx: None)
    async with anyio.create_task_group() as tg:
        await stop_all([await Instance(old).start(tg)])
    async with started(old.backend):
        assert set(await old.backend.workflows()) == {"close", "sync"}

    ran: list[str] = []
    new = make(store, "new")

    async def close(ctx: RunContext) -> None:
        ran.append(ctx.job)

    new.every("close", "1h", close, offset=quiet_offset_now())

    async with anyio.create_task_group() as tg:
        instance = await Instance(new).start(tg)
        assert await new.backend.workflows() == {"sync": ["first", "second"]}
        slot = await admin_for(store, by="ops").trigger("close")
        await wait_for(lambda: ran == ["close"], what="the triggered job ran")
        await stop_all([instance])
    assert [(a.job, a.reason) for a in await new.history() if a.slot == slot] == [
        ("close", "manual")]


async def test_a_triggered_workflows_step_is_taken_over_and_the_rest_runs_once(
        store: Store) -> None:
    """The member running a triggered workflow's middle step crashes: the other member
    takes that step over (its earlier step is not run again) and runs the last step."""
    admin = admin_for(store, by="ops")
    offset = await quiet(store)
    ran: list[tuple[str, str, int]] = []
    schedulers = [make(store, name) for name in ("a", "b")]
    for s in schedulers:
        flow = s.workflow("close", every="1h", offset=offset)

        async def snapshot(ctx: RunContext, name: str = s.instance_id) -> int:
            ran.append((name, "snapshot", ctx.attempt))
            return 3

        async def post(ctx: RunContext, name: str = s.instance_id) -> None:
            ran.append((name, "post", ctx.attempt))
            if ctx.attempt == 1:
                await anyio.sleep_forever()  # its member crashes meanwhile

        async def publish(ctx: RunContext, name: str = s.instance_id) -> None:
            ran.append((name, f"publish {ctx.results['snapshot']}", ctx.attempt))

        flow.step("snapshot")(snapshot)
        flow.step("post")(post)
        flow.step("publish")(publish)
    async with anyio.create_task_group() as tg:
        instances = dict(zip("ab", [await Instance(s).start(tg) for s in schedulers],
                             strict=True))
        await wait_for(lambda: all(s.health().fleet_size == 2 for s in schedulers),
                       timeout=10, what="both members known")
        await admin.trigger("close")
        await wait_for(lambda: any(step == "post" for _, step, _ in ran), timeout=10,
                       what="the middle step started")
        holder = next(name for name, step, _ in ran if step == "post")
        instances[holder].crash()
        await instances[holder].wait_done()
        await wait_for(lambda: any(step.startswith("publish") for _, step, _ in ran),
                       timeout=20, what="the last step ran")
        await stop_all([i for name, i in instances.items() if name != holder])
    other = "b" if holder == "a" else "a"
    assert [(step, attempt) for _, step, attempt in ran] == [
        ("snapshot", 1), ("post", 1), ("post", 2), ("publish 3", 1)], ran
    assert [name for name, _, _ in ran][2:] == [other, other]


async def test_pause_of_a_workflow_by_its_name_skips_its_slots_until_resume(
        store: Store) -> None:
    admin = admin_for(store, by="ops-1")
    ran: list[int] = []
    s = make(store, "a")
    flow = s.workflow("flow", every="1s")

    @flow.step("one")
    async def one(ctx: RunContext) -> None:
        pass

    @flow.step("two")
    async def two(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    async with anyio.create_task_group() as tg:
        instance = await Instance(s).start(tg)
        await admin.pause("flow")
        assert await admin.paused() == {"flow": "ops-1"}
        first_paused = len(ran)
        history = await wait_history(
            s, lambda h: sum(a.outcome == "skipped" for a in h) >= 2, job="flow/one",
            what="two slots of the workflow skipped while paused")
        skipped = [a for a in history if a.outcome == "skipped"]
        assert all(a.error and a.error.startswith("job paused by ops-1") for a in skipped)
        assert not any(slot > min(a.slot for a in skipped) for slot in ran[first_paused:])
        await admin.resume("flow")
        assert await admin.paused() == {}
        after = max(a.slot for a in skipped)
        await wait_for(lambda: any(slot > after for slot in ran),
                       what="a whole workflow run after resume")
        await stop_all([instance])
    assert not {a.slot for a in skipped} & set(ran)


async def test_a_pause_outlives_a_release_that_changes_a_workflows_first_step(
        store: Store) -> None:
    """A paused workflow, then a release that puts a step before its first one (or turns
    a paused job into a workflow of its name): the pause stayed on the former first job
    only, so each slot ran the new first step and stopped at the former one, skipped,
    and the workflow's resume was refused as not paused. The release's start carries the
    pause to the new first step, by its author; the workflow's resume ends both."""
    admin = admin_for(store, by="ops")
    ran: list[tuple[str, str]] = []

    def release(steps: list[str], plain: bool = False) -> Scheduler:
        s = make(store, "a")
        if plain:
            s.every("report", "1h", lambda ctx: None)
        else:
            for name in ("flow", "report"):
                flow = s.workflow(name, every="0.5s")
                for step in steps:
                    flow.step(step)(_recording(ran, name, step))
        return s

    async with release(["a", "b"]):  # the store knows the workflow and its steps
        pass
    async with release([], plain=True):
        pass
    await admin.pause("flow")
    await admin.pause("report")  # the plain job, paused before it becomes a workflow
    new = release(["prepare", "a", "b"])
    async with new:
        assert await new.backend.paused() == {
            "flow/prepare": "ops", "flow/a": "ops", "report/prepare": "ops", "report": "ops"}
        await admin.resume("flow")
        await admin.resume("report")
        assert await new.backend.paused() == {}
        await wait_for(lambda: {("flow", "b"), ("report", "b")} <= set(ran),
                       what="a whole run of each after the resume")
    assert ("flow", "prepare") in ran


@pytest.mark.parametrize("bad", [None, "", ["x"], 3])
async def test_a_job_operation_on_a_bad_name_is_refused_naming_it(bad: Any) -> None:
    admin = Admin(MemoryBackend(), by="ops")
    for act in (admin.trigger, admin.pause, admin.resume):
        with pytest.raises(ConfigurationError, match="must be a non-empty job name"):
            await act(bad)


def _recording(ran: list[tuple[str, str]], workflow: str, step: str) -> Any:
    async def handler(ctx: RunContext) -> None:
        ran.append((workflow, step))
    return handler


async def register_close(store: Store) -> None:
    """Record the two-step workflow ``close`` and its steps' jobs, as a start would."""
    backend = store.backend()
    await backend.start()
    try:
        await backend.register_workflows({"close": ["snapshot", "interest"]})
        await backend.register_jobs(["close/snapshot", "close/interest"])
    finally:
        await backend.close()


async def test_a_trigger_or_pause_of_a_later_step_s_own_job_is_refused(store: Store) -> None:
    """A later step's job, paused, stopped each run of its workflow half applied (the
    step recorded skipped, beyond a retry's reach); triggered, it ran without the steps
    before it. Both are refused, naming the workflow; the first step's job is the
    workflow's own (as its name is), and a resume is allowed."""
    admin = admin_for(store, by="ops")
    await register_close(store)
    for act in (admin.trigger, admin.pause):
        with pytest.raises(ConfigurationError, match="step 'interest' of workflow 'close'"):
            await act("close/interest")
    assert await admin.paused() == {}
    with pytest.raises(OperationRefused, match="not paused"):
        await admin.resume("close/interest")
    await admin.pause("close/snapshot")
    assert await admin.paused() == {"close": "ops"}


async def test_a_refusal_of_an_operation_on_a_workflow_names_the_workflow(
        store: Store) -> None:
    """An operation given a workflow's name acts on one of its steps' jobs. A refusal
    about the workflow as a whole (no run at that slot, not paused, paused already) names
    the workflow as given: it named the first step's job ("cannot resume job
    'close/snapshot'"), a name the operator never wrote. Each changes nothing."""
    admin = admin_for(store, by="ops")
    await register_close(store)
    run = "close@12345 (1970-01-01T00:00:12.345Z)"
    for call, text in (
            (lambda: admin.retry("close", 12345),
             f"cannot retry run {run}: the store has no run of 'close' at that slot"),
            (lambda: admin.cancel("close", 12345),
             f"cannot cancel run {run}: the store has no run of 'close' at that slot"),
            (lambda: admin.resume("close"), "cannot resume workflow 'close': it is not paused")):
        with pytest.raises(OperationRefused) as refused:
            await call()
        assert str(refused.value) == text
    assert await admin.paused() == {}
    await admin.pause("close")
    with pytest.raises(OperationRefused) as refused:
        await admin_for(store, by="other").pause("close")
    assert str(refused.value) == ("cannot pause workflow 'close': it is paused already by "
                                  "'ops'; resume it first to pause it in another name")
    assert await admin.paused() == {"close": "ops"}
    backend = store.backend()
    await backend.start()
    try:
        assert await backend.runs("close/snapshot") == []
    finally:
        await backend.close()


async def test_a_retry_of_a_run_waiting_for_its_automatic_retry_is_refused_clearly(
        store: Store) -> None:
    """A run whose handler failed and that waits for its next automatic retry (``retry=``,
    status ``retrying``) is no failed run: a retry is refused, saying what it waits for
    (the message said only "it is retrying"), and changes nothing."""
    from lease_core.abc import Lease, Outcome

    admin = admin_for(store, by="ops")
    backend = store.backend()
    if not supports_retries(backend):
        pytest.skip(f"{type(backend).__name__} has no retry_later()")
    await backend.start()
    try:
        await backend.register_jobs(["r"])
        await backend.claim(ClaimRequest("r", 1000, "i-1", "t-1", 60_000))
        assert await backend.retry_later(
            [(Lease("r", 1000, "t-1", 60_000), Outcome.FAILED, "boom", [600_000])]) == [1]
        with pytest.raises(OperationRefused, match=r"it is retrying \(it failed and waits for "
                           r"its next automatic retry") as refused:
            await admin.retry("r", 1000)
        assert refused.value.kind == "conflict"
        assert [(r.slot, r.status) for r in await backend.runs("r")] == [(1000, "retrying")]
        assert await backend.queued(["r"]) == []
    finally:
        await backend.close()


async def test_a_cancel_of_a_run_nobody_holds_is_recorded_as_an_attempt(
        store: Store) -> None:
    """A triggered, retried, handed-over or retrying run cancelled before any instance
    claimed it: its history records the cancel (who, the reason and requester the claim
    would have had), and its run says the same attempt."""
    from lease_core._status import read_run
    from lease_core.abc import ClaimRequest, ClaimStatus, Lease, Outcome

    cli, http = admin_for(store, by="cli"), admin_for(store, by="http")
    backend = store.backend()
    await backend.start()
    try:
        await backend.register_jobs(["c"])
        for slot, end in ((1000, "hand_over"), (2000, "fail"), (3000, "retry_later")):
            await backend.claim(ClaimRequest("c", slot, "i-1", f"t{slot}", 30_000))
            lease = Lease("c", slot, f"t{slot}", 30_000)
            if end == "hand_over":
                assert await backend.hand_over([lease])
            elif end == "fail":
                assert await backend.finish(lease, Outcome.FAILED, "boom")
            else:
                assert await backend.retry_later([(lease, Outcome.FAILED, "boom",
                                                   [60_000])]) == [1]
        await http.retry("c", 2000)
        triggered = await http.trigger("c")
        for slot in (1000, 2000, 3000, triggered):
            await cli.cancel("c", slot)
        history = await backend.history("c", 100)
        runs = {r.slot: r for r in await backend.runs("c", limit=100)}
        # Trimming the attempts before the cancels keeps the cancelled runs and their
        # records: a run is deleted only once none of its attempts is left.
        assert await backend.prune("c", keep=4) == 3
        kept = await backend.history("c", 100)
        # The status API: the cancelled triggered run never started.
        view = await read_run(backend, "c", triggered)
        assert view is not None and view["status"] == "cancelled", view
        assert view["started_at"] is None and view["finished_at"] is not None, view
        for slot in (1000, 2000, 3000, triggered):
            claimed = await backend.claim(ClaimRequest("c", slot, "i-2", "t-late", 30_000))
            assert claimed.status is ClaimStatus.FINISHED, (slot, claimed)
    finally:
        await backend.close()
    assert sorted((a.slot, a.attempt, str(a.outcome)) for a in kept) == sorted(
        (a.slot, a.attempt, "cancelled") for a in history if a.outcome == "cancelled")
    last = {a.slot: a for a in sorted(history, key=lambda a: a.attempt)}
    assert {slot: (a.attempt, a.instance_id, str(a.reason), str(a.outcome), a.error,
                   a.requested_by) for slot, a in last.items()} == {
        1000: (2, "cli", "hand-over", "cancelled", "cancelled by cli", None),
        2000: (2, "cli", "retry", "cancelled", "cancelled by cli", "http"),
        3000: (2, "cli", "retry", "cancelled", "cancelled by cli", None),
        triggered: (1, "cli", "manual", "cancelled", "cancelled by cli", "http")}
    assert all(a.finished_at is not None and a.finished_at == a.claimed_at
               for a in last.values())
    # The attempts before the cancel are kept as they ended.
    assert sorted((a.slot, a.attempt, str(a.outcome)) for a in history
                  if a.attempt == 1 and a.slot != triggered) == [
        (1000, 1, "handed_over"), (2000, 1, "failed"), (3000, 1, "failed")]
    assert {slot: (str(r.status), r.attempt, r.instance_id) for slot, r in runs.items()} == {
        slot: ("cancelled", a.attempt, "cli") for slot, a in last.items()}


async def test_trimming_keeps_a_run_cancelled_within_its_grace(store: Store) -> None:
    """A run cancelled with a grace keeps its holder's token until the grace has passed:
    trimming by size or by age leaves it and its attempt (deleting them made the holder's
    next heartbeat find its lease neither held nor cancelled, so its handler was cancelled
    at once, grace ignored); once the grace has passed, trimming deletes them."""
    from lease_core.abc import ClaimRequest, Lease, Outcome

    admin = admin_for(store, by="ops")
    backend = store.backend()
    await backend.start()
    try:
        await backend.register_jobs(["g"])
        for slot in (1000, 2000, 3000, 4000):
            await backend.claim(ClaimRequest("g", slot, "i-1", f"t{slot}", 30_000,
                                             overlap_skip=False))
        for slot in (3000, 4000):  # newer runs finish meanwhile
            assert await backend.finish(Lease("g", slot, f"t{slot}", 30_000),
                                        Outcome.COMPLETED)
        await admin.cancel("g", 1000, grace="60s")
        await admin.cancel("g", 2000, grace="0.3s")
        graced = Lease("g", 1000, "t1000", 30_000)
        # The cancelled run's expiry is the end of its grace, on every store (memory's
        # said None): a check and a claim report it.
        seen = await backend.check([("g", 1000)])
        ends = seen.runs[("g", 1000)].expires_ms
        assert ends is not None and seen.now_ms < ends <= seen.now_ms + 60_000, seen
        late = await backend.claim(ClaimRequest("g", 1000, "i-2", "t-late", 30_000))
        assert (str(late.status), late.expires_ms) == ("finished", ends), late

        async def slots() -> set[int]:
            return {r.slot for r in await backend.runs("g", limit=100)}

        # by size, one job and many: the finished runs go, not 1000
        await backend.prune("g", keep=0)
        await backend.prune_many(["g", "h"], keep=0)
        assert 1000 in await slots() and not {3000, 4000} & await slots()
        assert (await backend.heartbeat([graced])).cancelled == {graced.token: 60_000}

        async def short_grace_gone() -> bool:  # by age too, until 2000's grace has passed
            await backend.prune("g", older_than_ms=0)
            await backend.prune_many(["g", "h"], older_than_ms=0)
            await backend.prune("g", keep=0)
            return 2000 not in await slots()

        await wait_for(short_grace_gone, what="the run whose grace has passed trimmed")
        assert await slots() == {1000}
        assert [(a.slot, a.attempt, str(a.outcome)) for a in await backend.history("g")] == [
            (1000, 1, "cancelled")]
        beat = await backend.heartbeat([graced])
        assert graced.token not in beat.held and beat.cancelled == {graced.token: 60_000}, beat
        assert await status_of(store.backend(), "g", 1000) == "cancelled"
    finally:
        await backend.close()


async def test_a_pause_of_a_paused_job_and_a_resume_of_a_job_not_paused_are_refused(
        store: Store) -> None:
    """A second pause would hide who paused the job (and the record its resume leaves on
    the skipped slots): refused, naming the first, changing nothing. A resume of a job
    not paused is refused too."""
    offset = await quiet(store)
    s = make(store, "a")
    s.every("known", "1h", lambda ctx: None, offset=offset)
    async with s:
        with pytest.raises(OperationRefused, match="'known': it is not paused") as refused:
            await admin_for(store, by="C").resume("known")
        assert refused.value.kind == "conflict"
        await admin_for(store, by="A").pause("known")
        with pytest.raises(OperationRefused, match="paused already by 'A'") as refused:
            await admin_for(store, by="B").pause("known")
        assert refused.value.kind == "conflict"
        assert await admin_for(store).paused() == {"known": "A"}
        await admin_for(store, by="C").resume("known")
        assert await admin_for(store).paused() == {}


async def test_slots_due_while_paused_are_not_caught_up_when_no_instance_ran(
        store: Store) -> None:
    """Pause, every instance down, resume, start: the catch-up (policy "all") starts at
    the resume; no slot due while the job was paused runs."""
    ran: list[int] = []

    async def tick(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    def build() -> Scheduler:
        s = make(store, "a")
        s.every("tick", "0.5s", tick, catch_up="all")
        return s

    backend = store.backend()
    async with build():
        await wait_for(lambda: ran, what="a first run")
    admin = admin_for(store, by="ops")
    await admin.pause("tick")
    paused_at = await store_now_ms(backend)
    # Three slots come due while paused and no instance runs.
    await wait_for(lambda: _after(backend, paused_at + 1500), what="three slots due")
    await admin.resume("tick")
    resumed_at = await store_now_ms(backend)
    s = build()
    async with s:
        await wait_history(s, lambda h: any(a.slot > resumed_at + 500 and a.outcome == "completed"
                                            for a in h),
                           job="tick", what="a run of a slot after the resume")
        history = await s.history("tick", limit=1000)
    caught = [(a.slot, a.reason) for a in history
              if paused_at < a.slot <= resumed_at and a.outcome != "skipped"]
    assert caught == [], caught


async def _after(backend: Backend, ms: int) -> bool:
    return await store_now_ms(backend) >= ms


async def cancel_as_the_handler_ends(s: Scheduler, store: Store, admin: Admin, job: str,
                                     entered: anyio.Event, go: anyio.Event,
                                     events: list[Any]) -> int:
    """Claim a slot of ``job`` on the running ``s``, cancel it while its handler waits
    for ``go`` (the holder's heartbeat too far off to tell it), then let the handler end;
    return the slot once the attempt's end was reported."""
    slot = await store_now_ms(store.backend()) - 1000
    assert await claim_now(s, job, slot) is not None
    with anyio.fail_after(10):
        await entered.wait()
    await admin.cancel(job, slot, grace="10s")
    go.set()
    await wait_for(lambda: [e for e in events if isinstance(e, AttemptEnded)],
                   what="the attempt's end")
    return slot


async def test_a_cancel_after_the_handler_returned_is_reported_cancelled(store: Store) -> None:
    """The cancel ends the run in the store after the handler returned, before its
    holder's next heartbeat: the store refuses the finish, and the attempt is reported
    Cancelled (not Completed), as the history records it."""
    admin = admin_for(store, by="ops")
    offset = await quiet(store)
    go, entered = anyio.Event(), anyio.Event()
    s = Scheduler(store.backend(), instance_id="h", lease="30s", heartbeat="5s")
    events: list[Any] = []
    s.subscribe(events.append)

    async def work(ctx: RunContext) -> None:
        entered.set()
        await go.wait()

    s.every("w", "1h", work, offset=offset)
    async with s:
        slot = await cancel_as_the_handler_ends(s, store, admin, "w", entered, go, events)
        history = [(a.attempt, a.outcome) for a in await s.history("w") if a.slot == slot]
    ended = [type(e).__name__ for e in events if isinstance(e, AttemptEnded)]
    assert ended == ["Cancelled"], ended
    assert history == [(1, "cancelled")], history


async def test_a_cancel_after_a_retried_handler_raised_is_reported_cancelled(
        store: Store) -> None:
    """As above, for a job with ``retry=``: the handler raises after the cancel ended the
    run; the store refuses the retry, and the attempt is reported Cancelled (no Failed,
    no Retried), and nobody retries the run."""
    admin = admin_for(store, by="ops")
    offset = await quiet(store)
    go, entered = anyio.Event(), anyio.Event()
    s = Scheduler(store.backend(), instance_id="h", lease="30s", heartbeat="5s")
    if not supports_retries(s.backend):
        pytest.skip(f"{type(s.backend).__name__} has no retry_later()")
    events: list[Any] = []
    s.subscribe(events.append)

    async def work(ctx: RunContext) -> None:
        entered.set()
        await go.wait()
        raise RuntimeError("after the cancel")

    s.every("w", "1h", work, offset=offset, retry=Retry(retries=3, backoff=0, jitter=0))
    async with s:
        slot = await cancel_as_the_handler_ends(s, store, admin, "w", entered, go, events)
        history = [(a.attempt, a.outcome) for a in await s.history("w") if a.slot == slot]
    ended = [type(e).__name__ for e in events if isinstance(e, (AttemptEnded, Retried))]
    assert ended == ["Cancelled"], ended
    assert history == [(1, "cancelled")], history
    assert await status_of(store.backend(), "w", slot) is RunStatus.CANCELLED


async def test_a_cancel_after_a_step_returned_is_reported_cancelled(store: Store) -> None:
    """As above, for a workflow's step: the store refuses its result, and the attempt is
    reported Cancelled (it was reported Lost, "lease lost before the result was stored");
    the next step never runs."""
    admin = admin_for(store, by="ops")
    offset = await quiet(store)
    go, entered = anyio.Event(), anyio.Event()
    s = Scheduler(store.backend(), instance_id="h", lease="30s", heartbeat="5s")
    events: list[Any] = []
    s.subscribe(events.append)
    close = s.workflow("close", every="1h", offset=offset)
    later: list[int] = []

    @close.step("snapshot")
    async def snapshot(ctx: RunContext) -> int:
        entered.set()
        await go.wait()
        return 3

    close.step("interest", lambda ctx: later.append(ctx.slot))
    async with s:
        slot = await cancel_as_the_handler_ends(s, store, admin, "close", entered, go, events)
        assert s.watching == [] and s.running == []
    ended = [type(e).__name__ for e in events if isinstance(e, AttemptEnded)]
    assert ended == ["Cancelled"], ended
    assert later == []
    assert await status_of(store.backend(), "close/snapshot", slot) is RunStatus.CANCELLED


async def test_a_retried_run_counts_its_takeovers_and_retries_anew(store: Store) -> None:
    """max_attempts=2: a takeover, then escalated. Retried by an operator, the run's first
    crash is taken over again (not escalated at once)."""
    backend = store.backend()
    await backend.start()
    try:
        await backend.register_jobs(["j"])
        slot = (await backend.now_ms()) - 60_000

        async def claim(instance: str) -> tuple[str, int]:
            async def answer() -> tuple[str, int] | None:
                (r,) = await backend.claim_many([ClaimRequest(
                    "j", slot, instance, uuid.uuid4().hex, 300, max_attempts=2)])
                # 'running': the last holder's lease is still live; claim again
                return None if r.status == "running" else (str(r.status), r.attempt)
            found: tuple[str, int] = await wait_for(answer, what=f"{instance}'s claim")
            return found

        assert await claim("a") == ("won", 1)
        assert await claim("b") == ("won", 2)  # a takeover: 2 of max_attempts=2
        assert await claim("c") == ("escalated", 2)
        await admin_for(store, by="ops").retry("j", slot)
        assert await claim("d") == ("won", 3)  # the retry
        assert await claim("e") == ("won", 4)  # its holder died: taken over, not escalated
    finally:
        await backend.close()


@pytest.mark.parametrize("ms", [0, 1_796_463_000_001, 2_166_817_981_930, 253_402_300_799_999])
def test_a_slot_given_as_a_time_is_exact_to_the_millisecond(ms: int) -> None:
    """``timestamp() * 1000`` is a float: 2166817981930 ms came out 1 ms early."""
    at = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    assert _slot(at, "j") == ms
    assert _slot(at.isoformat(), "j") == ms
    assert _slot(at.astimezone(timezone(timedelta(hours=-3))).isoformat(), "j") == ms


async def test_a_cancel_of_a_workflow_between_two_steps_waits_for_the_next_step(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that finds a workflow's run between two steps (the first completed, the
    second not claimed yet) cancels the second once it starts; when it does not start in
    time, the refusal says so, not "completed"; a completed workflow is refused as such."""
    from lease_core import operations
    from lease_core.abc import ClaimRequest, ClaimStatus, Lease, Outcome

    monkeypatch.setattr(operations, "BETWEEN_STEPS_WAIT_S", 0.5)
    admin = admin_for(store)
    backend = store.backend()
    await backend.start()
    first, second = "close/snapshot", "close/publish"

    async def run_step(job: str, slot: int) -> None:
        await backend.claim(ClaimRequest(job, slot, "i-1", f"t-{job}-{slot}", 30_000))
        assert await backend.finish(Lease(job, slot, f"t-{job}-{slot}", 30_000),
                                    Outcome.COMPLETED)

    try:
        await backend.register_jobs([first, second])
        await backend.register_workflows({"close": ["snapshot", "publish"]})
        # nobody claims the second step: refused, naming the step that completed
        await run_step(first, 1000)
        with pytest.raises(OperationRefused, match="between two steps") as refused:
            await admin.cancel("close", 1000)
        assert refused.value.kind == "conflict"
        assert "step 'snapshot' completed" in str(refused.value)
        assert (await backend.check([(second, 1000)])).runs == {}
        # the second step's agent claims it while the cancel waits: cancelled
        await run_step(first, 2000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(admin.cancel, "close", 2000)
            await anyio.sleep(0.2)
            won = await backend.claim(ClaimRequest(second, 2000, "i-1", "t-late", 30_000))
            assert won.status is ClaimStatus.WON
        state = (await backend.check([(second, 2000)])).runs[(second, 2000)]
        assert state.status is RunStatus.CANCELLED
        # a workflow whose last step completed is refused as completed, at once
        await run_step(first, 3000)
        await run_step(second, 3000)
        with anyio.fail_after(0.4):
            with pytest.raises(OperationRefused, match="completed") as done:
                await admin.cancel("close", 3000)
        assert "between" not in str(done.value)
    finally:
        await backend.close()
