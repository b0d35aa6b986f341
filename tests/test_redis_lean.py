"""The lean single-command path of plain asyncio clients (adapters/redis_lean.py).

Every guarantee of ``execute_command`` it replaces, on real servers: the same replies
(response callbacks, decoding, error replies), lost scripts loaded again, a killed
connection retried, ``socket_timeout``, the bounded pool's wait, a cancelled call that
leaves no reply behind, and the clients that keep ``execute_command``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio
import valkey.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from adapters.redis import AsyncClientAdapter, redis_adapter
from backends.embedded.redis import EmbeddedRedis, find_server
from lease_core.errors import BackendUnavailable

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]

SCRIPT = "return {1, 'two', ARGV[1]}"


@pytest.fixture
def own_server() -> Iterator[EmbeddedRedis]:
    """A server of this test's own: the tests pause it and kill its clients."""
    binary = find_server("valkey")
    assert binary is not None
    with EmbeddedRedis(binary) as server:
        yield server


def _adapter(client: Any) -> AsyncClientAdapter:
    adapter = redis_adapter(client)
    assert isinstance(adapter, AsyncClientAdapter)
    return adapter


async def test_plain_clients_are_lean_and_the_others_are_not(
        system_redis_server: EmbeddedRedis) -> None:
    url = system_redis_server.url
    plain = redis.asyncio.Redis.from_url(url)
    blocking = redis.asyncio.Redis.from_pool(
        redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=2))
    single = redis.asyncio.Redis.from_url(url, single_connection_client=True)

    class Sub(redis.asyncio.Redis):
        """A subclass, whose execute_command may do more."""

    from redis.asyncio.sentinel import Sentinel

    sentinel = Sentinel([("127.0.0.1", system_redis_server.port)]).master_for("svc")
    cached = valkey.asyncio.Valkey.from_url(url, protocol=3, cache_enabled=True)
    clients = {"plain": plain, "blocking": blocking, "valkey": valkey.asyncio.Valkey.from_url(url),
               "single": single, "subclass": Sub.from_url(url), "sentinel": sentinel,
               "valkey-cached": cached}
    try:
        lean = {name: _adapter(client).lean for name, client in clients.items()}
    finally:
        for client in clients.values():
            await client.aclose()
    assert lean == {"plain": True, "blocking": True, "valkey": True, "single": False,
                    "subclass": False, "sentinel": False, "valkey-cached": False}


@pytest.mark.parametrize("kind", ["redis", "redis-decoded", "valkey"])
async def test_replies_are_the_drivers_own(system_redis_server: EmbeddedRedis,
                                           kind: str) -> None:
    url = system_redis_server.url
    client: Any = (valkey.asyncio.Valkey.from_url(url) if kind == "valkey" else
                   redis.asyncio.Redis.from_url(url, decode_responses=kind.endswith("decoded")))
    adapter = _adapter(client)
    assert adapter.lean
    try:
        (sha,) = await adapter.load_scripts([SCRIPT])
        key = f"lean:{kind}"
        assert await adapter.execute([("DEL", key, f"{key}:h")]) == [0]
        assert await adapter.execute([("HSET", f"{key}:h", "a", 1, "b", "2")]) == [2]
        # each command's reply the same twice, so ours and the driver's can be compared
        commands: list[tuple[Any, ...]] = [
            ("SET", key, "välue"), ("GET", key), ("GET", f"{key}:no"), ("HGETALL", f"{key}:h"),
            ("PING",), ("EXISTS", key), ("TYPE", key), ("EVALSHA", sha, 0, "x"),
            ("HMGET", f"{key}:h", "a", "zz"), ("SET", key + "n", -3, "XX"),
        ]
        for command in commands:
            (ours,) = await adapter.execute([command])
            theirs = await client.execute_command(*command)
            assert ours == theirs, command
            assert type(ours) is type(theirs), command
        (error,) = await adapter.execute([("HGET", key)])  # a wrong number of arguments
        with pytest.raises(type(error), match="wrong number of arguments"):
            await client.execute_command("HGET", key)
        (seconds, micros), = await adapter.execute([("TIME",)])  # TIME's callback: ints
        assert isinstance(seconds, int) and isinstance(micros, int)
    finally:
        await client.aclose()


