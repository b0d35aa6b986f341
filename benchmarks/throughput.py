"""Claim throughput: the library beside the same statements sent by a minimal raw loop.

Every cell runs the library and the raw loop in alternating short rounds (``repeat``
rounds of ``seconds`` each, the order flipped every round), and reports operations per
second of both and the median of the per-round ratios (library / raw) with its spread:
on a shared machine a burst of other work hits one side of one round, and the median of
many paired rounds is steadier than a ratio of two bests.

*Uncontended*: each claim is a new job. *Contended*: all claimers walk the same sequence
of jobs, so every run is raced by all of them; exactly one wins each
(checked).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import tempfile
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import anyio
import anyio.to_thread
import pg8000.native
import psycopg
import redis.asyncio
from psycopg_pool import AsyncConnectionPool

from backends.postgres import PostgresBackend, Statements
from backends.redis import SCRIPTS, RedisBackend
from lease_core.abc import Backend, ClaimRequest, ClaimStatus, Lease, Outcome

from ._util import Servers, timed_ops

__all__ = ["Cell", "redis_claim_command", "redis_claim_won", "run_throughput"]

SLOT = 1_000
LEASE_MS = 30_000
HISTORY = 100
INSTANCE = "bench"


@dataclass
class Cell:
    """One measurement: a driver, a contention mode, a number of concurrent claimers."""

    store: str
    driver: str
    mode: str
    claimers: int
    library_ops: list[float] = field(default_factory=list)
    raw_ops: list[float] = field(default_factory=list)
    double_wins: int = 0

    @property
    def key(self) -> str:
        """The cell's name in the ratios table."""
        return f"claim.{self.store}.{self.driver}.{self.mode}.n{self.claimers}"

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        lib = statistics.median(self.library_ops)
        raw = statistics.median(self.raw_ops)
        # library/raw of each round (the two sides ran one right after the other)
        paired = sorted(a / b for a, b in zip(self.library_ops, self.raw_ops, strict=True))
        return {
            "key": self.key, "store": self.store, "driver": self.driver, "mode": self.mode,
            "claimers": self.claimers, "library_ops_s": round(lib, 1), "raw_ops_s": round(raw, 1),
            "ratio": round(statistics.median(paired), 3),
            "ratio_median": round(statistics.median(paired), 3),
            "ratio_spread": [round(paired[0], 3), round(paired[-1], 3)],
            "ratio_of_bests": round(max(self.library_ops) / max(self.raw_ops), 3),
            "rounds": len(paired),
            "library_reps": [round(v, 1) for v in self.library_ops],
            "raw_reps": [round(v, 1) for v in self.raw_ops], "double_wins": self.double_wins,
        }


Op = Callable[[str, int], Awaitable[bool]]


class Variant:
    """A driver setup: a library backend and a raw claim on the same connections."""

    store = ""
    driver = ""

    async def open(self, servers: Servers, claimers: int, table: str) -> None:
        """Open connections and the backend for ``claimers`` concurrent claimers."""

    async def close(self) -> None:
        """Close everything opened."""

    backend: Backend

    async def library(self, job: str, slot: int) -> bool:
        """Claim through the library; True when won."""
        request = ClaimRequest(job, slot, INSTANCE, uuid.uuid4().hex, LEASE_MS,
                               history_size=HISTORY)
        return (await self.backend.claim(request)).status is ClaimStatus.WON

    async def raw(self, job: str, slot: int) -> bool:
        """Claim through the raw driver; True when won."""
        raise NotImplementedError


def _pg_claim_params(job: str, slot: int, token: str) -> tuple[Any, ...]:
    """The claim function's arguments, as the library sends them for the library's request."""
    return (job, slot, INSTANCE, token, LEASE_MS, "scheduled", True, None, True)


async def raw_psycopg_claim(conn: psycopg.AsyncConnection[Any], s: Statements, job: str,
                            slot: int) -> bool:
    """The claim's one statement (the library's claim function), in autocommit, by hand."""
    cur = await conn.execute(s.claim, _pg_claim_params(job, slot, uuid.uuid4().hex),  # type: ignore[arg-type]
                             prepare=False)
    row = await cur.fetchone()
    return row is not None and row[0] == "won"


