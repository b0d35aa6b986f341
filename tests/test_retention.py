"""History trimmed by the ticker: one instance per period, every job in the store.

Runs on every store (the scheduler tests on the stores with ``scenarios=True``): history
is written straight through the backend, then schedulers with short periods trim it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

import lease_core.engine.base
from lease_core import (
    BackendUnavailable,
    ConfigurationError,
    Event,
    HistoryTrimmed,
    Lost,
    MemoryBackend,
    RunContext,
    Scheduler,
    SchedulerState,
    StoreUnreachable,
)
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, Outcome, RunStatus
from lease_core.abc import Backend
from lease_core.engine.base import PRUNE_JOBS
from lease_core.testing import claim_now
from tests.helpers import quiet_offset_now, wait_for
from tests.stores import Store

pytestmark = pytest.mark.anyio

SLOT = 1_700_000_000_000
FAST: dict[str, Any] = {"lease": "1.2s", "heartbeat": "0.2s"}


def req(job: str, slot: int, lease_ms: int = 60_000, **options: Any) -> ClaimRequest:
    """A claim of (job, slot) with a token of its own (runs may overlap by default)."""
    options.setdefault("overlap_skip", False)
    options.setdefault("history_size", 1_000_000)
    return ClaimRequest(job, slot, "writer", uuid.uuid4().hex, lease_ms, **options)


async def finished_runs(backend: Backend, job: str, slots: range) -> None:
    """Record one completed attempt for each slot of ``job``."""
    for slot in slots:
        r = req(job, slot)
        assert (await backend.claim(r)).status is ClaimStatus.WON
        assert await backend.finish(Lease(job, slot, r.token, r.lease_ms), Outcome.COMPLETED)


@asynccontextmanager
async def started(backend: Backend) -> AsyncIterator[Backend]:
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


class Recorder:
    """An async subscriber that keeps every event."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


# -- the scheduler's trimming --------------------------------------------------------------


async def test_an_undeclared_job_is_trimmed_by_the_ticker(store: Store) -> None:
    async with started(store.backend()) as writer:
        await finished_runs(writer, "gone", range(SLOT, SLOT + 6))
        s = Scheduler(store.backend(), instance_id="a", history_size=2, prune_every="0.3s",
                      **FAST)
        seen = Recorder()
        s.subscribe(seen)
        async with s:
            await wait_for(lambda: seen.of(HistoryTrimmed), what="the trimming")
        history = await writer.history("gone")
        assert [a.slot for a in history] == [SLOT + 5, SLOT + 4]
        assert sorted(r.slot for r in await writer.runs("gone")) == [SLOT + 4, SLOT + 5]
        assert "gone" in await writer.jobs()
    [event] = seen.of(HistoryTrimmed)
    assert (event.instance_id, event.attempts, event.jobs, event.complete) == (
        "a", 4, ("gone",), True)


async def test_one_scheduler_of_many_trims_per_period(store: Store) -> None:
    async with started(store.backend()) as writer:
        await finished_runs(writer, "old", range(SLOT, SLOT + 5))
        answers: dict[str, list[bool]] = {}
        seen: dict[str, Recorder] = {}
        schedulers = []
        for name in ("a", "b", "c"):
            backend = store.backend()  # the memory store's is one object
            if "maintenance_due" not in vars(backend):
                ask = backend.maintenance_due

                async def recorded(instance_id: str, every_ms: int, ask: Any = ask) -> bool:
                    found: bool = await ask(instance_id, every_ms)
                    answers.setdefault(instance_id, []).append(found)
                    return found

                backend.maintenance_due = recorded  # type: ignore[method-assign]
            s = Scheduler(backend, instance_id=name, history_size=1, prune_every="1h", **FAST)
            seen[name] = Recorder()
            s.subscribe(seen[name])
            schedulers.append(s)
        for s in schedulers:
            await s.start()
        try:
            await wait_for(lambda: len(answers) == 3, what="every instance asking")
            await wait_for(lambda: any(r.of(HistoryTrimmed) for r in seen.values()),
                           what="the trimming")
        finally:
            for s in schedulers:
                await s.stop(grace=0)
        assert sorted(answers) == ["a", "b", "c"]
        assert sorted(found for found_list in answers.values() for found in found_list) == [
            False, False, True]
        winner = next(name for name, found in answers.items() if found == [True])
        assert [name for name, r in seen.items() if r.of(HistoryTrimmed)] == [winner]
        assert [a.slot for a in await writer.history("old")] == [SLOT + 4]


