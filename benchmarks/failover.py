"""Failover and hand-over latency between two scheduler processes, from the store's clock.

A trial starts two processes with one job whose slot fires a moment later; one wins.
*Kill*: the holder is SIGKILLed; the figures are the backup's ``claimed_at`` (attempt 2)
minus the lease expiry the dead holder left in the store, minus its last heartbeat
(expiry - lease), and minus the store time of the kill. *Stop*: the holder is sent
SIGTERM and calls ``stop()``; the figures are the backup's ``claimed_at`` minus the store
time at which ``stop()`` began and minus the hand-over (attempt 1's ``finished_at``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core.abc import Backend

from ._util import Servers, median, p95
from .load import Worker

__all__ = ["run_failover"]

LEASE = "3s"
HEARTBEAT = "0.5s"
LEASE_MS = 3000


async def _expiry(backend: Backend, table: str, slot: int) -> int | None:
    state = (await backend.check([("fo", slot)])).runs.get(("fo", slot))
    return state.expires_ms if state is not None else None


class _StartedLate(Exception):
    """The workers started after the run's instant (a busy machine): try a longer lead."""


async def _trial(store: str, url: str, kind: str, n: int) -> dict[str, Any]:
    """One trial; the workers get a longer lead when they start too late to claim."""
    for lead_ms in (2500, 6000, 15000):
        try:
            return await _attempt(store, url, kind, f"fo_{kind}{n}_{lead_ms}", lead_ms)
        except _StartedLate:
            continue
    raise RuntimeError("the failover workers never started before their run's instant")


async def _attempt(store: str, url: str, kind: str, table: str, lead_ms: int) -> dict[str, Any]:
    backend: Backend = (PostgresBackend(url, table=table) if store == "pg"
                        else RedisBackend(url, prefix=table))
    await backend.start()
    workers: list[Worker] = []
    try:
        fire_at = await backend.now_ms() + lead_ms
        workers = [Worker("failover", url, name, str(fire_at), LEASE, HEARTBEAT, table)
                   for name in ("A", "B")]
        for w in workers:
            await w.wait_for("started", 60)
        if await backend.now_ms() > fire_at - 200:  # catch_up="none" would skip the run
            raise _StartedLate
        with anyio.fail_after(20):
            # polls another process's output, which no in-process event reports
            while not any(w.events("won") for w in workers):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        holder = next(w for w in workers if w.events("won"))
        backup = next(w for w in workers if w is not holder)
        await anyio.sleep(1.2)  # a few heartbeats
        row: dict[str, Any] = {"kind": kind}
        if kind == "kill":
            row["kill_ms"] = await backend.now_ms()
            holder.kill()
            await holder.wait()
            row["expires_ms"] = await _expiry(backend, table, fire_at)
        else:
            holder.terminate()
        await backup.wait_for("won", 30)
        attempts = {a.attempt: a for a in await backend.history("fo", 10) if a.slot == fire_at}
        claimed2 = int(attempts[2].claimed_at.timestamp() * 1000)
        if kind == "kill":
            expires = row["expires_ms"]
            row["after_expiry_ms"] = claimed2 - expires
            row["after_last_heartbeat_ms"] = claimed2 - (expires - LEASE_MS)
            row["after_kill_ms"] = claimed2 - row["kill_ms"]
        else:
            stop_ms = int((await holder.wait_for("stopping", 10))["store_ms"])
            finished1 = attempts[1].finished_at
            row["after_stop_ms"] = claimed2 - stop_ms
            row["after_hand_over_ms"] = (claimed2 - int(finished1.timestamp() * 1000)
                                         if finished1 else None)
            row["reason"] = str(attempts[2].reason)
        return row
    finally:
        for w in workers:
            w.kill()
        for w in workers:
            await w.wait()
        await backend.close()


def _summary(rows: list[dict[str, Any]], field: str) -> dict[str, Any]:
    values = [float(r[field]) for r in rows if r.get(field) is not None]
    return {"median_ms": median(values), "p95_ms": p95(values), "n": len(values),
            "values_ms": values}


async def run_failover(servers: Servers, *, trials: int, stores: tuple[str, ...],
                       log: Callable[[str], None]) -> dict[str, Any]:
    """``trials`` kills and ``trials`` stops per store; medians and p95 per figure."""
    out: dict[str, Any] = {"lease_ms": LEASE_MS, "heartbeat_ms": 500,
                           "check_interval_ms": 500}
    for store in stores:
        url = servers.dsn if store == "pg" else servers.redis_url
        rows = []
        for n in range(trials):
            for kind in ("kill", "stop"):
                rows.append(await _trial(store, url, kind, n))
        kills = [r for r in rows if r["kind"] == "kill"]
        stops = [r for r in rows if r["kind"] == "stop"]
        out[store] = {
            "kill_after_expiry": _summary(kills, "after_expiry_ms"),
            "kill_after_last_heartbeat": _summary(kills, "after_last_heartbeat_ms"),
            "kill_after_kill": _summary(kills, "after_kill_ms"),
            "stop_after_stop": _summary(stops, "after_stop_ms"),
            "stop_after_hand_over": _summary(stops, "after_hand_over_ms"),
            "trials": rows,
        }
        s = out[store]
        log(f"  failover {store}: kill->claim median {s['kill_after_kill']['median_ms']} ms "
            f"(after expiry {s['kill_after_expiry']['median_ms']} ms, p95 "
            f"{s['kill_after_expiry']['p95_ms']}); stop->claim median "
            f"{s['stop_after_stop']['median_ms']} ms p95 {s['stop_after_stop']['p95_ms']}")
    return out
