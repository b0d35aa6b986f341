"""Paired A/B of one burst (benchmarks/burst.py's anarchon side) between two trees.

``python -m benchmarks.burst_ab --base <checkout> [--stores memory,redis,pg]
[--sizes 1000] [--rounds 6]``: both trees' ``lease_core`` and ``backends`` are imported
side by side in one process; each round runs one burst per tree (3 schedulers, every job
due at one slot after the fleet is known), in an order that alternates from round to
round. Per burst: the time from the slot until every handler started (``latency_ms``)
and the process CPU in that window (``cpu_ms``). Reported per cell: base ÷ this tree per
round (higher: this tree is faster), median [min, max].
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

from ._rounds import load_tree
from .burst import INSTANCES, _until, _wait_all

ROOT = Path(__file__).resolve().parent.parent


def _imports() -> SimpleNamespace:
    """The classes a burst uses (imported by :func:`load_tree`)."""
    import backends.memory
    import backends.postgres
    import backends.redis
    import lease_core
    return SimpleNamespace(Scheduler=lease_core.Scheduler,
                           Memory=backends.memory.MemoryBackend,
                           Redis=backends.redis.RedisBackend,
                           Postgres=backends.postgres.PostgresBackend)


def _load(tree: str) -> SimpleNamespace:
    """The classes a burst uses, imported from ``tree``."""
    return load_tree(tree, _imports)


async def _burst(side: SimpleNamespace, servers: Any, store: str, n: int) -> dict[str, float]:
    tag = uuid.uuid4().hex[:8]
    started: dict[str, float] = {}
    slot = int(time.time() * 1000) + 2500 + 4 * n

    async def handler(ctx: Any) -> None:
        started.setdefault(ctx.job, time.time() * 1000)

    memory = side.Memory()
    schedulers = []
    for i in range(INSTANCES):
        backend = (memory if store == "memory"
                   else side.Redis(servers.redis_url, prefix=f"bab{tag}") if store == "redis"
                   else side.Postgres(servers.dsn, table="burst_ab_runs"))
        s = side.Scheduler(backend, instance_id=f"i{i}", lease=4, heartbeat=1,
                           history_size=10)
        for j in range(n):
            s.every(f"{tag}-{j}", "1h", handler, offset=(slot % 3_600_000) / 1000)
        schedulers.append(s)
    try:
        for s in schedulers:
            await s.start()
        while not all(s.health().fleet_size == INSTANCES for s in schedulers):
            if time.time() * 1000 > slot - 100:
                raise RuntimeError("the fleet was not known before the slot")
            await anyio.sleep(0.02)
        await _until(slot - 50)
        cpu = time.process_time()
        await _wait_all(started, n, 60)
        cpu = time.process_time() - cpu
    finally:
        for s in schedulers:
            await s.stop(grace=5)
    return {"latency_ms": max(started.values()) - slot, "cpu_ms": cpu * 1000}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


async def _run(servers: Any, base: str, stores: list[str], sizes: list[int],
               rounds: int) -> dict[str, Any]:
    sides = {"base": _load(base), "this": _load(str(ROOT))}
    out: dict[str, Any] = {}
    for store in stores:
        for n in sizes:
            got: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
            for name in ("base", "this"):  # warm-up: connections, scripts, plans
                await _burst(sides[name], servers, store, min(n, 100))
            for r in range(rounds):
                for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
                    got[name].append(await _burst(sides[name], servers, store, n))
            cell: dict[str, Any] = {}
            for key in ("latency_ms", "cpu_ms"):
                cell[f"base_over_this_{key}"] = _spread(
                    [b[key] / t[key] for b, t in zip(got["base"], got["this"], strict=True)])
                for name in got:
                    cell[f"{name}_{key}"] = round(statistics.median(g[key] for g in got[name]), 1)
            out[f"{store}.{n}"] = cell
            print(store, n, json.dumps(cell), file=sys.stderr, flush=True)
    return out


def main() -> None:
    """Parse the options, run the cells, print the JSON."""
    from ._util import pg_servers

    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the base side's checkout")
    parser.add_argument("--stores", default="memory,redis,pg")
    parser.add_argument("--sizes", default="1000")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    stores, sizes = args.stores.split(","), [int(s) for s in args.sizes.split(",")]
    with pg_servers() as servers:
        result = anyio.run(_run, servers, args.base, stores, sizes, args.rounds)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
