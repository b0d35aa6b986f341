"""Peers on the same servers, in the same run: acquire+release against claim+finish.

Redis: redis-py's asyncio ``Lock``, python-redis-lock (sync only), pottery's ``Redlock``
with one master (sync only). PostgreSQL: ShedLock's single-upsert lock statement and its
unlock through raw psycopg. One sequential client each; operations per second.

The contenders run **interleaved**: each round runs every contender once for a short
while, in an order rotated from round to round, and the ratio anarchon ÷ peer is taken
within each round. The report gives the median of those per-round ratios and their
spread (min, quartiles, max), so a busy moment of a shared machine moves one round, not
one contender.

On PostgreSQL each turn also reads the server's WAL position before and after
(``pg_current_wal_lsn()``, on a connection of its own): the WAL bytes a contender wrote
per operation (claim + finish, or lock + unlock) are reported beside its rate, as
``wal_bytes_per_op`` (all its turns' bytes over all its operations). And the CPU time of
each turn, this process's (``time.process_time``) plus that of the contender's one server
process (``/proc/<pid>/schedstat``): ``cpu_us`` gives the µs per operation and the
per-round ratio peer ÷ anarchon of the CPU per operation, which a machine shared with
other work distorts far less than the rates.

The batched claim: ``claim_many`` of ``BATCH`` claims against the same claims made one
at a time with ``claim``, interleaved the same way; the ratio is claims per second
batched ÷ one at a time.

After the rounds, each Redis contender runs :data:`COUNTED_OPS` operations alone, and
the server's ``INFO commandstats`` and ``INFO cpu`` deltas give the commands per
operation: sent by the client, and run inside its scripts (``redis.call``).
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import redis
import redis.asyncio
from psycopg_pool import AsyncConnectionPool

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core.abc import Backend, ClaimRequest, ClaimStatus

from ._rounds import round_order
from ._util import Servers
from .throughput import HISTORY, INSTANCE, LEASE_MS, claim_finish_op

__all__ = ["BATCH", "interleaved", "run_peers"]

#: Claims per batch in the batched-claim comparison.
BATCH = 10

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



async def _rate(fn: Callable[[int], Any], seconds: float, *, sync: bool = False,
                start_at: int = 0) -> tuple[float, int]:
    """Sequential operations per second of ``fn(i)`` for ``seconds``; and the next ``i``."""

    def loop_sync() -> tuple[int, float]:
        start = time.perf_counter()
        i = start_at
        while time.perf_counter() - start < seconds:
            fn(i)
            i += 1
        return i, time.perf_counter() - start

    if sync:
        end, elapsed = await anyio.to_thread.run_sync(loop_sync)
        return (end - start_at) / elapsed, end
    start = time.perf_counter()
    i = start_at
    while time.perf_counter() - start < seconds:
        await fn(i)
        i += 1
    return (i - start_at) / (time.perf_counter() - start), i


def _spread(values: list[float]) -> dict[str, Any]:
    """Median, quartiles and extremes of per-round ratios."""
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {"median": round(statistics.median(ordered), 3), "min": round(ordered[0], 3),
            "q1": round(q1, 3), "q3": round(q3, 3), "max": round(ordered[-1], 3),
            "rounds": len(ordered)}


async def interleaved(contenders: dict[str, tuple[Callable[[int], Any], bool]], ours: str,
                      *, rounds: int, seconds: float,
                      per_op: dict[str, int] | None = None,
                      probes: dict[str, Callable[[str], Awaitable[float]]] | None = None
                      ) -> dict[str, Any]:
    """Run every contender once per round, order rotated each round; ratios per round.

    ``per_op`` scales a contender's operations (claims per ``claim_many`` call). Returns
    the median operations per second of each contender and, for every other contender,
    the spread of the per-round ratio ``ours ÷ it``. Each of ``probes`` reads, for the
    contender named, a counter that only grows (the WAL position, CPU time); for each it
    returns ``per_op`` (the growth during a contender's turns over the calls it made in
    them) and ``ratio``, the spread of the per-round ratio ``it ÷ ours`` of the growth per
    call (above 1 when ours grows it less, like the rate ratio).
    """
    names = list(contenders)
    ops: dict[str, list[float]] = {name: [] for name in names}
    counters = dict.fromkeys(names, 0)
    probes = probes or {}
    grown = {key: {name: [0.0] * rounds for name in names} for key in probes}
    calls = {name: [0] * rounds for name in names}
    scale = per_op or {}
    for name in names:  # warm-up: connections, scripts, prepared plans
        fn, sync = contenders[name]
        _, counters[name] = await _rate(fn, min(0.1, seconds), sync=sync,
                                        start_at=counters[name])
    for r in range(rounds):
        for name in round_order(names, r):
            fn, sync = contenders[name]
            before = {key: await read(name) for key, read in probes.items()}
            first = counters[name]
            rate, counters[name] = await _rate(fn, seconds, sync=sync,
                                               start_at=counters[name])
            for key, read in probes.items():
                grown[key][name][r] = await read(name) - before[key]
            calls[name][r] = counters[name] - first
            ops[name].append(rate * scale.get(name, 1))
    ratios = {
        name: _spread([a / b for a, b in zip(ops[ours], ops[name], strict=True)])
        for name in names if name != ours
    }
    out: dict[str, Any] = {"ops_s": {k: round(statistics.median(v), 1) for k, v in ops.items()},
                           "ratio": ratios, "rounds": rounds, "seconds_per_turn": seconds}
    for key, by_name in grown.items():
        per_round = {name: [g / max(c, 1) for g, c in zip(by_name[name], calls[name],
                                                          strict=True)] for name in names}
        out[key] = {
            "per_op": {name: round(sum(by_name[name]) / max(sum(calls[name]), 1), 1)
                       for name in names},
            "ratio": {name: _spread([theirs / mine if mine else 0.0 for mine, theirs in zip(
                per_round[ours], per_round[name], strict=True)])
                for name in names if name != ours},
        }
    return out


#: Operations of each Redis contender in the counted pass (commands per operation).
COUNTED_OPS = 500
#: Commands the Redis contenders send themselves, not from inside a script.
_TOP_LEVEL = ("evalsha", "eval", "set")


async def _commands_per_op(admin: Any, fn: Callable[[int], Any], sync: bool,
                           start: int) -> dict[str, Any]:
    """Run ``fn`` :data:`COUNTED_OPS` times alone; the server's ``INFO commandstats`` and
    ``INFO cpu`` deltas per operation: every command's calls (the scripts' own
    ``redis.call`` included, under their names), the calls made inside scripts, the
    server's CPU and its time in the top-level commands, and this process's CPU (µs)."""
    await admin.config_resetstat()
    cpu0 = await admin.info("cpu")
    client0 = time.process_time()
    if sync:
        def loop() -> None:
            for i in range(start, start + COUNTED_OPS):
                fn(i)
        await anyio.to_thread.run_sync(loop)
    else:
        for i in range(start, start + COUNTED_OPS):
            await fn(i)
    client_cpu = time.process_time() - client0
    cpu1 = await admin.info("cpu")
    stats = {k[8:]: v for k, v in (await admin.info("commandstats")).items()
             if k.startswith("cmdstat_") and k[8:] not in ("info", "config")}
    calls = {name: round(int(v["calls"]) / COUNTED_OPS, 2) for name, v in stats.items()}
    inside = sum(c for name, c in calls.items() if name not in _TOP_LEVEL)
    top_us = sum(int(v["usec"]) for name, v in stats.items() if name in _TOP_LEVEL)
    cpu = sum(float(cpu1[k]) - float(cpu0[k]) for k in ("used_cpu_sys", "used_cpu_user"))
    return {"calls_per_op": calls, "script_calls_per_op": round(inside, 2),
            "top_level_per_op": round(sum(calls.get(n, 0) for n in _TOP_LEVEL), 2),
            "server_usec_per_op": round(top_us / COUNTED_OPS, 1),
            "server_cpu_us_per_op": round(cpu / COUNTED_OPS * 1e6, 1),
            "client_cpu_us_per_op": round(client_cpu / COUNTED_OPS * 1e6, 1)}


async def _redis_peers(servers: Servers, seconds: float, rounds: int) -> dict[str, Any]:
    aclient = redis.asyncio.Redis.from_url(servers.redis_url)
    sclient = redis.Redis.from_url(servers.redis_url)
    backend = RedisBackend(aclient, prefix="peers")
    await backend.start()
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

        out = await interleaved(contenders, "anarchon_claim_finish", rounds=rounds,
                                seconds=seconds)
        # commands per operation: each contender alone on the server, after the rounds
        admin = redis.asyncio.Redis.from_url(servers.redis_url)
        try:
            out["commands"] = {name: await _commands_per_op(admin, fn, sync, 10_000_000)
                               for name, (fn, sync) in contenders.items()}
        finally:
            await admin.aclose()
    finally:
        await backend.close()
        await aclient.aclose()
        sclient.close()
    return {**out, "notes": notes}


def _cpu_us(server_pid: int) -> float:
    """This process's CPU time plus that of one PostgreSQL server process, in µs.

    The server's from ``/proc/<pid>/schedstat`` (time on a CPU, ns); without it (not
    Linux) the client's alone. CPU time is what a busy shared machine distorts least.
    """
    client = time.process_time_ns() / 1000
    try:
        with open(f"/proc/{server_pid}/schedstat") as f:
            return client + int(f.read().split()[0]) / 1000
    except (OSError, ValueError, IndexError):
        return client


async def _backend_pid(pool: AsyncConnectionPool[Any]) -> int:
    """The server process of a pool of one connection."""
    async with pool.connection() as conn:
        return int(conn.info.backend_pid)


async def _pg_peers(servers: Servers, seconds: float, rounds: int) -> dict[str, Any]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        servers.dsn, min_size=1, max_size=1, open=False,
        kwargs={"autocommit": True, "prepare_threshold": None})
    await pool.open(wait=True)
    backend = PostgresBackend(pool, table="peers")
    await backend.start()
    try:
        async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as conn, \
                await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as admin:
            await conn.execute(SHEDLOCK_TABLE)
            tag = uuid.uuid4().hex[:6]

            ours_pid = await _backend_pid(pool)
            pids = {"anarchon_claim_finish": ours_pid,
                    "shedlock_upsert_raw_psycopg": conn.info.backend_pid}

            async def cpu_us(name: str) -> float:
                return _cpu_us(pids[name])

            async def wal_position(name: str) -> float:
                cur = await admin.execute(
                    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8")
                row = await cur.fetchone()
                assert row is not None
                return float(row[0])

            async def ours(i: int) -> None:
                await claim_finish_op(backend, f"peer-{tag}", i + 1)

            async def shedlock(i: int) -> None:
                cur = await conn.execute(SHEDLOCK_LOCK, ("peers", 30000, "bench", 30000,
                                                         "bench"), prepare=False)
                if cur.rowcount != 1:
                    raise RuntimeError("ShedLock lock not acquired")
                await conn.execute(SHEDLOCK_UNLOCK, ("peers",), prepare=False)

            out = await interleaved({"anarchon_claim_finish": (ours, False),
                                     "shedlock_upsert_raw_psycopg": (shedlock, False)},
                                    "anarchon_claim_finish", rounds=rounds, seconds=seconds,
                                    probes={"wal_bytes": wal_position, "cpu_us": cpu_us})
            out["wal_bytes_per_op"] = out["wal_bytes"]["per_op"]
    finally:
        await backend.close()
        await pool.close()
    return out


def _requests(tag: str, i: int) -> list[ClaimRequest]:
    """``BATCH`` claims of different jobs for one instant (a new instant for each ``i``)."""
    return [ClaimRequest(f"{tag}-{n}", i + 1, INSTANCE, uuid.uuid4().hex, LEASE_MS,
                         history_size=HISTORY, overlap_skip=False) for n in range(BATCH)]


async def _batch_cell(backend: Backend, seconds: float, rounds: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]

    async def batched(i: int) -> None:
        results = await backend.claim_many(_requests(f"b{tag}", i))
        if any(r.status is not ClaimStatus.WON for r in results):
            raise RuntimeError("a batched claim was not won")

    async def one_at_a_time(i: int) -> None:
        for request in _requests(f"s{tag}", i):
            if (await backend.claim(request)).status is not ClaimStatus.WON:
                raise RuntimeError("a claim was not won")

    return await interleaved({"claim_many": (batched, False),
                              "claim_one_at_a_time": (one_at_a_time, False)}, "claim_many",
                             rounds=rounds, seconds=seconds,
                             per_op={"claim_many": BATCH, "claim_one_at_a_time": BATCH})


async def run_batches(servers: Servers, *, seconds: float, rounds: int) -> dict[str, Any]:
    """claim_many against sequential claims on Redis, psycopg and pg8000."""
    out: dict[str, Any] = {}
    aclient = redis.asyncio.Redis.from_url(servers.redis_url)
    backends: dict[str, Backend] = {
        "redis.redis_asyncio": RedisBackend(aclient, prefix="batch"),
        "pg.psycopg_pool": PostgresBackend(servers.dsn, table="batch"),
        "pg.pg8000": PostgresBackend(
            servers.dsn.replace("postgresql://", "postgresql+pg8000://", 1), table="batch8"),
    }
    try:
        for key, backend in backends.items():
            await backend.start()
            try:
                out[key] = await _batch_cell(backend, seconds, rounds)
            finally:
                await backend.close()
    finally:
        await aclient.aclose()
    return out


async def run_peers(servers: Servers, *, seconds: float, rounds: int,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Both stores, and the batched claim; returns the JSON section."""
    out: dict[str, Any] = {"redis": await _redis_peers(servers, seconds, rounds),
                           "pg": await _pg_peers(servers, seconds, rounds)}
    for store in ("redis", "pg"):
        section = out[store]
        for name, spread in section["ratio"].items():
            log(f"  peers {store:<5} anarchon / {name:<30} median {spread['median']:.2f} "
                f"(min {spread['min']:.2f}, max {spread['max']:.2f}, {spread['rounds']} rounds)")
        for name, wal in section.get("wal_bytes_per_op", {}).items():
            log(f"  peers {store:<5} WAL bytes per operation, {name:<30} {wal}")
        cpu = section.get("cpu_us")
        for name, spread in (cpu or {}).get("ratio", {}).items():
            log(f"  peers {store:<5} CPU per op (client + server), {name} / anarchon: median "
                f"{spread['median']:.2f} (min {spread['min']:.2f}, max {spread['max']:.2f}); "
                f"µs per op {cpu['per_op']}")
    for name, c in out["redis"]["commands"].items():
        inner = ", ".join(f"{k} {v:g}" for k, v in sorted(c["calls_per_op"].items())
                          if k not in _TOP_LEVEL)
        log(f"  peers redis commands per op, {name:<30} sent {c['top_level_per_op']:g}, "
            f"in scripts {c['script_calls_per_op']:g} ({inner}); server "
            f"{c['server_usec_per_op']:g} µs, CPU {c['server_cpu_us_per_op']:g} µs; client "
            f"CPU {c['client_cpu_us_per_op']:g} µs")
    out["batch"] = await run_batches(servers, seconds=seconds, rounds=rounds)
    for key, section in out["batch"].items():
        spread = section["ratio"]["claim_one_at_a_time"]
        log(f"  batch {key:<22} claim_many({BATCH}) / {BATCH} claims  median "
            f"{spread['median']:.2f} (min {spread['min']:.2f}, max {spread['max']:.2f})")
    return out
