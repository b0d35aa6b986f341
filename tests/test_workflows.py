"""Workflows through the public API, on every store that runs scenarios.

Workflow runs are hourly (far from "now"); each test starts a run by claiming its first
step at the current slot, as the schedule would, so nothing waits for a clock. Instances
are schedulers in tasks (tests/helpers.py); every wait has a deadline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from lease_core import (
    ConfigurationError,
    LeaseLost,
    MemoryBackend,
    Outcome,
    Reason,
    RunContext,
    Scheduler,
)
from lease_core._status import read_run, read_runs, workflow_status
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, RunStatus
from lease_core.context import Checkpoint
from lease_core.engine.fleet import group_of, member_name, rendezvous_rank
from lease_core.errors import BackendUnavailable
from lease_core.recovery import step_job
from lease_core.scheduler import parse_run_id
from lease_core.testing import claim_now, claim_now_sync
from lease_core.workflows import Workflow
from tests.helpers import Instance, quiet_offset_now, started, wait_for, wait_history
from tests.stores import Store

pytestmark = pytest.mark.anyio

FAST = {"lease": "0.9s", "heartbeat": "0.2s"}
STEPS = ("snapshot", "interest", "publish")


def make(store: Store, name: str, **kw: Any) -> Scheduler:
    return Scheduler(store.backend(), instance_id=name, **{**FAST, **kw})


def current_slot(s: Scheduler, wf: str = "close") -> int:
    slot = s.workflows[wf].schedule.previous_at_or_before(s.store_now_ms())
    assert slot is not None
    return slot


async def begin(s: Scheduler, slot: int, wf: str = "close") -> None:
    """Claim the workflow run's first step, as the schedule does at the slot."""
    await claim_now(s, wf, slot)


async def statuses(s: Scheduler, slot: int, wf: str = "close") -> list[RunStatus | None]:
    keys = [(job.name, slot) for job in s.workflows[wf].jobs]
    async with started(s.backend):
        found = (await s.backend.check(keys)).runs
    return [found[k].status if k in found else None for k in keys]


async def wait_workflow(s: Scheduler, slot: int, want: str, *, timeout: float = 10) -> None:
    async def done() -> bool:
        return workflow_status(await statuses(s, slot)) == want

    await wait_for(done, timeout=timeout, what=f"workflow run {want}")


async def test_steps_run_in_order_and_read_earlier_results(store: Store) -> None:
    seen: list[tuple[str, str | None, dict[str, Any], str]] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())

        @close.step("snapshot")
        async def snapshot(ctx: RunContext) -> Any:
            seen.append((name, ctx.step, dict(ctx.results), ctx.job))
            return {"accounts": 3}

        @close.step("interest")
        def interest(ctx: RunContext) -> Any:  # sync steps run in a worker thread
            seen.append((name, ctx.step, dict(ctx.results), ctx.job))
            return ctx.results["snapshot"]["accounts"] * 2

        @close.step("publish")
        async def publish(ctx: RunContext) -> None:
            seen.append((name, ctx.step, dict(ctx.results), ctx.job))

        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = current_slot(a)
        await begin(a, slot)
        await begin(b, slot)
        await wait_workflow(a, slot, "completed")
        await ia.stop()
        await ib.stop()
    assert [(step, results, job) for _, step, results, job in seen] == [
        ("snapshot", {}, "close/snapshot"),
        ("interest", {"snapshot": {"accounts": 3}}, "close/interest"),
        ("publish", {"snapshot": {"accounts": 3}, "interest": 6}, "close/publish"),
    ]
    async with started(a.backend):
        assert await a.backend.workflows() == {"close": list(STEPS)}
    log = await a.recovery_log(f"close@{slot}")
    assert [(e.step, e.attempt, e.event) for e in log] == [
        (step, 1, event) for step in STEPS for event in ("started", "completed")
    ]
    assert all((h.attempt, h.reason) == (1, "scheduled") for h in await a.history())


async def test_a_later_step_runs_although_newer_runs_of_it_were_trimmed(
        store: Store) -> None:
    """Workflow runs overlap: a later step of an older run can come after newer runs of
    that step ran and were trimmed. It is started by the step before it, not by a
    schedule, so the store's trimmed mark does not hold it back."""
    s = make(store, "a")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    for step in STEPS:
        close.step(step, lambda ctx: ctx.step)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = current_slot(s)
        interest = step_job("close", "interest")
        for later in (slot + 3_600_000, slot + 7_200_000):  # newer runs of the step
            request = ClaimRequest(interest, later, "elsewhere", f"t{later}", 60_000,
                                   scheduled=False)
            assert (await s.backend.claim(request)).attempt == 1
            await s.backend.finish(Lease(interest, later, request.token, 60_000),
                                   Outcome.COMPLETED)
        assert await s.backend.prune(interest, keep=1) == 1  # trimmed past ``slot``
        await begin(s, slot)
        await wait_workflow(s, slot, "completed")
        await i.stop()
    assert sorted(h.slot for h in await s.history(interest)) == [slot, slot + 7_200_000]


class SeesClaims:
    """A backend wrapper that sees every claim (``claim`` and ``claim_many``): its
    requests before they go out (:meth:`before`), and their answers (:meth:`after`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def before(self, requests: list[Any]) -> None:
        """Called with a claim's requests before they go out."""

    def after(self, requests: list[Any], results: list[Any]) -> None:
        """Called with a claim's requests and their answers."""

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr not in ("claim", "claim_many"):
            return value
        many = attr == "claim_many"

        async def claim(requests: Any) -> Any:
            listed = list(requests) if many else [requests]
            self.before(listed)
            results = await value(requests)
            self.after(listed, list(results) if many else [results])
            return results
        return claim


class ClaimAnswers(SeesClaims):
    """A backend wrapper keeping the answers to claims of ``job``'s runs."""

    def __init__(self, inner: Any, job: str) -> None:
        super().__init__(inner)
        self.job = job
        self.answers: list[tuple[int, bool, Any]] = []  # (slot, scheduled, result)

    def after(self, requests: list[Any], results: list[Any]) -> None:
        self.answers.extend((r.slot, r.scheduled, a)
                            for r, a in zip(requests, results, strict=True)
                            if r.job == self.job)


async def ran_elsewhere(backend: Any, step: str, slot: int, *, finish: bool = True) -> Lease:
    """Run ``step`` of the close workflow's run ``slot`` as another instance would."""
    job = step_job("close", step)
    request = ClaimRequest(job, slot, "elsewhere", f"t-{step}-{slot}", 60_000,
                           scheduled=step == STEPS[0])
    assert (await backend.claim(request)).attempt == 1
    lease = Lease(job, slot, request.token, 60_000)
    if finish:
        await backend.finish(lease, Outcome.COMPLETED)
    return lease


@pytest.mark.parametrize("seen", ["at start", "as a backup"])
async def test_a_later_step_that_ran_and_was_trimmed_never_runs_again(
        store: Store, seen: str) -> None:
    """The step before completed; the step ran, and newer runs of it trimmed it away.
    An instance that finds the step before completed, at start or as its backup at its
    turn, does not run the step again: only the agent's own claim of the next step,
    made as it completes the step before, starts a run past the trimmed history."""
    s = make(store, "late")
    ran: list[tuple[str | None, int]] = []
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    for step in STEPS:
        async def handler(ctx: RunContext) -> None:
            ran.append((ctx.step, ctx.slot))
        close.step(step, handler)
    interest = step_job("close", "interest")
    store_ = s.backend
    wrapped = ClaimAnswers(store_, interest)  # the late instance's claims
    s.backend = wrapped  # type: ignore[assignment]
    slot = current_slot(s)
    await store_.start()  # the tables, before the late instance starts
    first = await ran_elsewhere(store_, "snapshot", slot, finish=seen == "at start")
    await ran_elsewhere(store_, "interest", slot)
    await ran_elsewhere(store_, "interest", slot + 3_600_000)  # a newer run of the step
    assert await store_.prune(interest, keep=1) == 1  # trimmed past ``slot``
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        if seen == "as a backup":  # watched since start, completed now
            await wrapped.finish(first, Outcome.COMPLETED)
        await wait_for(lambda: any(at == slot for at, _, _ in wrapped.answers), timeout=10,
                       what="the late instance's claim of the step")
        await i.stop()
    ((_, scheduled, answer),) = [a for a in wrapped.answers if a[0] == slot]
    assert scheduled  # not the agent's claim
    assert (answer.status, answer.attempt, answer.run_status) == (
        ClaimStatus.FINISHED, 0, None)
    assert ran == []
    assert [h.slot for h in await s.history(interest)] == [slot + 3_600_000]


