"""Heartbeat cost with 1 to 10,000 leases held by one instance.

Per size: statements the store executed per tick (pg_stat_statements) or round trips and
script calls per tick (Redis), and time per tick of the library beside the raw batched
``UPDATE`` / pipeline, measured tick by tick alternately (median of each).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import psycopg
import redis.asyncio
from psycopg_pool import AsyncConnectionPool

from backends.postgres import PostgresBackend, Statements
from backends.postgres.statements import int_array, text_array
from backends.redis import HEARTBEAT_BATCH, SCRIPTS, RedisBackend
from lease_core.abc import Lease

from ._stats import PgCounter, redis_commandstats, redis_reset_stats
from ._util import Servers, median
from .worker import CountingRedis

__all__ = ["run_heartbeat"]

SLOT = 1_000
LEASE_MS = 60_000
TABLE = "hb"


def _leases(n: int) -> list[Lease]:
    return [Lease(f"hb{g}", SLOT, f"tok{g}", LEASE_MS) for g in range(n)]


async def _alternate(lib: Callable[[], Awaitable[int]], raw: Callable[[], Awaitable[int]],
                     budget: float, n: int) -> tuple[float, float, int]:
    """Median seconds per tick of each, alternating; checks every lease was renewed."""
    times: dict[str, list[float]] = {"lib": [], "raw": []}
    deadline = time.perf_counter() + budget
    ticks = 0
    while ticks < 3 or (time.perf_counter() < deadline and ticks < 200):
        for name, fn in (("lib", lib), ("raw", raw)) if ticks % 2 == 0 else (("raw", raw),
                                                                               ("lib", lib)):
            t0 = time.perf_counter()
            held = await fn()
            times[name].append(time.perf_counter() - t0)
            if held != n:
                raise RuntimeError(f"{name} heartbeat renewed {held} of {n} leases")
        ticks += 1
    return median(times["lib"]) or 0.0, median(times["raw"]) or 0.0, ticks


async def _pg(servers: Servers, sizes: tuple[int, ...], budget: float,
              log: Callable[[str], None]) -> list[dict[str, Any]]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        servers.dsn, min_size=1, max_size=1, open=False,
        kwargs={"autocommit": True, "prepare_threshold": None})
    plain: AsyncConnectionPool[Any] = AsyncConnectionPool(
        servers.dsn, min_size=1, max_size=1, open=False)
    await pool.open(wait=True)
    await plain.open(wait=True)
    backend = PostgresBackend(pool, table=TABLE)
    default_pool_backend = PostgresBackend(plain, table=TABLE)
    await backend.start()
    await default_pool_backend.start()
    s = Statements(None, TABLE)
    counter = PgCounter(servers.dsn, "postgres", servers.pg_stat_statements)
    rows = []
    try:
        async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as raw:
            for n in sizes:
                await raw.execute(f"TRUNCATE {TABLE}")
                await raw.execute(
                    f"INSERT INTO {TABLE} (job, slot, status, attempt, token, instance_id, "
                    "expires_ms) SELECT 'hb' || g, %s, 'running', 1, 'tok' || g, 'bench', "
                    "(extract(epoch FROM clock_timestamp()) * 1000)::bigint + 3600000 "
                    "FROM generate_series(0, %s - 1) AS g", (SLOT, n))
                await raw.execute(f"ANALYZE {TABLE}")
                leases = _leases(n)
                params = (text_array([x.job for x in leases]),
                          int_array([x.slot for x in leases]),
                          text_array([x.token for x in leases]),
                          int_array([x.lease_ms for x in leases]))

                async def lib(leases: list[Lease] = leases) -> int:
                    return len((await backend.heartbeat(leases)).held)

                async def raw_tick(params: tuple[str, ...] = params,
                                   leases: list[Lease] = leases) -> int:
                    # the library builds its four array literals on every tick; so does
                    # this loop, with the same public helpers
                    args = (text_array([x.job for x in leases]),
                            int_array([x.slot for x in leases]),
                            text_array([x.token for x in leases]),
                            int_array([x.lease_ms for x in leases]))
                    assert len(args[0]) == len(params[0])
                    cur = await raw.execute(s.heartbeat, args, prepare=False)  # type: ignore[arg-type]
                    row = await cur.fetchone()
                    return len(row[1]) if row else 0

                stats: dict[str, Any] = {}
                for label, fn in (("library", lib), ("library_default_pool",
                                                     lambda lz=leases: _held(
                                                         default_pool_backend, lz)),
                                  ("raw", raw_tick)):
                    base = await counter.reset()
                    for _ in range(5):
                        await fn()
                    stats[label] = await counter.read(base)
                lib_t, raw_t, ticks = await _alternate(lib, raw_tick, budget, n)
                per_tick = {label: (v.get("statements", 0) / 5 if "statements" in v else None)
                            for label, v in stats.items()}
                xacts = {label: v["database"].get("xact_commit", 0) / 5
                         for label, v in stats.items()}
                row = {
                    "key": f"heartbeat.pg.n{n}", "store": "pg", "leases": n,
                    "statements_per_tick": per_tick["library"],
                    "statements_per_tick_raw": per_tick["raw"],
                    "statements_per_tick_default_pool": per_tick["library_default_pool"],
                    "by_kind": stats["library"].get("by_kind"),
                    "by_kind_default_pool": stats["library_default_pool"].get("by_kind"),
                    "xact_commit_per_tick": xacts["library"],
                    "library_ms": round(lib_t * 1000, 3), "raw_ms": round(raw_t * 1000, 3),
                    "ratio": round(raw_t / lib_t, 3) if lib_t else None, "ticks": ticks,
                }
                log(f"  heartbeat pg   {n:>6} leases: {row['statements_per_tick']} stmt/tick "
                    f"(default pool {row['statements_per_tick_default_pool']}), lib "
                    f"{row['library_ms']:.2f} ms raw {row['raw_ms']:.2f} ms ratio {row['ratio']}")
                rows.append(row)
    finally:
        await backend.close()
        await default_pool_backend.close()
        await pool.close()
        await plain.close()
    return rows


async def _held(backend: PostgresBackend, leases: list[Lease]) -> int:
    return len((await backend.heartbeat(leases)).held)


async def _redis(servers: Servers, sizes: tuple[int, ...], budget: float,
                 log: Callable[[str], None]) -> list[dict[str, Any]]:
    client = redis.asyncio.Redis.from_url(servers.redis_url)
    counting = CountingRedis(client)
    backend = RedisBackend(counting, prefix=TABLE)
    await backend.start()
    sha = SCRIPTS["heartbeat"].sha
    rows = []
    try:
        for n in sizes:
            leases = _leases(n)
            keys = [f"{{{TABLE}/{quote(x.job, safe='')}}}:run:{x.slot}" for x in leases]
            (t_s, _t_us) = await client.time()
            expires = int(t_s) * 1000 + 3_600_000
            pipe = client.pipeline(transaction=False)
            for key, lease in zip(keys, leases, strict=True):
                pipe.hset(key, mapping={"st": "running", "att": 1, "tok": lease.token,
                                        "inst": "bench", "exp": expires})
            await pipe.execute()

            async def lib(leases: list[Lease] = leases) -> int:
                return len((await backend.heartbeat(leases)).held)

            async def raw_tick(leases: list[Lease] = leases) -> int:
                # The same script calls as the library: HEARTBEAT_BATCH leases each.
                pipe = client.pipeline(transaction=False)
                for at in range(0, len(leases), HEARTBEAT_BATCH):
                    group = leases[at:at + HEARTBEAT_BATCH]
                    keys = [f"{{{TABLE}/{quote(x.job, safe='')}}}:run:{x.slot}" for x in group]
                    args = [v for x in group for v in (x.token, x.lease_ms)]
                    pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
                return sum(r[1].count(b"1") for r in replies)

            await redis_reset_stats(client)
            trips = counting.round_trips
            for _ in range(5):
                await lib()
            trips = (counting.round_trips - trips) / 5
            commands = await redis_commandstats(client)
            lib_t, raw_t, ticks = await _alternate(lib, raw_tick, budget, n)
            row = {
                "key": f"heartbeat.redis.n{n}", "store": "redis", "leases": n,
                "round_trips_per_tick": trips,
                "evalsha_per_tick": commands.get("evalsha", 0) / 5,
                "commands_per_tick_incl_scripts": sum(commands.values()) / 5,
                "library_ms": round(lib_t * 1000, 3), "raw_ms": round(raw_t * 1000, 3),
                "ratio": round(raw_t / lib_t, 3) if lib_t else None, "ticks": ticks,
            }
            log(f"  heartbeat redis {n:>6} leases: {trips} round trip/tick, "
                f"{row['evalsha_per_tick']} EVALSHA/tick, lib {row['library_ms']:.2f} ms "
                f"raw {row['raw_ms']:.2f} ms ratio {row['ratio']}")
            rows.append(row)
            await client.delete(*keys)
    finally:
        await backend.close()
        await client.aclose()
    return rows


async def run_heartbeat(servers: Servers, *, quick: bool, budget: float,
                        log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Both stores, every size; returns the JSON rows."""
    sizes = (1, 100, 1000) if quick else (1, 100, 1000, 10000)
    return [*await _pg(servers, sizes, budget, log), *await _redis(servers, sizes, budget, log)]
