"""Where the time of one claim + finish goes, against the peers' acquire + release.

One process, one run, the same servers (``benchmarks._util.pg_servers``). For each store
it runs, in turn and sequentially, ``N`` operations of:

- ``library``: ``backend.claim`` then ``backend.finish`` (a new slot each time);
- ``raw``: the very same script calls / statements sent through the raw driver;
- ``peer``: redis-py's asyncio ``Lock`` acquire + release, or ShedLock's upsert + unlock
  through raw psycopg (as in ``benchmarks/peers.py``).

The contenders take turns (``--rounds``, the order rotated from turn to turn), so a busy
moment of the shared machine is shared by all of them.

Client side: ``time.perf_counter_ns`` spans around each of the two calls (median, µs),
and the round trips per operation (Redis: writes to the socket, counted on redis-py's
connection; PostgreSQL: top-level statements in pg_stat_statements, each autocommit
statement being one round trip). Server side: Redis ``INFO commandstats`` (top-level
``EVALSHA`` / ``SET`` µs per call, commands run inside the scripts per operation),
``SLOWLOG`` at threshold 0 (so the claim and finish scripts apart) and the server's CPU
per operation (``INFO cpu``); PostgreSQL ``pg_stat_statements`` with ``track = all`` and
``track_planning = on`` (planning and execution of each top-level statement, and of the
claim function's own statements), and WAL bytes per operation (``pg_current_wal_lsn()``
deltas). PostgreSQL also runs the raw statements on a connection borrowed from a pool
for each statement (``pool``), which parts the pool's cost from the library's own.
``--cprofile`` adds a cProfile of the library's functions.

Run: ``python -m benchmarks.profile_claim [--n 2000] [--cprofile]``; prints Markdown.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import psycopg
import redis.asyncio
from psycopg_pool import AsyncConnectionPool

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core.abc import ClaimRequest, ClaimStatus, Lease, Outcome
from lease_core.errors import AnarchonError

from ._rounds import round_order
from ._util import Servers, pg_servers
from .peers import SHEDLOCK_LOCK, SHEDLOCK_TABLE, SHEDLOCK_UNLOCK
from .throughput import HISTORY, INSTANCE, LEASE_MS

__all__ = ["main"]

Step = Callable[[int], Awaitable[None]]
#: cProfile rows kept: the library's own functions.
_OURS = r"/(backends|adapters|lease_core)/"


def _us(values: list[int]) -> float:
    return round(statistics.median(values) / 1000, 1)


async def _spans(first: Step, second: Step, n: int, start: int = 0
                 ) -> tuple[list[int], list[int]]:
    """Run ``first(i)`` then ``second(i)`` for ``n`` values of ``i`` from ``start``.

    Returns the duration of each call in ns.
    """
    a: list[int] = []
    b: list[int] = []
    for i in range(start, start + n):
        t0 = time.perf_counter_ns()
        await first(i)
        t1 = time.perf_counter_ns()
        await second(i)
        t2 = time.perf_counter_ns()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return a, b


# ---------------------------------------------------------------------------- Redis


class _Writes:
    """Counts the writes to the socket of redis-py's asyncio connections (round trips)."""

    count = 0

    def __enter__(self) -> _Writes:
        self._orig = redis.asyncio.connection.AbstractConnection.send_packed_command
        orig = self._orig
        counter = self

        async def counting(conn: Any, command: Any, check_health: bool = True) -> None:
            counter.count += 1
            await orig(conn, command, check_health)

        redis.asyncio.connection.AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        redis.asyncio.connection.AbstractConnection.send_packed_command = self._orig  # type: ignore[method-assign]


def _cmdstats(info: dict[str, Any]) -> dict[str, tuple[int, int]]:
    out = {}
    for key, value in info.items():
        if key.startswith("cmdstat_"):
            out[key[8:]] = (int(value["calls"]), int(value["usec"]))
    return out


