"""Client CPU per run: one scheduler, no-op handlers, slots spread evenly over each second.

``N`` jobs ``every="1s"``, job ``i`` with ``offset = i * 1000 // N`` ms, offer ``N`` runs
per second with no two instants sharing more than ``ceil(N / 1000)`` slots. Each round
measures, over a window after a warm-up, the process's CPU time
(``time.process_time``: user + system, all threads) and the runs whose handler started in
the window; the figure is **runs per CPU-second** (the inverse of the CPU per run).

In the same round, interleaved (the order flipped from round to round), a *raw* client
does the same work at the same pace: the same claim and finish statements through the
raw driver (psycopg on one connection per worker; redis-py ``EVALSHA`` of the same
scripts; on the memory backend, the store's own ``claim`` and ``finish`` calls), each run
sent at its slot by one of a few worker tasks. The ratio library ÷ raw of runs per
CPU-second is taken within each round (``ratio_vs_raw``: the library with its default
slack, which batches the claims and finishes of slots close together, so not the raw
client's statements; ``exact_ratio_vs_raw``: with ``timer_slack=0``, the same
statements); the report gives the median of the per-round ratios and their spread,
the runs per second achieved against offered, and the *flatness*: library runs per
CPU-second at the highest load ÷ at the lowest.

The library runs twice per round: with the scheduler's default ``timer_slack`` (slots
close together share a wake-up, and so their claims and finishes go in one call each) and
with ``timer_slack=0`` (every slot claimed at its own instant, as the raw client does).
Each handler notes how late it started (the local wall clock minus its slot), and each
cell reports the median and 99th percentile of that lateness for both, which is what the
slack costs.

The servers are other processes: only the client's CPU is counted (on the memory backend
the store lives in the client, in both the library and the raw runs).
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import anyio
import psycopg
import redis.asyncio

from backends.memory import MemoryBackend
from backends.postgres import PostgresBackend, Statements
from backends.redis import SCRIPTS, RedisBackend
from lease_core import Scheduler
from lease_core.abc import Backend, ClaimRequest, ClaimStatus, Lease, Outcome

from ._util import Servers
from .peers import _spread
from .throughput import (
    HISTORY,
    INSTANCE,
    LEASE_MS,
    _pg_claim_params,
    redis_claim_command,
    redis_claim_won,
)

__all__ = ["LOADS", "run_cpu"]

#: Offered loads (runs per second) of a full run; ``--quick`` takes the first and last.
LOADS = (250, 500, 1000, 2000)
#: Raw worker tasks (each with its own connection) per 100 runs/s offered, at least 4:
#: each sends its runs one after the other, two round trips each.
RAW_WORKERS_PER_100 = 1
TABLE = "cpu_bench"


def _offsets(n: int) -> list[int]:
    """The slot offsets (ms) of ``n`` jobs spread evenly over a second."""
    return [i * 1000 // n for i in range(n)]


def _workers(n: int) -> int:
    """Raw worker tasks for ``n`` runs per second."""
    return max(4, n * RAW_WORKERS_PER_100 // 100)


async def _window(seconds: float, count: Callable[[], int]) -> tuple[float, float, int]:
    """CPU seconds, wall seconds and runs counted over the next ``seconds``."""
    cpu, wall, runs = time.process_time(), time.monotonic(), count()
    await anyio.sleep(seconds)
    return time.process_time() - cpu, time.monotonic() - wall, count() - runs


async def _library(backend: Backend, n: int, tag: str, warmup: float, seconds: float,
                   timer_slack: float | None = None) -> dict[str, Any]:
    """One scheduler with ``n`` no-op jobs, measured over ``seconds`` after ``warmup``.

    ``timer_slack`` is the scheduler's (``None``: its default). Each handler also notes
    how late it started (local wall clock minus its slot), for the lateness the slack
    costs.
    """
    # One instance id for every round: the members of earlier rounds would otherwise stay
    # live in the store for a lease, and rank first for some of the jobs.
    options = {} if timer_slack is None else {"timer_slack": timer_slack}
    scheduler = Scheduler(backend, instance_id="cpu-bench", **options)
    late: list[float] = []

    async def handler(ctx: Any) -> None:
        late.append(time.time() * 1000 - ctx.slot)

    for i, offset in enumerate(_offsets(n)):
        scheduler.every(f"{tag}-{i}", "1s", handler, offset=offset / 1000)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await anyio.sleep(warmup)
        first = len(late)
        cpu, wall, runs = await _window(seconds, lambda: len(late))
        await scheduler.stop(grace=5)
    return {"cpu_s": cpu, "wall_s": wall, "runs": runs,
            "late_ms": late[first:first + runs]}


RunOp = Callable[[int, str, int], Awaitable[None]]


async def _raw(op: RunOp, n: int, tag: str, warmup: float, seconds: float) -> dict[str, float]:
    """The same runs at the same pace: worker ``w`` claims and finishes each slot it takes."""
    offsets = _offsets(n)
    done = [0]
    start_ms = (int(time.time() * 1000) // 1000 + 1) * 1000
    end = time.monotonic() + warmup + seconds + 0.2
    nxt = [0]  # index into the endless sequence of (second, job) runs

    async def worker(w: int) -> None:
        while time.monotonic() < end:
            k = nxt[0]
            nxt[0] += 1
            second, i = divmod(k, n)
            slot = start_ms + second * 1000 + offsets[i]
            delay = slot / 1000 - time.time()
            if delay > 0:
                await anyio.sleep(delay)
            await op(w, f"{tag}-{i}", slot)
            done[0] += 1

    async with anyio.create_task_group() as tg:
        for w in range(_workers(n)):
            tg.start_soon(worker, w)
        await anyio.sleep(max(0.0, start_ms / 1000 - time.time()) + warmup)
        cpu, wall, runs = await _window(seconds, lambda: done[0])
    return {"cpu_s": cpu, "wall_s": wall, "runs": runs}


class _Store:
    """One store: how to make a fresh library backend, and the raw claim + finish."""

    name = ""

    async def open(self, servers: Servers) -> None:
        """Open what the raw side needs."""

    async def close(self) -> None:
        """Close it."""

    def backend(self) -> Backend:
        """A new library backend (the scheduler opens and closes it)."""
        raise NotImplementedError

    async def raw(self, w: int, job: str, slot: int) -> None:
        """Claim (job, slot) and finish it, through the raw driver on worker ``w``'s link."""
        raise NotImplementedError


