"""A Redis server that restarts without persistence, and so forgets every lease.

Each test starts its own server (``--save "" --appendonly no``) and restarts it for real.
After the loss no attempt may start until every lease that may have been live has
expired (the quarantine, on the store's clock), and holders learn of the loss at their
next heartbeat.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

from backends.embedded.redis import EmbeddedRedis, find_server
from backends.redis import RedisBackend
from lease_core import LeaseLost, Reason, RunContext, Scheduler
from lease_core._structures import CheckResult, ClaimRequest, ClaimStatus
from lease_core.errors import BackendUnavailable
from lease_core.testing import claim_now
from tests.helpers import Instance, quiet_offset, stop_all, store_now_ms, wait_for, wait_history

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["redis", "valkey"])
def server(request: pytest.FixtureRequest) -> Iterator[EmbeddedRedis]:
    """A server of its own, without persistence: redis-server 6.2 or valkey-server 8."""
    binary = find_server(request.param)
    assert binary is not None, f"no {request.param} server installed"
    with EmbeddedRedis(binary, appendonly=False) as made:
        yield made


@pytest.fixture
def raw(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A plain sync client, for reading the server behind the backends' back."""
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _request(job: str, slot: int, token: str, lease_ms: int) -> ClaimRequest:
    return ClaimRequest(job, slot, f"inst-{token}", token, lease_ms, overlap_skip=False)


def _server_ms(raw: redis.Redis) -> int:
    seconds, micros = raw.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _restart_empty(server: EmbeddedRedis, raw: redis.Redis) -> int:
    """Restart the server, check it came back empty; return its clock just before the stop.

    A key written just before the restart must be gone (the server's size alone is not
    checked: schedulers still running write again as soon as it is back). The clock is
    read before the stop because a running scheduler's claim can find the loss, and date
    it, before this test could read the clock again after the start."""
    stopped = _server_ms(raw)
    raw.set("restart-witness", "1")
    await anyio.to_thread.run_sync(server.stop)
    await anyio.to_thread.run_sync(server.start)
    assert not raw.exists("restart-witness"), "the server kept data across the restart"
    return stopped


def _job_hash(raw: redis.Redis, prefix: str, job: str) -> dict[str, str]:
    found: dict[bytes, bytes] = raw.hgetall("{" + prefix + "/" + job + "}:job")  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in found.items()}


# -- the backend -----------------------------------------------------------------------


async def test_a_fresh_store_has_no_quarantine(server: EmbeddedRedis, raw: redis.Redis) -> None:
    prefix = _prefix()
    one, two = RedisBackend(server.url, prefix=prefix), RedisBackend(server.url, prefix=prefix)
    await one.start()
    await two.start()
    try:
        first = await one.claim(_request("job", 1, "a", 60_000))
        assert (first.status, first.attempt) == (ClaimStatus.WON, 1)
        marker = _job_hash(raw, prefix, "job")
        assert marker.get("sid") and "quiet" not in marker and "lost" not in marker
        # another instance, and another slot: the marker is kept, nothing waits
        second = await two.claim(_request("job", 2, "b", 60_000))
        assert (second.status, second.attempt) == (ClaimStatus.WON, 1)
        # a job new to a store whose other jobs this backend knows
        other = await one.claim(_request("other", 1, "c", 60_000))
        assert (other.status, other.attempt) == (ClaimStatus.WON, 1)
        assert _job_hash(raw, prefix, "job")["sid"] == marker["sid"]
        assert "quiet" not in _job_hash(raw, prefix, "other")
    finally:
        await one.close()
        await two.close()


