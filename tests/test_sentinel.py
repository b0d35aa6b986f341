"""Redis through Sentinel: ``redis+sentinel://`` finds the primary, and the new one after a
failover, against a real primary, replica and Sentinel that the test starts."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from adapters.redis import sentinel_parts
from backends.embedded.redis import EmbeddedRedis, EmbeddedSentinel, find_server
from lease_core import BackendUnavailable, ConfigurationError, backend_from_url
from lease_core.abc import ClaimRequest, ClaimStatus, Lease, Outcome
from tests.helpers import wait_for
from tests.stores import missing_service

pytestmark = pytest.mark.anyio


def test_the_url_names_the_sentinels_the_service_and_the_db() -> None:
    sentinels, service, kwargs = sentinel_parts(
        "redis+sentinel://:pw@s1:26380,s2/jobs/3?sentinel_password=sp&socket_timeout=2")
    assert sentinels == [("s1", 26380), ("s2", 26379)] and service == "jobs"
    assert kwargs == {"db": 3, "password": "pw", "socket_timeout": 2.0,
                      "sentinel_kwargs": {"password": "sp"}}
    for bad in ("redis+sentinel://s1:26379", "redis+sentinel://s1/a/b/c",
                "redis+sentinel://s1/jobs/x"):
        with pytest.raises(ConfigurationError, match="service"):
            sentinel_parts(bad)


def test_an_ipv6_sentinel_is_named_without_its_brackets() -> None:
    # The brackets were kept as part of the host name ("[::1]", which no resolver
    # knows), and "[::1]" without a port raised a bare ValueError (port "1]").
    for url, expected in (("redis+sentinel://[::1]:26380/jobs", [("::1", 26380)]),
                          ("redis+sentinel://[::1]/jobs", [("::1", 26379)]),
                          ("redis+sentinel://s1,[fd00::2]:5000,[fd00::3]/jobs/1",
                           [("s1", 26379), ("fd00::2", 5000), ("fd00::3", 26379)])):
        assert sentinel_parts(url)[0] == expected
        backend_from_url(url)  # accepted as the adapter reads it


async def test_the_urls_pool_and_connection_options_reach_the_primarys_client() -> None:
    # ?max_connections= and ?timeout= (the pool's bounds, as on a redis:// URL) and the
    # connections' options were accepted and dropped: the pool stayed at 8 connections.
    from adapters.redis import redis_adapter

    url = ("redis+sentinel://127.0.0.1:1/jobs/2?max_connections=32&timeout=3"
           "&client_name=app&health_check_interval=5")
    backend_from_url(url)  # the backend accepts it, as the adapter below reads it
    adapter = redis_adapter(url)  # opens nothing yet
    try:
        pool = adapter.client.connection_pool
        assert (pool.max_connections, pool.timeout) == (32, 3.0)
        options = pool.connection_kwargs
        assert (options["client_name"], options["health_check_interval"], options["db"]) == (
            "app", 5, 2)
    finally:
        await adapter.aclose()


@pytest.mark.parametrize("query", ["ssl_ca_certs=/etc/ca.pem", "ssl_cert_reqs=required",
                                   "password=pw", "db=3", "retry_on_error=TimeoutError"])
def test_a_url_parameter_the_sentinel_url_cannot_apply_is_refused_not_dropped(
        query: str) -> None:
    # TLS options without TLS would have connected in clear text, silently.
    with pytest.raises(ConfigurationError, match=f"takes no parameter '{query.split('=')[0]}'"):
        backend_from_url(f"redis+sentinel://:secret@s1:26379/jobs/0?{query}")


def _sentinel_refusal(message: str, service: str, sentinels: str) -> None:
    assert message.startswith(f"no Sentinel at {sentinels} named a primary for the service "
                              f"{service!r} ("), message
    assert "<redis" not in message and "Redis at Redis" not in message, message
    assert "'sentinel monitor'" in message and "pw" not in message, message


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_sentinels_that_name_no_primary_are_said_so_without_the_clients_repr(
        anyio_backend: str) -> None:
    """redis-py's MasterNotFoundError holds each Sentinel client's whole repr (some 900
    characters of pool and connection settings), and the primary's client names no host:
    the message read "cannot reach Redis at Redis (No master found for 'jobs' :
    <redis.asyncio.client.Redis(<redis.asyncio.connection.ConnectionPool(...". It names
    the Sentinels' addresses and the service, and what to check."""
    backend = backend_from_url("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/jobs/0")
    with pytest.raises(BackendUnavailable) as info:
        await backend.start()
    _sentinel_refusal(str(info.value), "jobs", "127.0.0.1:1, 127.0.0.1:2")
    assert "127.0.0.1:1 - " in str(info.value) and "127.0.0.1:2 - " in str(info.value)
    await backend.close()


async def test_a_service_the_sentinel_does_not_watch_is_named(
        sentinel_group: tuple[EmbeddedRedis, EmbeddedRedis, EmbeddedSentinel]) -> None:
    sentinel = sentinel_group[2]
    backend = backend_from_url(f"redis+sentinel://:pw@127.0.0.1:{sentinel.port}/nosuch/0")
    with pytest.raises(BackendUnavailable) as info:
        await backend.start()
    _sentinel_refusal(str(info.value), "nosuch", f"127.0.0.1:{sentinel.port}")
    await backend.close()


def _binary() -> Path:
    binary = find_server("system") or find_server("valkey") or find_server("redis")
    if binary is None:
        missing_service("a redis-server or valkey-server binary (Sentinel mode)")
    assert binary is not None
    return binary


def _wait_linked(primary: EmbeddedRedis, replica: EmbeddedRedis, timeout: float = 60) -> None:
    """Wait until the replica's initial sync is over and the primary counts it (on a busy
    machine that can take seconds; a test's WAIT must not spend its timeout on it)."""
    deadline = time.monotonic() + timeout
    with redis.Redis(port=replica.port) as r, redis.Redis(port=primary.port) as p:
        while True:
            if (r.info("replication").get("master_link_status") == "up"
                    and p.info("replication").get("connected_slaves") == 1):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the replica did not sync with the primary in {timeout:g} s")
            time.sleep(0.05)


@pytest.fixture
def sentinel_group() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis, EmbeddedSentinel]]:
    """A primary, its replica, and a Sentinel that promotes the replica 0.5 s after the
    primary stops answering."""
    binary = _binary()
    # Without a delay before the replica's first sync: Redis 7 waits 5 s for more
    # replicas by default, as long as the test's WAIT gave it.
    fast = ("--repl-diskless-sync-delay", "0")
    primary = EmbeddedRedis(binary, extra_args=fast)
    primary.start()
    replica = EmbeddedRedis(binary, extra_args=(*fast, "--replicaof", "127.0.0.1",
                                                str(primary.port)))
    replica.start()
    sentinel = EmbeddedSentinel(binary, primary.port)
    sentinel.start()
    try:
        _wait_linked(primary, replica)
        yield primary, replica, sentinel
    finally:
        for server in (sentinel, replica, primary):
            server.close()