class _Memory(_Store):
    name = "memory"

    async def open(self, servers: Servers) -> None:
        self.store = MemoryBackend()
        await self.store.start()  # as the other stores' raw sides are opened

    def backend(self) -> Backend:
        return MemoryBackend()

    async def raw(self, w: int, job: str, slot: int) -> None:
        token = uuid.uuid4().hex
        result = await self.store.claim(ClaimRequest(job, slot, INSTANCE, token, LEASE_MS,
                                                     history_size=HISTORY))
        if result.status is ClaimStatus.WON:
            await self.store.finish(Lease(job, slot, token, LEASE_MS), Outcome.COMPLETED)


class _Postgres(_Store):
    name = "pg"

    async def open(self, servers: Servers) -> None:
        self.dsn = servers.dsn
        setup = PostgresBackend(self.dsn, table=TABLE)
        await setup.start()  # creates the tables and functions
        await setup.close()
        self.sql = Statements(None, TABLE)
        self.conns = [await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, prepare_threshold=None) for _ in range(_workers(LOADS[-1]))]

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close()

    def backend(self) -> Backend:
        return PostgresBackend(self.dsn, table=TABLE)

    async def raw(self, w: int, job: str, slot: int) -> None:
        conn, token = self.conns[w], uuid.uuid4().hex
        cur = await conn.execute(self.sql.claim, _pg_claim_params(job, slot, token),  # type: ignore[arg-type]
                                 prepare=False)
        row = await cur.fetchone()
        if row is None or row[0] != "won":
            raise RuntimeError(f"raw claim of {job} slot {slot}: {row}")
        await conn.execute(self.sql.finish,  # type: ignore[arg-type]
                           (job, slot, token, "completed", None), prepare=False)


class _Redis(_Store):
    name = "redis"

    async def open(self, servers: Servers) -> None:
        self.url = servers.redis_url
        self.client = redis.asyncio.Redis.from_url(self.url)
        setup = RedisBackend(self.client, prefix=TABLE)
        await setup.start()  # loads the scripts
        await setup.close()
        self.listed: set[str] = set()
        # each job's data marker and history sequence, as the library keeps them
        self.markers: dict[str, Any] = {}
        self.seqs: dict[str, int] = {}

    async def close(self) -> None:
        await self.client.aclose()

    def backend(self) -> Backend:
        return RedisBackend(self.url, prefix=TABLE)

    async def raw(self, w: int, job: str, slot: int) -> None:
        # As benchmarks/throughput.py's raw claim: claim.lua (+ SADD the first time), then
        # finish.lua, the keys and arguments the library sends.
        token, tag = uuid.uuid4().hex, "{" + TABLE + "/" + quote(job, safe="") + "}"
        claim = redis_claim_command(TABLE, job, slot, token, self.markers, self.seqs)
        if job in self.listed:
            reply = await self.client.execute_command(*claim)
        else:
            pipe = self.client.pipeline(transaction=False)
            pipe.execute_command(*claim)
            pipe.execute_command("SADD", "{" + TABLE + "}:jobs", job)
            reply = (await pipe.execute())[0]
            self.listed.add(job)
        if not redis_claim_won(job, reply, self.markers, self.seqs):
            raise RuntimeError(f"raw claim of {job} slot {slot}: {reply!r}")
        await self.client.execute_command(
            "EVALSHA", SCRIPTS["finish"].sha, 4, f"{tag}:run:{slot}", f"{tag}:open",
            f"{tag}:att", f"{tag}:done", token, slot, "completed")


STORES: dict[str, type[_Store]] = {"memory": _Memory, "pg": _Postgres, "redis": _Redis}


