"""Peers on the same servers, in the same run: acquire+release against claim+finish.

Redis: redis-py's asyncio ``Lock``, python-redis-lock (sync only), pottery's ``Redlock``
with one master (sync only). PostgreSQL: ShedLock's single-upsert lock statement and its
unlock through raw psycopg. One sequential client each; operations per second.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import redis
import redis.asyncio
from psycopg_pool import AsyncConnectionPool

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend

from ._util import Servers
from .throughput import claim_finish_op

__all__ = ["run_peers"]

SHEDLOCK_TABLE = """
CREATE TABLE IF NOT EXISTS shedlock (
    name VARCHAR(64) NOT NULL PRIMARY KEY, lock_until TIMESTAMP NOT NULL,
    locked_at TIMESTAMP NOT NULL, locked_by VARCHAR(255) NOT NULL)"""
# ShedLock's PostgresJdbcTemplateStorageAccessor with usingDbTime(): one upsert to lock.
SHEDLOCK_LOCK = """
INSERT INTO shedlock (name, lock_until, locked_at, locked_by)
VALUES (%s, timezone('utc', CURRENT_TIMESTAMP) + %s * interval '1 millisecond',
        timezone('utc', CURRENT_TIMESTAMP), %s)
ON CONFLICT (name) DO UPDATE
SET lock_until = timezone('utc', CURRENT_TIMESTAMP) + %s * interval '1 millisecond',
    locked_at = timezone('utc', CURRENT_TIMESTAMP), locked_by = %s
WHERE shedlock.lock_until <= timezone('utc', CURRENT_TIMESTAMP)"""
SHEDLOCK_UNLOCK = """
UPDATE shedlock SET lock_until = GREATEST(locked_at, timezone('utc', CURRENT_TIMESTAMP))
WHERE name = %s"""


async def _rate(fn: Callable[[int], Any], seconds: float, *, sync: bool = False) -> float:
    """Sequential operations per second of ``fn(i)`` for ``seconds``."""

    def loop_sync() -> tuple[int, float]:
        start = time.perf_counter()
        i = 0
        while time.perf_counter() - start < seconds:
            fn(i)
            i += 1
        return i, time.perf_counter() - start

    if sync:
        n, elapsed = await anyio.to_thread.run_sync(loop_sync)
        return n / elapsed
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < seconds:
        await fn(i)
        i += 1
    return i / (time.perf_counter() - start)


async def _redis_peers(servers: Servers, seconds: float, repeat: int) -> dict[str, Any]:
    aclient = redis.asyncio.Redis.from_url(servers.redis_url)
    sclient = redis.Redis.from_url(servers.redis_url)
    backend = RedisBackend(aclient, prefix="peers")
    await backend.start()
    results: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    try:
        tag = uuid.uuid4().hex[:6]

        async def ours(i: int) -> None:
            await claim_finish_op(backend, f"peer-{tag}", i + 1)

        async def redis_py_lock(i: int) -> None:
            lock = aclient.lock("peers:redis-py", timeout=30)
            if not await lock.acquire(blocking=False):
                raise RuntimeError("redis-py lock not acquired")
            await lock.release()

        contenders: dict[str, tuple[Callable[[int], Any], bool]] = {
            "anarchon_claim_finish": (ours, False),
            "redis_py_asyncio_lock": (redis_py_lock, False),
        }
        try:
            import redis_lock

            def python_redis_lock(i: int) -> None:
                lock = redis_lock.Lock(sclient, "peers:prl", expire=30)
                if not lock.acquire(blocking=False):
                    raise RuntimeError("python-redis-lock not acquired")
                lock.release()

            contenders["python_redis_lock_sync"] = (python_redis_lock, True)
        except ImportError:
            notes["python_redis_lock"] = "not installed (pip install python-redis-lock)"
        try:
            from pottery import Redlock

            def pottery_redlock(i: int) -> None:
                lock = Redlock(key="peers:pottery", masters={sclient}, auto_release_time=30)
                if not lock.acquire(blocking=False):
                    raise RuntimeError("pottery Redlock not acquired")
                lock.release()

            contenders["pottery_redlock_1_master_sync"] = (pottery_redlock, True)
        except ImportError:
            notes["pottery"] = "not installed (pip install pottery)"

        for _ in range(repeat):
            for name, (fn, sync) in contenders.items():
                results.setdefault(name, []).append(await _rate(fn, seconds, sync=sync))
    finally:
        await backend.close()
        await aclient.aclose()
        sclient.close()
    return {"ops_s": {k: round(max(v), 1) for k, v in results.items()}, "notes": notes}


async def _pg_peers(servers: Servers, seconds: float, repeat: int) -> dict[str, Any]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        servers.dsn, min_size=1, max_size=1, open=False,
        kwargs={"autocommit": True, "prepare_threshold": None})
    await pool.open(wait=True)
    backend = PostgresBackend(pool, table="peers")
    await backend.start()
    results: dict[str, list[float]] = {}
    try:
        async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as conn:
            await conn.execute(SHEDLOCK_TABLE)
            tag = uuid.uuid4().hex[:6]

            async def ours(i: int) -> None:
                await claim_finish_op(backend, f"peer-{tag}", i + 1)

            async def shedlock(i: int) -> None:
                cur = await conn.execute(SHEDLOCK_LOCK, ("peers", 30000, "bench", 30000,
                                                         "bench"), prepare=False)
                if cur.rowcount != 1:
                    raise RuntimeError("ShedLock lock not acquired")
                await conn.execute(SHEDLOCK_UNLOCK, ("peers",), prepare=False)

            for _ in range(repeat):
                for name, fn in (("anarchon_claim_finish", ours),
                                 ("shedlock_upsert_raw_psycopg", shedlock)):
                    results.setdefault(name, []).append(await _rate(fn, seconds))
    finally:
        await backend.close()
        await pool.close()
    return {"ops_s": {k: round(max(v), 1) for k, v in results.items()}}


async def run_peers(servers: Servers, *, seconds: float, repeat: int,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Both stores; returns the JSON section."""
    out = {"redis": await _redis_peers(servers, seconds, repeat),
           "pg": await _pg_peers(servers, seconds, repeat)}
    for store, section in out.items():
        ours = section["ops_s"]["anarchon_claim_finish"]
        for name, ops in section["ops_s"].items():
            log(f"  peers {store:<5} {name:<32} {ops:>8.1f}/s  ({ops / ours:.2f}x ours)")
    return out
