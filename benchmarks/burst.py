"""A burst: many jobs due at the same instant, 3 schedulers in one process, per store.

Each round runs one burst per contender, on one store, in an order that alternates from
round to round:

- ``anarchon``: 3 schedulers (each its own backend made from the URL, so with the
  default connection bounds; lease 4 s, heartbeat 1 s), every job declared on each, all
  due at one slot, which comes after every scheduler knows the whole fleet (so each job
  is claimed first by the member ranked first for it, as in a running fleet);
- Redis, ``redis_py_lock``: 3 instances (one redis.asyncio client each), each trying a
  redis-py asyncio ``Lock`` per (job, slot) with ``acquire(blocking=False)``, job after
  job; the instance that gets the lock "starts the handler";
- PostgreSQL, ``shedlock``: 3 instances (one raw psycopg connection each), each sending
  ShedLock's upsert lock per job, job after job.

Measured per burst, from just before the slot until every job's handler started
(exactly one start per job is checked):

- ``latency_ms``: from the slot (store clock; the servers are local, so the same clock
  as ``time.time()``) until the last handler started;
- ``round_trips``: requests the client sent, counted at the driver (redis-py's
  ``send_packed_command``: one per command or pipeline, connection handshakes
  included; the Redis adapter's lean single commands, which bypass it; psycopg's and
  pg8000's statement calls), and on PostgreSQL the statements
  ``pg_stat_statements`` recorded when it is loaded;
- ``commands`` (Redis): ``INFO commandstats`` calls, commands run inside scripts
  included, and ``connections`` (``total_connections_received``);
- ``balance`` (anarchon): the busiest instance's handlers ÷ its fair share (jobs ÷ 3),
  target at most 1.5;
- ``store_cpu_s``: redis-server's ``used_cpu_sys + used_cpu_user``; for PostgreSQL the
  CPU time of the postmaster and its children from ``/proc`` (exited backends are in
  the postmaster's ``cutime``/``cstime``).

anarchon's window also holds the ``finish`` of the runs that completed before the last
handler started; the lock contenders never release. Ratios are peer ÷ anarchon per
round (higher is better for anarchon), then the median and spread of the rounds.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import psycopg
import redis.asyncio
import redis.asyncio.connection

from adapters.redis_lean import LeanSender
from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import Scheduler

from ._util import Servers

__all__ = ["INSTANCES", "declare_jobs", "run_burst"]

#: Schedulers (or lock clients) racing for every job.
INSTANCES = 3
#: Targets of the issue: peer ÷ anarchon.
TARGET_ROUND_TRIPS = 5.0
TARGET_TIME = 3.0
#: The busiest instance's handlers ÷ its fair share (anarchon only).
TARGET_BALANCE = 1.5
#: The schedulers' lease and heartbeat: membership renewed every 2 s.
LEASE = "4s"
HEARTBEAT = "1s"
#: Seconds from the schedulers' creation to the slot: start-up, and the membership known.
FLEET_LEAD_S = 5.0
#: Warm-up jobs, due this many ms before the burst's slot (see :func:`declare_jobs`).
WARM_JOBS = 30
WARM_LEAD_MS = 1000

SHEDLOCK_TABLE = """
CREATE TABLE IF NOT EXISTS burst_shedlock (
    name VARCHAR(64) NOT NULL PRIMARY KEY, lock_until TIMESTAMP NOT NULL,
    locked_at TIMESTAMP NOT NULL, locked_by VARCHAR(255) NOT NULL)"""
# ShedLock's PostgresJdbcTemplateStorageAccessor with usingDbTime(): one upsert to lock.
SHEDLOCK_LOCK = """
INSERT INTO burst_shedlock (name, lock_until, locked_at, locked_by)
VALUES (%s, timezone('utc', CURRENT_TIMESTAMP) + %s * interval '1 millisecond',
        timezone('utc', CURRENT_TIMESTAMP), %s)