class FailsOnce:
    """A backend wrapper whose first ``what`` ("claim" or "finish") of ``job``'s runs
    fails: before reaching the store, or (``after``) once the store has done it."""

    def __init__(self, inner: Any, job: str, what: str, *, after: bool = False) -> None:
        self.inner, self.job, self.what, self.after, self.failed = inner, job, what, after, False

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr not in (self.what, f"{self.what}_many"):
            return value

        async def call(items: Any, *args: Any) -> Any:
            many = attr.endswith("_many")
            jobs = [getattr(item, "job", None) or item[0].job for item in items] if many \
                else [getattr(items, "job", None)]
            hit = not self.failed and self.job in jobs
            if hit and not self.after:
                self.failed = True
                raise BackendUnavailable(f"the {self.what} did not reach the store")
            result = await value(items, *args)
            if hit:
                self.failed = True
                raise BackendUnavailable(f"the {self.what}'s answer was lost")
            return result
        return call


async def trim_interest_past(backend: Any, slot: int) -> None:
    """Newer runs of the interest step ran and trimmed the step's history past ``slot``
    (workflow runs overlapping by more than the history kept)."""
    interest = step_job("close", "interest")
    for later in (slot + 3_600_000, slot + 7_200_000):
        request = ClaimRequest(interest, later, "elsewhere", f"t{later}", 60_000,
                               scheduled=False)
        assert (await backend.claim(request)).attempt == 1
        await backend.finish(Lease(interest, later, request.token, 60_000), Outcome.COMPLETED)
    assert await backend.prune(interest, keep=1) == 1


@pytest.mark.parametrize("fault", ["claim fails", "finish answer lost", "stop",
                                   "stop, claim fails"])
async def test_the_agent_claims_the_next_step_past_trimmed_history_through_faults(
        store: Store, fault: str) -> None:
    """The agent of a step is the one instance that may start the next step past the
    step's trimmed history. It stays so when its claim of the next step fails (and is
    retried), when its finish of the step was recorded but its answer lost (it finds the
    step completed itself), and when it stops while the step runs (it claims the next
    step and hands it over at once; a claim that fails then is made once more before
    the last hand-over). Otherwise the workflow run would stop there."""
    started = anyio.Event()

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())

        @close.step("snapshot")
        async def snapshot(ctx: RunContext) -> Any:
            if fault.startswith("stop"):  # it completes while its instance stops
                started.set()
                await ctx.stopping.wait()
            return 1

        close.step("interest", lambda ctx: ctx.step)
        close.step("publish", lambda ctx: ctx.step)
        return s

    a, b = build("a"), build("b")
    inner = a.backend
    if fault.endswith("claim fails"):
        a.backend = FailsOnce(inner, step_job("close", "interest"), "claim")  # type: ignore[assignment]
    elif fault == "finish answer lost":
        a.backend = FailsOnce(inner, step_job("close", "snapshot"), "finish",  # type: ignore[assignment]
                              after=True)
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg) if fault.startswith("stop") else None
        slot = current_slot(a)
        await trim_interest_past(inner, slot)
        await begin(a, slot)
        if ib is not None:
            await begin(b, slot)  # b backs the step up
            with anyio.fail_after(10):
                await started.wait()
            await ia.stop(grace=10)
        await wait_workflow(b if ib is not None else a, slot, "completed")
        await (ib or ia).stop()


class FinishGate:
    """A backend wrapper whose finishes of ``job``'s runs wait until ``open`` is set."""

    def __init__(self, inner: Any, job: str) -> None:
        self.inner, self.job = inner, job
        self.reached, self.open = anyio.Event(), anyio.Event()

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr not in ("finish", "finish_many"):
            return value

        async def finish(items: Any, *args: Any) -> Any:
            leases = [item[0] for item in items] if attr == "finish_many" else [items]
            if any(lease.job == self.job for lease in leases):
                self.reached.set()
                await self.open.wait()
            return await value(items, *args)
        return finish


async def test_the_agent_at_capacity_claims_the_next_step_past_trimmed_history_later(
        store: Store) -> None:
    """The agent completes a step while at ``max_running``: its claim of the next step
    waits until a handler ends, and is still the agent's then (past the step's trimmed
    history), so the workflow run goes on rather than stopping there."""
    s = make(store, "a", max_running=1)
    hog_started, hog_done = anyio.Event(), anyio.Event()
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    close.step("snapshot", lambda ctx: ctx.step)
    close.step("interest", lambda ctx: ctx.step)
    close.step("publish", lambda ctx: ctx.step)

    @s.every("hog", "1h", offset=quiet_offset_now())
    async def hog(ctx: RunContext) -> None:
        hog_started.set()
        await hog_done.wait()

    inner = s.backend
    gate = FinishGate(inner, step_job("close", "snapshot"))
    s.backend = gate  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = current_slot(s)
        await trim_interest_past(inner, slot)
        await begin(s, slot)
        with anyio.fail_after(10):
            await gate.reached.wait()  # the snapshot ended; its finish is on its way
        hog_slot = s.jobs["hog"].schedule.previous_at_or_before(s.store_now_ms())
        assert hog_slot is not None
        await claim_now(s, "hog", hog_slot)
        with anyio.fail_after(10):
            await hog_started.wait()  # the one handler max_running allows
        gate.open.set()

        async def interest_waits() -> bool:
            return (await statuses(s, slot) == ["completed", None, None]
                    and (step_job("close", "interest"), slot) in s.watching)

        await wait_for(interest_waits, timeout=10, what="the interest step deferred")
        assert s.running == [("hog", hog_slot)]
        hog_done.set()  # a handler ends: the agent's claim of the interest step goes out
        await wait_workflow(s, slot, "completed")
        await i.stop()


class FinishFailsOnce:
    """A backend wrapper whose finishes of the first attempt of ``job``'s runs never
    reach the store (sent again within the lease, they fail again)."""

    def __init__(self, inner: Any, job: str) -> None:
        self.inner, self.job, self.token = inner, job, None

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr not in ("finish", "finish_many"):
            return value

        async def finish(items: Any, *args: Any) -> Any:
            leases = [item[0] for item in items] if attr == "finish_many" else [items]
            for lease in leases:
                if lease.job == self.job and self.token in (None, lease.token):
                    self.token = lease.token
                    raise BackendUnavailable("the finish did not reach the store")
            return await value(items, *args)
        return finish


class CheckpointReadFailsOnce:
    """A backend wrapper whose first read of ``job``'s checkpoints does not answer."""

    def __init__(self, inner: Any, job: str) -> None:
        self.inner, self.job, self.failed = inner, job, False

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr != "get_checkpoint":
            return value

        async def read(job: str, slot: int) -> Any:
            if job == self.job and not self.failed:
                self.failed = True
                raise BackendUnavailable("the read did not reach the store")
            return await value(job, slot)
        return read


