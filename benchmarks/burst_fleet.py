"""A burst with each instance in an OS process of its own, as the instances of a fleet are.

:mod:`benchmarks.burst` runs its 3 instances in one Python process, so the work that
anarchon spreads over the fleet (each instance claims and starts about a third of the
jobs) still runs on one event loop, one after the other, while each lock instance tries
every job as before. Here every instance, on both sides, is a child process
(``python -m benchmarks.burst_fleet child SPEC``) with its own event loop, connections
and garbage collector; the parent only starts them, waits, and collects their handler
start times. The contenders, settings and measure are :mod:`benchmarks.burst`'s:

- ``anarchon``: 3 schedulers (lease 4 s, heartbeat 1 s), every job declared on each, all
  due at one slot that comes after every scheduler knows the whole fleet;
- Redis, ``redis_py_lock``: 3 instances each trying a redis-py asyncio ``Lock`` per
  (job, slot), job after job; PostgreSQL, ``shedlock_raw_psycopg``: 3 instances each
  sending ShedLock's upsert per job, job after job.

Measured per burst: ``latency_ms``, from the slot (wall clock: every process runs on
this host) until the last handler started in any process; ``first_ms``; ``balance``, the
busiest process's handlers ÷ its fair share. Exactly one start per job, over all the
processes, is checked. Round trips and store CPU are :mod:`benchmarks.burst`'s figures
(the children are not instrumented). The machine has 2 CPUs for the 3 children and the
store, on both sides alike.

``python -m benchmarks.burst_fleet [SIZES] [STORES] [ROUNDS] [--gc collect|freeze]
[--profile DIR]``, e.g. ``100,1000 redis,pg 3``. The store runs on the loopback device,
whose round trip (tens of microseconds) is far shorter than between machines; the lock
side pays one per job and instance, anarchon one per batch.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import psycopg
import redis.asyncio
from anyio.streams.buffered import BufferedByteReceiveStream

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import Scheduler

from ._util import Servers
from .burst import (
    FLEET_LEAD_S,
    HEARTBEAT,
    INSTANCES,
    LEASE,
    SHEDLOCK_LOCK,
    SHEDLOCK_TABLE,
    TARGET_BALANCE,
    TARGET_TIME,
    _spread,
    _until,
    declare_jobs,
)

__all__ = ["markdown", "ratios", "run_burst_fleet", "targets"]

ROOT = Path(__file__).resolve().parent.parent
#: Milliseconds allowed for a child to start (import, connect) before its slot.
CHILD_START_MS = 4000
#: How long after the slot every handler must have started.
LIMIT_S = 60.0


# --- the children ----------------------------------------------------------------------


async def _child(spec: dict[str, Any]) -> None:
    """One instance: get ready, say so, run the burst, answer ``report`` and ``stop``."""
    started: dict[str, float] = {}
    doubles = [0]
    stop: Callable[[], Any]
    async with anyio.create_task_group() as tg:
        if spec.get("profile"):
            path = Path(spec["profile"]) / f"{spec['contender']}-{spec['index']}.prof"
            tg.start_soon(_profile_window, spec["slot"], path)
        if spec["contender"] == "anarchon":
            stop = await _child_anarchon(spec, started, doubles)
        else:
            stop = await _child_locks(spec, started)
        try:
            async with anyio.wrap_file(sys.stdin) as commands:
                async for line in commands:
                    if line.strip() == "report":
                        print(json.dumps({"started": started, "doubles": doubles[0]}),
                              flush=True)
                    elif line.strip() == "stop":
                        break
        finally:
            await stop()


async def _child_anarchon(spec: dict[str, Any], started: dict[str, float],
                          doubles: list[int]) -> Callable[[], Any]:
    slot, tag, url = spec["slot"], spec["tag"], spec["url"]

    async def handler(ctx: Any) -> None:
        if ctx.job in started:
            doubles[0] += 1
        started.setdefault(ctx.job, time.time() * 1000)

    backend = (RedisBackend(url, prefix=f"burst{tag}") if spec["store"] == "redis"
               else PostgresBackend(url, table="burst_runs"))
    scheduler = Scheduler(backend, instance_id=f"i{spec['index']}", lease=LEASE,
                          heartbeat=HEARTBEAT, history_size=10)
    declare_jobs(scheduler, tag, spec["jobs"], slot, handler)
    await scheduler.start()
    while scheduler.health().fleet_size != INSTANCES:
        if time.time() * 1000 > slot - 100:
            await scheduler.stop(grace=5)
            raise RuntimeError("the scheduler did not know the whole fleet before the slot")
        await anyio.sleep(0.02)
    _ready(spec)
    return lambda: scheduler.stop(grace=5)


def _ready(spec: dict[str, Any]) -> None:
    """Apply the ``gc`` setting (see :func:`run_burst_fleet`), then tell the parent."""
    import gc

    if spec.get("gc") == "collect":
        gc.collect()
    elif spec.get("gc") == "freeze":
        gc.freeze()
    print("ready", flush=True)


async def _profile_window(slot: int, path: Path) -> None:
    """cProfile this process from just before the slot until 1 s after it, into ``path``
    (``python -m pstats`` reads it), and the garbage collector's pauses in that window
    into ``<path>.gc.json``."""
    import cProfile
    import gc

    profiler = cProfile.Profile()
    pauses: list[tuple[int, float]] = []
    began = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - began[0]) * 1000))

    await _until(slot - 2)
    gc.callbacks.append(timed)
    profiler.enable()
    await _until(slot + 1000)
    profiler.disable()
    gc.callbacks.remove(timed)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(path)
    path.with_suffix(".gc.json").write_text(json.dumps({
        "collections": pauses, "ms_by_generation": {
            g: round(sum(ms for gen, ms in pauses if gen == g), 2) for g in (0, 1, 2)}}))


async def _child_locks(spec: dict[str, Any], started: dict[str, float]) -> Callable[[], Any]:
    slot, tag, n, i = spec["slot"], spec["tag"], spec["jobs"], spec["index"]
    if spec["store"] == "redis":
        client = redis.asyncio.Redis.from_url(spec["url"])
        await client.ping()  # connected before the slot, as a running service would be
        # and has locked before, as the schedulers' warm-up claims have claimed
        await client.lock(f"burst{tag}:warm:{i}", timeout=30).acquire(blocking=False)
        _ready(spec)
        await _until(slot)
        for j in range(n):
            lock = client.lock(f"burst{tag}:lock:{j}:{slot}", timeout=30)
            if await lock.acquire(blocking=False):
                started.setdefault(f"{tag}-{j}", time.time() * 1000)
        return client.aclose
    conn = await psycopg.AsyncConnection.connect(spec["url"], autocommit=True)
    # warm, as the schedulers' warm-up claims warm theirs (the table's caches, the code)
    await conn.execute(SHEDLOCK_LOCK, (f"{tag}-warm-{i}", 30_000, f"i{i}", 30_000, f"i{i}"),
                       prepare=False)
    _ready(spec)
    await _until(slot)
    for j in range(n):
        cur = await conn.execute(SHEDLOCK_LOCK, (f"{tag}-{j}", 30_000, f"i{i}", 30_000,
                                                 f"i{i}"), prepare=False)
        if cur.rowcount == 1:
            started.setdefault(f"{tag}-{j}", time.time() * 1000)
    return conn.close


# --- the parent ------------------------------------------------------------------------


class _Child:
    """One child process and its line-oriented pipe."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None and process.stdin is not None
        self.out = BufferedByteReceiveStream(process.stdout)
        self.stdin = process.stdin

    async def line(self) -> str:
        return (await self.out.receive_until(b"\n", 16 * 1024 * 1024)).decode()

    async def send(self, command: str) -> None:
        await self.stdin.send(f"{command}\n".encode())


