"""The memory backend with an injected clock: lease arithmetic without waiting."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import anyio
import pytest

from lease_core import (
    ConfigurationError,
    MemoryBackend,
    Outcome,
    Reason,
    RunContext,
    RunStatus,
    Scheduler,
)
from lease_core.abc import Backend, ClaimRequest, ClaimStatus, Lease
from lease_core.testing import claim_now
from tests.helpers import (
    HOUR_MS,
    Instance,
    quiet_cron,
    quiet_offset,
    quiet_offset_now,
    wait_for,
    wait_history,
)

pytestmark = pytest.mark.anyio


class FakeClock:
    """A store clock that only moves when told to."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def request(token: str, **kw: object) -> ClaimRequest:
    return ClaimRequest("job", 1000, f"i-{token}", token, 30_000, **kw)  # type: ignore[arg-type]


async def test_expiry_follows_the_injected_clock_exactly() -> None:
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    await backend.start()
    assert (await backend.claim(request("t1"))).status is ClaimStatus.WON
    clock.advance(29.999)
    assert (await backend.claim(request("t2"))).status is ClaimStatus.RUNNING
    beat = await backend.heartbeat([Lease("job", 1000, "t1", 30_000)])
    assert beat.held == {"t1"} and beat.now_ms == int(clock.now * 1000)
    clock.advance(29.999)
    assert (await backend.claim(request("t2"))).status is ClaimStatus.RUNNING
    clock.advance(0.001)
    took = await backend.claim(request("t2"))
    assert (took.status, took.attempt, took.reason) == (ClaimStatus.WON, 2, Reason.TAKEOVER)


async def test_history_ttl_with_an_injected_clock() -> None:
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    await backend.start()
    for i in range(3):
        r = ClaimRequest("j", i, "a", f"t{i}", 1000, history_ttl_ms=60_000)
        await backend.claim(r)
        await backend.finish(Lease("j", i, f"t{i}", 1000), Outcome.COMPLETED)
        clock.advance(50)
    # t0 finished 150 s ago, t1 100 s ago, t2 50 s ago: only t2 survives the trimming.
    await backend.claim(ClaimRequest("j", 9, "a", "t9", 1000, history_ttl_ms=60_000))
    assert len(await backend.history("j")) == 4  # a claim trims nothing
    assert await backend.prune("j", older_than_ms=60_000) == 2
    assert [h.slot for h in await backend.history("j")] == [9, 2]


async def test_scheduler_follows_the_store_clock_not_the_local_one() -> None:
    """A store clock ten days ahead of this machine: slots are the store's slots."""
    offset = 10 * 86_400.0
    backend = MemoryBackend(clock=lambda: time.time() + offset)
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    s.every("far", "1s", lambda ctx: None)

    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        history = await wait_history(s, lambda h: h and h[0].outcome, job="far")
        await i.stop()
    slot = history[0].slot
    assert slot / 1000 > time.time() + offset - 30
    assert history[0].claimed_at.timestamp() >= slot / 1000