ON CONFLICT (name) DO UPDATE
SET lock_until = timezone('utc', CURRENT_TIMESTAMP) + %s * interval '1 millisecond',
    locked_at = timezone('utc', CURRENT_TIMESTAMP), locked_by = %s
WHERE burst_shedlock.lock_until <= timezone('utc', CURRENT_TIMESTAMP)"""


# --- counters --------------------------------------------------------------------------

_sent = [0]
#: ids of the meter's own connections, whose requests are not counted.
_uncounted: set[int] = set()
#: Inside a lean send (counted once there, whether or not it calls the driver's sender).
_in_lean: contextvars.ContextVar[bool] = contextvars.ContextVar("_in_lean", default=False)


@contextlib.contextmanager
def _count_driver_calls() -> Iterator[None]:
    """Count requests at the drivers: redis-py sends, psycopg and pg8000 statements."""
    import pg8000.native

    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, is_async: bool) -> None:
        original = getattr(owner, name)
        if is_async:
            async def counted_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                if (id(getattr(self, "connection", self)) not in _uncounted
                        and not _in_lean.get()):
                    _sent[0] += 1
                return await original(self, *args, **kwargs)
            setattr(owner, name, counted_async)
        else:
            def counted(*args: Any, **kwargs: Any) -> Any:
                _sent[0] += 1
                return original(*args, **kwargs)
            setattr(owner, name, counted)
        patched.append((owner, name, original))

    wrap(redis.asyncio.connection.AbstractConnection, "send_packed_command", True)
    wrap(psycopg.AsyncCursor, "execute", True)
    wrap(pg8000.native.Connection, "run", False)
    # The Redis adapter's single commands (adapters/redis_lean.py) write to the stream
    # themselves, not through send_packed_command: each is one request too.
    send = LeanSender.send

    async def lean_send(self: Any, command: tuple[Any, ...]) -> Any:
        token = _in_lean.set(True)
        try:
            _sent[0] += 1
            return await send(self, command)
        finally:
            _in_lean.reset(token)

    LeanSender.send = lean_send  # type: ignore[method-assign]
    patched.append((LeanSender, "send", send))
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def _proc_cpu(pid: int, *, children_done: bool) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children_done:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _postmaster_pid(servers: Servers) -> int:
    pidfile = servers.pg.datadir / "postmaster.pid"
    return int(pidfile.read_text().split()[0])


def _pg_cpu(postmaster: int) -> float:
    """CPU seconds of the postmaster, its live children and its reaped children."""
    total = _proc_cpu(postmaster, children_done=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                total += _proc_cpu(int(entry.name), children_done=False)
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class _Sample:
    sent: int
    cpu: float
    commands: int = 0
    connections: int = 0
    statements: int = 0


class _Meter:
    """Samples one store's counters before and after a burst."""

    def __init__(self, servers: Servers, store: str) -> None:
        self.servers, self.store = servers, store
        self.redis: Any = None
        self.pg: Any = None
        self.postmaster = _postmaster_pid(servers) if store == "pg" else 0

    async def open(self) -> None:
        if self.store == "redis":
            self.redis = redis.asyncio.Redis.from_url(self.servers.redis_url,
                                                      single_connection_client=True)
            await self.redis.initialize()
            _uncounted.add(id(self.redis.connection))
        else:
            self.pg = await psycopg.AsyncConnection.connect(self.servers.dsn, autocommit=True)
            _uncounted.add(id(self.pg))

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
        if self.pg is not None:
            await self.pg.close()

    async def sample(self) -> _Sample:
        if self.store == "redis":
            info = await self.redis.info("all")
            commands = sum(v["calls"] for k, v in info.items()
                           if k.startswith("cmdstat_") and isinstance(v, dict))
            out = _Sample(0, float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                          commands=commands, connections=int(info["total_connections_received"]))
        else:
            statements = 0
            if self.servers.pg_stat_statements:
                cur = await self.pg.execute(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                    "WHERE query NOT LIKE '%pg_stat_statements%'")
                row = await cur.fetchone()
                statements = int(row[0]) if row else 0
            out = _Sample(0, await anyio.to_thread.run_sync(_pg_cpu, self.postmaster),
                          statements=statements)
        out.sent = _sent[0]
        return out