async def _spawn(spec: dict[str, Any]) -> _Child:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    process = await anyio.open_process(
        [sys.executable, "-m", "benchmarks.burst_fleet", "child", json.dumps(spec)],
        cwd=ROOT, env=env, stderr=None)
    return _Child(process)


async def _burst(servers: Servers, store: str, contender: str, n: int,
                 extra: dict[str, Any]) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    lead = CHILD_START_MS + (int(FLEET_LEAD_S * 1000) + 4 * n if contender == "anarchon"
                             else 300)
    slot = int(time.time() * 1000) + lead
    url = servers.redis_url if store == "redis" else servers.dsn
    children: list[_Child] = []
    try:
        for i in range(INSTANCES):
            children.append(await _spawn({"contender": contender, "store": store, "url": url,
                                          "index": i, "jobs": n, "tag": tag, "slot": slot,
                                          **extra}))
        with anyio.fail_after(lead / 1000 + 5):
            for child in children:
                if (await child.line()).strip() != "ready":
                    raise RuntimeError(f"a {contender} child did not get ready")
        if time.time() * 1000 > slot:
            raise RuntimeError(f"the {contender} children were ready only after the slot")
        await _until(slot + 200)
        reports = await _collect(children, n)
        for child in children:
            await child.send("stop")
        with anyio.fail_after(30):
            for child in children:
                await child.process.wait()
    finally:
        for child in children:
            if child.process.returncode is None:
                child.process.kill()
                await child.process.wait()
    seen: Counter[str] = Counter()
    for report in reports:
        seen.update(list(report["started"]))
    twice = sum(report["doubles"] for report in reports) + sum(
        1 for count in seen.values() if count > 1)
    if twice:
        raise RuntimeError(f"{twice} {contender} runs started twice")
    starts = [t for report in reports for t in report["started"].values()]
    busiest = max(len(report["started"]) for report in reports)
    out = {"latency_ms": round(max(starts) - slot, 1), "first_ms": round(min(starts) - slot, 1)}
    if contender == "anarchon":
        out["balance"] = round(busiest / (n / INSTANCES), 3)
    return out