async def test_a_step_completed_before_its_lease_was_lost_does_not_run_again(
        store: Store) -> None:
    """The step's handler returned and its result was stored, fenced, but its finish did
    not reach the store: the takeover's attempt completes the step with the stored
    result instead of running the handler (and its effects) a second time, even when
    its first read of that result does not answer (it is read again)."""
    calls: list[tuple[str | None, int]] = []
    seen: dict[str, Any] = {}
    s = make(store, "a")
    s.backend = CheckpointReadFailsOnce(  # type: ignore[assignment]
        FinishFailsOnce(s.backend, "close/interest"), "close/interest")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())

    @close.step("snapshot")
    async def snapshot(ctx: RunContext) -> int:
        calls.append((ctx.step, ctx.attempt))
        return 3

    @close.step("interest")
    async def interest(ctx: RunContext) -> int:
        calls.append((ctx.step, ctx.attempt))
        return ctx.results["snapshot"] * 2

    @close.step("publish")
    async def publish(ctx: RunContext) -> None:
        calls.append((ctx.step, ctx.attempt))
        seen.update(ctx.results)

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = current_slot(s)
        await begin(s, slot)
        await wait_workflow(s, slot, "completed")
        await i.stop()
    assert calls == [("snapshot", 1), ("interest", 1), ("publish", 1)]
    assert seen == {"snapshot": 3, "interest": 6}
    history = await s.history(step_job("close", "interest"))
    assert sorted((h.attempt, h.reason, h.outcome) for h in history) == [
        (1, "scheduled", "lost"), (2, "takeover", "completed")]


async def test_a_backup_covers_the_step_after_one_completed_while_its_turn_was_coming(
        store: Store) -> None:
    """Member ``b`` backs up a workflow run whose agent is another member. Ranked second
    for the next step, ``b`` checks it at its turn; the agent claims and completes that
    step just before, then dies without claiming the one after: ``b`` must still back
    that one up, and claim it (the run never stalls)."""
    heartbeat = 0.5
    ran: list[str | None] = []
    b = make(store, "b", lease="3s", heartbeat=f"{heartbeat}s")
    close = b.workflow("close", every="1h", offset=quiet_offset_now())
    for step in STEPS:
        close.step(step, lambda ctx: ran.append(ctx.step))
    agent_id = next(f"agent-{n}" for n in range(100) if rendezvous_rank(
        step_job("close", "interest"), "b", ("b", f"agent-{n}")) == 1)
    agent = store.backend()
    await agent.start()
    alive = anyio.Event()

    async def agent_membership() -> None:
        name = member_name(agent_id, group_of(b.jobs))
        while not alive.is_set():
            await agent.members(name, 3000)
            await anyio.sleep(0.2)

    async def complete(step: str, slot: int) -> None:
        request = ClaimRequest(step_job("close", step), slot, agent_id, f"t-{step}", 60_000,
                               scheduled=step == STEPS[0])
        assert (await agent.claim(request)).attempt == 1
        lease = Lease(request.job, slot, request.token, 60_000)
        assert await agent.set_checkpoint(lease, {"result": step})
        assert await agent.finish(lease, Outcome.COMPLETED)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent_membership)
            i = await Instance(b).start(tg)
            await wait_for(lambda: b.health().fleet_size == 2, timeout=10, what="two members")
            slot = current_slot(b)
            first = ClaimRequest(step_job("close", "snapshot"), slot, agent_id, "t-0", 60_000)
            assert (await agent.claim(first)).attempt == 1
            await begin(b, slot)  # b backs the agent's first step up
            lease = Lease(first.job, slot, first.token, 60_000)
            assert await agent.set_checkpoint(lease, {"result": "snapshot"})
            assert await agent.finish(lease, Outcome.COMPLETED)
            interest = (step_job("close", "interest"), slot)
            await wait_for(lambda: interest in b.watching, timeout=5, interval=0.005,
                           what="b backing the next step up")
            # b's turn for it is two check intervals away: the agent completes it in the
            # second interval, after b's next tick found it unclaimed, then dies.
            await anyio.sleep(1.5 * heartbeat)
            await complete("interest", slot)
            alive.set()
            await wait_workflow(b, slot, "completed", timeout=15)
            await i.stop()
            tg.cancel_scope.cancel()
    finally:
        await agent.close()
    assert ran == ["publish"]


async def test_the_next_step_starts_without_waiting_for_a_tick(store: Store) -> None:
    s = make(store, "a", lease="9s", heartbeat="3s")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    for step in STEPS:
        close.step(step, lambda ctx: ctx.step)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = current_slot(s)
        t0 = time.monotonic()
        await begin(s, slot)
        await wait_workflow(s, slot, "completed")
        took = time.monotonic() - t0
        await i.stop()
    assert took < 2.5, f"3 steps took {took:.1f}s; a tick is 3s"


async def test_a_crashed_agent_s_step_is_taken_over_with_attempt_2(store: Store) -> None:
    runs: list[tuple[str, str | None, int, Any]] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now(), max_attempts=3)

        @close.step("snapshot")
        async def snapshot(ctx: RunContext) -> Any:
            runs.append((name, ctx.step, ctx.attempt, None))
            return [1, 2, 3]

        @close.step("interest")
        async def interest(ctx: RunContext) -> Any:
            done = await ctx.checkpoint.get() or 0
            runs.append((name, ctx.step, ctx.attempt, done))
            for i in range(done, 4):
                await ctx.checkpoint.set(i + 1)
                if name == "a" and i == 1:
                    await anyio.sleep_forever()  # the agent dies here
            return "credited"

        @close.step("publish")
        async def publish(ctx: RunContext) -> None:
            runs.append((name, ctx.step, ctx.attempt, ctx.results["interest"]))

        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        slot = current_slot(a)
        await begin(a, slot)
        await wait_for(lambda: ("a", "interest", 1, 0) in runs, what="a in interest")
        ib = await Instance(b).start(tg)
        await begin(b, slot)  # finds the snapshot completed: backs up the next step
        assert b.watching == [("close/interest", slot)]

        async def two_done() -> bool:
            return await b.backend.get_checkpoint("close/interest", slot) == {"progress": 2}

        await wait_for(two_done, what="a's progress")
        ia.crash()
        await wait_workflow(b, slot, "completed")
        await ib.stop()
    assert ("b", "interest", 2, 2) in runs  # attempt 2 resumed from a's progress
    assert ("b", "publish", 1, "credited") in runs
    assert [r for r in runs if r[1] == "snapshot"] == [("a", "snapshot", 1, None)]
    log = await b.recovery_log(("close", slot))
    interest = [(e.attempt, e.event, e.instance_id) for e in log if e.step == "interest"]
    assert interest == [(1, "started", "a"), (1, "lost", "a"), (2, "taken_over", "b"),
                        (2, "completed", "b")]


async def test_stop_hands_a_step_over_mid_step(store: Store) -> None:
    started: list[tuple[str, int, Reason]] = []

    def build(name: str) -> Scheduler:
        s = make(store, name, lease="20s")
        close = s.workflow("close", every="1h", offset=quiet_offset_now())
        close.step("snapshot", lambda ctx: None)

        @close.step("interest")
        async def interest(ctx: RunContext) -> None:
            started.append((name, ctx.attempt, ctx.reason))
            if name == "a":
                await anyio.sleep_forever()

        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        slot = current_slot(a)
        await begin(a, slot)
        await wait_for(lambda: started, what="a in interest")
        ib = await Instance(b).start(tg)
        await begin(b, slot)  # finds the snapshot completed: backs up the next step
        assert b.watching == [("close/interest", slot)]
        t0 = time.monotonic()
        await ia.stop(grace=0.1)
        await wait_workflow(b, slot, "completed", timeout=5)
        assert time.monotonic() - t0 < 5  # the lease is 20 s
        await ib.stop()
    assert started == [("a", 1, Reason.SCHEDULED), ("b", 2, Reason.HAND_OVER)]
    log = await b.recovery_log(f"close@{slot}")
    assert [(e.step, e.event) for e in log if e.step == "interest"] == [
        ("interest", "started"), ("interest", "handed_over"),
        ("interest", "started"), ("interest", "completed")]