async def _cell(store: _Store, n: int, rounds: int, warmup: float, seconds: float,
                log: Callable[[str], None]) -> dict[str, Any]:
    lib: list[dict[str, Any]] = []
    exact: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for r in range(rounds):
        tag = f"c{n}r{r}{uuid.uuid4().hex[:4]}"
        sides = [("lib", lib), ("exact", exact), ("raw", raw)]
        for side, out in sides if r % 2 == 0 else sides[::-1]:
            if side == "lib":
                out.append(await _library(store.backend(), n, tag, warmup, seconds))
            elif side == "exact":
                out.append(await _library(store.backend(), n, tag + "x", warmup, seconds,
                                          timer_slack=0))
            else:
                out.append(await _raw(store.raw, n, tag + "raw", warmup, seconds))

    def per_cpu(m: dict[str, Any]) -> float:
        return m["runs"] / m["cpu_s"] if m["cpu_s"] > 0 else 0.0

    ratios = [per_cpu(a) / per_cpu(b) for a, b in zip(lib, raw, strict=True) if per_cpu(b)]
    # With its default timer_slack the library batches the slots of a wake-up (claim_many,
    # one finish call), which the raw client does not: the like-for-like figure, the same
    # statements one run at a time, is timer_slack=0's.
    exact_ratios = [per_cpu(a) / per_cpu(b) for a, b in zip(exact, raw, strict=True)
                    if per_cpu(b)]
    cell = {
        "store": store.name, "offered_runs_s": n, "rounds": rounds, "seconds": seconds,
        "runs_per_cpu_s": round(statistics.median(per_cpu(m) for m in lib), 1),
        "raw_runs_per_cpu_s": round(statistics.median(per_cpu(m) for m in raw), 1),
        "cpu_ms_per_run": round(1000 / max(1e-9, statistics.median(per_cpu(m) for m in lib)), 3),
        "raw_cpu_ms_per_run": round(
            1000 / max(1e-9, statistics.median(per_cpu(m) for m in raw)), 3),
        "achieved_runs_s": round(statistics.median(m["runs"] / m["wall_s"] for m in lib), 1),
        "raw_achieved_runs_s": round(statistics.median(m["runs"] / m["wall_s"] for m in raw), 1),
        "ratio_vs_raw": _spread(ratios),
        "exact_ratio_vs_raw": _spread(exact_ratios),
        "exact_runs_per_cpu_s": round(statistics.median(per_cpu(m) for m in exact), 1),
        "late_ms": _lateness(lib),
        "exact_late_ms": _lateness(exact),
        "library_rounds": [round(per_cpu(m), 1) for m in lib],
        "raw_rounds": [round(per_cpu(m), 1) for m in raw],
    }
    spread = cell["ratio_vs_raw"]
    log(f"  {store.name:<6} {n:>5}/s offered: {cell['achieved_runs_s']:>7.1f}/s achieved, "
        f"{cell['runs_per_cpu_s']:>7.1f} runs/CPU-s (raw {cell['raw_runs_per_cpu_s']:.1f}), "
        f"lib/raw {spread['median']:.2f} [{spread['min']:.2f}, {spread['max']:.2f}]; "
        f"timer_slack=0: {cell['exact_runs_per_cpu_s']:.1f} runs/CPU-s (lib/raw "
        f"{cell['exact_ratio_vs_raw']['median']:.2f}); late p50/p99 "
        f"{cell['late_ms']['p50']}/{cell['late_ms']['p99']} ms "
        f"(timer_slack=0: {cell['exact_late_ms']['p50']}/{cell['exact_late_ms']['p99']})")
    return cell


def _lateness(sides: list[dict[str, Any]]) -> dict[str, float]:
    """Median and 99th percentile (ms) of how late the handlers of every round started."""
    late = sorted(x for m in sides for x in m["late_ms"])
    if not late:
        return {"p50": 0.0, "p99": 0.0}
    return {"p50": round(late[len(late) // 2], 1),
            "p99": round(late[min(len(late) - 1, len(late) * 99 // 100)], 1)}


async def run_cpu(servers: Servers, *, quick: bool, log: Callable[[str], None],
                  stores: tuple[str, ...] | None = None,
                  loads: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Measure every store at every load; the cells and each store's flatness."""
    stores = stores or (("memory", "pg") if quick else ("memory", "pg", "redis"))
    loads = loads or ((LOADS[0], LOADS[-1]) if quick else LOADS)
    rounds, warmup, seconds = (3, 1.2, 1.5) if quick else (5, 1.5, 2.5)
    out: dict[str, Any] = {"loads": list(loads), "cells": [], "flatness": {}}
    for name in stores:
        store = STORES[name]()
        await store.open(servers)
        try:
            cells = [await _cell(store, n, rounds, warmup, seconds, log) for n in loads]
        finally:
            await store.close()
        out["cells"] += cells
        low, high = cells[0]["runs_per_cpu_s"], cells[-1]["runs_per_cpu_s"]
        out["flatness"][name] = round(high / low, 3) if low else None
        log(f"  {name}: flatness (runs/CPU-s at {loads[-1]}/s ÷ at {loads[0]}/s) "
            f"{out['flatness'][name]}")
    return out