async def test_claims_wait_out_the_longest_lease_after_a_loss(
    server: EmbeddedRedis, raw: redis.Redis
) -> None:
    prefix = _prefix()
    short = RedisBackend(server.url, prefix=prefix)   # knows a 400 ms lease
    long = RedisBackend(server.url, prefix=prefix)    # knows a 1.2 s lease
    await short.start()
    await long.start()
    try:
        assert (await short.claim(_request("job", 1, "a", 400))).status is ClaimStatus.WON
        assert (await long.claim(_request("job", 2, "b", 1_200))).status is ClaimStatus.WON
        before = _job_hash(raw, prefix, "job")["sid"]
        stopped = await _restart_empty(server, raw)

        found = await short.claim(_request("job", 3, "c", 400))
        assert (found.status, found.run_status, found.attempt) == (ClaimStatus.RUNNING, None, 0)
        assert found.instance_id is None
        marker = _job_hash(raw, prefix, "job")
        lost = int(marker["lost"])
        assert stopped <= lost <= found.now_ms
        assert found.expires_ms == int(marker["quiet"]) == lost + 400
        assert marker["sid"] != before
        # nothing recorded while in quarantine
        assert await short.history("job") == []
        assert (await short.check([("job", 3)])).runs == {}

        # a caller that knew a longer lease extends the quarantine ...
        extended = await long.claim(_request("job", 3, "d", 1_200))
        assert (extended.status, extended.run_status) == (ClaimStatus.RUNNING, None)
        assert extended.expires_ms == int(_job_hash(raw, prefix, "job")["quiet"]) == lost + 1_200
        # ... and a shorter one never shortens it
        again = await short.claim(_request("job", 3, "e", 400))
        assert again.expires_ms == lost + 1_200
        # a backend that never saw the job before the loss is held back too
        fresh = RedisBackend(server.url, prefix=prefix)
        await fresh.start()
        try:
            held = await fresh.claim(_request("job", 3, "f", 400))
            assert (held.status, held.expires_ms) == (ClaimStatus.RUNNING, lost + 1_200)
        finally:
            await fresh.close()
        assert await short.history("job") == []

        await wait_for(lambda: _server_ms(raw) >= lost + 1_200, what="the quarantine's end")
        won = await short.claim(_request("job", 3, "g", 400))
        assert (won.status, won.attempt, won.reason) == (ClaimStatus.WON, 1, Reason.SCHEDULED)
        assert won.now_ms >= lost + 1_200
        # every backend adopted the new marker: later claims do not start another quarantine
        assert (await long.claim(_request("job", 4, "h", 1_200))).status is ClaimStatus.WON
        assert int(_job_hash(raw, prefix, "job")["quiet"]) == lost + 1_200
    finally:
        await short.close()
        await long.close()


async def test_a_backup_that_only_registered_the_job_finds_the_loss(
    server: EmbeddedRedis, raw: redis.Redis
) -> None:
    # The backup never won the job nor watched one of its runs: it learnt the job's
    # marker from the registration every scheduler makes at start. Its first claim after
    # the loss (made because the owner's claims failed while the server was down) must
    # start the quarantine, not win attempt 1 of a job it takes for new.
    prefix = _prefix()
    owner, backup = RedisBackend(server.url, prefix=prefix), RedisBackend(server.url, prefix=prefix)
    await owner.start()
    await backup.start()
    try:
        await owner.register_jobs(["job", "other"])
        marker = _job_hash(raw, prefix, "job")["sid"]
        assert set(await backup.register_jobs(["job", "other"])) == {"job", "other"}
        assert _job_hash(raw, prefix, "job")["sid"] == marker  # registering keeps it
        assert (await owner.claim(_request("job", 1, "a", 800))).status is ClaimStatus.WON
        assert _job_hash(raw, prefix, "job")["sid"] == marker  # the first win keeps it
        stopped = await _restart_empty(server, raw)

        found = await backup.claim(_request("job", 2, "b", 800))
        assert (found.status, found.run_status, found.attempt) == (ClaimStatus.RUNNING, None, 0)
        quiet = int(_job_hash(raw, prefix, "job")["quiet"])
        assert found.expires_ms == quiet >= stopped + 800
        assert await backup.history("job") == []
        # A listing after the loss (as after a new epoch) gives a job a new marker; the
        # owner keeps the one it knew, so its next claim still finds the loss.
        await owner.register_jobs(["other"])
        assert "sid" in _job_hash(raw, prefix, "other")
        held = await owner.claim(_request("other", 2, "c", 800))
        assert (held.status, held.run_status) == (ClaimStatus.RUNNING, None)
        assert held.expires_ms == int(_job_hash(raw, prefix, "other")["quiet"]) >= stopped + 800
    finally:
        await owner.close()
        await backup.close()


# -- schedulers ------------------------------------------------------------------------


