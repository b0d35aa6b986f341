"""The fleet: about one claim per slot whatever the number of instances, balance, capacity.

Each instance renews its membership every tick; per job, the live members are ranked by
rendezvous hashing, the first claims a due slot and the others only if it is still
unclaimed their rank's check intervals later.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from lease_core import Admin, ConfigurationError, RunContext, Scheduler
from lease_core.abc import ClaimStatus
from lease_core.engine.fleet import group_of, member_name, rendezvous_rank
from lease_core.testing import claim_now, renew_membership
from tests.helpers import (
    Instance,
    quiet_offset,
    quiet_offset_now,
    stop_all,
    store_now_ms,
    wait_for,
    wait_history,
)
from tests.stores import Store

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


class CountingClaims:
    """A backend wrapper counting the runs each instance asks the store to claim."""

    def __init__(self, inner: Any, counts: Counter[str], name: str) -> None:
        self.inner, self.counts, self.name = inner, counts, name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr == "claim":
            async def claim(request: Any) -> Any:
                self.counts[self.name] += 1
                return await value(request)
            return claim
        if attr == "claim_many":
            async def claim_many(requests: Any) -> Any:
                self.counts[self.name] += len(requests)
                return await value(requests)
            return claim_many
        return value


def counted(store: Store, name: str, counts: Counter[str], **kw: Any) -> Scheduler:
    s = Scheduler(store.backend(), instance_id=name, **{**FAST, **kw})
    s.backend = CountingClaims(s.backend, counts, name)  # type: ignore[assignment]
    return s


# ----------------------------------------------------------------- ranking, pure


def test_every_job_has_exactly_one_first_member_and_ranks_are_a_permutation() -> None:
    members = tuple(f"instance-{i}" for i in range(7))
    for job in (f"job-{j}" for j in range(200)):
        ranks = sorted(rendezvous_rank(job, m, members) for m in members)
        assert ranks == list(range(len(members))), (job, ranks)


def test_a_member_leaving_moves_only_the_jobs_it_ranked_first() -> None:
    members = tuple(f"i{n}" for n in range(10))
    jobs = [f"job/{n}" for n in range(1000)]

    def firsts(ms: tuple[str, ...]) -> dict[str, str]:
        return {job: next(m for m in ms if rendezvous_rank(job, m, ms) == 0) for job in jobs}

    before = firsts(members)
    after = firsts(tuple(m for m in members if m != "i3"))
    moved = {job for job in jobs if before[job] != after[job]}
    assert moved == {job for job in jobs if before[job] == "i3"}
    assert moved  # i3 ranked first for some jobs


def test_a_burst_of_1000_jobs_on_10_members_is_balanced() -> None:
    members = tuple(f"host-{n}-{n * 7919}" for n in range(10))
    firsts = Counter(
        next(m for m in members if rendezvous_rank(f"export-{j}", m, members) == 0)
        for j in range(1000))
    assert len(firsts) == 10
    assert max(firsts.values()) <= 1.5 * 100, firsts


def test_max_running_must_be_a_positive_integer() -> None:
    from lease_core import MemoryBackend

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigurationError, match="max_running"):
            Scheduler(MemoryBackend(), max_running=bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------- on every store


async def test_a_slot_costs_about_one_claim_on_3_instances(store: Store) -> None:
    await claims_per_slot(store, 3)


async def test_a_slot_costs_about_one_claim_on_6_instances(store: Store) -> None:
    await claims_per_slot(store, 6)


async def claims_per_slot(store: Store, instances: int) -> None:
    counts: Counter[str] = Counter()
    ran: Counter[tuple[str, int]] = Counter()
    schedulers = []
    for i in range(instances):
        s = counted(store, f"member-{i}", counts)
        for j in range(12):
            async def tick(ctx: RunContext) -> None:
                ran[(ctx.job, ctx.slot)] += 1
            s.every(f"tick-{j}", "1s", tick)
        schedulers.append(s)
    async with anyio.create_task_group() as tg:
        fleet = [await Instance(s).start(tg) for s in schedulers]
        # Every member knows every other once each has ticked (the first slots may cost
        # more while they join).
        await wait_for(lambda: all(s.health().fleet_size == instances for s in schedulers),
                       timeout=10, what="every member seeing the whole fleet")
        counts.clear()
        first = (schedulers[0].store_now_ms() // 1000 + 1) * 1000
        await wait_for(lambda: sum(1 for (_, slot) in ran if slot >= first + 3000) >= 12,
                       timeout=15, what="four slots of every job")
        await stop_all(fleet)
    window = [key for key in ran if first <= key[1] < first + 4000]
    assert len(window) == 4 * 12, sorted(window)
    assert all(ran[key] == 1 for key in ran), ran
    per_run = sum(counts.values()) / len([key for key in ran if key[1] >= first])
    assert per_run <= 1.5, (per_run, counts)
    # Each member claimed some of the jobs: the work is spread.
    assert len(counts) >= 2, counts


async def test_a_crashed_members_slots_are_claimed_by_the_next_ranked(store: Store) -> None:
    await crashed_member(store)


async def crashed_member(store: Store) -> None:
    ran: list[tuple[str, int, str]] = []
    schedulers = []
    for name in ("a", "b"):
        s = Scheduler(store.backend(), instance_id=name, **FAST)
        for j in range(8):
            async def tick(ctx: RunContext, name: str = name) -> None:
                ran.append((ctx.job, ctx.slot, name))
            s.every(f"job-{j}", "1s", tick)
        schedulers.append(s)
    a, b = schedulers
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        await wait_for(lambda: a.health().fleet_size == b.health().fleet_size == 2,
                       timeout=10, what="both members known")
        await wait_for(lambda: {n for _, _, n in ran} == {"a", "b"}, timeout=10,
                       what="both members running their share")
        ia.crash()
        await ia.wait_done()
        crashed = b.store_now_ms()
        # The first slot after the crashed member's leases ran out: a run it held when it
        # crashed keeps its job's next slot skipped (overlap skip) until then.
        after = ((crashed + 1200) // 1000 + 1) * 1000
        await wait_for(lambda: all((f"job-{j}", slot) in {(j, s) for j, s, _ in ran}
                                   for j in range(8) for slot in (after, after + 1000)),
                       timeout=10, what="two slots of every job after the crash")
        await ib.stop()
    later = [(job, slot, name) for job, slot, name in ran if slot >= after]
    slots = Counter((job, slot) for job, slot, _ in later)
    assert all(n == 1 for n in slots.values()), slots
    assert {name for _, _, name in later} == {"b"}
    for slot in (after, after + 1000):
        assert {job for job, s, _ in later if s == slot} == {f"job-{j}" for j in range(8)}


async def test_an_instance_at_capacity_claims_nothing_and_the_next_takes_the_slot(
        store: Store) -> None:
    await capacity(store)


async def capacity(store: Store) -> None:
    offset = quiet_offset(await store_now_ms(store.backend()))
    # A job that "full" ranks first for, among the two members.
    job = next(f"due-{n}" for n in range(100)
               if rendezvous_rank(f"due-{n}", "full", ("full", "spare")) == 0)
    release = anyio.Event()
    ran: list[tuple[str, int, str]] = []

    def build(name: str) -> Scheduler:
        s = Scheduler(store.backend(), instance_id=name, max_running=1, **FAST)

        @s.every("hold", "1h", offset=offset)
        async def hold(ctx: RunContext) -> None:
            await release.wait()

        @s.every(job, "1s")
        async def due(ctx: RunContext, name: str = name) -> None:
            ran.append((ctx.job, ctx.slot, name))

        return s

    full, spare = build("full"), build("spare")
    async with anyio.create_task_group() as tg:
        i_full = await Instance(full).start(tg)
        i_spare = await Instance(spare).start(tg)
        await wait_for(lambda: full.health().fleet_size == spare.health().fleet_size == 2,
                       timeout=10, what="both members known")
        slot = full.jobs["hold"].schedule.previous_at_or_before(full.store_now_ms())
        assert slot is not None
        await claim_now(full, "hold", slot)
        # An answer too slow on a loaded machine is retried at the next heartbeat.
        await wait_for(lambda: full.running == [("hold", slot)], timeout=5,
                       what="full holding its one run")
        since = (full.store_now_ms() // 1000 + 1) * 1000
        await wait_for(lambda: len([r for r in ran if r[1] >= since]) >= 3, timeout=10,
                       what="three slots of the due job")
        assert full.running == [("hold", slot)]
        history = [x for x in await spare.history(job, 100) if x.slot >= since]
        release.set()
        await stop_all([i_full, i_spare])
    late = [r for r in ran if r[1] >= since]
    assert {name for _, _, name in late} == {"spare"}, late
    assert Counter(s for _, s, _ in ran).most_common(1)[0][1] == 1
    # Ranked second, spare claims one check interval (200 ms) after the slot: at its
    # turn, not at its first tick after it (up to a whole interval later).
    late_ms = [x.claimed_at.timestamp() * 1000 - x.slot for x in history]
    assert len(late_ms) >= 3 and all(150 <= late < 320 for late in late_ms), late_ms


async def test_a_gracefully_stopped_members_next_slot_is_claimed_at_the_slot(
        store: Store) -> None:
    await leaving_on_stop(store)


async def leaving_on_stop(store: Store) -> None:
    """``a`` stops gracefully; ``b``, ranked next for a job ``a`` ranked first, claims the
    job's slots at the slot, not one check interval (a heartbeat) after it: at once once
    it renewed its membership, which it does at the next tick after it found a slot
    unclaimed at its turn, not half a lease (10 s) after its last renewal."""
    # The membership lasts a lease: 20 s, so without leaving, ``a`` stays listed.
    slow = {"lease": "20s", "heartbeat": "0.5s"}
    job = next(f"leave-{n}" for n in range(100)
               if rendezvous_rank(f"leave-{n}", "a", ("a", "b")) == 0)
    ran: list[tuple[int, str]] = []
    schedulers = []
    for name in ("a", "b"):
        s = Scheduler(store.backend(), instance_id=name, **slow)

        async def tick(ctx: RunContext, name: str = name) -> None:
            ran.append((ctx.slot, name))
        s.every(job, "1s", tick)
        schedulers.append(s)
    a, b = schedulers
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        assert await renew_membership(a) == await renew_membership(b) == ("a", "b")
        await wait_for(lambda: any(name == "a" for _, name in ran), timeout=10,
                       what="a running the job it ranks first for")
        await ia.stop()
        # a left (not listed for 20 s more): b renews well before its half lease
        await wait_for(lambda: b.health().fleet_size == 1, timeout=5,
                       what="b renewing its membership without a")
        after = (b.store_now_ms() // 1000 + 1) * 1000
        await wait_for(lambda: {after, after + 1000} <= {slot for slot, _ in ran},
                       timeout=10, what="the job's next two slots")
        history = [x for x in await b.history(job, 100) if x.slot in (after, after + 1000)]
        await ib.stop()
    assert sorted((x.slot, x.instance_id, str(x.reason)) for x in history) == [
        (after, "b", "scheduled"), (after + 1000, "b", "scheduled")]
    late_ms = [x.claimed_at.timestamp() * 1000 - x.slot for x in history]
    # Ranked second with a still listed, b would claim a check interval (500 ms) late.
    assert all(late < 400 for late in late_ms), late_ms


async def test_fleet_size_is_unknown_once_the_instance_stops() -> None:
    """An instance that stops leaves the fleet; its health reported the last membership
    it renewed, itself included, for good."""
    from lease_core import MemoryBackend

    backend = MemoryBackend()
    schedulers = [Scheduler(backend, instance_id=name, **FAST) for name in ("a", "b")]
    for s in schedulers:
        s.every("job", "1h", lambda ctx: None, offset=quiet_offset_now())
    a, b = schedulers
    async with anyio.create_task_group() as tg:
        ia, ib = await Instance(a).start(tg), await Instance(b).start(tg)
        await wait_for(lambda: a.health().fleet_size == b.health().fleet_size == 2,
                       timeout=10, what="both members known")
        await ia.stop()
        assert a.health().fleet_size is None
        assert await renew_membership(b) == ("b",)
        await ib.stop()
    assert b.health().fleet_size is None


async def test_a_job_only_one_instance_declares_is_claimed_at_its_slots(
        store: Store) -> None:
    await groups(store)


async def groups(store: Store) -> None:
    """Instances declaring different jobs rank only the members that declare the same:
    ``a``, alone to declare a job it would rank last for among all three members, claims
    its slots at the slot, not two check intervals (400 ms) after it."""
    job = next(f"own-{n}" for n in range(100)
               if rendezvous_rank(f"own-{n}", "a", ("a", "b", "c")) == 2)
    ran: list[tuple[str, int, str]] = []
    schedulers = []
    for name, jobs in (("a", (job, "shared")), ("b", ("other", "shared")),
                       ("c", ("other", "shared"))):
        s = Scheduler(store.backend(), instance_id=name, **FAST)
        for declared in jobs:
            async def tick(ctx: RunContext, name: str = name) -> None:
                ran.append((ctx.job, ctx.slot, name))
            s.every(declared, "1s", tick)
        schedulers.append(s)
    a, b, c = schedulers
    async with anyio.create_task_group() as tg:
        fleet = [await Instance(s).start(tg) for s in schedulers]
        assert await renew_membership(a) == ("a",)
        assert await renew_membership(b) == await renew_membership(c) == ("b", "c")
        since = (a.store_now_ms() // 1000 + 1) * 1000
        await wait_for(lambda: len({s for j, s, _ in ran if j == job and s >= since}) >= 3,
                       timeout=10, what="three slots of a's own job")
        history = [x for x in await a.history(job, 100) if x.slot >= since]
        await stop_all(fleet)
    assert {(x.instance_id, str(x.reason)) for x in history} == {("a", "scheduled")}
    late_ms = [x.claimed_at.timestamp() * 1000 - x.slot for x in history]
    assert len(late_ms) >= 3 and all(late < 150 for late in late_ms), late_ms
    # The jobs both groups declare still run once a slot (each group claims them).
    assert all(n == 1 for n in Counter((j, s) for j, s, _ in ran).values()), ran


async def test_a_job_whose_schedule_a_new_release_changed_is_claimed_at_its_slots(
        store: Store) -> None:
    """During a rolling deploy that moves a job's slots (an offset added), the instances
    of the two releases rank apart: the old one, ranked first for the job among both,
    does not hold up the new schedule's slots by a check interval (500 ms) each."""
    job = "report"
    old_id = next(f"old-{n}" for n in range(100)
                  if rendezvous_rank(job, f"old-{n}", (f"old-{n}", "new")) == 0)
    old = Scheduler(store.backend(), instance_id=old_id, lease="3s", heartbeat="0.5s")
    new = Scheduler(store.backend(), instance_id="new", lease="3s", heartbeat="0.5s")
    old.every(job, "1s", lambda ctx: None)                 # at whole seconds
    new.every(job, "1s", lambda ctx: None, offset="0.5s")  # the new release: half past
    async with anyio.create_task_group() as tg:
        fleet = [await Instance(s).start(tg) for s in (old, new)]
        await renew_membership(old)  # each now knows the other, whatever its group
        await renew_membership(new)
        since = (new.store_now_ms() // 1000 + 1) * 1000
        history = await wait_history(
            new, lambda h: len({x.slot for x in h if x.slot >= since and x.slot % 1000}) >= 3,
            job=job, timeout=15)
        await stop_all(fleet)
    moved = [x for x in history if x.slot >= since and x.slot % 1000]
    assert {x.instance_id for x in moved} == {"new"}
    late_ms = [x.claimed_at.timestamp() * 1000 - x.slot for x in moved]
    assert all(late < 250 for late in late_ms), late_ms


async def test_a_member_whose_turn_comes_after_trimming_never_runs_the_slot_again(
        store: Store) -> None:
    await trimmed_turns(store)


async def trimmed_turns(store: Store) -> None:
    """The member ranked third checks a slot first at its turn, two of its 1.5 s check
    intervals after the slot. By then the two members ranked before it ran the slot and
    the next ones, and history_size=1 trimmed the slot's run away. The store finds the
    slot trimmed instead of never claimed: every slot runs once."""
    names = ("top", "mid", "late")
    job = next(f"trim-{n}" for n in range(1000)
               if [rendezvous_rank(f"trim-{n}", name, names) for name in names] == [0, 1, 2])
    ran: list[tuple[int, str]] = []
    counts: Counter[str] = Counter()

    def build(name: str, **settings: Any) -> Scheduler:
        s = counted(store, name, counts, history_size=1, prune_every="0.3s", **settings)

        @s.every(job, "1s")
        async def tick(ctx: RunContext, name: str = name) -> None:
            ran.append((ctx.slot, name))

        return s

    schedulers = [build("top"), build("mid"), build("late", lease="6s", heartbeat="1.5s")]
    async with anyio.create_task_group() as tg:
        fleet = [await Instance(s).start(tg) for s in schedulers]
        await wait_for(lambda: all(s.health().fleet_size == 3 for s in schedulers),
                       timeout=10, what="every member seeing the whole fleet")
        counts.clear()
        since = (schedulers[0].store_now_ms() // 1000 + 1) * 1000
        # late's turn for a slot comes 3 s after it: wait for two turns of slots since.
        await wait_for(lambda: counts["late"] >= 2, timeout=15,
                       what="the last-ranked member's turn for two slots")
        await stop_all(fleet)
    runs = Counter(slot for slot, _ in ran if slot >= since)
    assert runs and all(n == 1 for n in runs.values()), sorted(ran)
    assert {name for slot, name in ran if slot >= since} == {"top"}, sorted(ran)


async def test_members_ranked_behind_many_frozen_ones_claim_by_the_last_turn(
        store: Store) -> None:
    """Eight frozen members (in the membership, never claiming) rank ahead of the only
    live one for its job. It does not wait eight check intervals (4 s): from the last
    turn (half the 3 s lease in 0.5 s intervals, plus one: 2 s) every member left claims
    a slot still unclaimed, so each slot is claimed within a lease of its time."""
    frozen = [f"frozen-{n}" for n in range(8)]
    names = (*frozen, "live")
    job = next(f"deep-{n}" for n in range(10_000)
               if rendezvous_rank(f"deep-{n}", "live", names) == 8)
    s = Scheduler(store.backend(), instance_id="live", lease="3s", heartbeat="0.5s")

    # The job's own lease is long: the turns end with the scheduler's lease (the
    # membership's), which the frozen members lapse with, not with the job's.
    @s.every(job, "1s", lease="30s")
    async def tick(ctx: RunContext) -> None:
        pass

    async with anyio.create_task_group() as tg:
        live = await Instance(s).start(tg)
        for name in frozen:  # members that renewed once, then froze
            await s.backend.members(member_name(name, group_of(s.jobs)), 60_000)
        assert await renew_membership(s) == tuple(sorted(names))
        since = (s.store_now_ms() // 1000 + 1) * 1000
        history = await wait_history(
            s, lambda h: len([x for x in h if x.slot >= since]) >= 2, job=job, timeout=15)
        await live.stop()
    late_ms = [x.claimed_at.timestamp() * 1000 - x.slot for x in history if x.slot >= since]
    # its turn (2 s), not its rank (4 s), and never more than the 3 s lease
    assert all(1_500 <= late < 3_000 for late in late_ms), late_ms


class ClaimsByJob:
    """A backend wrapper counting, per job, the runs any instance asks to claim."""

    def __init__(self, inner: Any, counts: Counter[str]) -> None:
        self.inner, self.counts = inner, counts

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr in ("claim", "claim_many"):
            async def claim(requests: Any) -> Any:
                for request in requests if attr == "claim_many" else [requests]:
                    self.counts[request.job] += 1
                return await value(requests)
            return claim
        return value


async def test_a_workflow_step_and_a_trigger_each_cost_about_one_claim(
        store: Store) -> None:
    await ranked_backups(store)


async def ranked_backups(store: Store) -> None:
    """On 5 members, claims that follow a slot's first are ranked too (issue 18): the
    next step of a workflow (claimed by its agent as it completes the step before; the
    others only check it) and the pick-up of a triggered run each cost about one claim,
    not one per member. A crashed member's run is still taken over by every member
    backing it up (one claim each), and once."""
    counts: Counter[str] = Counter()
    ran: list[tuple[str, int, str]] = []
    release, backed_up = anyio.Event(), anyio.Event()
    names = [f"m{i}" for i in range(5)]
    offset = quiet_offset(await store_now_ms(store.backend()))
    schedulers = []
    for name in names:
        s = Scheduler(store.backend(), instance_id=name, **FAST)
        s.backend = ClaimsByJob(s.backend, counts)  # type: ignore[assignment]
        wf = s.workflow("wf", every="1h", offset=offset)
        for step in ("one", "two", "three"):
            async def run_step(ctx: RunContext, name: str = name) -> None:
                ran.append((ctx.job, ctx.slot, name))
                await backed_up.wait()  # every member backs the first step up
            wf.step(step, run_step)

        @s.every("held", "1h", offset=offset)
        async def held(ctx: RunContext, name: str = name) -> None:
            ran.append((ctx.job, ctx.slot, name))
            if name == holder:
                await release.wait()  # until its instance crashes

        schedulers.append(s)
    holder = next(n for n in names if rendezvous_rank("held", n, tuple(names)) == 0)
    async with anyio.create_task_group() as tg:
        fleet = [await Instance(s).start(tg) for s in schedulers]
        await wait_for(lambda: all(s.health().fleet_size == 5 for s in schedulers),
                       timeout=10, what="every member seeing the whole fleet")
        first = schedulers[0]
        slot = first.workflows["wf"].schedule.previous_at_or_before(first.store_now_ms())
        assert slot is not None
        counts.clear()
        # A workflow run: every member backs its first step up, as at a scheduled slot.
        for s in schedulers:
            await claim_now(s, "wf", slot)
        backed_up.set()
        await wait_for(lambda: ("wf/three", slot) in {(j, sl) for j, sl, _ in ran},
                       timeout=10, what="the workflow's last step")
        # A run whose holder crashes: taken over by the next member in rank.
        by_name = dict(zip(names, schedulers, strict=True))
        for s in sorted(schedulers, key=lambda s: s.instance_id != holder):  # holder wins
            await claim_now(s, "held", slot)
        await wait_for(lambda: ("held", slot, holder) in ran, timeout=10, what="the held run")
        fleet[names.index(holder)].crash()
        await wait_for(lambda: [n for j, _, n in ran if j == "held"] != [holder], timeout=10,
                       what="the takeover")
        # A triggered run, picked up by one member.
        triggered = await Admin(by_name[names[0]].backend.inner).trigger("wf")  # (unwrapped)
        await wait_for(lambda: ("wf/three", triggered) in {(j, sl) for j, sl, _ in ran},
                       timeout=10, what="the triggered run's last step")
        live = [s for s in schedulers if s.instance_id != holder]
        # Every member done backing them up: any late claim is made, and counted.
        await wait_for(lambda: not any(s.watching for s in live), timeout=10,
                       what="every member done with the runs")
        release.set()
        await stop_all([i for i, n in zip(fleet, names, strict=True) if n != holder])
    steps = Counter((j, sl) for j, sl, _ in ran if j.startswith("wf/"))
    assert all(n == 1 for n in steps.values()), steps
    assert [n for j, _, n in ran if j == "held"].count(holder) == 1
    # Each later step: its agent's claim, and at most one more (a member whose check
    # came before the agent's claim). The first step of the triggered run is one
    # pick-up; each was claimed by every member before.
    assert counts["wf/two"] <= 2 * 2 and counts["wf/three"] <= 2 * 2, counts
    assert counts["wf/one"] <= 5 + 2, counts  # 5 first claims, about one pick-up
    assert counts["held"] <= 5 + 4, counts  # 5 first claims, one takeover per survivor


def current_slots(s: Scheduler, *jobs: str) -> list[int]:
    """Each job's slot at or before the store's now."""
    slots = [s.jobs[job].schedule.previous_at_or_before(s.store_now_ms()) for job in jobs]
    assert all(slot is not None for slot in slots), slots
    return [slot for slot in slots if slot is not None]


async def test_a_lone_instance_at_capacity_runs_the_slot_once_a_handler_ends(
        store: Store) -> None:
    offset = quiet_offset(await store_now_ms(store.backend()))
    release = anyio.Event()
    ran: list[int] = []
    s = Scheduler(store.backend(), instance_id="alone", max_running=1, **FAST)

    @s.every("hold", "1h", offset=offset)
    async def hold(ctx: RunContext) -> None:
        await release.wait()

    @s.every("next", "1h", offset=(offset + 60) % 3600)
    async def after(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        hold_slot, next_slot = current_slots(s, "hold", "next")
        await claim_now(s, "hold", hold_slot)
        assert await claim_now(s, "next", next_slot) is None  # at capacity: deferred
        assert ("next", next_slot) in s.watching
        assert ran == [] and s.running == [("hold", hold_slot)]
        release.set()
        await wait_for(lambda: ran == [next_slot], timeout=10,
                       what="the deferred run once capacity is free")
        await inst.stop()


async def test_slots_deferred_at_capacity_do_not_pile_up_and_run_oldest_first() -> None:
    """At capacity, a job's deferred slots used to wait one record each and all run,
    oldest first, once a handler ended, ahead of the slots due then (catch_up ignored).
    As after a store failure, only the newest deferred slot of a job waits."""
    from lease_core import MemoryBackend

    backend = MemoryBackend()
    offset = quiet_offset(await store_now_ms(backend))
    release = anyio.Event()
    ran: list[int] = []
    s = Scheduler(backend, instance_id="alone", max_running=1, **FAST)

    @s.every("hold", "1h", offset=offset)
    async def hold(ctx: RunContext) -> None:
        await release.wait()

    @s.every("tick", "1h", offset=(offset + 60) % 3600)  # default catch_up="latest"
    async def tick(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        hold_slot, newest = current_slots(s, "hold", "tick")
        await claim_now(s, "hold", hold_slot)
        stale = [newest - k * 3_600_000 for k in (3, 2, 1)]
        for slot in [*stale, newest]:  # as the ticks of an hour each would defer them
            assert await claim_now(s, "tick", slot) is None
        release.set()
        await wait_for(lambda: newest in ran, timeout=10,
                       what="the newest deferred slot once capacity is free")
        # the older ones are forgotten at the next check (nobody claimed them)
        await wait_for(lambda: not any(("tick", slot) in s.watching for slot in stale),
                       timeout=5, what="the superseded slots forgotten")
        await inst.stop()
    assert ran == [newest]


async def test_a_first_member_at_capacity_does_not_renew_its_membership_every_tick(
        ) -> None:
    """The member ranked first for a job, at capacity, finds its deferred slot unclaimed
    at every tick; that asked for a membership renewal at every tick (a write), as if a
    member ranked before it might be gone, where none is."""
    from lease_core import MemoryBackend

    class Renewals(MemoryBackend):
        renewals = 0

        async def members(self, instance_id: str, ttl_ms: int) -> list[str]:
            if instance_id.startswith("full#"):
                Renewals.renewals += 1
            return await super().members(instance_id, ttl_ms)

    backend = Renewals()
    offset = quiet_offset(await store_now_ms(backend))
    job = next(f"due-{n}" for n in range(100)
               if rendezvous_rank(f"due-{n}", "full", ("full", "spare")) == 0)
    release = anyio.Event()

    def build(name: str) -> Scheduler:
        s = Scheduler(backend, instance_id=name, max_running=1, **FAST)

        @s.every("hold", "1h", offset=offset)
        async def hold(ctx: RunContext) -> None:
            await release.wait()

        @s.every(job, "1h", offset=(offset + 60) % 3600)
        async def due(ctx: RunContext) -> None:
            pass

        return s

    full, spare = build("full"), build("spare")
    async with anyio.create_task_group() as tg:
        i_full = await Instance(full).start(tg)
        i_spare = await Instance(spare).start(tg)
        assert await renew_membership(full) == await renew_membership(spare) == (
            "full", "spare")
        hold_slot, slot = current_slots(full, "hold", job)
        await claim_now(full, "hold", hold_slot)
        await claim_now(spare, "hold", hold_slot)  # held by full: spare backs it up
        assert await claim_now(full, job, slot) is None  # at capacity: deferred
        before = Renewals.renewals
        await anyio.sleep(2.4)  # 12 ticks; the membership lasts 1.2 s: 4 renewals
        renewed = Renewals.renewals - before
        release.set()
        await stop_all([i_full, i_spare])
    assert renewed <= 6, renewed


async def full_with_tick() -> tuple[Scheduler, anyio.Event, anyio.Event, list[int]]:
    """An instance with max_running=2, whose jobs "hold" and "hold-2" (hourly) fill it
    until ``release`` is set, and whose job "tick" (overlap="skip", a minute later each
    hour) records its slots in ``started`` and runs until ``done`` is set."""
    from lease_core import MemoryBackend

    backend = MemoryBackend()
    offset = quiet_offset(await store_now_ms(backend))
    release, done = anyio.Event(), anyio.Event()
    started: list[int] = []
    s = Scheduler(backend, instance_id="alone", max_running=2, **FAST)

    for name in ("hold", "hold-2"):
        @s.every(name, "1h", offset=offset)
        async def hold(ctx: RunContext) -> None:
            await release.wait()

    @s.every("tick", "1h", offset=(offset + 60) % 3600)  # overlap="skip"
    async def tick(ctx: RunContext) -> None:
        started.append(ctx.slot)
        await done.wait()

    return s, release, done, started


async def test_a_slot_deferred_at_capacity_does_not_run_beside_a_newer_one() -> None:
    """A slot deferred at capacity was claimed at the next tick even when a newer slot of
    its job had been claimed meanwhile, once a handler ended: it ran after the newer one
    and beside it, an overlap="skip" job too (the store skips a slot for earlier runs
    only). The newer slot's claim supersedes it, as a newer deferral does."""
    s, release, done, started = await full_with_tick()

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        hold_slot, newest = current_slots(s, "hold", "tick")
        older = newest - 3_600_000
        await claim_now(s, "hold", hold_slot)
        await claim_now(s, "hold-2", hold_slot)
        assert await claim_now(s, "tick", older) is None  # at capacity: deferred
        release.set()
        await wait_for(lambda: s.running == [], timeout=5, what="capacity free")
        won = await claim_now(s, "tick", newest)  # as its slot falls due
        assert won is not None and won.status is ClaimStatus.WON
        # the deferred slot is forgotten at the next check: nobody claimed it
        await wait_for(lambda: ("tick", older) not in s.watching, timeout=5,
                       what="the older deferred slot superseded")
        history = await s.history("tick", 10)
        done.set()
        await inst.stop()
    assert started == [newest]
    assert [a.slot for a in history] == [newest]


async def test_slots_of_a_job_claimed_together_go_to_the_store_oldest_first() -> None:
    """Slots of an overlap="skip" job whose turns come at one check are claimed in one
    batch, which the store answers claim by claim, skipping a slot for the earlier runs
    only: in the order their records were made (newest first here), both ran, side by
    side. Oldest first, the older runs and the newer is skipped."""
    s, release, done, started = await full_with_tick()

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        hold_slot, newest = current_slots(s, "hold", "tick")
        newer, older = newest - 3_600_000, newest - 7_200_000
        await claim_now(s, "hold", hold_slot)
        await claim_now(s, "hold-2", hold_slot)
        assert await claim_now(s, "tick", newer) is None  # at capacity: deferred
        assert await claim_now(s, "tick", older) is None
        release.set()  # both claimed at the next check
        history = await wait_history(s, lambda h: len(h) == 2, job="tick", timeout=5,
                                     what="both deferred slots claimed")
        done.set()
        await inst.stop()
    assert started == [older]
    assert sorted((a.slot, a.outcome) for a in history) == [
        (older, None), (newer, "skipped")]


async def test_a_slot_the_first_member_deferred_does_not_run_beside_its_next_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first-ranked member, at capacity at a slot, is free at the job's next slot and
    runs it; the next-ranked member's turn for the deferred slot comes a check interval
    after that slot, while the next one runs. It claimed it, and ran it beside the next
    one, though the job has overlap="skip" (the store skips a slot for earlier runs
    only). A slot whose turn comes while a newer slot of its job runs is not claimed,
    whatever slots were skipped since (here the three after the one that runs), and
    said so at DEBUG: at INFO, every member ranked after the first said it of every slot
    of every job after an outage (3,643 lines from 5 instances of 100 jobs)."""
    from lease_core import MemoryBackend

    caplog.set_level("DEBUG", logger="anarchon")

    backend = MemoryBackend()
    offset = quiet_offset(await store_now_ms(backend))
    job = next(f"due-{n}" for n in range(100)
               if rendezvous_rank(f"due-{n}", "full", ("full", "spare")) == 0)
    release = anyio.Event()
    active: list[int] = []
    overlapped: list[tuple[int, ...]] = []

    def build(name: str, **kw: Any) -> Scheduler:
        # The turn (1.8 s after a slot) falls between two slots: not a race with the
        # first member's claim of a slot at that instant.
        s = Scheduler(backend, instance_id=name, lease="6s", heartbeat="1.8s", **kw)

        @s.every("hold", "1h", offset=offset)
        async def hold(ctx: RunContext) -> None:
            await release.wait()

        @s.every(job, "500ms")  # overlap="skip"
        async def due(ctx: RunContext) -> None:
            active.append(ctx.slot)
            if len(active) > 1:
                overlapped.append(tuple(active))
            try:
                await anyio.sleep(2.5)
            finally:
                active.remove(ctx.slot)

        return s

    full, spare = build("full", max_running=1), build("spare")
    async with anyio.create_task_group() as tg:
        i_full = await Instance(full).start(tg)
        i_spare = await Instance(spare).start(tg)
        assert await renew_membership(full) == await renew_membership(spare) == (
            "full", "spare")
        (hold_slot,) = current_slots(full, "hold")
        await claim_now(full, "hold", hold_slot)
        await wait_for(lambda: any(key[0] == job for key in full.watching), timeout=10,
                       interval=0.01, what="full deferring a slot at capacity")
        deferred = max(slot for name, slot in full.watching if name == job)
        release.set()  # full runs the next slot itself; spare's turn for this one comes
        await wait_for(lambda: spare.store_now_ms() > deferred + 4500, timeout=15,
                       what="spare's turn for the deferred slot, and the slot after")
        await stop_all([i_full, i_spare])
    assert not overlapped
    newer = [r for r in caplog.records if "a newer slot of the job runs" in r.getMessage()]
    assert newer and {r.levelno for r in newer} == {logging.DEBUG}


async def test_a_sync_handler_past_its_timeout_still_counts_against_max_running() -> None:
    """A sync handler's thread cannot be cancelled: its run ends at the timeout, but the
    thread goes on, and the instance must not start another handler beside it."""
    import threading

    from lease_core import MemoryBackend

    backend = MemoryBackend()
    offset = quiet_offset(await store_now_ms(backend))
    go = threading.Event()
    ran: list[int] = []
    s = Scheduler(backend, instance_id="alone", max_running=1, **FAST)

    @s.every("hold", "1h", offset=offset, timeout="0.1s")
    def hold(ctx: RunContext) -> None:
        go.wait(10)

    @s.every("next", "1h", offset=(offset + 60) % 3600)
    async def after(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        hold_slot, next_slot = current_slots(s, "hold", "next")
        await claim_now(s, "hold", hold_slot)
        await wait_history(s, lambda h: any(a.job == "hold" and a.outcome is not None
                                            for a in h), timeout=5, what="hold timed out")
        assert s.running == []
        assert await claim_now(s, "next", next_slot) is None  # its thread still runs
        assert ran == []
        go.set()
        await wait_for(lambda: ran == [next_slot], timeout=10,
                       what="the deferred run once the thread returned")
        await inst.stop()


async def test_a_sync_thread_left_running_by_a_stop_counts_after_a_restart() -> None:
    """stop() abandons a sync handler's thread (it cannot be cancelled); started again,
    the same scheduler must still count it against max_running."""
    import threading

    from lease_core import MemoryBackend

    backend = MemoryBackend()
    offset = quiet_offset(await store_now_ms(backend))
    go, began = threading.Event(), threading.Event()
    ran: list[int] = []
    s = Scheduler(backend, instance_id="alone", max_running=1, **FAST)

    @s.every("hold", "1h", offset=offset)
    def hold(ctx: RunContext) -> None:
        began.set()
        go.wait(10)  # ignores ctx.stopping

    @s.every("next", "1h", offset=(offset + 60) % 3600)
    async def after(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    await s.start()
    try:
        hold_slot, next_slot = current_slots(s, "hold", "next")
        await claim_now(s, "hold", hold_slot)
        await wait_for(began.is_set, timeout=5, what="hold's thread")
        await s.stop(grace=0)
        await s.start()
        assert await claim_now(s, "next", next_slot) is None  # hold's thread still runs
        assert ran == []
        go.set()
        await wait_for(lambda: ran == [next_slot], timeout=10,
                       what="the deferred run once the thread returned")
    finally:
        go.set()
        await s.stop()


async def test_a_failed_membership_renewal_is_tried_again_at_the_next_tick() -> None:
    """A renewal that failed is not put off for half a lease (5 s here): the membership
    lasts one lease, so a second failure could let it lapse while the instance lives."""
    from lease_core import MemoryBackend

    calls: list[float] = []

    class FailingOnce(MemoryBackend):
        async def members(self, instance_id: str, lease_ms: int) -> list[str] | None:
            calls.append(anyio.current_time())
            if len(calls) == 2:
                raise ConnectionError("the store did not answer")
            return await super().members(instance_id, lease_ms)

    s = Scheduler(FailingOnce(), instance_id="m", lease="10s", heartbeat="0.2s")
    s.every("job", "1h", lambda ctx: None)
    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        # Renewals every half lease (5 s): the second is the first the ticks make.
        await wait_for(lambda: len(calls) >= 2, timeout=10, what="a second renewal")
        await wait_for(lambda: len(calls) >= 3, timeout=2,
                       what="the failed renewal tried again")
        await inst.stop()
    assert calls[2] - calls[1] < 1.0, calls


async def test_a_failing_check_does_not_put_the_membership_renewal_off() -> None:
    """The renewal came last in a tick: a check that failed every tick (here the pick-up
    of queued runs) skipped it, and a live member's membership lapsed."""
    from lease_core import MemoryBackend

    calls: list[float] = []

    class FailingQueued(MemoryBackend):
        async def members(self, instance_id: str, lease_ms: int) -> list[str] | None:
            calls.append(anyio.current_time())
            return await super().members(instance_id, lease_ms)

        async def queued(self, jobs: Sequence[str]) -> list[tuple[str, int]]:
            raise ConnectionError("the store did not answer")

    s = Scheduler(FailingQueued(), instance_id="m", lease="1s", heartbeat="0.2s")
    s.every("job", "1h", lambda ctx: None)
    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        # Renewals every half lease (0.5 s), whatever the pick-up does.
        await wait_for(lambda: len(calls) >= 4, timeout=5, what="renewals")
        await inst.stop()


@pytest.mark.asyncio_only  # engine timing; the loops are covered elsewhere
async def test_one_failed_check_at_a_backups_turn_does_not_drop_its_slot() -> None:
    """The first-ranked member is frozen; the next one's check at its turn fails once, and
    the store answers before and after. The slot is claimed at the next tick: it was not
    missed while the store was unreachable, although a newer slot is due by then (it was
    dropped for good, never run)."""
    from lease_core import MemoryBackend

    job = next(f"j-{n}" for n in range(1000) if rendezvous_rank(f"j-{n}", "b", ("a", "b")))
    failed: list[tuple[int, int]] = []

    class FailOnce(MemoryBackend):
        target: int | None = None

        async def check(self, keys: Sequence[tuple[str, int]]) -> Any:
            target = self.target
            # at its turn (a check interval after the slot), not a tick's look before it
            if target is not None and (job, target) in keys and self._now() >= target + 900:
                self.target = None
                failed.append((target, self._now()))
                raise ConnectionError("the store did not answer, once")
            return await super().check(keys)

    backend = FailOnce()
    await backend.start()
    s = Scheduler(backend, instance_id="b", lease="6s", heartbeat="1s")
    s.every(job, "500ms", lambda ctx: None)
    await backend.members(member_name("a", group_of(s.jobs)), 60_000)  # renewed, then froze
    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        assert await renew_membership(s) == ("a", "b")
        target = (s.store_now_ms() // 1000 + 2) * 1000
        backend.target = target
        await wait_history(s, lambda h: any(x.slot == target for x in h), job=job,
                           timeout=10)
        await inst.stop()
    assert failed and failed[0][0] == target  # the failure came at the slot's turn


# ----------------------------------------------------------------- on a Redis Cluster
# The same checks on a 3-node Valkey Cluster: the members' sorted set and the jobs' keys
# fall on different nodes (asyncio only: redis-py's Cluster client is asyncio's).


@pytest.mark.asyncio_only
async def test_on_a_redis_cluster_a_slot_costs_about_one_claim(
        redis_cluster_store: Store) -> None:
    await claims_per_slot(redis_cluster_store, 3)


@pytest.mark.asyncio_only
async def test_on_a_redis_cluster_a_crashed_members_slots_are_claimed_by_the_next_ranked(
        redis_cluster_store: Store) -> None:
    await crashed_member(redis_cluster_store)


@pytest.mark.asyncio_only
async def test_on_a_redis_cluster_an_instance_at_capacity_claims_nothing(
        redis_cluster_store: Store) -> None:
    await capacity(redis_cluster_store)


@pytest.mark.asyncio_only
async def test_on_a_redis_cluster_a_gracefully_stopped_members_next_slot_is_claimed_at_once(
        redis_cluster_store: Store) -> None:
    await leaving_on_stop(redis_cluster_store)


@pytest.mark.asyncio_only
async def test_on_a_redis_cluster_instances_declaring_other_jobs_rank_apart(
        redis_cluster_store: Store) -> None:
    await groups(redis_cluster_store)


async def test_a_catch_up_deferred_at_capacity_runs_its_missed_slots_one_after_another() -> None:
    """catch_up="all" with overlap="skip": missed slots run one after another. Deferred at
    capacity, they used to be queued all at once, and claimed together once handlers
    ended: the store recorded all but the first of a batch skipped (an earlier run open)."""
    from lease_core import MemoryBackend
    from lease_core._structures import ClaimRequest, Lease, Outcome

    backend = MemoryBackend()
    await backend.start()
    await backend.register_jobs(["c"])
    now = await backend.now_ms()
    last = now - now % 1000
    # A run of the store's last slot of "c", still open: the new instance's catch-up
    # waits for it, and meanwhile its capacity is taken.
    (held,) = await backend.claim_many([ClaimRequest("c", last, "gone", "t0", 60_000)])
    assert held.status == "won", held
    await wait_for(lambda: _after(backend, last + 3_500), what="three missed slots")
    offset = quiet_offset(await store_now_ms(backend))
    release = anyio.Event()
    ran: list[int] = []
    s = Scheduler(backend, instance_id="alone", max_running=2, **FAST)

    async def hold(ctx: RunContext) -> None:
        await release.wait()

    s.every("hold-1", "1h", hold, offset=offset)
    s.every("hold-2", "1h", hold, offset=offset)

    @s.every("c", "1s", catch_up="all")
    async def c(ctx: RunContext) -> None:
        ran.append(ctx.slot)

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        until = s.store_now_ms()
        missed = list(range(last + 1000, until + 1, 1000))
        assert len(missed) >= 3, missed
        one, two = current_slots(s, "hold-1", "hold-2")
        assert await claim_now(s, "hold-1", one) is not None
        assert await claim_now(s, "hold-2", two) is not None
        assert await backend.finish(Lease("c", last, "t0", 60_000), Outcome.COMPLETED)
        # the catch-up is deferred at capacity meanwhile; then the handlers end
        await wait_for(lambda: ("c", missed[0]) in s.watching, timeout=5,
                       what="the first missed slot deferred")
        release.set()
        await wait_for(lambda: set(missed) <= set(ran), timeout=15,
                       what="every missed slot run")
        await inst.stop()
    outcomes = {a.slot: a.outcome for a in await backend.history("c", limit=100)
                if a.slot in missed}
    assert outcomes == dict.fromkeys(missed, "completed"), outcomes
    assert ran[:len(missed)] == missed, ran


async def _after(backend: Any, ms: int) -> bool:
    return int(await backend.now_ms()) >= ms
