"""Fences on Redis across a real data loss (issue 21, item 1).

Each test starts its own server without persistence and restarts it for real: the store
then numbers attempts (and named-lease tokens) again from scratch, but the fences
(:func:`lease_core.fence_of` of the claim's epoch and attempt; the lease's token) stay
above every fence issued before the loss.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
import redis

from backends.embedded.redis import EmbeddedRedis, find_server
from backends.redis import RedisBackend
from lease_core import fence_of
from lease_core._structures import FENCE_NUMBER_BITS, ClaimRequest, ClaimResult, ClaimStatus
from tests.helpers import wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A server of its own, without persistence."""
    binary = find_server("redis")
    assert binary is not None, "no redis server installed"
    with EmbeddedRedis(binary, appendonly=False) as made:
        yield made


@pytest.fixture
async def backend(server: EmbeddedRedis) -> AsyncIterator[RedisBackend]:
    """A started backend on the server, under a prefix of its own."""
    made = RedisBackend(server.url, prefix=f"f{uuid.uuid4().hex[:10]}")
    await made.start()
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
def raw(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A plain sync client, for reading the server behind the backend's back."""
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def _server_ms(raw: redis.Redis) -> int:
    seconds, micros = raw.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _restart_empty(server: EmbeddedRedis, raw: redis.Redis) -> int:
    # A marker written just before, not an empty server: a scheduler still running may
    # write again as soon as the server is back.
    marker = f"restart-marker-{uuid.uuid4().hex}"
    raw.set(marker, "1")
    await anyio.to_thread.run_sync(server.stop)
    await anyio.to_thread.run_sync(server.start)
    assert not raw.exists(marker), "the server kept data across the restart"
    return _server_ms(raw)


def _request(job: str, token: str, lease_ms: int = 300) -> ClaimRequest:
    return ClaimRequest(job, 1_000, "inst", token, lease_ms, overlap_skip=False)


def _fence(result: ClaimResult) -> int:
    assert result.status is ClaimStatus.WON, result
    return fence_of(result.epoch, result.attempt)


def _number(fence: int) -> int:
    """The attempt number a fence carries (below its epoch)."""
    return fence & ((1 << FENCE_NUMBER_BITS) - 1)


async def _after(raw: redis.Redis, ms: int | None) -> None:
    assert ms is not None
    await wait_for(lambda: _server_ms(raw) > ms, what=f"the server's clock past {ms}")


async def test_attempts_numbered_again_after_a_loss_are_fenced_above_the_lost_ones(
        server: EmbeddedRedis, backend: RedisBackend, raw: redis.Redis) -> None:
    jobs = ["single", "b1", "b2"]
    fences: dict[str, list[int]] = {job: [] for job in jobs}
    before = _server_ms(raw)
    # attempts 1 and 2 of each run (a takeover after the first lease expired): the
    # single job through claim.lua, the two others through one claim_many.lua call
    for round_ in ("t1", "t2"):
        one = await backend.claim(_request("single", f"s-{round_}"))
        batch = await backend.claim_many([_request("b1", f"b1-{round_}"),
                                          _request("b2", f"b2-{round_}")])
        for result in (one, *batch):
            # a job new to the server starts an epoch at its first claim (the server's
            # clock), kept by its later attempts
            assert result.epoch >= before
            fences[result.job].append(_fence(result))
        await _after(raw, max(r.expires_ms or 0 for r in (one, *batch)))
    assert all([_number(f) for f in issued] == [1, 2] and issued[1] == issued[0] + 1
               for issued in fences.values())

    restarted = await _restart_empty(server, raw)
    held = await backend.claim_many([_request(job, f"{job}-q") for job in jobs])
    assert all((r.status, r.run_status) == (ClaimStatus.RUNNING, None) for r in held)
    await _after(raw, max(r.expires_ms or 0 for r in held))  # the quarantine

    for round_ in ("t3", "t4"):
        one = await backend.claim(_request("single", f"s-{round_}"))
        batch = await backend.claim_many([_request("b1", f"b1-{round_}"),
                                          _request("b2", f"b2-{round_}")])
        for result in (one, *batch):
            lost = int(raw.hget("{" + backend.prefix + "/" + result.job + "}:job",
                                "lost") or 0)
            assert result.epoch == lost >= restarted
            fences[result.job].append(_fence(result))
        await _after(raw, max(r.expires_ms or 0 for r in (one, *batch)))
    for job, issued in fences.items():
        # the store numbered attempts 1 and 2 again, but every fence is new and grows
        assert _number(issued[2]) == 1, job
        assert issued == sorted(set(issued)) and len(issued) == 4, (job, issued)


@pytest.mark.parametrize("registers", [False, True], ids=["claims", "registers"])
async def test_a_job_met_after_a_loss_only_by_new_callers_is_fenced_above_the_lost_ones(
        server: EmbeddedRedis, backend: RedisBackend, raw: redis.Redis,
        registers: bool) -> None:
    """The server restarts empty and no caller that saw the job is left (the whole
    fleet restarted with it): nothing in the store says the job lost anything, so its
    next claim wins at once with attempt 1 again, but its fence is above the lost ones:
    the job's first claim, or its registration by a starting scheduler, in a store
    starts an epoch."""
    lost: list[int] = []
    for token in ("t1", "t2"):  # attempts 1 and 2, the second a takeover
        won = await backend.claim(_request("job", token))
        lost.append(_fence(won))
        await _after(raw, won.expires_ms)
    assert [_number(f) for f in lost] == [1, 2]
    restarted = await _restart_empty(server, raw)
    fresh = RedisBackend(server.url, prefix=backend.prefix)  # a new process's backend
    await fresh.start()
    try:
        if registers:
            await fresh.register_jobs(["job"])
        again = await fresh.claim(_request("job", "t3"))
        assert again.attempt == 1 and again.epoch >= restarted
        assert _fence(again) > max(lost)
        named_again = await fresh.claim(_request("job", "t4"))  # the same run, held
        assert named_again.status is ClaimStatus.RUNNING
    finally:
        await fresh.close()


async def test_a_lease_token_after_a_loss_is_above_every_earlier_one(
        server: EmbeddedRedis, backend: RedisBackend, raw: redis.Redis) -> None:
    before = _server_ms(raw)
    first = await backend.acquire_lease("leader", "h1", 60_000)
    assert first.held and first.token >> FENCE_NUMBER_BITS >= before
    assert await backend.release_lease("leader", first.token)
    second = await backend.acquire_lease("leader", "h2", 60_000)
    assert second.held and second.token == first.token + 1
    assert await backend.renew_lease("leader", second.token, 60_000) is not None

    restarted = await _restart_empty(server, raw)
    third = await backend.acquire_lease("leader", "h3", 60_000)
    assert third.held and third.token > second.token
    assert third.token >= restarted << FENCE_NUMBER_BITS
    # the old holder's token is refused; the new one renews and releases
    assert await backend.renew_lease("leader", second.token, 60_000) is None
    assert not await backend.release_lease("leader", second.token)
    assert await backend.renew_lease("leader", third.token, 60_000) is not None
    assert await backend.release_lease("leader", third.token)


async def test_a_lease_key_written_before_epochs_moves_to_a_new_epoch(
        backend: RedisBackend, raw: redis.Redis) -> None:
    legacy = _server_ms(raw) + 5  # the old scripts' token: the clock in ms, then + 1
    raw.hset("{" + backend.prefix + "/lease/old}",
             mapping={"tok": legacy, "exp": 0, "hold": ""})
    taken = await backend.acquire_lease("old", "h1", 60_000)
    assert taken.held and taken.token > legacy
    assert taken.token >> FENCE_NUMBER_BITS >= legacy - 5


async def test_a_lease_taken_on_another_server_than_its_last_holders_starts_a_new_epoch(
        backend: RedisBackend, raw: redis.Redis) -> None:
    """The lease hash keeps the server's replication id at its last new holder; a new
    holder on a server with another id (a promoted replica, which may have missed the
    newest holders) starts a new epoch, and one on the same server does not."""
    key = "{" + backend.prefix + "/lease/leader}"
    first = await backend.acquire_lease("leader", "h1", 60_000)
    assert first.held
    replid = raw.info("replication")["master_replid"]
    assert raw.hget(key, "rid") == replid.encode()
    assert await backend.release_lease("leader", first.token)
    same = await backend.acquire_lease("leader", "h2", 60_000)
    assert same.held and same.token == first.token + 1  # same server: same epoch
    assert await backend.release_lease("leader", same.token)

    raw.hset(key, "rid", "0" * 40)  # as if the last holders were on another server
    before = _server_ms(raw)
    moved = await backend.acquire_lease("leader", "h3", 60_000)
    assert moved.held and moved.token > same.token
    assert moved.token & ((1 << FENCE_NUMBER_BITS) - 1) == 1
    assert moved.token >> FENCE_NUMBER_BITS >= before
    assert raw.hget(key, "rid") == replid.encode()


async def test_a_loss_of_only_the_newest_writes_is_found_by_a_caller_that_saw_them(
        server: EmbeddedRedis, backend: RedisBackend, raw: redis.Redis) -> None:
    """The server comes back from an older snapshot: the job's keys and marker survive,
    its newest claim does not (as when a replica a little behind is promoted)."""
    first = await backend.claim(ClaimRequest("job", 1_000, "inst", "a", 300,
                                             overlap_skip=False))
    assert _number(_fence(first)) == 1
    raw.save()  # the snapshot the server comes back from
    second = await backend.claim(ClaimRequest("job", 2_000, "inst", "b", 300,
                                              overlap_skip=False))
    assert _number(_fence(second)) == 1 and second.epoch == first.epoch
    await anyio.to_thread.run_sync(server.stop)
    await anyio.to_thread.run_sync(server.start)
    restarted = _server_ms(raw)
    key = "{" + backend.prefix + "/job}:job"
    assert raw.hget(key, "sid") is not None and raw.hget(key, "lost") is None

    held = await backend.claim(ClaimRequest("job", 2_000, "inst", "c", 300,
                                            overlap_skip=False))
    assert (held.status, held.run_status) == (ClaimStatus.RUNNING, None)  # quarantine
    assert held.epoch == int(raw.hget(key, "lost") or 0) >= restarted
    await _after(raw, held.expires_ms)
    again = await backend.claim(ClaimRequest("job", 2_000, "inst", "d", 300,
                                             overlap_skip=False))
    # attempt 1 of slot 2000 is numbered again, with a fence above the lost one
    assert again.attempt == 1 and _fence(again) > _fence(second)
    assert again.epoch >= held.epoch


@contextlib.asynccontextmanager
async def _primary_and_replica() -> AsyncIterator[
        tuple[EmbeddedRedis, EmbeddedRedis, list[redis.Redis]]]:
    """An embedded primary and its replica, in sync, the user "app" on both (the backends
    log in as it; the replica as default): the two servers and raw clients of each."""
    binary = find_server("redis")
    assert binary is not None
    fast = ("--repl-diskless-sync-delay", "0")
    with EmbeddedRedis(binary, extra_args=fast) as primary, EmbeddedRedis(
            binary, extra_args=(*fast, "--replicaof", "127.0.0.1", str(primary.port))
    ) as replica:
        clients = [redis.Redis(port=s.port) for s in (primary, replica)]
        try:
            for client in clients:
                client.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all")
            await wait_for(lambda: clients[0].info("replication").get("slave0", {}).get(
                "state") == "online", timeout=15, what="the replica in sync")
            yield primary, replica, clients
        finally:
            for client in clients:
                client.close()


def _cut_the_replica_off(primary: redis.Redis) -> None:
    """The replica can no longer sync: what the primary acknowledges from now is lost."""
    primary.execute_command("ACL", "SETUSER", "default", "off")
    primary.execute_command("CLIENT", "KILL", "TYPE", "replica")


async def test_an_attempt_numbered_again_on_a_promoted_replica_is_fenced_above() -> None:
    """A replica promoted without the primary's newest claim: its holder may still run,
    so no attempt wins before that lease has passed (the quarantine of a server with
    another replication id); then a backend that never saw that claim wins the same
    attempt number again, with a fence above it (a new epoch)."""
    async with _primary_and_replica() as (primary, replica, clients):
        prefix = f"f{uuid.uuid4().hex[:10]}"
        old = RedisBackend(f"redis://app:pw@127.0.0.1:{primary.port}/0", prefix=prefix)
        await old.start()
        try:
            first = await old.claim(_request("job", "a"))
            assert _number(_fence(first)) == 1
            leader = await old.acquire_lease("leader", "h1", 200)
            assert clients[0].execute_command("WAIT", 1, 5000) == 1
            _cut_the_replica_off(clients[0])
            lost = await old.claim(ClaimRequest("job", 2_000, "inst", "b", 300,
                                                overlap_skip=False))
            assert _number(_fence(lost)) == 1 and lost.epoch == first.epoch
            await _after(clients[0], leader.expires_ms)
            taken = await old.acquire_lease("leader", "h2", 400)  # lost too
            assert taken.held and taken.token == leader.token + 1
        finally:
            await old.close()
        primary.stop()
        clients[1].execute_command("REPLICAOF", "NO", "ONE")
        promoted = _server_ms(clients[1])

        new = RedisBackend(f"redis://app:pw@127.0.0.1:{replica.port}/0", prefix=prefix)
        await new.start()
        try:
            # the lost claim's holder ("b") may still run: nobody wins until its
            # lease (300 ms, the longest known) has surely passed (sentinelfix)
            quiet = await new.claim(ClaimRequest("job", 2_000, "inst", "c", 300,
                                                 overlap_skip=False))
            assert (quiet.status, quiet.run_status) == (ClaimStatus.RUNNING, None)
            assert quiet.expires_ms is not None
            assert quiet.expires_ms >= promoted + 300 > lost.expires_ms  # type: ignore[operator]
            assert quiet.epoch >= promoted
            assert (await new.claim(ClaimRequest("job", 3_000, "inst", "e", 300,
                                                 overlap_skip=False))).run_status is None
            await _after(clients[1], quiet.expires_ms)
            again = await new.claim(ClaimRequest("job", 2_000, "inst", "c", 300,
                                                 overlap_skip=False))
            assert again.status is ClaimStatus.WON
            assert again.attempt == lost.attempt == 1  # numbered again ...
            assert again.epoch >= promoted and _fence(again) > _fence(lost)  # ... fenced
            later = await new.claim(ClaimRequest("job", 3_000, "inst", "d", 300,
                                                 overlap_skip=False))
            assert later.epoch == again.epoch  # one new epoch per change of server
            # the lost acquire's holder ("h2") may still run: nobody takes the name
            # until the longest ttl known (this caller's 400 ms; the survivor's was
            # 200) has passed since the failover was found
            await _after(clients[1], leader.expires_ms)
            found = _server_ms(clients[1])
            waits = await new.acquire_lease("leader", "h3", 400)
            assert not waits.held and waits.holder is None
            assert waits.expires_ms >= found + 400
            assert (await new.read_lease("leader")).expires_ms == waits.expires_ms
            assert not (await new.acquire_lease("leader", "h2", 400)).held  # not its own
            await _after(clients[1], waits.expires_ms)
            token = (await new.acquire_lease("leader", "h3", 400)).token
            assert token > taken.token and token >> FENCE_NUMBER_BITS >= promoted
            assert await new.release_lease("leader", token)
            after = await new.acquire_lease("leader", "h4", 400)  # one quarantine only
            assert after.held and after.token == token + 1
        finally:
            await new.close()


async def test_a_registered_jobs_first_win_lost_in_a_failover_is_fenced_above() -> None:
    """A job registered on the primary (its marker and epoch replicated) whose first win
    there is lost with the failover: the promoted replica has the job's hash without the
    server id that win recorded. A backend that registered the job but never saw that
    win (its history sequence finds no loss) must not win the same attempt again at the
    same epoch: the job's data changed servers, so it starts a new epoch, after the
    quarantine of a promoted server (the lost win's holder may still run)."""
    async with _primary_and_replica() as (primary, replica, clients):
        prefix = f"f{uuid.uuid4().hex[:10]}"
        old = RedisBackend(f"redis://app:pw@127.0.0.1:{primary.port}/0", prefix=prefix)
        await old.start()
        try:
            await old.register_jobs(["job"])
            assert clients[0].execute_command("WAIT", 1, 5000) == 1
            _cut_the_replica_off(clients[0])
            lost = await old.claim(ClaimRequest("job", 2_000, "inst", "b", 300,
                                                overlap_skip=False))
            assert _number(_fence(lost)) == 1
        finally:
            await old.close()
        primary.stop()
        clients[1].execute_command("REPLICAOF", "NO", "ONE")
        promoted = _server_ms(clients[1])
        assert clients[1].hget("{" + prefix + "/job}:job", "sid") is not None

        new = RedisBackend(f"redis://app:pw@127.0.0.1:{replica.port}/0", prefix=prefix)
        await new.start()
        try:
            await new.register_jobs(["job"])  # as a scheduler does before its claims
            quiet = await new.claim(ClaimRequest("job", 2_000, "inst", "c", 300,
                                                 overlap_skip=False))
            assert (quiet.status, quiet.run_status) == (ClaimStatus.RUNNING, None), (
                quiet, lost)
            assert quiet.expires_ms is not None and quiet.expires_ms >= promoted + 300
            await _after(clients[1], quiet.expires_ms)
            again = await new.claim(ClaimRequest("job", 2_000, "inst", "c", 300,
                                                 overlap_skip=False))
            assert again.attempt == lost.attempt == 1  # numbered again ...
            assert again.epoch >= promoted and _fence(again) > _fence(lost)  # ... fenced
        finally:
            await new.close()


async def test_a_quarantine_found_again_on_a_promoted_replica_starts_a_new_epoch() -> None:
    """A loss found on the primary starts an epoch and a quarantine; after it a win
    there (at that epoch) is lost with a failover. On the promoted replica, which has
    the loss replicated, a caller that still knows the marker from before that loss and
    a longer lease raises the old quarantine: the server's id it records then must come
    with a new epoch, or the win after that quarantine numbers the lost attempt again at
    the lost epoch (no change of server found any more: sentinelfix)."""
    async with _primary_and_replica() as (primary, replica, clients):
        prefix = f"f{uuid.uuid4().hex[:10]}"
        key = "{" + prefix + "/job}:job"
        urls = [f"redis://app:pw@127.0.0.1:{s.port}/0" for s in (primary, replica)]
        old = RedisBackend(urls[0], prefix=prefix)
        await old.start()
        try:
            await old.register_jobs(["job"])
            first_marker = clients[0].hget(key, "sid").decode()
            clients[0].hdel(key, "sid")  # a loss of the marker, found by old's claim
            held = await old.claim(ClaimRequest("job", 2_000, "inst", "a", 300,
                                                overlap_skip=False))
            assert (held.status, held.run_status) == (ClaimStatus.RUNNING, None)
            await _after(clients[0], held.expires_ms)
            assert clients[0].execute_command("WAIT", 1, 5000) == 1
            _cut_the_replica_off(clients[0])
            lost = await old.claim(ClaimRequest("job", 2_000, "inst", "b", 300,
                                                overlap_skip=False))
            assert _number(_fence(lost)) == 1 and lost.epoch == held.epoch
        finally:
            await old.close()
        primary.stop()
        clients[1].execute_command("REPLICAOF", "NO", "ONE")
        promoted = _server_ms(clients[1])
        assert int(clients[1].hget(key, "lost") or 0) == lost.epoch

        # a process that registered the job before the loss and claimed nothing
        # since (it knows the first marker), with a longer lease
        stale = RedisBackend(urls[1], prefix=prefix)
        await stale.start()
        stale._markers["job"] = first_marker
        try:
            quiet = await stale.claim(ClaimRequest("job", 2_000, "inst", "c", 3_000,
                                                   overlap_skip=False))
            assert (quiet.status, quiet.run_status) == (ClaimStatus.RUNNING, None)
            await _after(clients[1], quiet.expires_ms)
            again = await stale.claim(ClaimRequest("job", 2_000, "inst", "c", 3_000,
                                                   overlap_skip=False))
            assert again.attempt == lost.attempt == 1  # numbered again ...
            assert again.epoch >= promoted and _fence(again) > _fence(lost)  # ... fenced
        finally:
            await stale.close()


# -- schedulers ------------------------------------------------------------------------


async def test_a_run_a_loss_reopened_is_watched_and_run_again(
        server: EmbeddedRedis, raw: redis.Redis) -> None:
    """The server comes back from a snapshot taken while a run was running, so the run
    its scheduler then completed is open again, and nobody watches it: the new epoch of
    the job's next claim makes the scheduler list the job's open runs and take it over."""
    from lease_core import RunContext, Scheduler
    from lease_core.testing import claim_now
    from tests.helpers import Instance, quiet_offset, stop_all, store_now_ms, wait_history

    prefix = f"f{uuid.uuid4().hex[:10]}"
    offset = quiet_offset(await store_now_ms(RedisBackend(server.url, prefix=prefix)))
    scheduler = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id="one",
                          lease="1s", heartbeat="0.2s")
    release = anyio.Event()
    fences: list[tuple[int, int, int]] = []

    @scheduler.every("job", "1h", offset=offset)
    async def job(ctx: RunContext) -> None:
        fences.append((ctx.slot, ctx.attempt, ctx.fence))
        if len(fences) == 1:
            await release.wait()

    async with anyio.create_task_group() as tg:
        (instance,) = [await Instance(scheduler).start(tg)]
        try:
            slot = scheduler.jobs["job"].schedule.previous_at_or_before(
                scheduler.store_now_ms())
            assert slot is not None
            assert (await claim_now(scheduler, "job", slot)) is not None
            await wait_for(lambda: fences, what="the handler")
            raw.save()  # the snapshot: the run is running
            release.set()
            await wait_history(scheduler, lambda h: h and h[0].outcome == "completed",
                               job="job", what="the run completed")
            await anyio.to_thread.run_sync(server.stop)
            await anyio.to_thread.run_sync(server.start)
            # the job's next claim (an earlier slot) finds the store changed servers
            assert (await claim_now(scheduler, "job", slot - 3_600_000)) is not None
            history = await wait_history(
                scheduler, lambda h: any(a.slot == slot and a.attempt == 2
                                         and a.outcome == "completed" for a in h),
                job="job", timeout=15, what="the reopened run taken over and completed")
        finally:
            await stop_all([instance])
    assert [(a.attempt, a.outcome) for a in history if a.slot == slot] == [
        (2, "completed"), (1, "lost")]
    first, again = (f for s, _, f in fences if s == slot)
    assert again > first  # attempt 2 of the reopened run is fenced above attempt 1