def _primary_port(sentinel: EmbeddedSentinel) -> int:
    client = redis.Redis(port=sentinel.port)
    try:
        _, port = client.execute_command("SENTINEL", "get-master-addr-by-name", sentinel.service)
    finally:
        client.close()
    return int(port)


async def test_claims_reach_the_new_primary_after_a_failover(
        sentinel_group: tuple[EmbeddedRedis, EmbeddedRedis, EmbeddedSentinel]) -> None:
    primary, replica, sentinel = sentinel_group
    prefix = "sentinel_" + uuid.uuid4().hex[:8]
    backend = backend_from_url(sentinel.url, namespace=prefix)
    await backend.start()
    try:
        first = ClaimRequest("nightly", 1_000, "a", "t1", 500)
        assert (await backend.claim(first)).status is ClaimStatus.WON
        assert await backend.finish(Lease("nightly", 1_000, "t1", 500), Outcome.COMPLETED)
        direct = redis.Redis(port=primary.port)
        assert direct.execute_command("WAIT", 1, 30_000) == 1  # the replica has it all
        direct.close()

        assert primary.process is not None
        primary.process.send_signal(signal.SIGKILL)
        started = time.monotonic()
        await wait_for(lambda: _primary_port(sentinel) == replica.port, timeout=30,
                       what="the Sentinel to promote the replica")

        quarantined: list[int | None] = []

        async def claimed() -> bool:
            try:
                again = ClaimRequest("nightly", 2_000, "b", "t2", 500)
                result = await backend.claim(again)
            except BackendUnavailable:
                return False  # still on the old primary's connections; asked again
            if result.status is ClaimStatus.RUNNING and result.run_status is None:
                quarantined.append(result.expires_ms)
            return result.status is ClaimStatus.WON

        await wait_for(claimed, timeout=30, what="a claim on the new primary")
        # the first win on the new server (another replication id) waited a lease first
        assert quarantined, "no quarantine on the promoted replica"
        print(f"claims reached the new primary {time.monotonic() - started:.1f} s "
              "after the primary was killed")
        history = await backend.history("nightly")
        assert [(a.slot, a.outcome) for a in history] == [
            (2_000, None), (1_000, Outcome.COMPLETED)]  # replicated before the failover
    finally:
        await backend.close()


async def test_calls_beyond_the_pool_wait_for_a_connection_through_sentinel(
        sentinel_group: tuple[EmbeddedRedis, EmbeddedRedis, EmbeddedSentinel]) -> None:
    """More calls at once than the pool holds wait for a free connection, as through a
    ``redis://`` URL: redis-py's own Sentinel pool raised "Too many connections", which
    read as the store being unreachable while it answered (sentinelfix)."""
    import anyio

    from adapters.redis import MAX_CONNECTIONS, redis_adapter

    _, _, sentinel = sentinel_group
    adapter = redis_adapter(sentinel.url)
    key = "pool_" + uuid.uuid4().hex[:8]
    replies: list[object] = []

    async def blocked() -> None:  # holds its connection for 0.2 s
        replies.extend(await adapter.execute([("BLPOP", key, "0.2")]))

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(MAX_CONNECTIONS + 4):
                tg.start_soon(blocked)
    finally:
        await adapter.aclose()
    assert replies == [None] * (MAX_CONNECTIONS + 4)