async def test_a_lost_script_is_loaded_again(system_redis_server: EmbeddedRedis) -> None:
    client = redis.asyncio.Redis.from_url(system_redis_server.url)
    adapter = _adapter(client)
    try:
        (sha,) = await adapter.load_scripts([SCRIPT])
        await client.script_flush()
        assert await adapter.execute([("EVALSHA", sha, 0, "z")]) == [[1, b"two", b"z"]]
    finally:
        await client.aclose()


@pytest.mark.parametrize("driver_retry", [True, False])
async def test_a_killed_connection_is_retried(own_server: EmbeddedRedis,
                                              driver_retry: bool) -> None:
    options = {} if driver_retry else {"retry": Retry(NoBackoff(), 0)}
    client = redis.asyncio.Redis.from_url(own_server.url, **options)
    raw = redis.Redis.from_url(own_server.url)
    adapter = _adapter(client)
    try:
        assert await adapter.execute([("SET", "k", "1")]) == [True]
        assert raw.client_kill_filter(_type="normal", skipme=True) >= 1
        # without the driver's retry, the adapter's own (one try on a fresh connection)
        assert await adapter.execute([("GET", "k")]) == [b"1"]
    finally:
        await client.aclose()
        raw.close()


async def test_socket_timeout_holds_and_leaves_no_reply_behind(
        own_server: EmbeddedRedis) -> None:
    client = redis.asyncio.Redis.from_url(own_server.url, socket_timeout=0.2,
                                          retry=Retry(NoBackoff(), 0))
    raw = redis.Redis.from_url(own_server.url)
    adapter = _adapter(client)
    try:
        await adapter.execute([("SET", "a", "A")])
        await adapter.execute([("SET", "b", "B")])
        raw.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        started = anyio.current_time()
        with pytest.raises(BackendUnavailable, match="cannot reach Redis"):
            await adapter.execute([("GET", "a")])
        assert anyio.current_time() - started < 1.2  # the timeout, not the pause
        raw.execute_command("CLIENT", "UNPAUSE")
        assert await adapter.execute([("GET", "b")]) == [b"B"]
    finally:
        await client.aclose()
        raw.close()


async def test_a_cancelled_call_leaves_no_reply_behind(own_server: EmbeddedRedis) -> None:
    client = redis.asyncio.Redis.from_url(own_server.url)
    raw = redis.Redis.from_url(own_server.url)
    adapter = _adapter(client)
    try:
        await adapter.execute([("SET", "a", "A")])
        await adapter.execute([("SET", "b", "B")])
        raw.execute_command("CLIENT", "PAUSE", 500, "ALL")
        with anyio.move_on_after(0.1) as scope:
            await adapter.execute([("GET", "a")])
        assert scope.cancelled_caught
        raw.execute_command("CLIENT", "UNPAUSE")
        for _ in range(3):
            assert await adapter.execute([("GET", "b")]) == [b"B"]
    finally:
        await client.aclose()
        raw.close()