async def test_history_ttl_is_honoured_without_new_claims(store: Store) -> None:
    async with started(store.backend()) as writer:
        await finished_runs(writer, "ttl", range(SLOT, SLOT + 3))
        open_run = req("ttl", SLOT + 3)
        assert (await writer.claim(open_run)).status is ClaimStatus.WON
        s = Scheduler(store.backend(), instance_id="a", history_ttl="0.5s",
                      prune_every="0.3s", **FAST)
        async with s:
            async def only_the_open_attempt() -> bool:
                return [a.slot for a in await writer.history("ttl")] == [SLOT + 3]

            await wait_for(only_the_open_attempt, what="finished attempts past the ttl trimmed")
        runs = await writer.runs("ttl")
        assert [(r.slot, r.status) for r in runs] == [(SLOT + 3, RunStatus.RUNNING)]
        assert await writer.finish(Lease("ttl", SLOT + 3, open_run.token, 60_000),
                                   Outcome.COMPLETED)


async def test_trimming_keeps_running_runs_and_the_newest_attempts(store: Store) -> None:
    async with started(store.backend()) as writer:
        first = req("keep", SLOT)
        assert (await writer.claim(first)).status is ClaimStatus.WON  # held throughout
        await finished_runs(writer, "keep", range(SLOT + 1, SLOT + 8))
        s = Scheduler(store.backend(), instance_id="a", history_size=3, prune_every="0.3s",
                      **FAST)
        seen = Recorder()
        s.subscribe(seen)
        async with s:
            await wait_for(lambda: seen.of(HistoryTrimmed), what="the trimming")
        # the newest three, and the running run's attempt (never trimmed while it runs)
        assert [a.slot for a in await writer.history("keep")] == [
            SLOT + 7, SLOT + 6, SLOT + 5, SLOT]
        assert [r.slot for r in await writer.runs("keep", open_only=True)] == [SLOT]
        lease = Lease("keep", SLOT, first.token, first.lease_ms)
        assert (await writer.heartbeat([lease])).held == {first.token}
        assert await writer.finish(lease, Outcome.COMPLETED)


async def test_an_open_run_s_ended_attempts_are_kept_by_size_and_by_age(
    store: Store,
) -> None:
    """A run waiting for a retry, or handed over, is open: the attempts it has ended (its
    recovery log: the failure the retry follows) are kept, by size and by age, until the
    run ends; then they are trimmed like any other."""
    async with started(store.backend()) as b:
        failed = req("open", SLOT)
        assert (await b.claim(failed)).status is ClaimStatus.WON
        assert await b.retry_later([(Lease("open", SLOT, failed.token, failed.lease_ms),
                                     Outcome.FAILED, "boom", [0])]) == [True]
        await finished_runs(b, "open", range(SLOT + 1, SLOT + 4))
        assert await b.prune("open", keep=0, older_than_ms=0) == 3
        assert [(a.slot, a.error) for a in await b.history("open")] == [(SLOT, "boom")]
        again = req("open", SLOT)
        won = await b.claim(again)
        assert (won.status, won.attempt) == (ClaimStatus.WON, 2)
        assert await b.finish(Lease("open", SLOT, again.token, again.lease_ms),
                              Outcome.COMPLETED)
        assert sorted(a.attempt for a in await b.history("open")) == [1, 2]
        assert await b.prune("open", keep=0) == 2
        assert await b.history("open") == []


async def test_a_hand_over_nobody_declares_is_kept_until_cancelled(store: Store) -> None:
    """A run handed over of a job no instance declares any more (a deploy removed it) is
    never claimed: open, its attempt is kept; cancelled by an operator, it has ended and
    is trimmed like any other (the operating guide says so)."""
    from lease_core import Admin

    async with started(store.backend()) as b:
        held = req("removed", SLOT)
        assert (await b.claim(held)).status is ClaimStatus.WON
        await b.hand_over([Lease("removed", SLOT, held.token, held.lease_ms)])
        await finished_runs(b, "removed", range(SLOT + 1, SLOT + 3))
        assert await b.prune("removed", keep=0, older_than_ms=0) == 2
        assert [a.slot for a in await b.history("removed")] == [SLOT]
        await Admin(b).cancel("removed", SLOT, grace=0)
        assert (await b.runs("removed"))[0].status is RunStatus.CANCELLED
        ended = await b.history("removed")  # the handed-over attempt and the cancel's
        assert {a.slot for a in ended} == {SLOT} and len(ended) == 2, ended
        assert await b.prune("removed", keep=0) == 2
        assert await b.history("removed") == []


