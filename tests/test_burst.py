"""Many jobs due at the same instant: each scheduler sends its claims in one batch.

The store behind every scheduler is real; its ``claim`` and ``claim_many`` are counted
through a wrapper around the backend's own methods, which still do the work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from lease_core import Outcome, RunContext, Scheduler
from lease_core._batch import ClaimAbandoned, ClaimBatcher
from lease_core.abc import Backend, ClaimRequest, ClaimStatus
from lease_core.errors import BackendUnavailable
from tests.helpers import Instance, stop_all, store_now_ms, wait_for, wait_history
from tests.stores import Store

pytestmark = pytest.mark.anyio

JOBS = 50
INSTANCES = 3
#: How far ahead of the store's clock the shared slot is put: time to start 3 schedulers.
LEAD_MS = 2500


class Calls:
    """Counts the claim calls a scheduler makes on its backend (the real one answers)."""

    def __init__(self, backend: Backend, *, fail_first: int = 0) -> None:
        self.batches: list[int] = []
        self.single = 0
        self.fail_first = fail_first
        self._inside: set[int] = set()  # tasks inside a counted claim or claim_many
        claim_many: Callable[[Any], Awaitable[Any]] = backend.claim_many
        claim: Callable[[Any], Awaitable[Any]] = backend.claim

        async def counted_many(requests: Any) -> Any:
            # A backend's claim and claim_many may call each other (in the same task):
            # only the outer call counts.
            task = anyio.get_current_task().id
            if task in self._inside:
                return await claim_many(requests)
            self.batches.append(len(requests))
            if self.fail_first:
                self.fail_first -= 1
                raise BackendUnavailable("the store is down (injected by the test)")
            self._inside.add(task)
            try:
                return await claim_many(requests)
            finally:
                self._inside.discard(task)

        async def counted_one(request: Any) -> Any:
            # A lone claim sent while another batch is in flight counts.
            task = anyio.get_current_task().id
            if task in self._inside:
                return await claim(request)
            self.single += 1
            self._inside.add(task)
            try:
                return await claim(request)
            finally:
                self._inside.discard(task)

        backend.claim_many = counted_many  # type: ignore[method-assign]
        backend.claim = counted_one  # type: ignore[method-assign]

        # Finishes: the size of each finish_many call, and lone finish() calls.
        self.finish_batches: list[int] = []
        self._finishing: set[int] = set()
        finish_many: Callable[[Any], Awaitable[Any]] = backend.finish_many
        finish: Callable[..., Awaitable[Any]] = backend.finish

        async def counted_finish_many(items: Any) -> Any:
            return await counted(finish_many, len(items), items)

        async def counted_finish(*args: Any) -> Any:
            return await counted(finish, 1, *args)

        async def counted(call: Callable[..., Awaitable[Any]], size: int, *args: Any) -> Any:
            # One of finish() and finish_many() may call the other (in the same task).
            task = anyio.get_current_task().id
            if task in self._finishing:
                return await call(*args)
            self.finish_batches.append(size)
            self._finishing.add(task)
            try:
                return await call(*args)
            finally:
                self._finishing.discard(task)

        backend.finish_many = counted_finish_many  # type: ignore[method-assign]
        backend.finish = counted_finish  # type: ignore[method-assign]


async def _burst(store: Store, **options: Any) -> tuple[list[Scheduler], list[Calls], int,
                                                        list[tuple[str, int]]]:
    now = await store_now_ms(store.backend())
    slot = now + LEAD_MS
    ran: list[tuple[str, int]] = []

    async def handler(ctx: RunContext) -> None:
        ran.append((ctx.job, ctx.slot))

    schedulers, calls = [], []
    counted: dict[int, Calls] = {}  # the memory store shares one backend object
    fail_first = options.pop("fail_first", 0)
    for i in range(INSTANCES):
        backend = store.backend()
        if id(backend) not in counted:
            counted[id(backend)] = Calls(backend, fail_first=fail_first if i == 0 else 0)
            calls.append(counted[id(backend)])
        s = Scheduler(backend, instance_id=f"i{i}", **options)
        for j in range(JOBS):
            s.every(f"burst-{j}", "1h", handler, offset=(slot % 3_600_000) / 1000)
        schedulers.append(s)
    return schedulers, calls, slot, ran


async def test_a_burst_is_claimed_in_one_batch_per_scheduler_and_run_once(
    store: Store,
) -> None:
    schedulers, calls, slot, ran = await _burst(store)
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in schedulers]
        assert schedulers[0].store_now_ms() < slot, "the schedulers started too slowly"
        await wait_for(lambda: len(ran) >= JOBS, timeout=30, what="every job's run")
        history = await wait_history(
            schedulers[0], lambda h: sum(a.outcome is Outcome.COMPLETED for a in h) >= JOBS,
            timeout=15, what="every run completed")
        await stop_all(instances)
    assert Counter(ran) == {(f"burst-{j}", slot): 1 for j in range(JOBS)}
    completed = Counter(a.job for a in history if a.outcome is Outcome.COMPLETED)
    assert completed == {f"burst-{j}": 1 for j in range(JOBS)}
    # At most one claim per job and instance, all sent in one claim_many call per
    # scheduler: the scheduler wakes the jobs due at an instant together. (Schedulers
    # started together learn each other at their first renewal, half a lease later:
    # until then each ranks the members it saw at start, so the burst costs between JOBS
    # and JOBS x INSTANCES claims; test_fleet measures the claims once the members know
    # each other.)
    # (The memory store's schedulers share one backend, counted once.)
    batches = [n for c in calls for n in c.batches]
    assert 1 <= len(batches) <= INSTANCES, [(c.batches, c.single) for c in calls]
    assert JOBS <= sum(batches) <= JOBS * INSTANCES, batches
    assert sum(c.single for c in calls) == 0
    # The handlers, all quick, end together: their finishes share finish_many calls.
    finishes = [n for c in calls for n in c.finish_batches]
    assert sum(finishes) == JOBS
    assert len(finishes) <= JOBS // 4, finishes


async def test_a_failed_batch_fails_each_claim_and_they_are_retried_together(
    store: Store,
) -> None:
    schedulers, calls, slot, ran = await _burst(
        store, lease="1.2s", heartbeat="0.2s", fail_first=1)
    schedulers = schedulers[:1]  # one instance: the retries are its own
    async with anyio.create_task_group() as tg:
        instance = await Instance(schedulers[0]).start(tg)
        await wait_for(lambda: len(ran) >= JOBS, timeout=30, what="every job's run")
        await wait_history(
            schedulers[0],
            lambda h: sum(a.outcome is Outcome.COMPLETED for a in h) >= JOBS,
            timeout=15, what="every run completed")
        await instance.stop()
    assert Counter(ran) == {(f"burst-{j}", slot): 1 for j in range(JOBS)}
    # The failed batch, then the retries of its claims (together, at the next tick), and
    # nothing claimed one at a time.
    batches = calls[0].batches
    assert batches[0] > 1 and sum(batches) == JOBS + batches[0], batches
    assert len(batches) <= 4, batches
    assert calls[0].single == 0


async def test_the_counter_counts_each_call_once_on_every_store(store: Store) -> None:
    # Some backends' claim() calls their claim_many() (Redis); the counter must count such
    # a lone claim once, or the burst test above sees a phantom claim when a late job loop
    # sends one.
    backend = store.backend()
    calls = Calls(backend)
    await backend.start()
    try:
        now = await store_now_ms(backend)
        await backend.claim(_request("counted-lone", now))
        await backend.claim_many([_request("counted-a", now), _request("counted-b", now)])
    finally:
        await backend.close()
    assert (calls.single, calls.batches) == (1, [2])


# --- the batcher alone, on the memory store -------------------------------------------------


def _request(job: str, slot: int = 1, token: str | None = None) -> ClaimRequest:
    return ClaimRequest(job, slot, "i", token or f"t-{job}-{slot}", 60_000)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_concurrent_claims_of_one_instant_share_one_call() -> None:
    from backends.memory import MemoryBackend

    backend = MemoryBackend()
    await backend.start()
    calls = Calls(backend)
    batcher = ClaimBatcher(backend)
    results: dict[str, Any] = {}

    async def claim(job: str) -> None:
        (results[job],) = await batcher.claim_many([_request(job)])

    async with anyio.create_task_group() as tg:
        for j in range(30):
            tg.start_soon(claim, f"j{j}")
    assert calls.batches == [30]
    assert all(results[f"j{j}"].status is ClaimStatus.WON for j in range(30))
    assert all(results[f"j{j}"].job == f"j{j}" for j in range(30))


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_large_batch_goes_in_ordered_chunks() -> None:
    from backends.memory import MemoryBackend

    backend = MemoryBackend()
    await backend.start()
    calls = Calls(backend)
    batcher = ClaimBatcher(backend, limit=10)
    # Two claims of the same run in one batch: the second sees what the first wrote.
    requests = [_request(f"j{j}") for j in range(24)] + [_request("j0", token="again")]
    results = await batcher.claim_many(requests)
    assert calls.batches == [10, 10, 5]
    assert [r.job for r in results if not isinstance(r, Exception)] == [
        r.job for r in requests]
    statuses = [r.status for r in results if not isinstance(r, Exception)]
    assert statuses == [ClaimStatus.WON] * 24 + [ClaimStatus.RUNNING]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_failed_chunk_fails_only_its_claims_and_a_cancelled_sender_abandons_them(
) -> None:
    from backends.memory import MemoryBackend

    backend = MemoryBackend()
    await backend.start()
    calls = Calls(backend, fail_first=1)
    batcher = ClaimBatcher(backend, limit=3)
    results = await batcher.claim_many([_request(f"j{j}") for j in range(5)])
    assert calls.batches == [3, 2]
    assert all(isinstance(r, BackendUnavailable) for r in results[:3])
    assert [getattr(r, "status", None) for r in results[3:]] == [ClaimStatus.WON] * 2

    # Two claims woken at the same instant share a batch; its sender (the first to run)
    # is cancelled while the store hangs: the other claim learns its outcome is unknown.
    sender: list[Any] = []

    async def hang(requests: Any) -> Any:
        sender.append(anyio.get_current_task().id)
        await anyio.sleep_forever()

    backend.claim_many = hang  # type: ignore[method-assign]
    go = anyio.Event()
    scopes: dict[Any, anyio.CancelScope] = {}
    answers: dict[str, Any] = {}

    async def claim(job: str) -> None:
        with anyio.CancelScope() as scope:
            scopes[anyio.get_current_task().id] = scope
            await go.wait()
            answers[job] = await batcher.claim_many([_request(job)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(claim, "a")
        tg.start_soon(claim, "b")
        await anyio.wait_all_tasks_blocked()
        go.set()
        await anyio.wait_all_tasks_blocked()
        assert len(sender) == 1
        scopes[sender[0]].cancel()
    assert len(answers) == 1
    (answer,) = answers.values()
    assert len(answer) == 1 and isinstance(answer[0], ClaimAbandoned)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_tasks_of_a_scheduler_do_not_grow_with_its_jobs() -> None:
    # One task wakes the jobs due at each instant: a scheduler with 300 jobs runs about
    # as many tasks as one with 3 (a task per job used to wake each once per heartbeat).
    from backends.memory import MemoryBackend

    async def handler(ctx: RunContext) -> None:
        pass

    counts = []
    for jobs in (3, 300):
        s = Scheduler(MemoryBackend(), instance_id="i", heartbeat="0.2s", lease="1s")
        for j in range(jobs):
            s.every(f"idle-{j}", "1h", handler, offset=f"{j}s")
        before = len(anyio.get_running_tasks())
        async with anyio.create_task_group() as tg:
            instance = await Instance(s).start(tg)
            counts.append(len(anyio.get_running_tasks()) - before)
            await instance.stop()
    assert counts[1] == counts[0] < 20, counts