class PsycopgPool(Variant):
    """A user's ``AsyncConnectionPool`` (autocommit, no prepared statements), one per claimer."""

    store, driver = "pg", "psycopg_pool"

    async def open(self, servers: Servers, claimers: int, table: str) -> None:
        """Open a pool of ``claimers`` connections."""
        self.pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            servers.dsn, min_size=claimers, max_size=claimers, open=False,
            kwargs={"autocommit": True, "prepare_threshold": None},
        )
        await self.pool.open(wait=True)
        self.backend = PostgresBackend(self.pool, table=table)
        await self.backend.start()
        self.s = Statements(None, table)

    async def close(self) -> None:
        """Close the backend and the pool."""
        await self.backend.close()
        await self.pool.close()

    async def raw(self, job: str, slot: int) -> bool:
        """Claim on a pooled connection."""
        async with self.pool.connection() as conn:
            return await raw_psycopg_claim(conn, self.s, job, slot)


class PsycopgConnection(Variant):
    """One user's ``AsyncConnection`` shared by every claimer (queued by a lock)."""

    store, driver = "pg", "psycopg_conn"

    async def open(self, servers: Servers, claimers: int, table: str) -> None:
        """Open one connection."""
        self.conn = await psycopg.AsyncConnection.connect(
            servers.dsn, autocommit=True, prepare_threshold=None)
        self.lock = anyio.Lock()
        self.backend = PostgresBackend(self.conn, table=table)
        await self.backend.start()
        self.s = Statements(None, table)

    async def close(self) -> None:
        """Close the backend and the connection."""
        await self.backend.close()
        await self.conn.close()

    async def raw(self, job: str, slot: int) -> bool:
        """Claim on the shared connection."""
        async with self.lock:
            return await raw_psycopg_claim(self.conn, self.s, job, slot)


def _numbered(sql: str) -> str:
    counter = iter(range(1, 1000))
    return re.sub(r"%s", lambda _: f"${next(counter)}", sql)


class Pg8000(Variant):
    """pg8000 from a ``postgresql+pg8000://`` DSN (the library's pool of ``claimers``).

    The raw loop runs the whole claim, blocking, in one worker thread per claim: the least
    an async program must do to drive a blocking driver.
    """

    store, driver = "pg", "pg8000"

    async def open(self, servers: Servers, claimers: int, table: str) -> None:
        """Open the library's pool and ``claimers`` raw connections."""
        pg = servers.pg
        self.backend = PostgresBackend(
            pg.dsn.replace("postgresql://", "postgresql+pg8000://"), table=table,
            min_size=claimers, max_size=claimers)
        await self.backend.start()
        s = Statements(None, table)
        self.sql = _numbered(s.claim)
        self.idle = [
            await anyio.to_thread.run_sync(lambda: pg8000.native.Connection(
                "postgres", host=pg.host, port=pg.port, password=pg.password))
            for _ in range(claimers)
        ]
        self.all = list(self.idle)

    async def close(self) -> None:
        """Close the backend and the raw connections."""
        await self.backend.close()
        for conn in self.all:
            conn.close()

    def _claim_blocking(self, conn: Any, job: str, slot: int) -> bool:
        vals = _pg_claim_params(job, slot, uuid.uuid4().hex)
        ((status, *_),) = conn.execute_unnamed(self.sql, vals=vals).rows
        return bool(status == "won")

    async def raw(self, job: str, slot: int) -> bool:
        """Claim in a worker thread on a free raw connection."""
        conn = self.idle.pop()
        try:
            return await anyio.to_thread.run_sync(self._claim_blocking, conn, job, slot)
        finally:
            self.idle.append(conn)


def redis_claim_command(prefix: str, job: str, slot: int, token: str,
                        markers: dict[str, Any], seqs: dict[str, int]) -> tuple[Any, ...]:
    """The claim script's ``EVALSHA`` exactly as the library sends it for a default request
    of :data:`INSTANCE` (lease :data:`LEASE_MS`, the longest the client has seen):
    ``markers`` and ``seqs`` hold what :func:`redis_claim_won` kept of the job's last
    reply (its data marker and history sequence), as the library keeps them."""
    tag = "{" + prefix + "/" + quote(job, safe="") + "}"
    keys = [f"{tag}:job", f"{tag}:run:{slot}", f"{tag}:open", f"{tag}:hist", f"{tag}:att",
            f"{tag}:done"]
    args = [slot, INSTANCE, token, LEASE_MS, "scheduled", 1, "", f"{tag}:run:",
            markers.get(job, ""), LEASE_MS, seqs.get(job, ""), 1]
    return ("EVALSHA", SCRIPTS["claim"].sha, len(keys), *keys, *args)