async def test_slots_due_in_a_quarantine_are_all_claimed_after_it(
        server: EmbeddedRedis, raw: redis.Redis) -> None:
    """The store restarts empty: the scheduler's claims find the loss and wait out the
    quarantine (a lease). The store answered all along, so every slot that fell due
    during it is claimed once it ends, not only the newest (sentinelfix)."""
    from lease_core import RunContext, Scheduler
    from tests.helpers import Instance, stop_all, wait_history

    prefix = f"f{uuid.uuid4().hex[:10]}"
    scheduler = Scheduler(RedisBackend(server.url, prefix=prefix), instance_id="one",
                          lease="1.5s", heartbeat="0.2s")

    @scheduler.every("job", "0.4s", overlap="allow")
    async def job(ctx: RunContext) -> None:
        pass

    async with anyio.create_task_group() as tg:
        (instance,) = [await Instance(scheduler).start(tg)]
        try:
            await wait_history(scheduler, lambda h: any(a.outcome == "completed" for a in h),
                               job="job", what="a run completed before the restart")
            restarted = await _restart_empty(server, raw)
            key = "{" + prefix + "/job}:job"
            await wait_for(lambda: raw.hget(key, "quiet"), timeout=10, what="the quarantine")
            quiet = int(raw.hget(key, "quiet") or 0)
            assert quiet >= restarted + 1_000
            history = await wait_history(
                scheduler, lambda h: any(a.slot > quiet + 400 for a in h), job="job",
                timeout=15, what="slots after the quarantine")
        finally:
            await stop_all([instance])
    slots = {a.slot for a in history}
    # the slots due in the quarantine, after the first claim that found it
    first_held = min(s for s in slots if s > restarted)
    during = range(first_held, quiet - 400, 400)
    assert len(during) >= 2
    assert all(s in slots for s in during), (sorted(slots), list(during))