def _delta(a: _Sample, b: _Sample, store: str) -> dict[str, Any]:
    out: dict[str, Any] = {"round_trips": b.sent - a.sent,
                           "store_cpu_s": round(b.cpu - a.cpu, 4)}
    if store == "redis":
        out["commands"] = b.commands - a.commands - 1  # the meter's INFO
        out["connections"] = b.connections - a.connections
    elif b.statements:
        out["statements"] = b.statements - a.statements
    return out


# --- contenders ------------------------------------------------------------------------


def declare_jobs(scheduler: Scheduler, tag: str, n: int, slot: int,
                 handler: Callable[[Any], Awaitable[None]]) -> None:
    """Declare the burst's ``n`` jobs, due at ``slot``, and the warm-up jobs.

    The fleet is a running one (its members know each other at the slot; the lock side's
    connections are open): each scheduler has claimed before. So :data:`WARM_JOBS` jobs
    with a no-op handler fall due :data:`WARM_LEAD_MS` before the slot, about ten per
    member, whose claims run the store's claim code once on the connection the burst then
    borrows: on PostgreSQL, the first call of the claim function on a connection compiles
    it and plans its statements (33 claims: 9.0-9.6 ms cold against 3.0-5.7 ms warm,
    measured), which a service that has run a while paid long ago.
    """
    for j in range(n):
        scheduler.every(f"{tag}-{j}", "1h", handler, offset=(slot % 3_600_000) / 1000)

    async def warm_up(ctx: Any) -> None:
        return None

    for j in range(WARM_JOBS):
        scheduler.every(f"{tag}-warm-{j}", "1h", warm_up,
                        offset=((slot - WARM_LEAD_MS) % 3_600_000) / 1000)


async def _until(epoch_ms: int) -> None:
    """Sleep until ``epoch_ms`` (wall clock), on time: a long sleep on the event loop ends
    late by 0.1 % of its length (Linux's slack on a poll timeout), which gave a lock
    instance that slept 4 s before its slot a 4 ms handicap over the schedulers, which
    wake at least every heartbeat (and sleep in two legs as here, see the CHANGELOG)."""
    delay = epoch_ms / 1000 - time.time()
    if delay > 0.5:  # a first leg that ends 2 ms + 0.6 % (at most 152 ms) early
        await anyio.sleep(delay - 0.002 - min(delay * 0.006, 0.15))
    rest = epoch_ms / 1000 - time.time()  # the short second leg
    if rest > 0:
        await anyio.sleep(rest)


async def _wait_all(started: dict[str, float], n: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    while len(started) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(started)} of {n} handlers started within {limit}s")
        await anyio.sleep(0.002)


async def _anarchon(servers: Servers, store: str, n: int, meter: _Meter,
                    tag: str) -> dict[str, Any]:
    # The slot is after every member knows the whole fleet (membership is renewed every
    # half lease), as in a fleet that has been running: each job is claimed first by the
    # one member ranked first for it.
    lead_ms = int(FLEET_LEAD_S * 1000) + 4 * n
    slot = int(time.time() * 1000) + lead_ms
    started: dict[str, float] = {}
    by: dict[str, str] = {}
    doubles = [0]

    def handler_of(name: str) -> Any:
        async def handler(ctx: Any) -> None:
            if ctx.job in started:
                doubles[0] += 1
            started.setdefault(ctx.job, time.time() * 1000)
            by.setdefault(ctx.job, name)
        return handler

    url = servers.redis_url if store == "redis" else servers.dsn
    schedulers = []
    for i in range(INSTANCES):
        backend = (RedisBackend(url, prefix=f"burst{tag}") if store == "redis"
                   else PostgresBackend(url, table="burst_runs"))
        s = Scheduler(backend, instance_id=f"i{i}", lease=LEASE, heartbeat=HEARTBEAT,
                      history_size=10)
        declare_jobs(s, tag, n, slot, handler_of(f"i{i}"))
        schedulers.append(s)
    try:
        for s in schedulers:
            await s.start()
        while not all(s.health().fleet_size == INSTANCES for s in schedulers):
            if time.time() * 1000 > slot - 100:
                raise RuntimeError("the schedulers did not know the whole fleet before the "
                                   "slot")
            await anyio.sleep(0.02)
        await _until(slot - 50)
        before = await meter.sample()
        await _wait_all(started, n, 60)
        after = await meter.sample()
    finally:
        for s in schedulers:
            await s.stop(grace=5)
    if doubles[0]:
        raise RuntimeError(f"{doubles[0]} runs started twice")
    busiest = max(Counter(by.values()).values())
    return {"latency_ms": round(max(started.values()) - slot, 1),
            "first_ms": round(min(started.values()) - slot, 1),
            "balance": round(busiest / (n / INSTANCES), 3), **_delta(before, after, store)}