def redis_claim_won(job: str, reply: bytes, markers: dict[str, Any],
                    seqs: dict[str, int]) -> bool:
    """Keep the job's marker and sequence from a claim's reply, as the library does; True
    when the claim won."""
    fields = reply.split(b"|", 9)  # status|now|attempt|reason|expires|run_status|marker|...
    if markers.get(job) != fields[6]:
        markers[job] = fields[6]
        seqs.pop(job, None)  # a new marker: a new sequence
    if fields[8] and int(fields[8]) > seqs.get(job, 0):
        seqs[job] = int(fields[8])
    return fields[0] == b"won"


class RedisAsyncio(Variant):
    """A user's ``redis.asyncio.Redis`` client; the claim is EVALSHA claim.lua (+ SADD).

    Like the library, the raw loop adds a job to the jobs set the first time it claims it
    (in the same pipeline); later claims of the job are the script alone.
    """

    store, driver = "redis", "redis_asyncio"

    async def open(self, servers: Servers, claimers: int, table: str) -> None:
        """Open the client and the backend."""
        self.client = redis.asyncio.Redis.from_url(servers.redis_url)
        self.prefix = table
        self.backend = RedisBackend(self.client, prefix=table)
        await self.backend.start()
        self.listed: set[str] = set()
        # each job's data marker and history sequence, as the library keeps them
        self.markers: dict[str, Any] = {}
        self.seqs: dict[str, int] = {}

    async def close(self) -> None:
        """Close the backend and the client."""
        await self.backend.close()
        await self.client.aclose()

    async def raw(self, job: str, slot: int) -> bool:
        """The same script and SADD in one non-transactional pipeline."""
        command = redis_claim_command(self.prefix, job, slot, uuid.uuid4().hex, self.markers,
                                      self.seqs)
        if job in self.listed:
            reply = await self.client.execute_command(*command)
        else:
            pipe = self.client.pipeline(transaction=False)
            pipe.execute_command(*command)
            pipe.execute_command("SADD", "{" + self.prefix + "}:jobs", job)
            reply = (await pipe.execute(raise_on_error=False))[0]
            self.listed.add(job)
        return redis_claim_won(job, reply, self.markers, self.seqs)


VARIANTS: dict[str, type[Variant]] = {
    "psycopg_pool": PsycopgPool, "psycopg_conn": PsycopgConnection, "pg8000": Pg8000,
    "redis_asyncio": RedisAsyncio,
}


async def _measure(cell: Cell, variant: Variant, op: Op, seconds: float, tag: str) -> float:
    wins: Counter[str] = Counter()

    async def one(w: int, i: int) -> None:
        job = f"{tag}-w{w}-{i}" if cell.mode == "uncontended" else f"{tag}-{i}"
        if await op(job, SLOT):
            wins[job] += 1

    ops, _ = await timed_ops(cell.claimers, seconds, one)
    cell.double_wins += sum(1 for n in wins.values() if n > 1)
    return ops


async def run_cell(servers: Servers, variant_cls: type[Variant], mode: str, claimers: int,
                   seconds: float, repeat: int, counter: list[int]) -> Cell:
    """Measure one cell: library and raw in ``repeat`` rounds, the order flipped each round."""
    variant = variant_cls()
    table = f"tp_{variant.driver}"
    await variant.open(servers, claimers, table)
    cell = Cell(variant.store, variant.driver, mode, claimers)
    try:
        counter[0] += 1
        await _measure(cell, variant, variant.library, min(0.3, seconds), f"warm{counter[0]}")
        await _measure(cell, variant, variant.raw, min(0.3, seconds), f"warmr{counter[0]}")
        cell.double_wins = 0
        for rep in range(repeat):
            order = [("lib", variant.library), ("raw", variant.raw)]
            if rep % 2:
                order.reverse()
            for name, op in order:
                counter[0] += 1
                ops = await _measure(cell, variant, op, seconds, f"{name}{counter[0]}")
                (cell.library_ops if name == "lib" else cell.raw_ops).append(ops)
    finally:
        await variant.close()
    return cell


