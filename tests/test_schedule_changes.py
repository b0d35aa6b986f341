"""Catch-up at a start: a job's schedule changed by a new release (the slots the new
schedule had before it was deployed were never due, so they are not caught up), and a
start that first waits for a run a dead instance left open.

The memory store's clock and the schedulers' are shifted together, so the tests place
"now" at a chosen time of day and jump it forward.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import anyio
import pytest

from backends.memory import MemoryBackend
from lease_core import RunContext, Scheduler
from lease_core.schedules import schedule_from_spec
from tests.helpers import Instance, wait_for

pytestmark = pytest.mark.anyio

#: 10:00 UTC on a day of the test: the old release's daily slot.
TEN = int(datetime(2026, 12, 1, 10, 0, tzinfo=UTC).timestamp() * 1000)
HOUR = 3_600_000
DAY = 24 * HOUR


class Clocks:
    """The wall clock shifted by ``shift`` seconds, for the store and the schedulers."""

    def __init__(self, at_ms: int) -> None:
        self.shift = at_ms / 1000 - time.time()
        self.backend = MemoryBackend(clock=lambda: time.time() + self.shift)

    def now_ms(self) -> int:
        return int((time.time() + self.shift) * 1000)

    def jump_to(self, at_ms: int) -> None:
        self.shift += at_ms / 1000 - (time.time() + self.shift)

    def scheduler(self, name: str, cron: str, ran: list[tuple[str, int, str]],
                  catch_up: str = "latest") -> Scheduler:
        s = Scheduler(self.backend, instance_id=name, lease="3s", heartbeat="0.3s",
                      clock=lambda: time.monotonic() + self.shift)

        def handler(ctx: RunContext) -> None:
            ran.append((name, ctx.slot, str(ctx.reason)))
        s.cron("nightly", cron, handler, catch_up=catch_up)  # type: ignore[arg-type]
        return s


@pytest.mark.parametrize("catch_up", ["latest", "all"])
async def test_a_changed_schedule_catches_up_no_slot_from_before_its_deploy(
        catch_up: str) -> None:
    """The job ran at 10:00 on the old schedule (0 10 * * *); at 11:30 a rolling deploy
    moves it to 0 11 * * *: two instances of the new release start while the old one
    still runs. The new schedule's 11:00 of that day was never due (the old schedule
    ran the job that day); it ran at once as a "missed" catch-up slot, the job's
    second run of the day. Now the new schedule starts at its next slot (11:00 the next
    day), on the first new instance and on the second alike."""
    clocks = Clocks(TEN - 800)
    ran: list[tuple[str, int, str]] = []
    old = clocks.scheduler("old", "0 10 * * *", ran, catch_up)
    async with anyio.create_task_group() as tg:
        o = await Instance(old).start(tg)
        await wait_for(lambda: ran, timeout=5, what="the old release's 10:00 run")
        clocks.jump_to(TEN + HOUR + HOUR // 2)
        a = await Instance(clocks.scheduler("a", "0 11 * * *", ran, catch_up)).start(tg)
        b = await Instance(clocks.scheduler("b", "0 11 * * *", ran, catch_up)).start(tg)
        await o.stop()
        # The next day's 11:00: each new instance queued it once its start-up catch-up
        # was done, so any catch-up of 11:00 today ran before it.
        clocks.jump_to(TEN + DAY + HOUR - 800)
        await wait_for(lambda: any(r[1] == TEN + DAY + HOUR for r in ran), timeout=5,
                       what="the next day's 11:00 run")
        await a.stop()
        await b.stop()
    assert [(slot, reason) for _, slot, reason in ran] == [
        (TEN, "scheduled"), (TEN + DAY + HOUR, "scheduled")], ran
    # The store records the spec and when it took effect (the first new instance's
    # start), which a reader of the spec (the status page) ignores.
    record = json.loads((await clocks.backend.schedules())["nightly"])
    assert TEN + HOUR + HOUR // 2 <= record["since_ms"] < TEN + 2 * HOUR, record
    assert schedule_from_spec(record).describe() == "cron 0 11 * * *"


async def test_an_unchanged_schedule_still_catches_up_after_a_downtime() -> None:
    """The record of when the schedule took effect holds the catch-up back for a changed
    schedule only: the same schedule, deployed again after every instance was down
    past its slot, catches that slot up."""
    clocks = Clocks(TEN - 800)
    ran: list[tuple[str, int, str]] = []
    async with anyio.create_task_group() as tg:
        first = await Instance(clocks.scheduler("first", "0 10,11 * * *", ran)).start(tg)
        await wait_for(lambda: ran, timeout=5, what="the 10:00 run")
        await first.stop()
        clocks.jump_to(TEN + HOUR + HOUR // 2)  # 11:00 passes with no instance up
        again = await Instance(clocks.scheduler("again", "0 10,11 * * *", ran)).start(tg)
        await wait_for(lambda: len(ran) >= 2, timeout=5, what="the catch-up of 11:00")
        await again.stop()
    assert [(slot, reason) for _, slot, reason in ran] == [
        (TEN, "scheduled"), (TEN + HOUR, "catch-up")], ran


async def test_latest_catches_up_the_newest_slot_once_a_run_left_open_has_ended() -> None:
    """An hourly job's 10:00 run was left open by a crash; the next instance starts at
    13:10 and, the job not overlapping, first waits for that run (taken over) to end, at
    14:00:30. ``catch_up="latest"`` then claimed the newest slot before its start, 13:00,
    and the dispatcher 14:00 beside it: two catch-up runs, one of them stale. Now only
    the newest slot missed until the wait ended runs."""
    clocks = Clocks(TEN - 800)
    ran: list[tuple[str, int, str]] = []
    gate = anyio.Event()

    def hourly(name: str) -> Scheduler:
        s = Scheduler(clocks.backend, instance_id=name, lease="2h", heartbeat="0.3s",
                      clock=lambda: time.monotonic() + clocks.shift)

        async def handler(ctx: RunContext) -> None:
            ran.append((name, ctx.slot, str(ctx.reason)))
            if ctx.slot == TEN:
                await gate.wait()
        s.every("hourly", "1h", handler)  # overlap="skip", catch_up="latest"
        return s

    async with anyio.create_task_group() as tg:
        a = await Instance(hourly("a")).start(tg)
        await wait_for(lambda: ran, timeout=5, what="the 10:00 run")
        a.crash()
        await a.wait_done()
        clocks.jump_to(TEN + 3 * HOUR + HOUR // 6)  # 13:10: the 10:00 run's lease lapsed
        b = await Instance(hourly("b")).start(tg)
        await wait_for(lambda: len(ran) >= 2, timeout=5, what="the takeover of 10:00")
        clocks.jump_to(TEN + 4 * HOUR + 30_000)  # 14:00:30, the takeover still runs
        gate.set()
        fifteen = TEN + 5 * HOUR
        await wait_for(lambda: any(r[1] >= TEN + 4 * HOUR for r in ran), timeout=5,
                       what="the catch-up")
        clocks.jump_to(fifteen - 800)
        await wait_for(lambda: any(r[1] == fifteen for r in ran), timeout=5,
                       what="the 15:00 run")
        await b.stop()
    assert [(slot, reason) for _, slot, reason in ran] == [
        (TEN, "scheduled"), (TEN, "takeover"), (TEN + 4 * HOUR, "catch-up"),
        (TEN + 5 * HOUR, "scheduled")], ran