async def test_a_zombie_agent_is_refused_everything(store: Store) -> None:
    zombie: list[RunContext] = []
    finished: list[str] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())
        close.step("snapshot", lambda ctx: None)

        @close.step("interest")
        async def interest(ctx: RunContext) -> str:
            if name == "a":
                zombie.append(ctx)
                await anyio.sleep_forever()
            return "by b"

        @close.step("publish")
        async def publish(ctx: RunContext) -> None:
            finished.append(ctx.results["interest"])

        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        slot = current_slot(a)
        await begin(a, slot)
        await wait_for(lambda: zombie, what="a in interest")
        ib = await Instance(b).start(tg)
        await begin(b, slot)
        assert b.watching == [("close/interest", slot)]
        ia.crash()  # a stalls: its lease expires, b takes the step over
        await wait_workflow(b, slot, "completed")
        await ib.stop()
    late = zombie[0]
    old = Lease(late.job, late.slot, late.token, a.jobs[late.job].lease_ms)
    backend = b.backend
    await backend.start()
    try:
        # The late agent can neither store a result, checkpoint, nor complete the step.
        assert not await backend.set_checkpoint(old, {"result": "by a"})
        with pytest.raises(LeaseLost):
            await Checkpoint(backend, old).set({"progress": 9})
        assert not await backend.finish(old, Outcome.COMPLETED)
        assert await backend.get_checkpoint("close/interest", slot) == {
            "result": "by b", "next": "publish", "steps": list(STEPS)}
    finally:
        await backend.close()
    assert finished == ["by b"]


async def test_escalation_fails_the_workflow_and_stops_later_steps(store: Store) -> None:
    ran: list[tuple[str, str | None, int]] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now(), max_attempts=5)
        close.step("snapshot", lambda ctx: None)

        @close.step("interest", max_attempts=1)  # the step's limit overrides the workflow's
        async def interest(ctx: RunContext) -> None:
            ran.append((name, ctx.step, ctx.attempt))
            await anyio.sleep_forever()

        @close.step("publish")
        async def publish(ctx: RunContext) -> None:
            ran.append((name, ctx.step, ctx.attempt))

        return s

    a, b = build("a"), build("b")
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        slot = current_slot(a)
        await begin(a, slot)
        await begin(b, slot)
        await wait_for(lambda: ran, what="interest running")
        holder = ia if ran[0][0] == "a" else ib
        holder.crash()
        await wait_workflow(b if holder is ia else a, slot, "failed")
        survivor = b if holder is ia else a
        await anyio.sleep(0.4)  # two more ticks: nothing may start publish
        assert await statuses(survivor, slot) == [RunStatus.COMPLETED, RunStatus.ESCALATED,
                                                  None]
        await (ib if holder is ia else ia).stop()
    assert [r[1:] for r in ran] == [("interest", 1)]
    log = await survivor.recovery_log(f"close@{slot}")
    assert log[-1].step == "interest" and log[-1].event == "escalated"


async def test_a_failed_step_fails_the_workflow_at_once(store: Store) -> None:
    ran: list[str] = []
    s = make(store, "a")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())

    @close.step("snapshot")
    async def snapshot(ctx: RunContext) -> None:
        ran.append("snapshot")
        raise RuntimeError("no positions")

    close.step("interest", lambda ctx: ran.append("interest"))
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = current_slot(s)
        await begin(s, slot)
        await wait_workflow(s, slot, "failed")
        await i.stop()
    assert ran == ["snapshot"]
    log = await s.recovery_log(f"close@{slot}")
    assert [(e.step, e.event) for e in log] == [("snapshot", "started"), ("snapshot", "failed")]
    assert log[-1].detail is not None and "no positions" in log[-1].detail


async def test_a_backup_dispatches_the_next_step_when_the_agent_dies_after_finishing(
    store: Store,
) -> None:
    ran: list[tuple[str, str | None]] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())
        close.step("snapshot", lambda ctx: ran.append((name, ctx.step)))
        close.step("interest", lambda ctx: ran.append((name, ctx.step)))
        return s

    b = build("b")
    dead = store.backend()  # an agent that completes the first step and dies at once
    await dead.start()
    try:
        async with anyio.create_task_group() as tg:
            ib = await Instance(b).start(tg)
            slot = current_slot(b)
            won = await dead.claim(ClaimRequest("close/snapshot", slot, "dead", "t1", 60_000))
            assert won.status == "won"
            await begin(b, slot)
            assert b.watching == [("close/snapshot", slot)]
            lease = Lease("close/snapshot", slot, "t1", 60_000)
            assert await dead.set_checkpoint(lease, {"result": 1})
            assert await dead.finish(lease, Outcome.COMPLETED)
            await wait_workflow(b, slot, "completed")
            await ib.stop()
        assert ran == [("b", "interest")]
        # On start, an instance finds a workflow run left between two steps.
        won = await dead.claim(ClaimRequest("close/snapshot", slot + 3_600_000, "dead", "t2",
                                            60_000))
        lease = Lease("close/snapshot", slot + 3_600_000, "t2", 60_000)
        assert await dead.set_checkpoint(lease, {"result": 2})
        assert await dead.finish(lease, Outcome.COMPLETED)
        c = build("c")
        async with anyio.create_task_group() as tg:
            ic = await Instance(c).start(tg)
            await wait_workflow(c, slot + 3_600_000, "completed")
            await ic.stop()
        assert ran == [("b", "interest"), ("c", "interest")]
    finally:
        await dead.close()


class DiesClaiming(SeesClaims):
    """A backend wrapper whose instance dies as it claims ``job``'s run at ``slot``: the
    instance is crashed and the claim never reaches the store."""

    def __init__(self, inner: Any, job: str, slot: int) -> None:
        super().__init__(inner)
        self.job, self.slot = job, slot
        self.instance: Instance | None = None

    def before(self, requests: list[Any]) -> None:
        if any((r.job, r.slot) == (self.job, self.slot) for r in requests):
            assert self.instance is not None
            self.instance.crash()
            raise BackendUnavailable("the instance died before its claim went out")


async def test_a_starting_instance_continues_an_older_run_left_between_two_steps(
    store: Store,
) -> None:
    """An older workflow run stopped between two steps (its first step completed, its
    agent and every supervisor died before any claimed the second), while a newer run of
    the workflow is its latest: an instance that starts later runs the older run's second
    step, once. The start-up check must not look only at the workflow's latest run."""
    ran: list[tuple[str, str | None, int]] = []

    def build(name: str) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())
        for step in STEPS[:2]:
            close.step(step, lambda ctx, name=name: ran.append((name, ctx.step, ctx.slot)))
        return s

    a, b = build("a"), build("b")
    newer = current_slot(a)
    older = newer - 3_600_000
    dying = [DiesClaiming(s.backend, step_job("close", "interest"), older) for s in (a, b)]
    a.backend, b.backend = dying  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        ib = await Instance(b).start(tg)
        dying[0].instance, dying[1].instance = ia, ib
        await begin(a, newer)
        await begin(b, newer)
        await wait_workflow(a, newer, "completed")
        await begin(a, older)  # a runs the first step; b backs it up
        await begin(b, older)
        with anyio.fail_after(10):  # both die as they claim the second step
            await ia.wait_done()
            await ib.wait_done()
    assert await statuses(a, older) == [RunStatus.COMPLETED, None]
    assert await statuses(a, newer) == [RunStatus.COMPLETED, RunStatus.COMPLETED]
    c = build("c")
    async with anyio.create_task_group() as tg:
        ic = await Instance(c).start(tg)
        await wait_workflow(c, older, "completed")
        await ic.stop()
    assert sorted(r for r in ran if r[2] == older) == [
        ("a", "snapshot", older), ("c", "interest", older)]