# --- pgbench ---------------------------------------------------------------------------


def _fill(sql: str, values: list[str]) -> str:
    it = iter(values)
    out = re.sub(r"%s", lambda _: next(it), sql)
    assert next(it, None) is None, "wrong number of values"
    return out


def pgbench_script(table: str) -> str:
    """The uncontended claim (the library's one statement, CLAIM) for pgbench.

    Only the ``%s`` placeholders change: they become pgbench expressions.
    """
    s = Statements(None, table)
    job = "('pgb' || :client_id || '-' || :r)"
    claim = _fill(s.claim, [
        job, str(SLOT), f"'{INSTANCE}'", "md5(:r::text)", str(LEASE_MS), "'scheduled'", "true",
        "NULL", "true"])
    return "\n".join([
        "\\set r random(1, 1000000000000)",
        claim + ";",
        "",
    ])


def run_pgbench(servers: Servers, clients: int, seconds: float) -> dict[str, Any] | None:
    """Run the claim script with pgbench (extended protocol); None when unavailable."""
    if servers.pgbench is None:
        return None
    pg = servers.pg
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(pgbench_script("tp_psycopg_pool"))
        script = f.name
    env = {"PGPASSWORD": pg.password, "PATH": "/usr/bin:/bin"}
    try:
        out = subprocess.run(
            [str(servers.pgbench), "-n", "-M", "extended", "-h", pg.host, "-p", str(pg.port),
             "-U", "postgres", "-c", str(clients), "-j", str(min(clients, 2)),
             "-T", str(max(1, round(seconds))), "-f", script, "postgres"],
            capture_output=True, text=True, timeout=seconds + 60, env=env,
        )
    finally:
        import os

        os.unlink(script)
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    if out.returncode != 0 or not match:
        return {"clients": clients, "error": (out.stderr or out.stdout)[-500:]}
    return {"clients": clients, "tps": round(float(match.group(1)), 1),
            "pgbench": str(servers.pgbench)}


# --- entry -----------------------------------------------------------------------------


async def run_throughput(servers: Servers, *, quick: bool, seconds: float, repeat: int,
                         log: Callable[[str], None]) -> dict[str, Any]:
    """All claim cells, pgbench and claim+finish sanity; returns the JSON section."""
    uncontended = (1, 4) if quick else (1, 2, 4, 8)
    contended = (4,) if quick else (2, 4, 8)
    cells = []
    counter = [0]
    for cls in VARIANTS.values():
        plan = [("uncontended", n) for n in uncontended] + [("contended", n) for n in contended]
        for mode, n in plan:
            cell = await run_cell(servers, cls, mode, n, seconds, repeat, counter)
            d = cell.as_dict()
            low, high = d["ratio_spread"]
            log(f"  {d['key']:<42} lib {d['library_ops_s']:>8.1f}/s  raw "
                f"{d['raw_ops_s']:>8.1f}/s  ratio {d['ratio']:.2f} [{low:.2f}, {high:.2f}]")
            cells.append(d)
    bench = []
    for n in ((4,) if quick else uncontended):
        result = await anyio.to_thread.run_sync(run_pgbench, servers, n, max(2.0, seconds * 2))
        if result is not None:
            bench.append(result)
            log(f"  pgbench claim script, {n} clients: {result.get('tps', result)} tps")
    return {"cells": cells, "pgbench": bench}


async def claim_finish_op(backend: Backend, job: str, slot: int) -> None:
    """Claim a run and finish it (the library side of the peers comparison).

    A claim not won raises, as a peer's lock not acquired does: counted as an operation,
    a lost claim (one round trip, no finish) would make the rate look better."""
    token = uuid.uuid4().hex
    result = await backend.claim(ClaimRequest(job, slot, INSTANCE, token, LEASE_MS,
                                              history_size=HISTORY))
    if result.status is not ClaimStatus.WON:
        raise RuntimeError(f"claim of {job} slot {slot} not won: {result.status}")
    await backend.finish(Lease(job, slot, token, LEASE_MS), Outcome.COMPLETED)