async def test_a_backup_starts_no_attempt_before_the_quarantine_ends(
    server: EmbeddedRedis, raw: redis.Redis
) -> None:
    prefix = _prefix()
    lease_ms = 2_000
    offset = quiet_offset(await store_now_ms(RedisBackend(server.url, prefix=prefix)))
    holder = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id="holder",
                       lease="2s", heartbeat="0.2s")
    backup = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id="backup",
                       lease="2s", heartbeat="0.2s")
    contexts: list[RunContext] = []
    starts: list[float] = []
    ended: list[float] = []
    for scheduler in (holder, backup):

        @scheduler.every("long", "1h", offset=offset)
        async def long(ctx: RunContext) -> None:
            contexts.append(ctx)
            starts.append(time.monotonic())
            try:
                await anyio.sleep_forever()
            finally:
                ended.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        instances = [await Instance(holder).start(tg), await Instance(backup).start(tg)]
        try:
            job = holder.jobs["long"]
            slot = job.schedule.previous_at_or_before(holder.store_now_ms())
            assert slot is not None
            first = await claim_now(holder, job, slot)
            assert first is not None and first.status is ClaimStatus.WON
            await wait_for(lambda: contexts, what="the holder's handler")
            standing = await claim_now(backup, "long", slot)
            assert standing is not None and standing.status is ClaimStatus.RUNNING

            stopped = await _restart_empty(server, raw)
            # The backup claims the run again (as when its claim went unanswered during
            # the restart): the store lost it, but its holder is still running it.
            held_back = await claim_now(backup, "long", slot)
            assert held_back is not None
            assert (held_back.status, held_back.run_status) == (ClaimStatus.RUNNING, None)
            quiet = int(_job_hash(raw, prefix, "long")["quiet"])
            assert held_back.expires_ms == quiet >= stopped + lease_ms

            # the holder learns of the loss at its next heartbeat
            await wait_for(lambda: ended, timeout=5, what="the holder cancelled")
            assert contexts[0].stop_reason == "lease lost"
            assert len(starts) == 1
            with pytest.raises(LeaseLost):
                await contexts[0].checkpoint.set({"late": True})

            # the claims wait out the quarantine; then one attempt 1 starts
            await wait_for(lambda: len(starts) == 2, timeout=15, what="the next attempt")
            assert ended[0] < starts[1]
            history = await backup.history("long")
            assert [a.attempt for a in history] == [1]
            assert history[0].claimed_at.timestamp() * 1000 + 0.5 >= quiet
        finally:
            await stop_all(instances)
    assert len(starts) == 2


async def test_scheduling_resumes_after_the_quarantine(
    server: EmbeddedRedis, raw: redis.Redis
) -> None:
    prefix = _prefix()
    runs: list[tuple[int, str]] = []
    schedulers = []
    for name in ("a", "b"):
        scheduler = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id=name,
                              lease="1s", heartbeat="0.2s")

        @scheduler.every("tick", "0.5s")
        async def tick(ctx: RunContext, name: str = name) -> None:
            runs.append((ctx.slot, name))

        schedulers.append(scheduler)

    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in schedulers]
        try:
            await wait_for(lambda: len(runs) >= 2, what="runs before the restart")
            stopped = await _restart_empty(server, raw)
            restarted = _server_ms(raw)
            await wait_for(lambda: "quiet" in _job_hash(raw, prefix, "tick"),
                           what="the loss found by a claim")
            marker = _job_hash(raw, prefix, "tick")
            quiet = int(marker["quiet"])
            assert quiet == int(marker["lost"]) + 1_000 >= stopped + 1_000
            await wait_for(lambda: len([s for s, _ in runs if s >= quiet]) >= 3, timeout=15,
                           what="three slots after the quarantine")
            history = await schedulers[0].history("tick", 1000)
        finally:
            await stop_all(instances)

    # nothing was claimed in the quarantine; each slot since ran once, on one instance
    # (a claim can land on the quarantine's end to the millisecond: float slack)
    assert history and all(a.claimed_at.timestamp() * 1000 + 0.5 >= quiet for a in history)
    assert all(a.attempt == 1 for a in history)
    later = [slot for slot, _ in runs if slot >= restarted]
    assert len(later) == len(set(later)) >= 3
    assert {a.slot for a in history if a.outcome == "completed"} >= {
        slot for slot in later if slot < max(later)}