async def test_a_starting_instance_does_not_run_again_a_later_step_whose_run_was_trimmed(
    store: Store,
) -> None:
    """An older workflow run whose second step's run was trimmed (its step's history is
    by attempts; the first step's run at that slot still kept): the start-up check that
    looks past the latest run finds the first step completed and the second missing; its
    claim starts nothing past the step's trimmed history, and the step never runs twice."""
    ran: list[tuple[str | None, int]] = []

    def build(name: str) -> Scheduler:
        return _close_workflow(store, name, STEPS[:2],
                               lambda ctx: ran.append((ctx.step, ctx.slot)))

    old = build("old")
    older, newer = await _two_runs_completed(old)
    async with started(old.backend):  # the second step's history trimmed alone
        assert await old.backend.prune(step_job("close", STEPS[1]), keep=1) == 1
    assert await statuses(old, older) == [RunStatus.COMPLETED, None]
    new = build("new")
    seen = ClaimAnswers(new.backend, step_job("close", STEPS[1]))
    new.backend = seen  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        i = await Instance(new).start(tg)
        await wait_for(lambda: any(slot == older for slot, _, _ in seen.answers),
                       what="the older run's second step claimed at start")
        await i.stop()
    assert sorted(ran) == sorted([(STEPS[0], older), (STEPS[1], older),
                                  (STEPS[0], newer), (STEPS[1], newer)])


def _close_workflow(store: Store, name: str, steps: tuple[str, ...],
                    handler: Callable[[RunContext], object]) -> Scheduler:
    """A scheduler named ``name`` with the hourly workflow ``close`` of ``steps``, each
    step running ``handler``."""
    s = make(store, name)
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    for step in steps:
        close.step(step, handler)
    return s


async def _two_runs_completed(scheduler: Scheduler) -> tuple[int, int]:
    """Run ``scheduler`` until the workflow's run an hour before the current slot, then
    the current one, completed; return their slots (older, newer)."""
    newer = current_slot(scheduler)
    older = newer - 3_600_000
    async with anyio.create_task_group() as tg:
        i = await Instance(scheduler).start(tg)
        for slot in (older, newer):
            await begin(scheduler, slot)
            await wait_workflow(scheduler, slot, "completed")
        await i.stop()
    return older, newer


async def _one_run_completed(scheduler: Scheduler) -> int:
    """Run ``scheduler`` until the workflow's current run completed; return its slot."""
    async with anyio.create_task_group() as tg:
        i = await Instance(scheduler).start(tg)
        slot = current_slot(scheduler)
        await begin(scheduler, slot)
        await wait_workflow(scheduler, slot, "completed")
        await i.stop()
    return slot


