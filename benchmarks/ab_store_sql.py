"""Paired A/B of the PostgreSQL store code: another git ref's v4 functions against this tree's.

One process, one server (``benchmarks._util.pg_servers``), interleaved rounds: two stores
(tables ``ab_ref`` and ``ab_tree``), each on its own pool of one connection, the first
with the functions of ``--ref`` (``git show <ref>:backends/postgres_sql/<file>``, default
``main``), the second with this tree's; ShedLock's upsert + unlock on a raw psycopg
connection is the third contender. The first store also sends the ref's named-lease
acquire and release statements (``leases.sql``; their parameters must match this tree's).
The Python code is this tree's for both stores, so a difference is the SQL's alone.
``--swap`` gives the ref's functions and statements to the second store instead (a
systematic difference between the two connections then changes sides).

Per contender: operations per second, this process's CPU per operation, and the CPU of
the contender's server process per operation (``/proc/<pid>/schedstat``); per round the
ratios tree ÷ ref and tree ÷ ShedLock (median, lowest, highest). Then every top-level
statement's mean execution time from ``pg_stat_statements`` (each store's functions
carry its table's name), the steadiest figure on a shared machine.

Run: ``python -m benchmarks.ab_store_sql lease|cf [--rounds 10] [--seconds 1] [--ref main]
[--swap]`` (``lease``: ``Lease`` acquire + release; ``cf``: claim + finish).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool

from backends.postgres import PostgresBackend
from backends.postgres import statements as st
from lease_core import Lease

from ._rounds import round_order
from ._util import pg_servers
from .peers import SHEDLOCK_LOCK, SHEDLOCK_TABLE, SHEDLOCK_UNLOCK
from .throughput import claim_finish_op

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
Op = Callable[[int], Awaitable[None]]
#: The module constants of backends.postgres.statements holding the v4 function templates.
_TEMPLATES = {"FAILOVER_FUNCTION": "failover_v4.sql", "CLAIM_FUNCTION": "claim_v4.sql",
              "BATCH_FUNCTION": "batch_v4.sql", "FINISH_FUNCTION": "finish_v4.sql",
              "LEASE_FUNCTION": "lease_v4.sql"}


def _ref_text(ref: str, name: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:backends/postgres_sql/{name}"],
        check=True, capture_output=True, text=True).stdout


async def _install_ref(dsn: str, backend: PostgresBackend, table: str, ref: str) -> None:
    """Replace the v4 functions of store ``table`` by those of git ``ref``, and give
    ``backend`` the ref's named-lease statements (``leases.sql``)."""
    saved = {key: getattr(st, key) for key in _TEMPLATES}
    queries = dict(st.QUERIES)
    try:
        for key, name in _TEMPLATES.items():
            setattr(st, key, _ref_text(ref, name))
        st.QUERIES.update(st.parse_queries(_ref_text(ref, "leases.sql")))
        sql = st.Statements(None, table)
    finally:
        for key, value in saved.items():
            setattr(st, key, value)
        st.QUERIES.clear()
        st.QUERIES.update(queries)
    for key in ("lease_acquire", "lease_release"):  # same parameters on both sides
        setattr(backend._sql, key, getattr(sql, key))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for create in (sql.create_failover_function, sql.create_claim_function,
                       sql.create_batch_function, sql.create_finish_function,
                       sql.create_lease_function):
            await conn.execute(create.encode())


def _server_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


async def _pool(dsn: str) -> tuple[AsyncConnectionPool[Any], int]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False,
        kwargs={"autocommit": True, "prepare_threshold": None})
    await pool.open(wait=True)
    async with pool.connection() as conn:
        return pool, int(conn.info.backend_pid)


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered):.3f} [{ordered[0]:.3f}, {ordered[-1]:.3f}]"


def _op(mode: str, backend: PostgresBackend, name: str) -> Op:
    async def lease(i: int) -> None:
        held = Lease(backend, name, ttl=30)
        if not await held.acquire(timeout=0):
            raise RuntimeError("lease not acquired")
        await held.release()

    async def claim_finish(i: int) -> None:
        await claim_finish_op(backend, name, i + 1)

    return lease if mode == "lease" else claim_finish