async def test_the_store_records_come_back_while_the_fleet_runs_on(
    server: EmbeddedRedis, raw: redis.Redis
) -> None:
    """After the loss, a running fleet claimed on, but the store-wide records stayed gone
    ({P}:meta: its format, the workflows' steps, the schedules) until an instance
    restarted: operations and the CLI said there was no store where the fleet ran, and
    trimming no longer knew which steps' runs go on. The scheduler lists its jobs again
    at the new epoch, and that records them again."""
    prefix = _prefix()
    scheduler = Scheduler(RedisBackend(server.url, prefix=prefix), lease="1s",
                          heartbeat="0.2s")
    runs: list[int] = []

    @scheduler.every("tick", "0.5s")
    async def tick(ctx: RunContext) -> None:
        runs.append(ctx.slot)

    flow = scheduler.workflow("flow", every="1h")

    @flow.step("only")
    async def only(ctx: RunContext) -> None:
        """Never due in the test: its steps are recorded."""

    async with anyio.create_task_group() as tg:
        instance = await Instance(scheduler).start(tg)
        try:
            await wait_for(lambda: len(runs) >= 1, what="a run before the restart")
            await _restart_empty(server, raw)
            await wait_for(lambda: "quiet" in _job_hash(raw, prefix, "tick"),
                           what="the loss found by a claim")
            await wait_for(lambda: raw.hget("{" + prefix + "}:meta", "format") is not None,
                           timeout=10, what="the store's format recorded again")
            reader = RedisBackend(server.url, prefix=prefix)
            await reader.start(create=False)  # an operation's or the CLI's start
            try:
                assert await reader.workflows() == {"flow": ["only"]}
                assert "tick" in await reader.schedules()
                assert "tick" in await reader.jobs()
            finally:
                await reader.close()
        finally:
            await stop_all([instance])


async def test_the_run_lost_in_flight_runs_again_once_after_the_quarantine(
    server: EmbeddedRedis, raw: redis.Redis
) -> None:
    prefix = _prefix()
    offset = quiet_offset(await store_now_ms(RedisBackend(server.url, prefix=prefix)))
    schedulers = [Scheduler(RedisBackend(server.url, prefix=prefix), instance_id=name,
                            lease="1.5s", heartbeat="0.2s") for name in ("holder", "backup")]
    starts: list[tuple[str, float]] = []
    first_ended: list[float] = []
    for scheduler in schedulers:

        @scheduler.every("long", "1h", offset=offset)
        async def long(ctx: RunContext, owner: str = scheduler.instance_id) -> None:
            starts.append((owner, time.monotonic()))
            if len(starts) == 1:
                try:
                    await anyio.sleep_forever()
                finally:
                    first_ended.append(time.monotonic())

    holder, backup = schedulers
    async with anyio.create_task_group() as tg:
        instances = [await Instance(s).start(tg) for s in schedulers]
        try:
            slot = holder.jobs["long"].schedule.previous_at_or_before(holder.store_now_ms())
            assert slot is not None
            won = await claim_now(holder, "long", slot)
            assert won is not None and won.status is ClaimStatus.WON
            await wait_for(lambda: starts, what="the holder's handler")
            standing = await claim_now(backup, "long", slot)
            assert standing is not None and standing.status is ClaimStatus.RUNNING
            assert backup.watching == [("long", slot)]

            stopped = await _restart_empty(server, raw)
            # the instances watching the run find it lost, and wait out the quarantine
            await wait_for(lambda: first_ended, timeout=5, what="the holder cancelled")
            await wait_for(lambda: len(starts) == 2, timeout=15, what="the run again")
            # The second handler returns at once; its finish reaches the store just after.
            history = await wait_history(holder, lambda h: h and h[0].outcome is not None,
                                         job="long", what="the second run's end")
        finally:
            await stop_all(instances)
    quiet = int(_job_hash(raw, prefix, "long")["quiet"])
    assert quiet >= stopped + 1_500
    assert first_ended[0] < starts[1][1]
    assert len(starts) == 2
    assert [(a.slot, a.attempt, a.reason, a.outcome) for a in history] == [
        (slot, 1, Reason.TAKEOVER, "completed")]
    assert history[0].claimed_at.timestamp() * 1000 + 0.5 >= quiet


