"""``RedisBackend(wait_replicas=N)`` on finishes, checkpoints and operations (issue 21,
item 3), against a real primary and replica that the test starts.

The WAITs are counted in the primary's ``INFO commandstats``; once the replica is gone,
a write that the primary made but no replica acknowledged raises
:class:`~lease_core.errors.BackendUnavailable` as documented.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from backends.embedded.redis import EmbeddedRedis, find_server
from backends.redis import RedisBackend
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, Outcome, RunStatus
from lease_core.errors import BackendUnavailable
from lease_core.operations import Operation, OperationKind
from tests.helpers import wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture
def group() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    """A primary and its replica, in sync."""
    binary = find_server("redis")
    assert binary is not None, "no redis server installed"
    with EmbeddedRedis(binary, extra_args=("--repl-diskless-sync-delay", "0")) as primary:
        replica = EmbeddedRedis(binary, extra_args=("--replicaof", "127.0.0.1",
                                                    str(primary.port)))
        with replica:
            yield primary, replica


def _waits(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def _lease(job: str, slot: int, token: str) -> Lease:
    return Lease(job, slot, token, 30_000)


async def test_finishes_checkpoints_and_operations_wait_for_the_replicas(
        group: tuple[EmbeddedRedis, EmbeddedRedis]) -> None:
    primary, replica = group
    direct = redis.Redis.from_url(primary.url)
    await wait_for(lambda: direct.info("replication").get("slave0", {}).get("state")
                   == "online", timeout=15, what="the replica to be in sync")
    prefix = f"w{uuid.uuid4().hex[:10]}"
    waited = RedisBackend(primary.url, prefix=prefix, wait_replicas=1, wait_timeout="300ms")
    plain = RedisBackend(primary.url, prefix=prefix)
    await waited.start()
    await plain.start()
    try:
        for slot in (1, 2, 3, 4):
            won = await plain.claim(ClaimRequest("job", slot, "i", f"t{slot}", 30_000,
                                                  overlap_skip=False))
            assert won.status is ClaimStatus.WON

        calls = _waits(direct)
        assert await waited.set_checkpoint(_lease("job", 1, "t1"), {"at": 1})
        assert await waited.delete_checkpoint(_lease("job", 1, "t1"))
        assert await waited.finish(_lease("job", 1, "t1"), Outcome.COMPLETED)
        assert await waited.finish_many([(_lease("job", 2, "t2"), Outcome.COMPLETED, None),
                                         (_lease("job", 3, "t3"), Outcome.FAILED, "boom")])
        result = await waited.operate(Operation(OperationKind.PAUSE, "job", None, "test"))
        assert result.refused is None
        # one WAIT per call, in the call's round trip
        assert _waits(direct) == calls + 5

        # a call that wrote nothing (a stale token, a refused operation) does not fail
        replica.stop()
        await wait_for(lambda: direct.info("replication")["connected_slaves"] == 0,
                       timeout=15, what="the primary to see its replica gone")
        assert not await waited.finish(_lease("job", 1, "t1"), Outcome.COMPLETED)
        refused = await waited.operate(Operation(OperationKind.RETRY, "job", 99, "test"))
        assert refused.refused == "no_run"
        # writes no replica acknowledged raise, naming the call and the count
        with pytest.raises(BackendUnavailable,
                           match=r"the checkpoint of 'job' slot 4 was acknowledged by 0 of "
                                 r"wait_replicas=1 replicas within 300 ms"):
            await waited.set_checkpoint(_lease("job", 4, "t4"), {"at": 4})
        with pytest.raises(BackendUnavailable, match=r"the finish of 'job' slot 4 .* 0 of"):
            await waited.finish(_lease("job", 4, "t4"), Outcome.COMPLETED)
        # the primary made the write: not taken as done, but kept (a failover may lose it)
        state = (await plain.check([("job", 4)])).runs[("job", 4)]
        assert state.status is RunStatus.COMPLETED
        with pytest.raises(BackendUnavailable, match="the operation resume of 'job'") as raised:
            await waited.operate(Operation(OperationKind.RESUME, "job", None, "test"))
        # ... and the error says so: the resume is in effect, not to be sent again
        assert "the Redis primary made it" in str(raised.value)
        assert "does not count" not in str(raised.value)
        assert await plain.paused() == {}
    finally:
        await waited.close()
        await plain.close()
        direct.close()