async def _run(args: argparse.Namespace) -> None:
    with pg_servers() as servers:
        dsn = servers.dsn
        pool_a, pid_a = await _pool(dsn)
        pool_b, pid_b = await _pool(dsn)
        ref_b, tree_b = PostgresBackend(pool_a, table="ab_ref"), PostgresBackend(
            pool_b, table="ab_tree")
        await ref_b.start()
        await tree_b.start()
        if args.swap:
            await _install_ref(dsn, tree_b, "ab_tree", args.ref)
            ref_b, tree_b, pid_a, pid_b = tree_b, ref_b, pid_b, pid_a
        else:
            await _install_ref(dsn, ref_b, "ab_ref", args.ref)
        raw = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            await raw.execute(SHEDLOCK_TABLE)
            tag = uuid.uuid4().hex[:6]

            async def shedlock(i: int) -> None:
                cur = await raw.execute(SHEDLOCK_LOCK, (f"ab-{tag}", 30000, "b", 30000, "b"),
                                        prepare=False)
                if cur.rowcount != 1:
                    raise RuntimeError("ShedLock lock not acquired")
                await raw.execute(SHEDLOCK_UNLOCK, (f"ab-{tag}",), prepare=False)

            contenders: dict[str, tuple[Op, int]] = {
                "ref": (_op(args.mode, ref_b, f"{tag}-ref"), pid_a),
                "tree": (_op(args.mode, tree_b, f"{tag}-tree"), pid_b),
                "shedlock": (shedlock, raw.info.backend_pid)}
            await _rounds(contenders, raw, args)
        finally:
            await raw.close()
            for backend in (ref_b, tree_b):
                await backend.close()
            for pool in (pool_a, pool_b):
                await pool.close()


async def _rounds(contenders: dict[str, tuple[Op, int]], raw: psycopg.AsyncConnection[Any],
                  args: argparse.Namespace) -> None:
    names = list(contenders)
    rate: dict[str, list[float]] = {n: [] for n in names}
    client: dict[str, list[float]] = {n: [] for n in names}
    server: dict[str, list[float]] = {n: [] for n in names}
    nexts = dict.fromkeys(names, 0)
    for name, (fn, _) in contenders.items():  # warm-up: plans, pools
        for _ in range(200):
            await fn(nexts[name])
            nexts[name] += 1
    await raw.execute("SELECT pg_stat_statements_reset()")
    for r in range(args.rounds):
        for name in round_order(names, r):
            fn, pid = contenders[name]
            first = nexts[name]
            cpu, ns, wall = time.process_time(), _server_ns(pid), time.perf_counter()
            while time.perf_counter() - wall < args.seconds:
                await fn(nexts[name])
                nexts[name] += 1
            done = nexts[name] - first
            rate[name].append(done / (time.perf_counter() - wall))
            client[name].append((time.process_time() - cpu) / done * 1e6)
            server[name].append((_server_ns(pid) - ns) / done / 1000)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.mode}: {args.rounds} rounds of {args.seconds} s, ref {args.ref}"
          f"{' (swapped)' if args.swap else ''}, load average {load}")
    for name in names:
        print(f"  {name:9} ops/s {statistics.median(rate[name]):8.1f}   client CPU µs/op "
              f"{statistics.median(client[name]):6.1f}   server CPU µs/op "
              f"{statistics.median(server[name]):6.1f}")
    pairs = (("tree", "shedlock"), ("ref", "shedlock"), ("tree", "ref"))
    for a, b in pairs:
        ratios = [x / y for x, y in zip(rate[a], rate[b], strict=True)]
        print(f"  ops/s {a} ÷ {b}: {_spread(ratios)}")
    print("  server CPU tree ÷ ref: "
          + _spread([x / y for x, y in zip(server["tree"], server["ref"], strict=True)]))
    cur = await raw.execute(
        "SELECT query, calls, mean_exec_time * 1000 FROM pg_stat_statements"
        " WHERE toplevel AND calls > 100 AND query NOT LIKE '%%pg_stat_statements%%'"
        " ORDER BY query")
    for query, calls, mean in await cur.fetchall():
        print(f"  pg_stat_statements {calls:7} calls, {mean:7.1f} µs exec: "
              f"{' '.join(str(query).split())[:80]}")


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and run the A/B."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab_store_sql",
                                     description=__doc__)
    parser.add_argument("mode", choices=("lease", "cf"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--ref", default="main")
    parser.add_argument("--swap", action="store_true")
    anyio.run(_run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
