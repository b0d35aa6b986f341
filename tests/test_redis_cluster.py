"""A Redis Cluster through a URL: ``redis+cluster://host:port`` (any node) makes a Cluster
client, so ``backend_from_url`` and the CLI reach every node's slots; a ``redis://`` URL
of one node is refused (tests/test_redis_server_checks.py). On the suite's 3-node Valkey
Cluster (``valkey8_cluster``), each test under a key prefix of its own."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Iterator

import anyio.to_thread
import pytest
import redis.cluster

from backends.embedded.redis import EmbeddedRedisCluster
from backends.redis import RedisBackend
from lease_core import backend_from_url
from lease_core._structures import ClaimRequest, ClaimStatus
from lease_core.cli import main
from lease_core.errors import ConfigurationError
from lease_core.operations import Admin
from tests.stores.redis import delete_prefix

pytestmark = pytest.mark.anyio

JOBS = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]


def _url(cluster: EmbeddedRedisCluster) -> str:
    """The Cluster URL of the cluster's first node."""
    return cluster.url.replace("redis://", "redis+cluster://", 1)


@pytest.fixture
def prefix(valkey8_cluster: EmbeddedRedisCluster) -> Iterator[str]:
    """A key prefix whose jobs fall on more than one node; deleted on every node after."""
    name = f"c{uuid.uuid4().hex[:10]}"
    raw = redis.cluster.RedisCluster.from_url(valkey8_cluster.url)
    try:
        nodes = {raw.get_node_from_key("{" + f"{name}/{job}" + "}:job").name for job in JOBS}
    finally:
        raw.close()
    assert len(nodes) > 1, "the jobs' slots should fall on more than one node"
    yield name
    for url in valkey8_cluster.urls:
        delete_prefix(url, name, True)


async def _store(cluster: EmbeddedRedisCluster, prefix: str) -> None:
    """A store with JOBS, each with a run at slot 1000 claimed by instance 'i'."""
    backend = backend_from_url(f"{_url(cluster)}?prefix={prefix}")
    await backend.start()
    try:
        await backend.register_jobs(JOBS)
        for job in JOBS:
            claimed = await backend.claim(ClaimRequest(job, 1000, "i", f"{job}-1", 30_000))
            assert claimed.status is ClaimStatus.WON
    finally:
        await backend.close()


async def test_a_cluster_url_reaches_the_jobs_on_every_node(
        valkey8_cluster: EmbeddedRedisCluster, prefix: str) -> None:
    # A Cluster client of redis-py's under asyncio, its blocking one under trio (as a
    # redis:// URL makes the one or the other); there was no URL of a Cluster at all.
    await _store(valkey8_cluster, prefix)
    backend = backend_from_url(_url(valkey8_cluster), namespace=prefix)
    admin = Admin(backend, by="ops")
    async with admin:
        assert sorted(await backend.jobs()) == sorted(JOBS)
        assert len(await backend.history()) == len(JOBS)
        await admin.pause("beta")
        assert await admin.paused() == {"beta": "ops"}
        slot = await admin.trigger("gamma")
        assert ("gamma", slot) in await backend.queued(JOBS)
        runs = await backend.runs(open_only=True)
        assert {r.job for r in runs} == set(JOBS)


async def test_a_cluster_url_is_checked_before_connecting() -> None:
    for url, why in (("redis+cluster://127.0.0.1:7000/3", "database 0 only"),
                     ("redis+cluster://127.0.0.1:7000?db=2", "names database '2'.* no \\?db="),
                     ("rediss+cluster://h:7000/0?db=1", "database 0 only"),
                     ("redis+cluster:///0", "names no node"),
                     ("redis+cluster://h:7000?timeout=5", "no such wait"),
                     ("redis+cluster://h:7000?ssl_cert_reqs=none", "rediss\\+cluster")):
        with pytest.raises(ConfigurationError, match=why):
            RedisBackend(url)
    with pytest.raises(ConfigurationError, match="cannot be used on a Redis Cluster"):
        RedisBackend("redis+cluster://127.0.0.1:7000?wait_replicas=1")


@pytest.mark.asyncio_only
async def test_a_cluster_client_that_reads_from_replicas_is_refused() -> None:
    """A Cluster client with ``read_from_replicas`` (or a ``load_balancing_strategy``)
    sends the backend's plain reads (a backup's check of the runs it watches, a step's
    checkpoint) to replicas, which lag: a taking-over step could read a checkpoint from
    before its effect and make the effect again. It was accepted, and undocumented; it
    is refused (a URL's query is refused as unknown, as before)."""
    from redis.asyncio import RedisCluster
    from redis.cluster import LoadBalancingStrategy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # redis-py's, of the keyword
        clients = [RedisCluster(host="127.0.0.1", port=7000, read_from_replicas=True),
                   RedisCluster(host="127.0.0.1", port=7000,
                                load_balancing_strategy=LoadBalancingStrategy.ROUND_ROBIN)]
    for client in clients:
        with pytest.raises(ConfigurationError, match=r"reads from replicas .*primaries only"):
            RedisBackend(client)
    assert RedisBackend(RedisCluster(host="127.0.0.1", port=7000)).wait_replicas is None
    for query in ("read_from_replicas=false", "load_balancing_strategy=1"):
        with pytest.raises(ConfigurationError, match="unknown parameter"):
            RedisBackend(f"redis+cluster://127.0.0.1:7000?{query}")


@pytest.mark.asyncio_only
async def test_the_cli_reaches_a_cluster_through_its_url(
        valkey8_cluster: EmbeddedRedisCluster, prefix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # status, history, trigger and prune: each read or wrote the one node of a redis://
    # URL, and was refused on a Cluster node; redis+cluster:// reaches them all.
    await _store(valkey8_cluster, prefix)
    url = _url(valkey8_cluster)

    def cli(*args: str) -> int:
        return main([*args, "--url", url, "--prefix", prefix])

    capsys.readouterr()
    assert await anyio.to_thread.run_sync(cli, "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert sorted(job["name"] for job in status["jobs"]) == sorted(JOBS)
    assert all(len(job["running"]) == 1 for job in status["jobs"])
    assert await anyio.to_thread.run_sync(cli, "trigger", "delta") == 0
    assert "queued" in capsys.readouterr().out
    assert await anyio.to_thread.run_sync(cli, "history", "--json", "--limit", "100") == 0
    assert sorted(row["job"] for row in json.loads(capsys.readouterr().out)) == sorted(JOBS)
    assert await anyio.to_thread.run_sync(cli, "pause", "eps") == 0
    assert await anyio.to_thread.run_sync(cli, "prune", "--keep", "0") == 0
    capsys.readouterr()
    backend = RedisBackend(url, prefix=prefix)
    async with Admin(backend) as admin:
        assert await admin.paused() == {"eps": "cli"}
        assert [job for job, _ in await backend.queued(JOBS)] == ["delta"]