async def _redis_locks(servers: Servers, n: int, meter: _Meter, tag: str) -> dict[str, Any]:
    clients = [redis.asyncio.Redis.from_url(servers.redis_url) for _ in range(INSTANCES)]
    started: dict[str, float] = {}
    slot = int(time.time() * 1000) + 300
    try:
        for k, c in enumerate(clients):
            await c.ping()  # connected before the slot, as a running service would be
            # and has locked before, as the schedulers' warm-up claims have claimed
            await c.lock(f"burst{tag}:warm:{k}", timeout=30).acquire(blocking=False)
        await _until(slot - 50)
        before = await meter.sample()
        await _until(slot)

        async def instance(client: Any) -> None:
            for j in range(n):
                lock = client.lock(f"burst{tag}:lock:{j}:{slot}", timeout=30)
                if await lock.acquire(blocking=False):
                    started.setdefault(str(j), time.time() * 1000)

        async with anyio.create_task_group() as tg:
            for c in clients:
                tg.start_soon(instance, c)
        await _wait_all(started, n, 60)
        after = await meter.sample()
    finally:
        for c in clients:
            await c.aclose()
    return {"latency_ms": round(max(started.values()) - slot, 1),
            "first_ms": round(min(started.values()) - slot, 1),
            **_delta(before, after, "redis")}


async def _shedlock(servers: Servers, n: int, meter: _Meter, tag: str) -> dict[str, Any]:
    conns = [await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True)
             for _ in range(INSTANCES)]
    started: dict[str, float] = {}
    slot = int(time.time() * 1000) + 300
    try:
        for i, c in enumerate(conns):
            # warm, as the schedulers' warm-up claims warm theirs: a running service's
            # connection has locked before (its first statement loads the table's caches)
            await c.execute(SHEDLOCK_LOCK, (f"{tag}-warm-{i}", 30_000, f"i{i}", 30_000,
                                            f"i{i}"), prepare=False)
        await _until(slot - 50)
        before = await meter.sample()
        await _until(slot)

        async def instance(i: int, conn: Any) -> None:
            for j in range(n):
                cur = await conn.execute(SHEDLOCK_LOCK, (f"{tag}-{j}", 30_000, f"i{i}",
                                                         30_000, f"i{i}"), prepare=False)
                if cur.rowcount == 1:
                    started.setdefault(str(j), time.time() * 1000)

        async with anyio.create_task_group() as tg:
            for i, c in enumerate(conns):
                tg.start_soon(instance, i, c)
        await _wait_all(started, n, 60)
        after = await meter.sample()
    finally:
        for c in conns:
            await c.close()
    return {"latency_ms": round(max(started.values()) - slot, 1),
            "first_ms": round(min(started.values()) - slot, 1),
            **_delta(before, after, "pg")}


# --- rounds ----------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 2), "min": round(ordered[0], 2),
            "max": round(ordered[-1], 2), "rounds": len(ordered)}