async def test_a_starting_instance_does_not_give_older_runs_a_step_they_never_had(
    store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    """A release replaces a workflow's last step: the older runs, which completed with
    the step it replaced, are not continued with the new one by the start-up check that
    looks past the latest run (their first step's result names the old next step)."""
    ran: list[tuple[str | None, int]] = []

    def build(name: str, steps: tuple[str, ...]) -> Scheduler:
        return _close_workflow(store, name, steps,
                               lambda ctx: ran.append((ctx.step, ctx.slot)))

    old = build("old", ("snapshot", "interest"))
    older, _ = await _two_runs_completed(old)
    new = build("new", ("snapshot", "audit"))
    with caplog.at_level(logging.DEBUG, logger="anarchon"):
        async with anyio.create_task_group() as tg:
            i = await Instance(new).start(tg)
            await wait_for(lambda: "completed under another definition" in caplog.text
                           or ("audit", older) in ran, what="the older run looked at")
            await i.stop()
    assert (await statuses(new, older)) == [RunStatus.COMPLETED, None]
    assert ("audit", older) not in ran


async def test_a_step_added_to_a_deployed_workflow_runs_from_the_next_run_on(
    store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[tuple[str | None, int]] = []

    def build(name: str, steps: tuple[str, ...]) -> Scheduler:
        return _close_workflow(store, name, steps,
                               lambda ctx: ran.append((ctx.step, ctx.slot)))

    slot = await _one_run_completed(build("old", STEPS[:2]))
    # A release adds a last step; its first instance finds the latest run ended.
    new, later = build("new", STEPS), slot + 3_600_000
    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with anyio.create_task_group() as tg:
            i = await Instance(new).start(tg)
            await wait_for(lambda: "before step 'publish' was added" in caplog.text,
                           what="the ended run seen")
            await begin(new, later)
            await wait_workflow(new, later, "completed")
            await i.stop()
    assert (await statuses(new, slot))[2] is None
    assert ran == [("snapshot", slot), ("interest", slot),
                   ("snapshot", later), ("interest", later), ("publish", later)]


async def test_a_step_inserted_in_a_deployed_workflow_runs_from_the_next_run_on(
    store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    """A release inserts a step between two: its first instance finds the latest run,
    which went on from the first step with the old next one, not missing the new step
    (the first step's result names the step it went on with), and runs the new step from
    the next run on. It ran the inserted step for that completed run."""
    ran: list[tuple[str | None, int]] = []

    def build(name: str, steps: tuple[str, ...]) -> Scheduler:
        return _close_workflow(store, name, steps,
                               lambda ctx: ran.append((ctx.step, ctx.slot)))

    slot = await _one_run_completed(build("old", (STEPS[0], STEPS[2])))
    new, later = build("new", STEPS), slot + 3_600_000
    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with anyio.create_task_group() as tg:
            i = await Instance(new).start(tg)
            await wait_for(lambda: "under an earlier definition" in caplog.text
                           or (STEPS[1], slot) in ran, what="the latest run looked at")
            await begin(new, later)
            await wait_workflow(new, later, "completed")
            await i.stop()
    assert ran == [(STEPS[0], slot), (STEPS[2], slot),
                   (STEPS[0], later), (STEPS[1], later), (STEPS[2], later)]
    async with started(new.backend):  # shown completed, not running for ever
        run = await read_run(new.backend, "close", slot)
        listed = await read_runs(new.backend, "close")
    assert run is not None and run["status"] == "completed", run
    assert listed is not None
    assert [r["status"] for r in listed["runs"] if r["slot"] == slot] == ["completed"]


async def test_a_step_inserted_is_not_run_for_a_run_an_earlier_build_completed(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release that marks a step's result with its next step is deployed with a step
    inserted between two: the latest run was completed by the earlier build (its first
    step's result names no next step), yet its later step ran: the run went on without
    the inserted step, which must not run for it (it ran: the inserted step's effect for
    a run completed before it existed, shown completed by the status API meanwhile)."""
    from lease_core.engine.steps import StepCoordinator

    ran: list[tuple[str | None, int]] = []

    def build(name: str, steps: tuple[str, ...]) -> Scheduler:
        return _close_workflow(store, name, steps,
                               lambda ctx: ran.append((ctx.step, ctx.slot)))

    def earlier_build(job: Any, value: Any) -> dict[str, Any]:
        # The results a543587's release stored: only the last step's marked.
        return {"result": value, **({"last": True} if job.next_step is None else {})}

    with monkeypatch.context() as m:
        m.setattr(StepCoordinator, "result_payload", staticmethod(earlier_build))
        slot = await _one_run_completed(build("old", (STEPS[0], STEPS[2])))
    new = build("new", STEPS)
    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with anyio.create_task_group() as tg:
            i = await Instance(new).start(tg)
            await wait_for(lambda: "went on without" in caplog.text
                           or (STEPS[1], slot) in ran, what="the latest run looked at")
            await i.stop()
    assert ran == [(STEPS[0], slot), (STEPS[2], slot)]


async def test_a_run_that_ended_before_a_step_was_added_is_shown_completed(
    store: Store) -> None:
    """The status API shows a run that ended with the workflow's old last step as
    completed, not running for ever: the step added since never runs for it."""
    slot = await _one_run_completed(_close_workflow(store, "old", STEPS[:2], lambda ctx: None))
    new = _close_workflow(store, "new", STEPS, lambda ctx: None)
    async with anyio.create_task_group() as tg:
        i = await Instance(new).start(tg)  # registers the workflow's three steps
        await i.stop()
    async with started(new.backend):
        run = await read_run(new.backend, "close", slot)
        listed = await read_runs(new.backend, "close")
    assert run is not None and run["status"] == "completed", run
    assert listed is not None
    assert [r["status"] for r in listed["runs"] if r["slot"] == slot] == ["completed"]


async def test_a_step_added_by_a_release_rolling_out_does_not_run_for_a_run_ending_meanwhile(
    store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    """The new release starts while the old one runs the workflow's last step, backs that
    run up, and sees it complete: the step it adds is not claimed for that run (the old
    step's result says the run ended with it)."""
    ran: list[tuple[str | None, str]] = []
    started = anyio.Event()

    def build(name: str, steps: tuple[str, ...]) -> Scheduler:
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())
        for step in steps:
            async def handler(ctx: RunContext, name: str = name) -> None:
                ran.append((ctx.step, name))
                if ctx.step == "interest":
                    started.set()
                    await anyio.sleep(1)
            close.step(step, handler)
        return s

    old, new = build("old", STEPS[:2]), build("new", STEPS)
    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with anyio.create_task_group() as tg:
            i_old = await Instance(old).start(tg)
            slot = current_slot(old)
            await begin(old, slot)
            await started.wait()
            i_new = await Instance(new).start(tg)  # the new release starts meanwhile
            await wait_for(lambda: "before step 'publish' was added" in caplog.text,
                           timeout=10, what="the run seen ended with its old last step")
            await i_new.stop()
            await i_old.stop()
    assert (await statuses(new, slot))[2] is None
    assert ("publish", "new") not in ran


def _releases(store: Store, waits: dict[str, float], steps: dict[str, tuple[str, ...]],
              ran: list[tuple[str, str | None, int, list[str]]]) -> dict[str, Scheduler]:
    """One scheduler per release (its name: its steps of the hourly workflow ``close``);
    each step records (release, step, attempt, the results it was given), then waits
    ``waits["release/step"]`` seconds (if given; ``math.inf``: for ever)."""
    made = {}
    for name, names in steps.items():
        s = make(store, name)
        close = s.workflow("close", every="1h", offset=quiet_offset_now())
        for step in names:
            async def handler(ctx: RunContext, name: str = name) -> dict[str, str]:
                ran.append((name, ctx.step, ctx.attempt, sorted(ctx.results)))
                await anyio.sleep(waits.get(f"{name}/{ctx.step}", 0))
                return {"by": name}
            close.step(step, handler)
        made[name] = s
    return made


@pytest.mark.parametrize("old_first", [True, False], ids=["old-to-new", "new-to-old"])
async def test_a_step_taken_over_by_a_release_with_a_step_inserted_before_it_runs(
    store: Store, old_first: bool,
) -> None:
    """A rolling deploy inserts a step before the last one (or removes it) while a run is
    in flight: the release without it completed the first step, went on with the last
    one, and its instance dies in it. An instance of the other release takes the last
    step over and runs it, with the results its run has. It failed: that release's
    definition wanted a result of the middle step ("no longer in the store (its history
    was trimmed...)"), which the run never had, and the workflow run failed."""
    ran: list[tuple[str, str | None, int, list[str]]] = []
    # old-to-new: the new release inserts "interest"; new-to-old: it removed it.
    first, then = ("old", "new") if old_first else ("new", "old")
    releases = _releases(store, {f"{first}/publish": math.inf},
                         {first: (STEPS[0], STEPS[2]), then: STEPS}, ran)
    async with anyio.create_task_group() as tg:
        dying = await Instance(releases[first]).start(tg)
        slot = current_slot(releases[first])
        await begin(releases[first], slot)
        await wait_for(lambda: (first, "publish", 1, ["snapshot"]) in ran,
                       what="the last step started")
        backup = await Instance(releases[then]).start(tg)
        dying.crash()
        await wait_workflow(releases[first], slot, "completed")
        await backup.stop()
    assert ran[-1] == (then, "publish", 2, ["snapshot"])
    assert (await statuses(releases[then], slot))[1] is None  # interest: never run


async def test_a_step_taken_over_by_a_release_that_moved_a_step_before_it_is_not_run(
    store: Store) -> None:
    """A rolling deploy swaps the last two steps while the old release runs the middle
    one, and its instance dies: the new release has the old last step before it, which
    has not run for this run. The step is not run without it (it would then complete as
    the new release's last step, and the run complete without that step's effect,
    silently): the attempt fails, as before inserted steps were told from moved ones (the
    results name the definition's steps)."""
    ran: list[tuple[str, str | None, int, list[str]]] = []
    releases = _releases(store, {"old/interest": math.inf},
                         {"old": STEPS, "new": (STEPS[0], STEPS[2], STEPS[1])}, ran)
    old, new = releases["old"], releases["new"]
    async with anyio.create_task_group() as tg:
        dying = await Instance(old).start(tg)
        slot = current_slot(old)
        await begin(old, slot)
        await wait_for(lambda: ("old", "interest", 1, ["snapshot"]) in ran,
                       what="the middle step started")
        backup = await Instance(new).start(tg)
        dying.crash()
        await wait_workflow(new, slot, "failed")
        await backup.stop()
    assert [r for r in ran if r[0] == "new"] == []
    assert (await statuses(old, slot))[2] is None


@pytest.mark.parametrize("new_up", [False, True], ids=["new-starts-after", "new-backs-up"])
async def test_a_run_left_between_two_steps_by_the_old_release_goes_on_as_it_did(
    store: Store, new_up: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rolling deploy inserts a step between two while a run is in flight: the old
    release's instance completes the first step (its result names the old next step) and
    dies before it claims the next one. The new release, which starts then or backs the
    run up, goes on with the step the run named, as it did, and not with the inserted one.
    The run was left there: no step was claimed for it again, and it showed running for
    ever."""
    from lease_core.engine.steps import StepCoordinator

    ran: list[tuple[str, str | None, int, list[str]]] = []
    releases = _releases(store, {"old/snapshot": 1.0 if new_up else 0},
                         {"old": (STEPS[0], STEPS[2]), "new": STEPS}, ran)
    old, new = releases["old"], releases["new"]

    async def dies_first(self: StepCoordinator, job: Any, slot: int) -> None:
        if self._s.settings.instance_id == "new":
            await completed(self, job, slot)

    def sees_nothing(self: StepCoordinator, job: Any, slot: int, status: Any) -> None:
        # Nor does the old instance continue the run by another way, as its start-up
        # resume (it may read the run after the test's claim completed its first step).
        if self._s.settings.instance_id == "new":
            seen_finished(self, job, slot, status)

    async def resumes_nothing(self: StepCoordinator, *args: Any) -> None:
        if self._s.settings.instance_id == "new":
            await resume(self, *args)

    async def first_completed() -> bool:
        return (await statuses(old, slot))[0] is RunStatus.COMPLETED

    completed, seen_finished = StepCoordinator.completed, StepCoordinator.seen_finished
    resume = StepCoordinator.resume
    monkeypatch.setattr(StepCoordinator, "completed", dies_first)
    monkeypatch.setattr(StepCoordinator, "seen_finished", sees_nothing)
    monkeypatch.setattr(StepCoordinator, "resume", resumes_nothing)
    async with anyio.create_task_group() as tg:
        dying = await Instance(old).start(tg)
        slot = current_slot(old)
        await begin(old, slot)
        await wait_for(lambda: ("old", "snapshot", 1, []) in ran, what="the first step")
        if new_up:  # backs the first step up, and sees it completed
            backup = await Instance(new).start(tg)
            await wait_for(first_completed, what="the first step completed")
        dying.crash()
        if not new_up:
            await anyio.sleep(0.3)
            backup = await Instance(new).start(tg)
        await wait_workflow(old, slot, "completed")
        await backup.stop()
    assert ran == [("old", "snapshot", 1, []), ("new", "publish", 1, ["snapshot"])]
    assert (await statuses(new, slot))[1] is None


async def test_a_run_in_flight_in_a_step_a_deploy_removed_shows_that_step(
    store: Store) -> None:
    """A rolling deploy removes a step while an instance of the old release runs it for a
    run, and that instance dies: the new release cannot run the step, nor the run's
    later steps. The run's view (status API, recovery log) shows that step, open, with
    its attempts, and the run ended once the step's run is cancelled. They showed neither:
    the run "running" for ever with no step running, and a recovery log without the
    step (they read only the steps the new release registered)."""
    from lease_core._status import read_recovery_log as api_recovery_log
    from tests.test_operations import admin_for

    ran: list[tuple[str, str | None, int, list[str]]] = []
    releases = _releases(store, {"old/interest": math.inf},
                         {"old": STEPS, "new": (STEPS[0], STEPS[2])}, ran)
    old, new = releases["old"], releases["new"]
    admin = admin_for(store)
    async with anyio.create_task_group() as tg:
        dying = await Instance(old).start(tg)
        slot = current_slot(old)
        await begin(old, slot)
        await wait_for(lambda: ("old", "interest", 1, ["snapshot"]) in ran,
                       what="the step the deploy removes started")
        dying.crash()
        i = await Instance(new).start(tg)  # registers the workflow's two steps
        await i.stop()
    async with started(new.backend):
        run = await read_run(new.backend, "close", slot)
        log = await api_recovery_log(new.backend, "close", slot)
    assert run is not None
    assert [(x["name"], x["status"]) for x in run["steps"]] == [
        ("snapshot", "completed"), ("publish", "pending"), ("interest", "running")]
    assert log is not None
    assert [(e["step"], e["event"]) for e in log] == [
        ("snapshot", "started"), ("snapshot", "completed"), ("interest", "started")]
    assert [(e.step, e.event) for e in await new.recovery_log(("close", slot))] == [
        (e["step"], e["event"]) for e in log]
    await admin.cancel("close/interest", slot)
    async with started(new.backend):
        run = await read_run(new.backend, "close", slot)
        listed = await read_runs(new.backend, "close")
    assert run is not None and run["status"] == "cancelled", run
    assert listed is not None
    assert [([x["name"] for x in r["steps"]], r["status"]) for r in listed["runs"]
            if r["slot"] == slot] == [(["snapshot", "publish", "interest"], "cancelled")]


async def test_a_plain_job_named_under_a_workflow_is_no_removed_step_of_it(
        store: Store) -> None:
    """A plain job ``close/daily/report`` (another service's on the store; job names may
    have '/') is no step of workflow ``close`` a deploy removed: a step's name has no
    '/'. Its failed run at the workflow's slot showed as a step of the workflow's run,
    and the completed run as failed."""
    wf = make(store, "wf")
    close = wf.workflow("close", every="1h", offset=quiet_offset_now())
    close.step("snapshot", lambda ctx: 1)
    close.step("publish", lambda ctx: 2)
    other = make(store, "other")

    def report(ctx: RunContext) -> None:
        raise RuntimeError("the report's own failure")
    other.every("close/daily/report", "1h", report, offset=quiet_offset_now())
    async with anyio.create_task_group() as tg:
        a = await Instance(wf).start(tg)
        b = await Instance(other).start(tg)
        slot = current_slot(wf)
        await begin(wf, slot)
        await claim_now(other, "close/daily/report", slot)
        await wait_workflow(wf, slot, "completed")
        await wait_history(other, lambda h: any(a.finished_at for a in h),
                           job="close/daily/report", what="the report failed")
        await a.stop()
        await b.stop()
    async with started(wf.backend):
        run = await read_run(wf.backend, "close", slot)
        listed = await read_runs(wf.backend, "close")
    assert run is not None and listed is not None
    assert ([s["name"] for s in run["steps"]], run["status"]) == (
        ["snapshot", "publish"], "completed")
    assert [([s["name"] for s in r["steps"]], r["status"]) for r in listed["runs"]
            if r["slot"] == slot] == [(["snapshot", "publish"], "completed")]


async def test_a_missed_workflow_run_is_caught_up(store: Store) -> None:
    ran: list[tuple[int, str | None, Any]] = []
    late = make(store, "late")
    close = late.workflow("close", every="1s")
    close.step("snapshot", lambda ctx: ctx.slot)
    close.step("publish", lambda ctx: ran.append((ctx.slot, ctx.step, ctx.results["snapshot"])))
    # The store saw the workflow (an instance ran it), then no instance was up for two runs.
    seen = store.backend()
    await seen.start()
    try:
        infos = await seen.register_jobs([job.name for job in close.jobs])
        since = infos["close/snapshot"].first_seen_ms

        async def missed() -> bool:
            # ... and the latest missed run is well past (a run due within a heartbeat
            # counts as on time, not as caught up).
            now = await seen.now_ms()
            return now > since + 2_300 and 400 <= now % 1000 <= 600

        await wait_for(missed, timeout=10, what="two missed runs")
    finally:
        await seen.close()
    async with anyio.create_task_group() as tg:
        i = await Instance(late).start(tg)
        history = await wait_history(
            late, lambda h: any(x.reason == "catch-up" for x in h), job="close/snapshot")
        caught = next(x.slot for x in history if x.reason == "catch-up")
        await wait_for(lambda: any(r[0] == caught for r in ran), what="caught-up run done")
        await i.stop()
    assert caught > since + 1_000  # the latest missed run, not the oldest
    assert (caught, "publish", caught) in ran


# --------------------------------------------------------------------------- declarations


def test_bad_declarations_are_configuration_errors() -> None:
    from backends.memory import MemoryBackend

    s = Scheduler(MemoryBackend(), **FAST)
    with pytest.raises(ConfigurationError, match="exactly one of every"):
        s.workflow("w", every="1h", cron="0 2 * * *")
    with pytest.raises(ConfigurationError, match="exactly one of every"):
        s.workflow("w")
    with pytest.raises(ConfigurationError, match="'a/b'"):
        s.workflow("a/b", every="1h", offset=quiet_offset_now())
    # A time zone means nothing to an interval (its slots count from the epoch): it was
    # ignored, and the runs came at UTC's midnight, not Lisbon's.
    with pytest.raises(ConfigurationError, match="tz='Europe/Lisbon' needs cron="):
        s.workflow("w", every="24h", tz="Europe/Lisbon")
    w = s.workflow("w", cron="0 2 * * *", tz="Europe/Lisbon", max_attempts=3)
    assert isinstance(w, Workflow)
    with pytest.raises(ConfigurationError, match="already declared"):
        s.workflow("w", every="1h", offset=quiet_offset_now())
    w.step("one", lambda ctx: None)
    with pytest.raises(ConfigurationError, match="step 'one' is already declared"):
        w.step("one", lambda ctx: None)
    with pytest.raises(ConfigurationError, match="max_attempts=0"):
        w.step("two", lambda ctx: None, max_attempts=0)
    with pytest.raises(ConfigurationError, match="shorter than 3 heartbeats"):
        w.step("two", lambda ctx: None, lease="0.3s")
    assert w.steps == ["one"]
    # A job and a workflow of one name: operations and the status would reach only one.
    with pytest.raises(ConfigurationError, match="a workflow of that name is declared"):
        s.every("w", "1h", lambda ctx: None)
    with pytest.raises(ConfigurationError, match="a workflow of that name is declared"):
        s.every("w/extra", "1h", lambda ctx: None)  # named as its steps' jobs are
    s.every("j", "1h", lambda ctx: None)
    with pytest.raises(ConfigurationError, match="a job of that name is declared"):
        s.workflow("j", every="1h", offset=quiet_offset_now())
    s.workflow("empty", every="1h", offset=quiet_offset_now())
    with pytest.raises(ConfigurationError, match="'empty' has no steps"):
        anyio.run(s.start)


def test_a_workflow_named_as_a_declared_jobs_prefix_is_refused_naming_that_job() -> None:
    """``every("close/snapshot", ...)`` then ``workflow("close", ...)`` was refused with
    "workflow 'close' is already declared; workflow names must be unique", though no
    workflow of that name was: it names the job whose name clashes."""
    from backends.memory import MemoryBackend

    s = Scheduler(MemoryBackend(), **FAST)
    s.every("close/snapshot", "1h", lambda ctx: None)
    with pytest.raises(ConfigurationError) as info:
        s.workflow("close", every="1d")
    assert str(info.value) == (
        "workflow 'close': the job 'close/snapshot' is declared, named as this workflow's "
        "steps' jobs are ('close/<step>'); give the job or the workflow another name")
    assert list(s.jobs) == ["close/snapshot"] and not s.workflows


async def test_a_step_added_after_start_is_refused() -> None:
    from backends.memory import MemoryBackend

    s = Scheduler(MemoryBackend(), **FAST)
    w = s.workflow("w", every="1h", offset=quiet_offset_now())
    w.step("one", lambda ctx: None)
    async with s:
        with pytest.raises(ConfigurationError, match="after start"):
            w.step("two", lambda ctx: None)
        with pytest.raises(ConfigurationError, match="after start"):
            s.workflow("v", every="1h", offset=quiet_offset_now())


def test_run_ids() -> None:
    assert parse_run_id("close@1764468000000") == ("close", 1764468000000)
    assert parse_run_id("a@b@2025-11-30T02:00:00Z") == ("a@b", 1764468000000)
    assert parse_run_id(("close", "2025-11-30T02:00:00")) == ("close", 1764468000000)
    assert parse_run_id(("close", 5)) == ("close", 5)
    for bad in ("close", "close@yesterday", "@5", ("", 5)):
        with pytest.raises(ConfigurationError):
            parse_run_id(bad)  # type: ignore[arg-type]


def test_sync_scheduler_declares_workflows_and_reads_recovery_logs() -> None:
    from backends.memory import MemoryBackend
    from lease_core import SyncScheduler

    s = SyncScheduler(MemoryBackend(), instance_id="sync", **FAST)
    w = s.workflow("w", every="1h", offset=quiet_offset_now())
    w.step("one", lambda ctx: 41)
    w.step("two", lambda ctx: ctx.results["one"] + 1)
    with s:
        slot = current_slot(s.scheduler, "w")
        claim_now_sync(s, "w", slot)
        deadline = time.monotonic() + 10
        while len(s.recovery_log(("w", slot))) < 4:
            assert time.monotonic() < deadline, "workflow run did not complete"
            time.sleep(0.05)
        log = s.recovery_log(f"w@{slot}")
    assert [(e.step, e.event) for e in log] == [
        ("one", "started"), ("one", "completed"), ("two", "started"), ("two", "completed")]
    assert step_job("w", "two") in s.jobs


async def test_a_result_that_is_not_json_fails_the_step(store: Store) -> None:
    s = make(store, "a")
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    close.step("snapshot", lambda ctx: {1, 2})  # a set: not JSON
    close.step("interest", lambda ctx: None)
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = current_slot(s)
        await begin(s, slot)
        await wait_workflow(s, slot, "failed")
        await i.stop()
    (attempt,) = await s.history("close/snapshot")
    assert attempt.outcome == Outcome.FAILED
    assert attempt.error is not None and "not JSON-serialisable" in attempt.error
    assert await s.history("close/interest") == []


class Unrecorded(MemoryBackend):
    """A store that records no workflow (a backend of the contract's defaults): it trims
    a workflow's steps as plain jobs."""

    async def workflows(self) -> dict[str, list[str]]:
        return {}


@pytest.mark.parametrize("store_kind", [MemoryBackend, Unrecorded])
async def test_a_retry_waiting_while_history_is_trimmed_reads_the_earlier_results(
        store_kind: type[MemoryBackend]) -> None:
    """History trimmed by size and by age while a step's retry waits: the step before it
    ended longer ago than the ttl, but its workflow run goes on, so its result stays. A
    store that does not keep a run's steps together trims it, and the retry fails saying
    so (it used to read the result as None: in the bank-close, credit nothing)."""
    from lease_core import Retry

    backend = store_kind()
    s = Scheduler(backend, instance_id="a", **FAST)
    wf = s.workflow("wf", every="1h", offset=quiet_offset_now())
    seen: list[Any] = []
    wf.step("snapshot", lambda ctx: {"positions": [1, 2, 3]})

    @wf.step("interest", retry=Retry(retries=1, backoff="0.5s", jitter=0))
    async def interest(ctx: RunContext) -> None:
        seen.append((ctx.attempt, ctx.results))
        if ctx.attempt == 1:
            raise RuntimeError("ledger unavailable")

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slot = current_slot(s, "wf")
        await claim_now(s, "wf", slot)

        async def retrying() -> bool:
            runs = (await backend.check([("wf/interest", slot)])).runs
            return ("wf/interest", slot) in runs and \
                runs[("wf/interest", slot)].status is RunStatus.RETRYING

        await wait_for(retrying, what="interest's retry waiting")
        ended = await backend.now_ms()

        async def later() -> bool:  # every attempt ended is older than 0 ms
            return await backend.now_ms() > ended

        await wait_for(later, what="the store clock to move")
        # the waiting step's run is open, so its failed attempt stays on every store; a
        # store that does not keep a run's steps together trims the ended step's
        trimmed = 0 if store_kind is MemoryBackend else 1
        assert await backend.prune_many(["wf/snapshot", "wf/interest"], keep=0,
                                        older_than_ms=0) == {"wf/snapshot": trimmed,
                                                             "wf/interest": 0}
        history = await wait_history(s, lambda h: any(a.attempt == 2 and a.outcome for a in h),
                                     job="wf/interest", what="the retry")
        await i.stop()
    retry = history[0]
    if store_kind is MemoryBackend:
        assert (retry.attempt, retry.outcome, retry.error) == (2, Outcome.COMPLETED, None)
        assert seen == [(n, {"snapshot": {"positions": [1, 2, 3]}}) for n in (1, 2)]
    else:
        assert (retry.attempt, retry.outcome) == (2, Outcome.FAILED)
        assert retry.error is not None and "'snapshot'" in retry.error
        assert "no longer in the store" in retry.error
        assert seen == [(1, {"snapshot": {"positions": [1, 2, 3]}})]


async def test_a_refused_step_completed_by_another_attempt_is_not_reported_completed() -> None:
    """The attempt opened a completing transaction, which failed; frozen past its lease,
    its run was taken over and completed by a backup. The store refuses its end: it lost
    the run (it was reported Completed, and went on to claim the next step)."""
    import uuid

    from lease_core import MemoryBackend

    now = [time.time()]
    backend = MemoryBackend(clock=lambda: now[0])
    s = Scheduler(backend, instance_id="a", lease="30s", heartbeat="5s")
    wf = s.workflow("wf", every="1h", offset=quiet_offset_now())
    ran: list[str] = []

    @wf.step("one")
    async def one(ctx: RunContext) -> None:
        with pytest.raises(ConfigurationError):  # no fenced transactions on this store
            async with ctx.transaction():
                pass
        now[0] += 120  # frozen past its lease: a backup takes the run over, completes it
        token = uuid.uuid4().hex
        (won,) = await backend.claim_many([ClaimRequest("wf/one", ctx.slot, "b", token,
                                                        30_000)])
        assert (won.status, won.attempt) == ("won", 2)
        assert await backend.finish(Lease("wf/one", ctx.slot, token, 30_000),
                                    Outcome.COMPLETED)
        ran.append("one")

    @wf.step("two")
    async def two(ctx: RunContext) -> None:
        ran.append("two by a")

    events: list[tuple[str, str, int]] = []
    s.subscribe(lambda e: events.append((type(e).__name__, getattr(e, "job", ""),
                                         getattr(e, "attempt", 0))))
    async with s:
        slot = s.workflows["wf"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "wf", slot)
        await wait_for(lambda: any(k == "Lost" for k, _, _ in events), what="its end")
    assert ran == ["one"]
    assert [(k, a) for k, job, a in events if job == "wf/one" and k != "Claimed"] == [
        ("Lost", 1)]