async def test_a_bounded_pool_waits_for_a_connection_then_gives_up(
        system_redis_server: EmbeddedRedis) -> None:
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        system_redis_server.url, max_connections=1, timeout=0.3)
    client = redis.asyncio.Redis.from_pool(pool)
    adapter = _adapter(client)
    try:
        assert adapter.lean
        held = await pool.get_connection()
        with pytest.raises(BackendUnavailable, match="no pooled connection"):
            await adapter.execute([("PING",)])
        replies: list[Any] = []

        async def call() -> None:
            replies.extend(await adapter.execute([("PING",)]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.wait_all_tasks_blocked()  # the call waits for the only connection
            assert replies == []
            await pool.release(held)
        assert replies == [True]
    finally:
        await client.aclose()


def _in_use(pool: Any) -> int:
    """The connections ``pool`` counts as in use (its public count, by state: redis-py 8
    has it, the declared minimum 5.3 does not, so `make test-minimums` skips this)."""
    attributes_module = pytest.importorskip(
        "redis.observability.attributes", reason="this redis-py has no public in-use count")
    state, used = (attributes_module.DB_CLIENT_CONNECTION_STATE,
                   attributes_module.ConnectionState.USED.value)
    return sum(count for count, attributes in pool.get_connection_count()
               if attributes.get(state) == used)


async def test_which_pools_lend_a_connection_to_keep(system_redis_server: EmbeddedRedis) -> None:
    url = system_redis_server.url
    clients = {
        "default": redis.asyncio.Redis.from_url(url),
        "small": redis.asyncio.Redis.from_url(url, max_connections=4),
        "blocking": redis.asyncio.Redis.from_pool(
            redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=200)),
        "resp3": redis.asyncio.Redis.from_url(url, protocol=3),
    }
    try:
        keeps = {name: _adapter(client).keeps_connection for name, client in clients.items()}
        for name, owned in {"owned url": _adapter(url),
                            "owned pool of 1": _adapter(f"{url}?max_connections=1")}.items():
            keeps[name] = owned.keeps_connection
            await owned.aclose()
    finally:
        for client in clients.values():
            await client.aclose()
    assert keeps == {"default": True, "small": False, "blocking": False, "resp3": False,
                     "owned url": True, "owned pool of 1": False}


async def test_a_kept_connection_is_given_back_on_close(
        system_redis_server: EmbeddedRedis) -> None:
    client = redis.asyncio.Redis.from_url(system_redis_server.url)
    adapter = _adapter(client)
    try:
        assert await adapter.execute([("PING",)]) == [True]
        assert _in_use(client.connection_pool) == 1  # kept for the next call
        assert await adapter.execute([("PING",)]) == [True]
        assert _in_use(client.connection_pool) == 1  # the same one
        await adapter.aclose()
        assert _in_use(client.connection_pool) == 0
        assert await client.ping()  # the client passed in still works
    finally:
        await client.aclose()


async def test_a_server_gone_while_a_connection_is_kept_fails_at_once(
        own_server: EmbeddedRedis) -> None:
    adapter = _adapter(own_server.url)
    try:
        assert adapter.keeps_connection
        assert await adapter.execute([("SET", "k", "v")]) == [True]
        own_server.stop()  # returns once the server process has exited
        await anyio.wait_all_tasks_blocked()  # a loop turn: the closed connection's EOF is read
        started = anyio.current_time()
        with pytest.raises(BackendUnavailable, match="cannot reach Redis"):
            await adapter.execute([("GET", "k")])
        # as through the pool: no driver retries with backoff against a server that is down
        assert anyio.current_time() - started < 1.0
        own_server.start()
        assert await adapter.execute([("PING",)]) == [True]
    finally:
        await adapter.aclose()


async def test_one_connection_serves_lean_calls_and_batches_at_once(
        own_server: EmbeddedRedis) -> None:
    adapter = _adapter(f"{own_server.url}?max_connections=2&timeout=5")
    replies: list[Any] = []
    try:
        assert adapter.keeps_connection

        async def lean(i: int) -> None:
            replies.append(await adapter.execute([("SET", f"k{i}", i)]))

        async def batch(i: int) -> None:
            replies.append(await adapter.execute([("SET", f"b{i}", i), ("GET", f"b{i}")]))

        # two connections for 20 calls at once: a kept one never starves the pool's waiters
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(lean if i % 3 else batch, i)
        assert sorted(map(str, replies)) == sorted(
            str([True, str(i).encode()] if i % 3 == 0 else [True]) for i in range(20))
    finally:
        await adapter.aclose()
