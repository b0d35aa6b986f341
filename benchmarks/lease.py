"""Named leases against their peers, same servers, same run: acquire + release.

Redis: ``Lease.acquire(timeout=0)`` + ``Lease.release()`` (one script each, the renewal
task started and stopped) against redis-py's asyncio ``Lock`` (``SET NX PX`` + its
release script), the same work: neither keeps history. PostgreSQL: the same ``Lease``
calls on a psycopg pool of one connection, against ShedLock's upsert + unlock on one raw
psycopg connection (:mod:`benchmarks.peers`): the issue's figure. The ``Lease`` borrows
a pooled connection for each statement, so ShedLock's same two statements through the
same kind of pool (a ``psycopg_pool`` checkout per statement, as the adapter makes) are a
fourth contender, the fairer peer (``report.LEASE_FAIRER_PEERS``: reported, not a
target). One sequential client each, uncontended (a new holder every time, so every
acquire takes the name).

Two more peers hand out a **fencing token**, as the ``Lease`` does (the issue's peers do
not): on Redis, a fenced lock in the way of Redisson's ``RFencedLock`` (one script: ``SET
NX PX`` and, when taken, ``INCR`` of the name's counter; released by redis-py's release
script); on PostgreSQL, ShedLock's upsert with a counter column incremented on every
take and returned (``RETURNING``), on the raw connection. Reported beside the others,
not targets (``report.LEASE_FAIRER_PEERS``).

Contenders run interleaved (order rotated every round); each round's ratio is taken
within the round, and the median and spread of the per-round ratios are reported, as
for the peers. Also measured per operation: this process's CPU time
(``time.process_time``), ratio peer ÷ anarchon (higher is better for anarchon too).
The contract's calls alone (``backend.acquire_lease`` + ``release_lease``, no ``Lease``
object) are a third contender, to show what the object costs.
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import redis.asyncio
from psycopg_pool import AsyncConnectionPool

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import Lease
from lease_core.abc import Backend

from ._rounds import Op, interleave
from ._util import Servers
from .peers import SHEDLOCK_LOCK, SHEDLOCK_TABLE, SHEDLOCK_UNLOCK

__all__ = ["FENCED_LOCK_SCRIPT", "run_lease"]

TTL_MS = 30_000
#: A Redis lock that hands out a fencing token: taken with ``SET NX PX``, then the
#: name's counter incremented and returned (nil when the name is held).
FENCED_LOCK_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false"""
#: ShedLock's table and upsert with a fencing counter, incremented at every take.
SHEDLOCK_FENCED_TABLE = """
CREATE TABLE IF NOT EXISTS shedlock_fenced (
    name VARCHAR(64) NOT NULL PRIMARY KEY, lock_until TIMESTAMP NOT NULL,
    locked_at TIMESTAMP NOT NULL, locked_by VARCHAR(255) NOT NULL,
    fence BIGINT NOT NULL DEFAULT 1)"""
SHEDLOCK_FENCED_LOCK = """
INSERT INTO shedlock_fenced (name, lock_until, locked_at, locked_by)
VALUES (%s, timezone('utc', CURRENT_TIMESTAMP) + %s * interval '1 millisecond',
        timezone('utc', CURRENT_TIMESTAMP), %s)
ON CONFLICT (name) DO UPDATE
SET lock_until = timezone('utc', CURRENT_TIMESTAMP) + %s * interval '1 millisecond',
    locked_at = timezone('utc', CURRENT_TIMESTAMP), locked_by = %s,
    fence = shedlock_fenced.fence + 1
WHERE shedlock_fenced.lock_until <= timezone('utc', CURRENT_TIMESTAMP)
RETURNING fence"""
SHEDLOCK_FENCED_UNLOCK = """
UPDATE shedlock_fenced SET lock_until = GREATEST(locked_at, timezone('utc', CURRENT_TIMESTAMP))
WHERE name = %s"""