async def test_renewals_go_on_while_a_large_trimming_runs(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_core.engine.base, "PRUNE_BATCH", 10)
    count = 600
    async with started(store.backend()) as writer:
        # a running run, then `count` later runs recorded as skipped behind it
        assert (await writer.claim(req("bulk", SLOT))).status is ClaimStatus.WON
        for start in range(SLOT + 1, SLOT + 1 + count, 200):
            results = await writer.claim_many([
                req("bulk", slot, overlap_skip=True)
                for slot in range(start, min(start + 200, SLOT + 1 + count))])
            assert {r.status for r in results} == {ClaimStatus.SKIPPED}
        backend = store.backend()
        # The first batch waits until the test has seen the held lease renewed twice: a
        # slow store, while the trimming is in progress.
        in_prune, go_on = anyio.Event(), anyio.Event()
        prune_many = backend.prune_many

        async def slow_prune(jobs: list[str], **options: Any) -> dict[str, int]:
            in_prune.set()
            await go_on.wait()
            found: dict[str, int] = await prune_many(jobs, **options)
            return found

        backend.prune_many = slow_prune  # type: ignore[method-assign]
        s = Scheduler(backend, instance_id="a", history_size=1, prune_every="1h", **FAST)
        seen = Recorder()
        s.subscribe(seen)
        release = anyio.Event()
        attempts: list[int] = []

        @s.every("held", "1h", catch_up="none", offset=quiet_offset_now())
        async def held(ctx: RunContext) -> None:
            attempts.append(ctx.attempt)
            await release.wait()

        async with s:
            slot = s.jobs["held"].schedule.previous_at_or_before(s.store_now_ms())
            assert slot is not None
            await claim_now(s, "held", slot)
            with anyio.fail_after(30):
                await in_prune.wait()
            expiries: list[int] = []

            async def renewed_twice() -> bool:
                expiry = (await writer.check([("held", slot)])).runs[("held", slot)].expires_ms
                if expiry is not None and (not expiries or expiry > expiries[-1]):
                    expiries.append(expiry)
                return len(expiries) >= 3

            await wait_for(renewed_twice, what="renewals while the trimming waits")
            go_on.set()
            await wait_for(lambda: seen.of(HistoryTrimmed), timeout=60, what="the trimming")
            release.set()
            await wait_for(lambda: not s.running, what="the handler's end")
        assert attempts == [1]
        assert not seen.of(Lost)
        [event] = seen.of(HistoryTrimmed)
        # all but the newest, and but the running run's attempt
        assert (event.attempts, event.complete) == (count - 1, True)
        assert [a.slot for a in await writer.history("bulk")] == [SLOT + count, SLOT]
        history = await writer.history("held")
        assert [(a.attempt, a.outcome) for a in history] == [(1, Outcome.COMPLETED)]


async def test_a_workflow_run_s_steps_are_trimmed_only_once_the_run_has_ended(
        store: Store) -> None:
    """A step's result stays while its workflow run goes on, however long ago the step
    ended (a later step reads it); once the run has ended, its steps go together, by age
    ``history_ttl`` after its last step ended."""
    ttl, steps = 300, ["wf/one", "wf/two"]
    async with started(store.backend()) as b:
        await b.register_workflows({"wf": ["one", "two"]})
        for job in steps:  # a run that ended an hour earlier
            await finished_runs(b, job, range(SLOT - 3_600_000, SLOT - 3_600_000 + 1))
        await finished_runs(b, "solo", range(SLOT, SLOT + 1))
        one, two = req("wf/one", SLOT), req("wf/two", SLOT)
        assert (await b.claim(one)).status is ClaimStatus.WON
        assert await b.set_checkpoint(Lease("wf/one", SLOT, one.token, 60_000),
                                      {"result": 7})
        assert await b.finish(Lease("wf/one", SLOT, one.token, 60_000), Outcome.COMPLETED)
        assert (await b.claim(two)).status is ClaimStatus.WON  # the run goes on
        one_ended = await b.now_ms()
        await wait_for(lambda: later(b, one_ended), what="the store clock to move")
        assert await b.prune_many([*steps, "solo"], older_than_ms=0) == {
            "wf/one": 1, "wf/two": 1, "solo": 1}  # the ended run's, not the open one's
        assert await b.prune_many(steps, keep=0) == {"wf/one": 0, "wf/two": 0}
        assert await b.get_checkpoint("wf/one", SLOT) == {"result": 7}
        await wait_for(lambda: later(b, one_ended + ttl), what="the ttl to pass")
        assert await b.finish(Lease("wf/two", SLOT, two.token, 60_000), Outcome.COMPLETED)
        # ended just now: the ttl counts from its last step's end, not from step one's
        assert await b.prune_many(steps, older_than_ms=ttl) == {"wf/one": 0, "wf/two": 0}
        two_ended = await b.now_ms()
        await wait_for(lambda: later(b, two_ended), what="the store clock to move")
        assert await b.prune_many(steps, older_than_ms=0) == {"wf/one": 1, "wf/two": 1}
        assert await b.runs("wf/one") == await b.runs("wf/two") == []