@pytest.mark.asyncio_only
async def test_a_cluster_node_that_loses_its_data() -> None:
    from redis.asyncio.cluster import RedisCluster

    binary = find_server("valkey")
    assert binary is not None
    args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
    with EmbeddedRedis(binary, appendonly=False, extra_args=args) as node:
        raw = redis.Redis.from_url(node.url)
        try:
            raw.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)

            def cluster_ok() -> bool:
                return bool(raw.cluster("info")["cluster_state"] == "ok")

            await wait_for(cluster_ok, what="the cluster ok")
            client = RedisCluster.from_url(node.url)
            backend = RedisBackend(client, prefix=_prefix())
            await backend.start()
            try:
                jobs = ["a", "b{x}", "c/d"]  # in different slots
                for job in jobs:
                    won = await backend.claim(_request(job, 1, f"{job}-1", 1_000))
                    assert won.status is ClaimStatus.WON
                await anyio.to_thread.run_sync(node.stop)
                await anyio.to_thread.run_sync(node.start)
                assert raw.dbsize() == 0
                await wait_for(cluster_ok, what="the cluster ok after the restart")
                checks: list[CheckResult] = []

                async def checked() -> bool:
                    # the cluster client may first report a connection the restart closed
                    try:
                        checks.append(await backend.check([(job, 1) for job in jobs]))
                    except BackendUnavailable:
                        return False
                    return True

                await wait_for(checked, what="a check after the restart")
                # every script still touches one slot: the markers live with the jobs
                check = checks[-1]
                assert check.runs == {} and check.lost == {(job, 1) for job in jobs}
                for job in jobs:
                    found = await backend.claim(_request(job, 1, f"{job}-2", 1_000))
                    assert (found.status, found.run_status) == (ClaimStatus.RUNNING, None)
                    assert found.expires_ms is not None
                    assert found.expires_ms >= found.now_ms + 900
            finally:
                await backend.close()
                await client.aclose()
        finally:
            raw.close()


@pytest.mark.parametrize("kind", ["sync-client", "asyncio-client"])
async def test_clients_passed_in_find_the_loss_too(
    server: EmbeddedRedis, raw: redis.Redis, kind: str, anyio_backend: str
) -> None:
    if kind == "asyncio-client" and anyio_backend != "asyncio":
        pytest.skip("redis-py's asyncio client runs on asyncio only")
    client: Any = (redis.asyncio.Redis.from_url(server.url) if kind == "asyncio-client"
                   else redis.Redis.from_url(server.url))
    backend = RedisBackend(client, prefix=_prefix())
    await backend.start()
    try:
        assert (await backend.claim(_request("job", 1, "a", 800))).status is ClaimStatus.WON
        await _restart_empty(server, raw)
        found = await backend.claim(_request("job", 1, "b", 800))
        assert (found.status, found.run_status) == (ClaimStatus.RUNNING, None)
        assert found.expires_ms == found.now_ms + 800
        assert (await backend.check([("job", 1)])).lost == {("job", 1)}
    finally:
        await backend.close()
        await client.aclose() if kind == "asyncio-client" else client.close()