async def test_a_check_before_any_claim_on_a_promoted_replica_reports_a_lost_run() -> None:
    """A backup's check that reaches a promoted replica before any claim there reports a
    watched run whose claim the failover lost as lost (the scheduler claims it again, and
    that claim is quarantined), not as deleted: backups then stopped watching it, its
    holder learnt at its heartbeat that its lease was gone, and the slot never ran."""
    async with _primary_and_replica() as (primary, replica, clients):
        prefix = f"f{uuid.uuid4().hex[:10]}"
        old = RedisBackend(f"redis://app:pw@127.0.0.1:{primary.port}/0", prefix=prefix)
        await old.start()
        try:
            assert (await old.claim(_request("job", "a"))).status is ClaimStatus.WON
            assert clients[0].execute_command("WAIT", 1, 5000) == 1
            _cut_the_replica_off(clients[0])
            lost = await old.claim(ClaimRequest("job", 2_000, "inst", "b", 60_000,
                                                overlap_skip=False))
            assert lost.status is ClaimStatus.WON
            before = await old.check([("job", 1_000), ("job", 2_000), ("job", 3_000)])
            assert set(before.runs) == {("job", 1_000), ("job", 2_000)}
            assert before.lost == frozenset()
        finally:
            await old.close()
        primary.stop()
        clients[1].execute_command("REPLICAOF", "NO", "ONE")

        backup = RedisBackend(f"redis://app:pw@127.0.0.1:{replica.port}/0", prefix=prefix)
        await backup.start()
        try:
            seen = await backup.check([("job", 1_000), ("job", 2_000)])
            assert set(seen.runs) == {("job", 1_000)}, seen
            assert seen.lost == frozenset({("job", 2_000)}), seen
            again = await backup.claim(ClaimRequest("job", 2_000, "inst", "c", 300,
                                                    overlap_skip=False))
            assert (again.status, again.run_status) == (ClaimStatus.RUNNING, None), again
        finally:
            await backup.close()