def test_schedulers_on_two_event_loops_share_one_memory_backend() -> None:
    """One process, two threads, asyncio and trio: each slot still runs once."""
    backend = MemoryBackend()
    ran: list[tuple[int, str]] = []
    errors: list[BaseException] = []

    def run(name: str, loop: str) -> None:
        async def main() -> None:
            s = Scheduler(backend, instance_id=name, lease="1.2s", heartbeat="0.2s")

            @s.every("shared", "1s")
            async def shared(ctx: object) -> None:
                ran.append((ctx.slot, name))  # type: ignore[attr-defined]

            async with s:
                await wait_for(lambda: len({slot for slot, _ in ran}) >= 3, timeout=10,
                               what="three slots")

        try:
            anyio.run(main, backend=loop)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n, loop))
               for n, loop in (("a", "asyncio"), ("b", "trio"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    slots = [slot for slot, _ in ran]
    assert len(set(slots)) >= 3 and len(slots) == len(set(slots)), ran


async def test_ctx_log_names_the_run(caplog: pytest.LogCaptureFixture) -> None:
    s = Scheduler(MemoryBackend(), instance_id="a", lease="1.2s", heartbeat="0.2s")

    @s.every("logged", "1s")
    async def logged(ctx: object) -> None:
        ctx.log.info("hello %s", "there")  # type: ignore[attr-defined]

    caplog.set_level("INFO", logger="anarchon")
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        await wait_for(lambda: any("hello there" in r.getMessage() for r in caplog.records),
                       what="a log line")
        await i.stop()
    record = next(r for r in caplog.records if "hello there" in r.getMessage())
    assert record.getMessage().startswith("[logged slot ")
    assert "attempt 1]" in record.getMessage()
    assert record.job == "logged" and record.attempt == 1  # type: ignore[attr-defined]


class _HistoryOnly(MemoryBackend):
    """A backend that implements only the abstract contract: jobs() and runs() derived."""

    jobs = Backend.jobs
    runs = Backend.runs


async def test_default_jobs_and_runs_derive_from_history() -> None:
    clock = FakeClock()
    backend = _HistoryOnly(clock=clock)
    await backend.start()
    done = ClaimRequest("alpha", 1000, "a", "t1", 5000)
    held = ClaimRequest("alpha", 2000, "b", "t2", 5000, overlap_skip=False)
    other = ClaimRequest("beta", 1000, "a", "t3", 5000)
    for r in (done, held, other):
        await backend.claim(r)
    await backend.finish(Lease("alpha", 1000, "t1", 5000), Outcome.COMPLETED)
    await backend.hand_over([Lease("beta", 1000, "t3", 5000)])
    assert await backend.jobs() == ["alpha", "beta"]
    runs = await backend.runs()
    assert [(r.job, r.slot, r.status, r.instance_id) for r in runs] == [
        ("alpha", 2000, RunStatus.RUNNING, "b"),
        ("alpha", 1000, RunStatus.COMPLETED, "a"),
        ("beta", 1000, RunStatus.HANDED_OVER, "a"),
    ]
    assert [r.slot for r in await backend.runs(open_only=True)] == [2000, 1000]
    assert await backend.runs("alpha", limit=1) == runs[:1]
    with pytest.raises(ConfigurationError, match="limit=-2"):
        await backend.runs(limit=-2)


@pytest.mark.parametrize("now_ms", [0, 1, HOUR_MS // 2, HOUR_MS - 1, 1_800_000_000_000,
                                    1_800_000_000_000 + 1_234_567])
def test_quiet_offset_puts_now_half_an_hour_from_any_slot(now_ms: int) -> None:
    s = Scheduler(MemoryBackend(), instance_id="a")
    s.every("j", "1h", lambda ctx: None, offset=quiet_offset(now_ms))
    schedule = s.jobs["j"].schedule
    assert schedule.previous_at_or_before(now_ms) == now_ms - HOUR_MS // 2
    assert schedule.next_after(now_ms) == now_ms + HOUR_MS // 2


def test_quiet_offset_now_keeps_slots_15_minutes_away(monkeypatch: pytest.MonkeyPatch) -> None:
    base = 1_800_000_000 - 1_800_000_000 % 3600  # the top of an hour
    offsets = set()
    for second in range(0, 3600, 7):
        now = base + second + 0.5
        monkeypatch.setattr(time, "time", lambda now=now: now)
        offset = quiet_offset_now()
        offsets.add(offset)
        s = Scheduler(MemoryBackend(), instance_id="a")
        s.every("j", "1h", lambda ctx: None, offset=offset)
        schedule, now_ms = s.jobs["j"].schedule, int(now * 1000)
        assert schedule.next_after(now_ms) - now_ms >= 15 * 60_000
        previous = schedule.previous_at_or_before(now_ms)
        assert previous is not None and now_ms - previous >= 15 * 60_000
    assert offsets == {0.0, 1800.0}


@pytest.mark.parametrize("now_ms", [0, HOUR_MS - 1, 3 * HOUR_MS, 1_800_000_000_000 + 1_234_567])
def test_quiet_cron_fires_11_to_12_hours_from_now(now_ms: int) -> None:
    s = Scheduler(MemoryBackend(), instance_id="a")
    s.cron("j", quiet_cron(now_ms), lambda ctx: None)
    schedule = s.jobs["j"].schedule
    assert 11 * HOUR_MS < schedule.next_after(now_ms) - now_ms <= 12 * HOUR_MS
    previous = schedule.previous_at_or_before(now_ms)
    assert previous is not None and 12 * HOUR_MS <= now_ms - previous < 13 * HOUR_MS


async def test_a_quiet_hourly_job_does_not_fire_when_the_store_clock_crosses_midnight() -> None:
    """The store's clock two seconds before 00:00 UTC while two runs hold their leases.

    A plain ``"1h"`` job fires at midnight mid-test (its slot is recorded as skipped, as in
    a scenario that once ran across midnight); one declared with ``quiet_offset`` does not.
    """
    midnight_ms = int(datetime(2031, 1, 1, tzinfo=UTC).timestamp() * 1000)
    shift = midnight_ms / 1000 - 2.0 - time.time()
    backend = MemoryBackend(clock=lambda: time.time() + shift)
    await backend.start()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    release = anyio.Event()

    async def hold(ctx: RunContext) -> None:
        await release.wait()

    s.every("plain", "1h", hold)
    s.every("quiet", "1h", hold, offset=quiet_offset(await backend.now_ms()))
    async with anyio.create_task_group() as tg:
        i = await Instance(s).start(tg)
        slots = {}
        for name, job in s.jobs.items():
            slot = job.schedule.previous_at_or_before(s.store_now_ms())
            assert slot is not None
            slots[name] = slot
            await claim_now(s, job, slot)
        assert slots["plain"] == midnight_ms - HOUR_MS  # claimed before midnight
        plain = await wait_history(s, lambda h: len(h) == 2, job="plain", timeout=10,
                                   what="the plain job's midnight slot")
        # Midnight has passed by the store's clock; the quiet job only has its own run.
        assert await backend.now_ms() > midnight_ms
        quiet = await backend.history("quiet", 10)
        release.set()
        await i.stop()
    assert [(h.slot, h.outcome) for h in plain] == [
        (midnight_ms, Outcome.SKIPPED), (midnight_ms - HOUR_MS, None)
    ]
    assert [(h.slot, h.outcome) for h in quiet] == [(slots["quiet"], None)]


async def finished_slots(backend: MemoryBackend, job: str, runs: int) -> None:
    """Record ``runs`` completed runs of ``job`` (slots 1 to ``runs``)."""
    requests = [ClaimRequest(job, slot, "w", f"{job}-{slot}", 60_000, overlap_skip=False)
                for slot in range(1, runs + 1)]
    assert all(r.status is ClaimStatus.WON for r in await backend.claim_many(requests))
    assert all(await backend.finish_many([(Lease(job, r.slot, r.token, 60_000),
                                           Outcome.COMPLETED, None) for r in requests]))


@pytest.mark.asyncio_only
async def test_trimming_jobs_beside_many_others_deletes_only_their_oldest_runs() -> None:
    """A job's trimming looks only at the runs of the attempts it deletes (not at every
    run of every job, which made a period's trimming grow with jobs times runs: 1,000
    jobs of 100 runs took 4 s with the lock held); the other jobs' runs stay."""
    trimmed = [f"t{i}" for i in range(100)]
    backend = MemoryBackend()
    await backend.start()
    for job in trimmed:
        await finished_slots(backend, job, 11)
    for i in range(20):
        await finished_slots(backend, f"other{i}", 100)
    counts = await backend.prune_many(trimmed, keep=10)
    assert counts == dict.fromkeys(trimmed, 1)  # each job's oldest run went
    assert [a.slot for a in await backend.history("t0")] == list(range(11, 1, -1))
    assert len(await backend.history("other0", limit=1000)) == 100
    runs = {(r.job, r.slot) for r in await backend.runs(limit=10_000)}
    assert ("t0", 1) not in runs and ("t0", 2) in runs and ("other0", 1) in runs


@pytest.mark.asyncio_only
async def test_a_long_running_store_whose_history_is_trimmed_stays_bounded() -> None:
    """A process that runs a job for good (here with overlap allowed, which no overlap
    check reads) and trims its history keeps a bounded store: the memory backend kept
    every slot ever run in its index of runs that may be running (the overlap check
    pruned it only when it read it), growing by one slot per run, forever."""
    import tracemalloc

    backend = MemoryBackend()
    await backend.start()
    done = 0

    async def run(count: int) -> None:
        nonlocal done
        for _ in range(count):
            done += 1
            r = ClaimRequest("forever", done, "w", f"t{done}", 60_000, overlap_skip=False)
            assert (await backend.claim(r)).status is ClaimStatus.WON
            assert await backend.finish(Lease("forever", done, r.token, 60_000),
                                        Outcome.COMPLETED)
            await backend.prune("forever", keep=5)

    mine = [tracemalloc.Filter(True, "*/backends/memory*.py")]
    tracemalloc.start()
    try:
        await run(200)
        before = tracemalloc.take_snapshot().filter_traces(mine)
        await run(1000)
        after = tracemalloc.take_snapshot().filter_traces(mine)
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 4_000, [str(s) for s in after.compare_to(before, "lineno")[:5]]
    assert len(await backend.runs("forever", limit=100)) == 5


async def test_every_call_is_a_cancellation_point_as_on_a_real_store() -> None:
    """The named leases' calls and the operations' reads raise in a cancelled scope, as
    the backend's other calls and a real store's (at their round trip) do: they never did,
    so a test on memory never met a lease's acquire or release cancelled (the shielded
    release that follows one, say)."""
    backend = MemoryBackend()
    await backend.start()
    taken = await backend.acquire_lease("n", "h", 60_000)
    calls = [lambda: backend.acquire_lease("m", "h", 60_000),
             lambda: backend.renew_lease("n", taken.token, 60_000),
             lambda: backend.read_lease("n"),
             lambda: backend.release_lease("n", taken.token),
             backend.paused, lambda: backend.queued(["j"]),
             lambda: backend.heartbeats([("j", 1)])]
    for call in calls:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await call()
        assert scope.cancelled_caught, call
    assert not (await backend.read_lease("m")).held  # the cancelled acquire took nothing
    assert (await backend.read_lease("n")).held  # nor did the release free it


async def test_a_use_before_start_or_after_close_warns_once_as_the_real_stores_refuse() -> None:
    """PostgreSQL and Redis backends raise ConfigurationError when called before start()
    (or after close()); the memory store answered silently, so a library author's test on
    memory never caught the missing start(). It answers still, with one RuntimeWarning."""
    backend = MemoryBackend()
    with pytest.warns(RuntimeWarning, match=r"before start\(\).*await backend.start\(\)"):
        assert (await backend.claim(request("t1"))).status is ClaimStatus.WON
    await backend.claim(request("t2"))  # once per store: no second warning (an error here)
    started = MemoryBackend()
    await started.start()
    await started.claim(request("t1"))  # started: no warning
    await started.close()
    with pytest.warns(RuntimeWarning, match="after close"):
        await started.claim(request("t2"))


async def test_operations_reads_are_ordered_and_bounded_as_on_postgresql() -> None:
    """``queued`` returns at most 1,000 runs sorted by job and slot, ``paused`` its jobs in
    name order (PostgreSQL's statements have that ORDER BY and LIMIT; memory had neither)."""
    from lease_core import Admin

    backend = MemoryBackend()
    admin = Admin(backend, by="ops")
    async with admin:
        await backend.register_jobs(["b", "a"])
        for job in ("b", "a"):
            await admin.pause(job)
        assert list(await backend.paused()) == ["a", "b"]
        for _ in range(1001):
            await admin.trigger("b")
        await admin.trigger("a")
        queued = await backend.queued(["b", "a"])
        assert len(queued) == 1000 and queued == sorted(queued) and queued[0][0] == "a"
