"""Store load at scale (3 scheduler processes in steady state), and RSS at 10,000 leases.

The reference model is the original design's: one UPDATE per active job per heartbeat,
plus one SELECT per backup per one to two heartbeats (the design's 5 s and 5-10 s, scaled
to this run's heartbeat of 1 s). "Active" and "backups" are the held and watched runs the
instances report, averaged over the window, which is the model's most favourable reading
(it only pays for runs in flight). Claims cost the same in both designs and are reported
apart; the target compares the upkeep traffic (heartbeats and checks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import redis.asyncio

from ._stats import PgCounter, redis_commandstats, redis_reset_stats
from ._util import ROOT, Servers

__all__ = ["run_load", "run_rss"]

INSTANCES = 3
HEARTBEAT_S = 1.0
# membership renewals (one statement per instance per half lease) are upkeep too
UPKEEP = ("heartbeat", "check", "members")


class Worker:
    """A benchmark worker process and the JSON lines it printed."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.lines: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                continue

    def events(self, name: str) -> list[dict[str, Any]]:
        """Lines with ``event == name``."""
        return [x for x in list(self.lines) if x.get("event") == name]

    async def wait_for(self, name: str, limit: float) -> dict[str, Any]:
        """Wait for the first line with ``event == name``, or raise TimeoutError."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            found = self.events(name)
            if found:
                return found[0]
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode} before {name!r}")
            await anyio.sleep(0.05)
        raise TimeoutError(f"worker never printed {name!r}")

    def terminate(self) -> None:
        """SIGTERM (graceful stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc.poll() is None:
            self.proc.kill()

    async def wait(self, limit: float = 20) -> None:
        """Wait for the process to end; SIGKILL it after ``limit`` seconds."""
        try:
            await anyio.to_thread.run_sync(lambda: self.proc.wait(timeout=limit))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await anyio.to_thread.run_sync(self.proc.wait)


def _model(active: float, backups: float) -> dict[str, float]:
    return {
        "low": active / HEARTBEAT_S + backups / (2 * HEARTBEAT_S),
        "high": active / HEARTBEAT_S + backups / HEARTBEAT_S,
    }


def _averages(workers: list[Worker], t0: float, t1: float
              ) -> tuple[float, float, float, float]:
    """Mean held and watched runs (summed over instances), and round trips/s, all and
    those of the upkeep (Redis; 0 on PostgreSQL)."""
    held = watch = 0.0
    trips = upkeep = 0.0
    for w in workers:
        window = [x for x in w.events("status") if t0 <= x["t"] <= t1]
        if window:
            held += sum(x["held"] for x in window) / len(window)
            watch += sum(x["watch"] for x in window) / len(window)
            if window[0].get("round_trips") is not None and len(window) > 1:
                span = window[-1]["t"] - window[0]["t"]
                trips += (window[-1]["round_trips"] - window[0]["round_trips"]) / span
                upkeep += (window[-1]["upkeep_round_trips"]
                           - window[0]["upkeep_round_trips"]) / span
    return held, watch, trips, upkeep


async def _fleet(url: str, jobs: int, prefix: str, warmup: float, window: float,
                 reset: Callable[[], Any], read: Callable[[Any], Any]) -> dict[str, Any]:
    workers = [Worker("load", url, str(jobs), f"i{k}", prefix) for k in range(INSTANCES)]
    try:
        for w in workers:
            await w.wait_for("started", 60)
        await anyio.sleep(warmup)
        base = await reset()
        t0 = time.monotonic()
        await anyio.sleep(window)
        stats = await read(base)
        t1 = time.monotonic()
        held, watch, trips, upkeep = _averages(workers, t0, t1)
        return {"elapsed_s": round(t1 - t0, 2), "stats": stats, "held": round(held, 1),
                "watched": round(watch, 1), "round_trips_s": round(trips, 1),
                "upkeep_round_trips_s": round(upkeep, 2)}
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            await w.wait()


async def _pg_load(servers: Servers, jobs: int, warmup: float, window: float) -> dict[str, Any]:
    db = f"load{jobs}"
    async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as conn:
        await conn.execute(f"DROP DATABASE IF EXISTS {db}")
        await conn.execute(f"CREATE DATABASE {db}")
    url = servers.pg.dsn_for("postgres", servers.pg.password, db)
    counter = PgCounter(servers.dsn, db, servers.pg_stat_statements)
    out = await _fleet(url, jobs, "anarchon_runs", warmup, window, counter.reset, counter.read)
    stats, elapsed = out["stats"], out["elapsed_s"]
    kinds = stats.get("by_kind", {})
    per_s = {k: round(v / elapsed, 2) for k, v in sorted(kinds.items())}
    total = stats.get("statements", stats["database"]["xact_commit"]) / elapsed
    upkeep = sum(kinds.get(k, 0) for k in UPKEEP) / elapsed
    model = _model(out["held"], out["watched"])
    return {
        "key": f"load.pg.j{jobs}", "store": "pg", "jobs": jobs, "instances": INSTANCES,
        "window_s": elapsed, "statements_s": round(total, 1), "by_kind_s": per_s,
        "upkeep_statements_s": round(upkeep, 2),
        "claim_statements_s": round(sum(v for k, v in kinds.items()
                                        if k not in UPKEEP) / elapsed, 1),
        "xact_commit_s": round(stats["database"]["xact_commit"] / elapsed, 1),
        "tuples_s": {k: round(v / elapsed, 1) for k, v in stats["database"].items()
                     if k.startswith("tup_")},
        "held_avg": out["held"], "watched_avg": out["watched"],
        "model_upkeep_s": {k: round(v, 1) for k, v in model.items()},
        "reduction": round(model["low"] / upkeep, 1) if upkeep else None,
        "source": "pg_stat_statements" if servers.pg_stat_statements else "pg_stat_database",
    }


async def _redis_load(servers: Servers, jobs: int, warmup: float,
                      window: float) -> dict[str, Any]:
    client = redis.asyncio.Redis.from_url(servers.redis_url)
    prefix = f"load{jobs}"

    async def reset() -> None:
        await redis_reset_stats(client)

    async def read(_: Any) -> dict[str, int]:
        return await redis_commandstats(client)

    try:
        out = await _fleet(servers.redis_url, jobs, prefix, warmup, window, reset, read)
    finally:
        await client.aclose()
    stats, elapsed = out["stats"], out["elapsed_s"]
    model = _model(out["held"], out["watched"])
    # upkeep round trips: those the instances made inside their backends' heartbeat,
    # check and members calls, counted by their clients (UPKEEP, as on PostgreSQL)
    upkeep = out["upkeep_round_trips_s"]
    return {
        "key": f"load.redis.j{jobs}", "store": "redis", "jobs": jobs, "instances": INSTANCES,
        "window_s": elapsed, "commands_s_incl_scripts": round(sum(stats.values()) / elapsed, 1),
        "by_command_s": {k: round(v / elapsed, 1) for k, v in sorted(stats.items())},
        "round_trips_s": out["round_trips_s"], "upkeep_round_trips_s": upkeep,
        "held_avg": out["held"], "watched_avg": out["watched"],
        "model_upkeep_s": {k: round(v, 1) for k, v in model.items()},
        "reduction_round_trips": round(model["low"] / upkeep, 1) if upkeep else None,
        "source": "INFO commandstats + client round-trip counter",
    }


async def run_load(servers: Servers, *, quick: bool,
                   log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The fleet at each size on PostgreSQL, and at the ends of the range on Redis."""
    warmup, window = (4.0, 8.0) if quick else (5.0, 20.0)
    pg_sizes = (300,) if quick else (100, 300, 1000)
    redis_sizes = () if quick else (100, 1000)
    rows = []
    for jobs in pg_sizes:
        row = await _pg_load(servers, jobs, warmup, window)
        log(f"  load pg    {jobs:>5} jobs x {INSTANCES}: {row['statements_s']} stmt/s, upkeep "
            f"{row['upkeep_statements_s']}/s vs model {row['model_upkeep_s']['low']}/s "
            f"(x{row['reduction']}), held {row['held_avg']} watched {row['watched_avg']}")
        rows.append(row)
    for jobs in redis_sizes:
        row = await _redis_load(servers, jobs, warmup, window)
        log(f"  load redis {jobs:>5} jobs x {INSTANCES}: {row['round_trips_s']} round trips/s, "
            f"{row['commands_s_incl_scripts']} commands/s; model {row['model_upkeep_s']['low']}"
            f"/s (x{row['reduction_round_trips']})")
        rows.append(row)
    return rows


async def run_rss(servers: Servers, *, leases: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """RSS of one scheduler process holding ``leases`` runs (PostgreSQL, psycopg pool)."""
    async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as conn:
        await conn.execute("DROP DATABASE IF EXISTS rss")
        await conn.execute("CREATE DATABASE rss")
    url = servers.pg.dsn_for("postgres", servers.pg.password, "rss")
    worker = Worker("rss", url, str(leases), "anarchon_runs")
    try:
        declared = await worker.wait_for("declared", 60)
        started = await worker.wait_for("started", 60)
        deadline = time.monotonic() + 60 + leases / 200
        last: dict[str, Any] = started
        while time.monotonic() < deadline:
            status = worker.events("status")
            if status:
                last = status[-1]
                if last["held"] >= leases:
                    break
            await anyio.sleep(0.5)
        await anyio.sleep(6)  # one heartbeat of every lease
        last = worker.events("status")[-1]
    finally:
        worker.kill()
        await worker.wait()
    row = {
        "leases": leases, "held": last.get("held"),
        "rss_mb_declared": round(declared["rss"] / 2**20, 1),
        "rss_mb_started": round(started["rss"] / 2**20, 1),
        "rss_mb_holding": round(last["rss"] / 2**20, 1),
        "kb_per_lease": round((last["rss"] - started["rss"]) / 1024 / max(1, leases), 2),
    }
    log(f"  rss: {row['held']} leases held: {row['rss_mb_holding']} MB "
        f"(started {row['rss_mb_started']} MB, {row['kb_per_lease']} KB per lease)")
    return row