async def _rounds(phase: Callable[..., Awaitable[dict[str, Any]]],
                  contenders: dict[str, tuple[Step, Step]], n: int, rounds: int
                  ) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` turns of every contender (``n // rounds`` operations each), the order
    rotated and reversed from turn to turn, so a busy moment of the machine is shared."""
    names = list(contenders)
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    per = max(1, n // rounds)
    for r in range(rounds):
        for name in round_order(names, r):
            parts[name].append(await phase(*contenders[name], per, r * per))
    return parts


async def _redis_phase(admin: Any, first: Step, second: Step, n: int, start: int,
                       names: dict[str, str]) -> dict[str, Any]:
    """One turn of a contender: spans, round trips, commandstats, slowlog, server CPU."""
    await admin.config_resetstat()
    await admin.slowlog_reset()
    cpu0 = await admin.info("cpu")
    with _Writes() as writes:
        a, b = await _spans(first, second, n, start)
    cpu1 = await admin.info("cpu")
    stats = _cmdstats(await admin.info("commandstats"))
    log = await admin.slowlog_get(128)
    server_us: dict[str, list[int]] = {}
    for entry in log:
        command = entry["command"].split()
        if not command or command[0] in (b"SLOWLOG", b"INFO", b"CONFIG"):
            continue
        key = command[0].decode().upper()
        if key == "EVALSHA":
            key = names.get(command[1].decode(), "EVALSHA ?")
        server_us.setdefault(key, []).append(int(entry["duration"]))
    cpu = sum(float(cpu1[k]) - float(cpu0[k]) for k in ("used_cpu_sys", "used_cpu_user"))
    return {"a": a, "b": b, "writes": writes.count, "cpu": cpu, "stats": stats,
            "slow": server_us, "n": n}


def _redis_summary(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The turns of one contender, added up."""
    n = sum(p["n"] for p in parts)
    stats: dict[str, list[int]] = {}
    slow: dict[str, list[int]] = {}
    for p in parts:
        for k, (calls, usec) in p["stats"].items():
            stats.setdefault(k, [0, 0])
            stats[k][0] += calls
            stats[k][1] += usec
        for k, values in p["slow"].items():
            slow.setdefault(k, []).extend(values)
    inner = {k: round(v[0] / n, 2) for k, v in stats.items()
             if k not in ("evalsha", "set", "info", "config", "slowlog", "get")}
    return {
        "client_us": (_us([x for p in parts for x in p["a"]]),
                      _us([x for p in parts for x in p["b"]])),
        "round_trips": round(sum(p["writes"] for p in parts) / n, 2),
        "evalsha_us_per_call": (round(stats["evalsha"][1] / stats["evalsha"][0], 1)
                                if "evalsha" in stats else None),
        "set_us_per_call": (round(stats["set"][1] / stats["set"][0], 1)
                            if "set" in stats else None),
        "slowlog_median_us": {k: statistics.median(v) for k, v in slow.items()},
        "inner_commands_per_op": inner,
        "inner_total_per_op": round(sum(inner.values()), 1),
        "server_cpu_us_per_op": round(sum(p["cpu"] for p in parts) / n * 1e6, 1),
    }


async def _warm(backend: RedisBackend, job: str) -> None:
    """A first claim and finish of ``job`` (slot 0): lists the job, learns its marker."""
    await backend.claim(ClaimRequest(job, 0, INSTANCE, "warm", LEASE_MS,
                                     history_size=HISTORY))
    await backend.finish(Lease(job, 0, "warm", LEASE_MS), Outcome.COMPLETED)


async def profile_redis(servers: Servers, n: int, rounds: int, cprof: bool) -> dict[str, Any]:
    """The three Redis contenders, in turn."""
    client = redis.asyncio.Redis.from_url(servers.redis_url)
    raw = redis.asyncio.Redis.from_url(servers.redis_url)
    admin = redis.asyncio.Redis.from_url(servers.redis_url)
    backend = RedisBackend(client, prefix="prof")
    await backend.start()
    await admin.config_set("slowlog-log-slower-than", 0)
    await admin.config_set("slowlog-max-len", 128)
    out: dict[str, Any] = {}
    try:
        from backends.redis import SCRIPTS
        names = {s.sha: f"EVALSHA {s.name}.lua" for s in SCRIPTS.values()}
        tag = uuid.uuid4().hex[:6]
        job = f"lib-{tag}"
        tokens: dict[int, str] = {}
        await _warm(backend, job)

        async def claim(i: int) -> None:
            tokens[i] = uuid.uuid4().hex
            result = await backend.claim(ClaimRequest(job, i + 1, INSTANCE, tokens[i],
                                                      LEASE_MS, history_size=HISTORY))
            if result.status is not ClaimStatus.WON:
                raise RuntimeError(f"claim not won: {result}")

        async def finish(i: int) -> None:
            if not await backend.finish(Lease(job, i + 1, tokens[i], LEASE_MS),
                                        Outcome.COMPLETED):
                raise RuntimeError("finish did not end the attempt")

        # the raw driver sends the very commands the library builds, outside the library
        rjob = f"raw-{tag}"
        rcmd: dict[int, tuple[Any, ...]] = {}
        await _warm(backend, rjob)
        for i in range(n):
            token = uuid.uuid4().hex
            tokens[-1 - i] = token
            rcmd[i] = backend._claim_command(ClaimRequest(
                rjob, i + 1, INSTANCE, token, LEASE_MS, history_size=HISTORY))
        tag_r = backend._tag(rjob)
        finish_sha = SCRIPTS["finish"].sha

        async def raw_claim(i: int) -> None:
            reply = await raw.execute_command(*rcmd[i])
            if not reply.startswith(b"won|"):
                raise RuntimeError(f"raw claim not won: {reply}")

        async def raw_finish(i: int) -> None:
            done = await raw.execute_command(
                "EVALSHA", finish_sha, 4, f"{tag_r}:run:{i + 1}", f"{tag_r}:open",
                f"{tag_r}:att", f"{tag_r}:done", tokens[-1 - i], i + 1, "completed", 0, "")
            if int(done) != 1:
                raise RuntimeError("raw finish did not end the attempt")

        locks: dict[int, Any] = {}

        async def acquire(i: int) -> None:
            locks[i] = raw.lock("prof:redis-py", timeout=30)
            if not await locks[i].acquire(blocking=False):
                raise RuntimeError("lock not acquired")

        async def release(i: int) -> None:
            await locks.pop(i).release()

        await acquire(0)
        await release(0)
        names[raw.lock("x").lua_release.sha] = "EVALSHA lock release"
        async def phase(first: Step, second: Step, count: int, start: int
                        ) -> dict[str, Any]:
            return await _redis_phase(admin, first, second, count, start, names)

        parts = await _rounds(phase, {"library": (claim, finish),
                                      "raw": (raw_claim, raw_finish),
                                      "peer": (acquire, release)}, n, rounds)
        out.update({k: _redis_summary(v) for k, v in parts.items()})
        if cprof:
            job = f"cprof-{tag}"
            profiler = cProfile.Profile()
            profiler.enable()
            await _spans(claim, finish, n, n)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(
                        _OURS, 15)
            out["cprofile"] = text.getvalue()
    finally:
        await backend.close()
        await raw.aclose()
        await admin.aclose()
    return out


# ------------------------------------------------------------------------ PostgreSQL


async def _lsn(conn: psycopg.AsyncConnection[Any]) -> Any:
    cur = await conn.execute("SELECT pg_current_wal_lsn()")
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def _pg_phase(admin: psycopg.AsyncConnection[Any], first: Step, second: Step, n: int,
                    start: int, pgss: bool) -> dict[str, Any]:
    """One turn of a contender: spans, WAL, and its statements' server costs.

    The table and function statistics of PostgreSQL 15 reach the shared counters only
    when a backend has been idle for 10 s, so the statements' figures come from
    pg_stat_statements (shared memory, at once): round trips are the top-level calls.
    """
    if pgss:
        await admin.execute("SELECT pg_stat_statements_reset()")
    before = await _lsn(admin)
    a, b = await _spans(first, second, n, start)
    after = await _lsn(admin)
    cur = await admin.execute("SELECT pg_wal_lsn_diff(%s, %s)::float8", (after, before))
    row = await cur.fetchone()
    assert row is not None
    statements: dict[tuple[bool, str], list[float]] = {}
    if pgss:
        cur = await admin.execute(
            "SELECT toplevel, regexp_replace(left(query, 70), '\\s+', ' ', 'g'), calls, "
            "total_exec_time, total_plan_time, rows, wal_bytes::float8, "
            "shared_blks_hit + shared_blks_read + shared_blks_dirtied "
            "FROM pg_stat_statements WHERE calls >= %s AND query NOT LIKE '%%pg_stat%%'",
            (n // 2,))
        for is_top, query, *values in await cur.fetchall():
            statements[(is_top, query)] = [float(v) for v in values]
    return {"a": a, "b": b, "wal": float(row[0]), "statements": statements, "n": n}


def _pg_summary(parts: list[dict[str, Any]], pgss: bool) -> dict[str, Any]:
    """The turns of one contender, added up."""
    n = sum(p["n"] for p in parts)
    sums: dict[tuple[bool, str], list[float]] = {}
    for p in parts:
        for key, values in p["statements"].items():
            old = sums.setdefault(key, [0.0] * len(values))
            sums[key] = [x + y for x, y in zip(old, values, strict=True)]
    statements = []
    top = 0.0
    for (is_top, query), (calls, total, plan, nrows, wal, blks) in sorted(
            sums.items(), key=lambda kv: (not kv[0][0], -kv[1][1])):
        top += calls if is_top else 0
        statements.append({"top": is_top, "calls_per_op": round(calls / n, 2),
                           "us_per_call": round(total / calls * 1000, 1),
                           "plan_us_per_call": round(plan / calls * 1000, 1),
                           "rows_per_call": round(nrows / calls, 2),
                           "wal_bytes_per_call": round(wal / calls),
                           "blocks_per_call": round(blks / calls, 1),
                           "query": query})
    return {
        "client_us": (_us([x for p in parts for x in p["a"]]),
                      _us([x for p in parts for x in p["b"]])),
        "round_trips": round(top / n, 2) if pgss else None,
        "wal_bytes_per_op": round(sum(p["wal"] for p in parts) / n),
        "statements": statements,
    }


async def profile_pg(servers: Servers, n: int, rounds: int, cprof: bool) -> dict[str, Any]:
    """The three PostgreSQL contenders, in turn."""
    async with await psycopg.AsyncConnection.connect(servers.dsn, autocommit=True) as admin:
        settings = []
        if servers.pg_stat_statements:
            settings += ["pg_stat_statements.track = 'all'",
                         "pg_stat_statements.track_planning = on"]
        for setting in settings:
            await admin.execute(f"ALTER SYSTEM SET {setting}")
        await admin.execute("SELECT pg_reload_conf()")
        await admin.execute(SHEDLOCK_TABLE)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            servers.dsn, min_size=1, max_size=1, open=False,
            kwargs={"autocommit": True, "prepare_threshold": None})
        await pool.open(wait=True)
        raw_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            servers.dsn, min_size=1, max_size=1, open=False,
            kwargs={"autocommit": True, "prepare_threshold": None})
        await raw_pool.open(wait=True)
        backend = PostgresBackend(pool, table="prof")
        await backend.start()
        out: dict[str, Any] = {}
        try:
            async with await psycopg.AsyncConnection.connect(servers.dsn,
                                                             autocommit=True) as conn:
                tag = uuid.uuid4().hex[:6]
                tokens: dict[int, str] = {}

                def step_pair(job: str, via: str) -> tuple[Step, Step]:
                    """Claim and finish through the library, or by hand on the connection
                    (``raw``), or by hand on a connection borrowed from the same kind of
                    pool for each statement (``pool``)."""
                    async def execute(sql: str, params: tuple[Any, ...] | dict[str, Any]) -> Any:
                        if via == "pool":
                            async with raw_pool.connection() as pooled:
                                cur = await pooled.execute(sql, params, prepare=False)
                                return await cur.fetchone()
                        cur = await conn.execute(sql, params, prepare=False)
                        return await cur.fetchone()

                    async def claim(i: int) -> None:
                        tokens[i] = uuid.uuid4().hex
                        if via == "library":
                            result = await backend.claim(ClaimRequest(
                                job, i + 1, INSTANCE, tokens[i], LEASE_MS,
                                history_size=HISTORY))
                            won = result.status is ClaimStatus.WON
                        else:
                            params = (job, i + 1, INSTANCE, tokens[i], LEASE_MS, "scheduled",
                                      True, None, True)
                            row = await execute(backend._sql.claim, params)
                            won = row is not None and row[0] == "won"
                        if not won:
                            raise RuntimeError("claim not won")

                    async def finish(i: int) -> None:
                        if via == "library":
                            done = await backend.finish(Lease(job, i + 1, tokens[i],
                                                              LEASE_MS), Outcome.COMPLETED)
                        else:
                            row = await execute(backend._sql.finish, (
                                job, i + 1, tokens[i], "completed", None))
                            done = row is not None and int(row[0]) == 1
                        if not done:
                            raise RuntimeError("finish did not end the attempt")

                    return claim, finish

                async def lock(i: int) -> None:
                    cur = await conn.execute(SHEDLOCK_LOCK, ("prof", 30000, "bench", 30000,
                                                             "bench"), prepare=False)
                    if cur.rowcount != 1:
                        raise RuntimeError("ShedLock lock not acquired")

                async def unlock(i: int) -> None:
                    await conn.execute(SHEDLOCK_UNLOCK, ("prof",), prepare=False)

                pgss = servers.pg_stat_statements
                for first, second in (step_pair(f"warm-{tag}", "library"),
                                      step_pair(f"warmr-{tag}", "raw"),
                                      step_pair(f"warmp-{tag}", "pool"), (lock, unlock)):
                    await _spans(first, second, 20)  # warm-up
                lib = step_pair(f"lib-{tag}", "library")
                await lib[0](-1)  # the job's first claim (slot 0) inserts its row
                await lib[1](-1)
                raw = step_pair(f"raw-{tag}", "raw")
                await raw[0](-1)
                await raw[1](-1)

                async def phase(first: Step, second: Step, count: int, start: int
                                ) -> dict[str, Any]:
                    return await _pg_phase(admin, first, second, count, start, pgss)

                pooled = step_pair(f"pool-{tag}", "pool")
                await pooled[0](-1)
                await pooled[1](-1)
                parts = await _rounds(phase, {"library": lib, "raw": raw, "pool": pooled,
                                              "peer": (lock, unlock)}, n, rounds)
                out.update({k: _pg_summary(v, pgss) for k, v in parts.items()})
                if cprof:
                    lib = step_pair(f"cprof-{tag}", "library")
                    profiler = cProfile.Profile()
                    profiler.enable()
                    await _spans(*lib, n, n)
                    profiler.disable()
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(
                        _OURS, 15)
                    out["cprofile"] = text.getvalue()
        finally:
            await backend.close()
            await pool.close()
            await raw_pool.close()
            for setting in settings:
                await admin.execute(f"ALTER SYSTEM RESET {setting.split(' =')[0]}")
            await admin.execute("SELECT pg_reload_conf()")
    return out


# ---------------------------------------------------------------------------- report


def _report(store: str, data: dict[str, Any]) -> str:
    keys = tuple(k for k in ("library", "raw", "pool", "peer") if k in data)
    titles = {"library": "library", "raw": "raw driver, same calls",
              "pool": "raw, same calls, pooled", "peer": "peer"}
    lines = [f"### {store}", "", "| | " + " | ".join(titles[k] for k in keys) + " |",
             "| --- |" + " ---: |" * len(keys)]
    lines.append("| client µs, claim / acquire (median) | " + " | ".join(
        str(data[k]["client_us"][0]) for k in keys) + " |")
    lines.append("| client µs, finish / release (median) | " + " | ".join(
        str(data[k]["client_us"][1]) for k in keys) + " |")
    lines.append("| round trips per op | " + " | ".join(
        str(data[k]["round_trips"]) for k in keys) + " |")
    for field in ("server_cpu_us_per_op", "evalsha_us_per_call", "set_us_per_call",
                  "inner_total_per_op", "wal_bytes_per_op"):
        if field in data["library"]:
            lines.append(f"| {field} | " + " | ".join(
                str(data[k].get(field)) for k in keys) + " |")
    lines.append("")
    for k in keys:
        extra = {f: data[k][f] for f in ("slowlog_median_us", "inner_commands_per_op",
                                         "rows_per_op", "functions") if f in data[k]}
        lines.append(f"- {k}: {extra}")
        for s in data[k].get("statements", []):
            lines.append(f"  - {'top' if s['top'] else 'nested'} {s['calls_per_op']}/op "
                         f"{s['us_per_call']} µs exec ({s['plan_us_per_call']} plan), "
                         f"rows {s['rows_per_call']}, WAL "
                         f"{s['wal_bytes_per_call']} B, blocks {s['blocks_per_call']}: "
                         f"`{s['query']}`")
    if "cprofile" in data:
        lines += ["", "```", data["cprofile"], "```"]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> None:
    with pg_servers() as servers:
        print(f"servers: {servers.versions}, pg_stat_statements: "
              f"{servers.pg_stat_statements}, n={args.n}\n")
        if "redis" in args.stores:
            print(_report("Redis", await profile_redis(servers, args.n, args.rounds,
                                                 args.cprofile)))
        if "pg" in args.stores:
            print(_report("PostgreSQL", await profile_pg(servers, args.n, args.rounds,
                                                   args.cprofile)))


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m benchmarks.profile_claim``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="operations per contender")
    parser.add_argument("--rounds", type=int, default=10,
                        help="turns of each contender, interleaved")
    parser.add_argument("--stores", default="redis,pg")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args(argv)
    try:
        anyio.run(_main, args)
    except AnarchonError as exc:
        print(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