async def test_history_size_trims_a_workflow_run_that_ended_within_history_ttl(
        store: Store) -> None:
    """By size, a workflow run's steps are kept only while the run goes on: a run that
    ended less than ``history_ttl`` ago is trimmed beyond the newest ``history_size`` as
    any other (Redis kept every run that ended within the ttl, however many)."""
    steps = ["wf/one", "wf/two"]
    async with started(store.backend()) as b:
        await b.register_workflows({"wf": ["one", "two"]})
        for job in steps:
            await finished_runs(b, job, range(SLOT, SLOT + 5))
        assert await b.prune_many(steps, keep=2, older_than_ms=3_600_000) == {
            "wf/one": 3, "wf/two": 3}
        assert [a.slot for a in await b.history("wf/one")] == [SLOT + 4, SLOT + 3]


async def later(backend: Backend, ms: int) -> bool:
    """Whether the store's clock is past ``ms``."""
    return await backend.now_ms() > ms


class PruneFailsTwice(MemoryBackend):
    """A memory store whose first two trimming calls fail as an unreachable store would."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 2

    async def prune_many(self, jobs: Any, **options: Any) -> dict[str, int]:
        if self.failures:
            self.failures -= 1
            raise BackendUnavailable("store unreachable (test)")
        return await super().prune_many(jobs, **options)


async def test_a_failed_trimming_is_reported_and_tried_again() -> None:
    backend = PruneFailsTwice()
    await backend.start()
    await finished_runs(backend, "old", range(SLOT, SLOT + 3))
    s = Scheduler(backend, instance_id="a", history_size=1, prune_every="0.2s", **FAST)
    seen = Recorder()
    s.subscribe(seen)
    async with s:
        await wait_for(lambda: seen.of(HistoryTrimmed), what="a trimming that succeeds")
        assert s.state is SchedulerState.RUNNING
    assert backend.failures == 0
    assert [e.error.args for e in seen.of(StoreUnreachable)][:1] == [
        ("store unreachable (test)",)]
    assert [a.slot for a in await backend.history("old")] == [SLOT + 2]


class PruneFailsSecond(MemoryBackend):
    """A memory store whose second trimming call fails as an unreachable store would."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def prune_many(self, jobs: Any, **options: Any) -> dict[str, int]:
        self.calls += 1
        if self.calls == 2:
            raise BackendUnavailable("store unreachable (test)")
        return await super().prune_many(jobs, **options)


async def test_what_a_trimming_deleted_before_it_failed_is_reported() -> None:
    """A trimming period whose second call fails (or that the period's deadline cuts
    short) reported nothing of what its first call deleted: no ``HistoryTrimmed``, no
    log line. It reports them, not complete; the next period trims the rest."""
    backend = PruneFailsSecond()
    await backend.start()
    jobs = [f"job{i:03}" for i in range(PRUNE_JOBS + 1)]
    for job in jobs:
        await finished_runs(backend, job, range(SLOT, SLOT + 3))
    s = Scheduler(backend, instance_id="a", history_size=1, prune_every="0.2s", **FAST)
    seen = Recorder()
    s.subscribe(seen)
    async with s:
        await wait_for(lambda: len(seen.of(HistoryTrimmed)) == 2, what="two trimmings")
    first, second = seen.of(HistoryTrimmed)
    assert (first.attempts, first.complete, first.jobs) == (
        2 * PRUNE_JOBS, False, tuple(jobs[:PRUNE_JOBS]))
    assert (second.attempts, second.complete, second.jobs) == (2, True, (jobs[-1],))
    assert [e.error.args for e in seen.of(StoreUnreachable)][:1] == [
        ("store unreachable (test)",)]


def test_prune_every_is_validated() -> None:
    with pytest.raises(ConfigurationError, match="prune_every='0s'"):
        Scheduler(MemoryBackend(), prune_every="0s")
    with pytest.raises(ConfigurationError, match="prune_every='soon'"):
        Scheduler(MemoryBackend(), prune_every="soon")
    assert Scheduler(MemoryBackend(), prune_every=None).prune_every is None
    assert Scheduler(MemoryBackend()).prune_every == 60.0