class _Registrations:
    """A backend wrapper counting ``register_jobs`` calls (a start, or a new epoch)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.count = inner, 0

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr != "register_jobs":
            return value

        async def register(jobs: Any) -> Any:
            found = await value(jobs)
            self.count += 1
            return found
        return register


async def test_an_old_instance_at_a_new_epoch_does_not_record_its_older_workflow_steps(
    server: EmbeddedRedis, raw: redis.Redis
) -> None:
    """A release adds a step to a workflow while an instance of the old release runs on.
    A failover takes the old instance's leases (the job's next win is on a server with
    another replication id: a new epoch), and it lists its jobs again: that must restore
    only store-wide records that are missing, not write its older steps over the newer
    ones the store kept (trimming would then no longer keep the new step's runs with
    their workflow run, and readers would show the old steps)."""
    prefix = _prefix()
    old = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id="old",
                    lease="1s", heartbeat="0.2s")
    runs: list[int] = []

    @old.every("tick", "0.5s")
    async def tick(ctx: RunContext) -> None:
        runs.append(ctx.slot)

    old.workflow("flow", every="1h").step("one", lambda ctx: None)
    registrations = _Registrations(old.backend)
    old.backend = registrations  # type: ignore[assignment]
    new = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id="new",
                    lease="1s", heartbeat="0.2s")
    flow = new.workflow("flow", every="1h")
    flow.step("one", lambda ctx: None)
    flow.step("two", lambda ctx: None)
    reader = RedisBackend(server.url, prefix=prefix)
    async with anyio.create_task_group() as tg:
        i_old = await Instance(old).start(tg)
        try:
            await wait_for(lambda: len(runs) >= 1, what="a run of the old instance")
            i_new = await Instance(new).start(tg)  # the new release records its steps
            await i_new.stop()
            await reader.start(create=False)
            assert await reader.workflows() == {"flow": ["one", "two"]}
            assert registrations.count == 1
            # as if the job's last holders were on another server (a failover)
            raw.hset("{" + prefix + "/tick}:job", "rid", "0" * 40)
            await wait_for(lambda: registrations.count >= 2, timeout=10,
                           what="the old instance listing its jobs at the new epoch")
            assert await reader.workflows() == {"flow": ["one", "two"]}
        finally:
            await reader.close()
            await stop_all([i_old])


async def test_a_later_step_whose_data_a_shard_lost_is_not_run_again_for_older_runs(
    server: EmbeddedRedis, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis Cluster shard loses a workflow's second step's data (its job's keys live on
    that shard; the first step's, on another, are kept). A starting instance's look at
    the workflow's recent runs, past the latest, finds each older run's first step
    completed and its second missing: the runs did not stop between the steps, their
    second step's runs were lost. It must not run the second step again for every older
    run (the store first saw that step's job after them)."""
    from urllib.parse import quote

    from lease_core.recovery import step_job

    prefix = _prefix()
    offset = quiet_offset(await store_now_ms(RedisBackend(server.url, prefix=prefix)))
    ran: list[tuple[str | None, int]] = []

    def build(name: str) -> Scheduler:
        s = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id=name,
                      lease="1s", heartbeat="0.2s")
        flow = s.workflow("close", every="1h", offset=offset)
        for step in ("snapshot", "interest"):
            flow.step(step, lambda ctx: ran.append((ctx.step, ctx.slot)))
        return s

    old = build("old")
    schedule = old.workflows["close"].schedule
    newer = schedule.previous_at_or_before(old.store_now_ms())
    assert newer is not None
    slots = [newer - 3_600_000 * k for k in range(3, 0, -1)]  # older runs, oldest first
    async with anyio.create_task_group() as tg:
        i = await Instance(old).start(tg)
        for slot in [*slots, newer]:
            await claim_now(old, "close", slot)
            await wait_for(lambda slot=slot: ("interest", slot) in ran,
                           what="the run's second step")
        await stop_all([i])
    # the shard of the second step's job loses its data
    lost = list(raw.scan_iter(match="{" + prefix + "/"
                              + quote(step_job("close", "interest"), safe="") + "}*"))
    assert lost
    raw.delete(*lost)
    seen: list[int] = []
    new = build("new")
    inner = new.backend

    class Claims:
        def __getattr__(self, attr: str) -> Any:
            value = getattr(inner, attr)
            if attr not in ("claim", "claim_many"):
                return value

            async def claim(requests: Any) -> Any:
                listed = requests if attr == "claim_many" else [requests]
                seen.extend(r.slot for r in listed
                            if r.job == step_job("close", "interest"))
                return await value(requests)
            return claim

    new.backend = Claims()  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        i = await Instance(new).start(tg)
        with caplog.at_level(logging.INFO, logger="anarchon"):
            await wait_for(lambda: set(slots) <= set(seen) or caplog.text.count(
                "before the store knew step 'interest'") == len(slots),
                what="the older runs looked at")
        await stop_all([i])
    assert [r for r in ran if r[0] == "interest" and r[1] in slots] == [
        ("interest", slot) for slot in slots]