async def _collect(children: list[_Child], n: int) -> list[dict[str, Any]]:
    """Every child's starts, asked for until every job has started (within LIMIT_S)."""
    deadline = time.monotonic() + LIMIT_S
    while True:
        reports = []
        for child in children:
            await child.send("report")
            reports.append(json.loads(await child.line()))
        count = len({job for report in reports for job in report["started"]})
        if count >= n:
            return reports
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {count} of {n} handlers started within {LIMIT_S}s")
        await anyio.sleep(0.2)


async def _cell(servers: Servers, store: str, n: int, rounds: int, *,
                profile: Path | None, gc: str) -> dict[str, Any]:
    peer = "redis_py_lock" if store == "redis" else "shedlock_raw_psycopg"
    if store == "pg":
        async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as c:
            await c.execute(SHEDLOCK_TABLE)
    runs: dict[str, list[dict[str, Any]]] = {"anarchon": [], peer: []}
    for r in range(rounds):
        for name in (["anarchon", peer] if r % 2 == 0 else [peer, "anarchon"]):
            where = profile and str(profile / f"{store}.{n}.r{r}")
            runs[name].append(await _burst(servers, store, name, n,
                                           {"profile": where, "gc": gc}))
    ratios = {key: _spread([p[key] / a[key] for a, p in zip(runs["anarchon"], runs[peer],
                                                            strict=True) if a[key] > 0])
              for key in ("latency_ms", "first_ms")}
    medians = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
               for name, rs in runs.items()}
    balance = _spread([run["balance"] for run in runs["anarchon"]])
    return {"jobs": n, "instances": INSTANCES, "processes": INSTANCES, "peer": peer,
            "median": medians, "ratio_peer_over_anarchon": ratios, "balance": balance,
            "targets_met": {"latency_ms": ratios["latency_ms"]["median"] >= TARGET_TIME,
                            "balance": balance["median"] <= TARGET_BALANCE},
            "runs": runs}


async def run_burst_fleet(servers: Servers, *, sizes: tuple[int, ...] = (100, 1000),
                          stores: tuple[str, ...] = ("redis", "pg"), rounds: int = 5,
                          log: Callable[[str], None] = print,
                          profile: Path | None = None,
                          gc: str = "none") -> dict[str, Any]:
    """Every (store, size) cell, one process per instance; returns the cells by
    ``<store>.<jobs>.processes`` (the keys :mod:`benchmarks.burst`'s section takes).

    With ``profile``, each child writes cProfile statistics of its burst window (from the
    slot to 1 s after it) to ``profile/<store>.<jobs>.r<round>/<contender>-<i>.prof``.
    ``gc``: ``"collect"``, every child (both sides) runs one full collection once
    started, as a service that has run for a while has had its start-up objects walked
    once; ``"freeze"``, every child calls ``gc.freeze()`` once started, as the fleet guide
    advises a service where bursts matter; ``"none"`` (the default) neither.
    """
    out: dict[str, Any] = {}
    for store in stores:
        for n in sizes:
            key = f"{store}.{n}.processes"
            cell = out[key] = await _cell(servers, store, n, rounds, profile=profile,
                                          gc=gc)
            a, p = cell["median"]["anarchon"], cell["median"][cell["peer"]]
            log(f"  burst {key:<15} latency anarchon {a['latency_ms']:.0f} ms, {cell['peer']} "
                f"{p['latency_ms']:.0f} ms; ratio {cell['ratio_peer_over_anarchon']['latency_ms']}"
                f"; balance {cell['balance']['median']}; targets {cell['targets_met']}")
    return out