async def _cell(servers: Servers, store: str, n: int, rounds: int) -> dict[str, Any]:
    meter = _Meter(servers, store)
    await meter.open()
    peer_name = "redis_py_lock" if store == "redis" else "shedlock_raw_psycopg"
    if store == "pg":
        await meter.pg.execute(SHEDLOCK_TABLE)
    runs: dict[str, list[dict[str, Any]]] = {"anarchon": [], peer_name: []}
    try:
        for r in range(rounds):
            order = ["anarchon", peer_name] if r % 2 == 0 else [peer_name, "anarchon"]
            for name in order:
                tag = uuid.uuid4().hex[:8]
                burst: Awaitable[dict[str, Any]]
                if name == "anarchon":
                    burst = _anarchon(servers, store, n, meter, tag)
                elif store == "redis":
                    burst = _redis_locks(servers, n, meter, tag)
                else:
                    burst = _shedlock(servers, n, meter, tag)
                runs[name].append(await burst)
    finally:
        await meter.close()
    keys = [k for k in runs["anarchon"][0] if k in runs[peer_name][0]]
    ratios = {}
    for key in keys:
        pairs = [(p[key], a[key]) for a, p in zip(runs["anarchon"], runs[peer_name],
                                                   strict=True) if a[key] > 0]
        if pairs:
            ratios[key] = _spread([p / a for p, a in pairs])
    medians = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
               for name, rs in runs.items()}
    return {"jobs": n, "instances": INSTANCES, "peer": peer_name, "median": medians,
            "ratio_peer_over_anarchon": ratios, "runs": runs,
            "round_trips_counted_at": "the driver (redis-py sends; psycopg/pg8000 "
                                      "statement calls)"}


async def run_burst(servers: Servers, *, sizes: tuple[int, ...] = (100, 1000),
                    stores: tuple[str, ...] = ("redis", "pg"), rounds: int = 5,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (store, size) cell, contenders interleaved; returns the JSON section."""
    out: dict[str, Any] = {}
    with _count_driver_calls():
        for store in stores:
            for n in sizes:
                # ".fleet": the members know each other at the slot (ranked claims); the
                # keys without it measured a fleet still unknown at the slot
                key = f"{store}.{n}.fleet"
                cell = out[key] = await _cell(servers, store, n, rounds)
                ratio = cell["ratio_peer_over_anarchon"]
                met = {k: ratio[k]["median"] >= t for k, t in
                       (("round_trips", TARGET_ROUND_TRIPS), ("latency_ms", TARGET_TIME))
                       if k in ratio}
                balance = [r["balance"] for r in cell["runs"]["anarchon"]]
                cell["balance"] = _spread(balance)
                met["balance"] = cell["balance"]["median"] <= TARGET_BALANCE
                cell["targets_met"] = met
                a, p = cell["median"]["anarchon"], cell["median"][cell["peer"]]
                log(f"  burst {key:<10} latency anarchon {a['latency_ms']:.0f} ms, "
                    f"{cell['peer']} {p['latency_ms']:.0f} ms; round trips {a['round_trips']:.0f}"
                    f" vs {p['round_trips']:.0f}; store CPU {a['store_cpu_s']:.3f} s vs "
                    f"{p['store_cpu_s']:.3f} s; balance {cell['balance']['median']}; "
                    f"targets {met}")
    return out


def main() -> None:
    """``python -m benchmarks.burst [SIZES] [STORES] [ROUNDS]``, e.g. ``100 redis,pg 3``."""
    import json
    import sys

    from ._util import pg_servers

    sizes = tuple(int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "100").split(","))
    stores = tuple((sys.argv[2] if len(sys.argv) > 2 else "redis,pg").split(","))
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    with pg_servers() as servers:
        result = anyio.run(lambda: run_burst(servers, sizes=sizes, stores=stores,
                                             rounds=rounds,
                                             log=lambda t: print(t, file=sys.stderr)))
    for cell in result.values():
        cell.pop("runs")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