def _spread(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {"median": round(statistics.median(ordered), 3), "min": round(ordered[0], 3),
            "q1": round(q1, 3), "q3": round(q3, 3), "max": round(ordered[-1], 3),
            "rounds": len(ordered)}


async def _interleaved(contenders: dict[str, Op], ours: str, *, rounds: int,
                       seconds: float) -> dict[str, Any]:
    rate, cpu = await interleave(contenders, rounds=rounds, seconds=seconds)
    names = list(contenders)
    others = [n for n in names if n != ours]
    return {
        "ops_s": {n: round(statistics.median(v), 1) for n, v in rate.items()},
        "cpu_us_per_op": {n: round(statistics.median(v) * 1e6, 1) for n, v in cpu.items()},
        "ratio": {n: _spread([a / b for a, b in zip(rate[ours], rate[n], strict=True)])
                  for n in others},
        "cpu_ratio": {n: _spread([b / a for a, b in zip(cpu[ours], cpu[n], strict=True)])
                      for n in others},
        "rounds": rounds, "seconds_per_turn": seconds,
    }


def _ours(backend: Backend, tag: str) -> tuple[Op, Op]:
    """``Lease`` acquire + release, and the contract's two calls alone."""

    async def lease(i: int) -> None:
        held = Lease(backend, f"{tag}-lease", ttl=TTL_MS / 1000)
        if not await held.acquire(timeout=0):
            raise RuntimeError("lease not acquired")
        await held.release()

    async def contract(i: int) -> None:
        answer = await backend.acquire_lease(f"{tag}-calls", f"holder-{i}", TTL_MS)
        if not answer.held:
            raise RuntimeError("lease not acquired")
        await backend.release_lease(f"{tag}-calls", answer.token)

    return lease, contract


async def _redis(servers: Servers, seconds: float, rounds: int) -> dict[str, Any]:
    client = redis.asyncio.Redis.from_url(servers.redis_url)
    backend = RedisBackend(client, prefix="leasebench")
    await backend.start()
    try:
        tag = uuid.uuid4().hex[:6]
        lease, contract = _ours(backend, tag)

        async def redis_py_lock(i: int) -> None:
            lock = client.lock(f"leasebench:{tag}:redis-py", timeout=TTL_MS / 1000)
            if not await lock.acquire(blocking=False):
                raise RuntimeError("redis-py lock not acquired")
            await lock.release()

        fenced_take = client.register_script(FENCED_LOCK_SCRIPT)
        fence_key = f"leasebench:{tag}:fenced:fence"

        async def fenced_lock(i: int) -> None:
            lock = client.lock(f"leasebench:{tag}:fenced", timeout=TTL_MS / 1000)
            token = f"holder-{i}"
            if not await fenced_take([lock.name, fence_key], [token, TTL_MS]):
                raise RuntimeError("fenced lock not acquired")
            lock.local.token = token.encode()  # released by redis-py's own script
            await lock.release()

        return await _interleaved({"anarchon_lease": lease, "anarchon_contract_calls": contract,
                                   "redis_py_asyncio_lock": redis_py_lock,
                                   "fenced_lock_script": fenced_lock},
                                  "anarchon_lease", rounds=rounds, seconds=seconds)
    finally:
        await backend.close()
        await client.aclose()


async def _pg(servers: Servers, seconds: float, rounds: int) -> dict[str, Any]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        servers.dsn, min_size=1, max_size=1, open=False,
        kwargs={"autocommit": True, "prepare_threshold": None})
    await pool.open(wait=True)
    backend = PostgresBackend(pool, table="leasebench")
    await backend.start()
    try:
        async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as conn:
            await conn.execute(SHEDLOCK_TABLE)
            await conn.execute(SHEDLOCK_FENCED_TABLE)
            tag = uuid.uuid4().hex[:6]
            lease, contract = _ours(backend, tag)

            async def shedlock_fenced(i: int) -> None:
                cur = await conn.execute(SHEDLOCK_FENCED_LOCK, (
                    f"lf-{tag}", TTL_MS, "bench", TTL_MS, "bench"), prepare=False)
                if await cur.fetchone() is None:
                    raise RuntimeError("fenced ShedLock lock not acquired")
                await conn.execute(SHEDLOCK_FENCED_UNLOCK, (f"lf-{tag}",), prepare=False)

            async def shedlock(i: int) -> None:
                cur = await conn.execute(SHEDLOCK_LOCK, (f"lb-{tag}", TTL_MS, "bench", TTL_MS,
                                                         "bench"), prepare=False)
                if cur.rowcount != 1:
                    raise RuntimeError("ShedLock lock not acquired")
                await conn.execute(SHEDLOCK_UNLOCK, (f"lb-{tag}",), prepare=False)

            async def shedlock_pooled(i: int) -> None:
                async with pool.connection() as pooled:
                    cur = await pooled.execute(SHEDLOCK_LOCK, (f"lp-{tag}", TTL_MS, "bench",
                                                               TTL_MS, "bench"), prepare=False)
                    if cur.rowcount != 1:
                        raise RuntimeError("ShedLock lock not acquired")
                async with pool.connection() as pooled:
                    await pooled.execute(SHEDLOCK_UNLOCK, (f"lp-{tag}",), prepare=False)

            return await _interleaved({"anarchon_lease": lease,
                                       "anarchon_contract_calls": contract,
                                       "shedlock_upsert_raw_psycopg": shedlock,
                                       "shedlock_upsert_psycopg_pool": shedlock_pooled,
                                       "shedlock_fenced_raw_psycopg": shedlock_fenced},
                                      "anarchon_lease", rounds=rounds, seconds=seconds)
    finally:
        await backend.close()
        await pool.close()


async def run_lease(servers: Servers, *, seconds: float, rounds: int,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Both stores; returns the JSON section (``redis`` and ``pg``)."""
    out = {"redis": await _redis(servers, seconds, rounds),
           "pg": await _pg(servers, seconds, rounds)}
    for store, section in out.items():
        for name, spread in section["ratio"].items():
            cpu = section["cpu_ratio"][name]
            log(f"  lease {store:<5} Lease / {name:<28} median {spread['median']:.2f} "
                f"(min {spread['min']:.2f}, max {spread['max']:.2f}, {spread['rounds']} "
                f"rounds); CPU per op {name} / Lease median {cpu['median']:.2f}")
    return out