def ratios(section: dict[str, Any]) -> dict[str, float]:
    """The figures compare.py tracks: time to every handler, peer ÷ anarchon, and the
    fair share ÷ the busiest process's handlers (higher is better for both)."""
    out: dict[str, float] = {}
    for key, cell in section.items():
        out[f"burst_fleet.{key}.latency_ms_vs_{cell['peer']}"] = (
            cell["ratio_peer_over_anarchon"]["latency_ms"]["median"])
        out[f"burst_fleet.{key}.fair_share_over_busiest"] = round(
            1 / cell["balance"]["median"], 3)
    return out


def targets(section: dict[str, Any]) -> dict[str, Any]:
    """Issue 18's burst targets on the process-per-instance cells."""
    out: dict[str, Any] = {}
    for key, cell in section.items():
        r, b = cell["ratio_peer_over_anarchon"]["latency_ms"], cell["balance"]
        out[f"burst_fleet_{key}_latency_ms_vs_{cell['peer']}"] = {
            "target": TARGET_TIME, "median": r["median"], "spread": [r["min"], r["max"]],
            "rounds": r["rounds"], "met": cell["targets_met"]["latency_ms"]}
        out[f"burst_fleet_{key}_balance"] = {
            "target": f"<= {TARGET_BALANCE}", "median": b["median"],
            "spread": [b["min"], b["max"]], "met": cell["targets_met"]["balance"]}
    return out


def markdown(section: dict[str, Any]) -> list[str]:
    """The section's table for the results Markdown."""
    lines = ["## Burst: jobs due at one instant, 3 instances in 3 processes", "",
             "Medians of the interleaved rounds; ratios are peer ÷ anarchon per round "
             "(higher is better for anarchon). Every instance is an OS process of its own.",
             "", "| store.jobs | contender | slot → first handler ms | slot → last handler ms |",
             "| --- | --- | ---: | ---: |"]
    for key, cell in section.items():
        for name, m in cell["median"].items():
            lines.append(f"| {key} | {name} | {m['first_ms']:.0f} | {m['latency_ms']:.0f} |")
        for figure, r in cell["ratio_peer_over_anarchon"].items():
            lines.append(f"| {key} | ratio {figure} | | {r['median']:.2f} "
                         f"[{r['min']:.2f}, {r['max']:.2f}] |")
        b = cell["balance"]
        lines.append(f"| {key} | anarchon balance (busiest ÷ fair share) | | "
                     f"{b['median']:.2f} [{b['min']:.2f}, {b['max']:.2f}] |")
    return lines


def main() -> None:
    """``python -m benchmarks.burst_fleet [SIZES] [STORES] [ROUNDS] [--gc ...]
    [--profile DIR]``, or a child."""
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        anyio.run(_child, json.loads(sys.argv[2]))
        return
    import argparse

    from ._util import pg_servers

    parser = argparse.ArgumentParser(prog="python -m benchmarks.burst_fleet",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="?", default="100", help="jobs per burst, e.g. 100,1000")
    parser.add_argument("stores", nargs="?", default="redis,pg", help="redis, pg or both")
    parser.add_argument("rounds", nargs="?", type=int, default=3, help="bursts per contender")
    parser.add_argument("--gc", choices=("none", "collect", "freeze"), default="none",
                        help="once started, every child runs gc.collect() or gc.freeze() "
                             "(see run_burst_fleet)")
    parser.add_argument("--profile", type=Path, help="write each child's cProfile "
                        "statistics of its burst window under this folder")
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    stores = tuple(args.stores.split(","))
    with pg_servers() as servers:
        result = anyio.run(lambda: run_burst_fleet(
            servers, sizes=sizes, stores=stores, rounds=args.rounds,
            log=lambda t: print(t, file=sys.stderr), profile=args.profile, gc=args.gc))
    for cell in result.values():
        cell.pop("runs")
        cell["gc"] = args.gc
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
