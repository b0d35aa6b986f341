"""Experiment: the PostgreSQL claim's round trips, as the library sends them and pipelined.

``python -m benchmarks.experiment_pipeline`` measures, on one psycopg connection and the
library's own SQL constants: the claim as the library sends it (BEGIN, UPSERT_JOB,
READ_RUN, INSERT_RUN, TRIM_HISTORY, COMMIT: six round trips), the same statements with
psycopg pipeline mode where no result is needed in between (three round trips), and the
library itself. A suggestion for backends/postgres.py, measured, not applied.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import anyio
import psycopg

from backends.postgres import PostgresBackend, _Statements
from lease_core._structures import ClaimRequest

from ._util import pg_servers, timed_ops
from .throughput import (
    INSTANCE,
    LEASE_MS,
    _pg_insert_params,
    _pg_trim_params,
    raw_psycopg_claim,
)

TABLE = "pipe"


async def pipelined_claim(conn: psycopg.AsyncConnection[Any], s: _Statements, job: str,
                          slot: int) -> bool:
    """BEGIN+UPSERT_JOB in one batch, READ_RUN, then INSERT+TRIM+COMMIT in one batch."""
    token = uuid.uuid4().hex
    async with conn.pipeline() as p:
        await conn.execute("BEGIN")
        cur = await conn.execute(s.upsert_job, (job, slot), prepare=False)  # type: ignore[arg-type]
        await p.sync()
        now, seq = await cur.fetchone()  # type: ignore[misc]
        cur = await conn.execute(s.read_run, (job, slot, now, job, slot), prepare=False)  # type: ignore[arg-type]
        await p.sync()
        row = await cur.fetchone()
        won = row is not None and row[1] is None
        if won:
            await conn.execute(s.insert_run, _pg_insert_params(job, slot, token, now, seq),  # type: ignore[arg-type]
                               prepare=False)
            await conn.execute(s.trim_history, _pg_trim_params(job), prepare=False)  # type: ignore[arg-type]
        await conn.execute("COMMIT")
    return won


async def main(dsn: str, seconds: float, repeat: int) -> None:
    """Print claims/s of the three ways, alternating, best of ``repeat``."""
    async with await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, prepare_threshold=None) as conn, \
            await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, prepare_threshold=None) as lib_conn:
        backend = PostgresBackend(lib_conn, table=TABLE)
        await backend.start()
        s = _Statements(None, TABLE)
        async def lib(tag: str, w: int, i: int) -> None:
            await backend.claim(ClaimRequest(f"{tag}-{i}", 1000, INSTANCE, uuid.uuid4().hex,
                                             LEASE_MS))

        ways = {
            "library (6 round trips)": lib,
            "raw, as the library sends it (6 round trips)":
                lambda tag, w, i: raw_psycopg_claim(conn, s, f"{tag}-{i}", 1000),
            "raw, pipelined (3 round trips)":
                lambda tag, w, i: pipelined_claim(conn, s, f"{tag}-{i}", 1000),
        }
        best: dict[str, float] = {}
        for rep in range(repeat):
            for name, fn in ways.items():
                tag = f"{name[:3]}{rep}{uuid.uuid4().hex[:4]}"
                ops, _ = await timed_ops(1, seconds, lambda w, i, fn=fn, tag=tag: fn(tag, w, i))
                best[name] = max(best.get(name, 0.0), ops)
        await backend.close()
    base = best["raw, as the library sends it (6 round trips)"]
    for name, ops in best.items():
        print(f"{name:<48} {ops:8.1f} claims/s  ({ops / base:.2f}x)")


if __name__ == "__main__":
    with pg_servers() as servers:
        anyio.run(main, servers.dsn, float(sys.argv[1]) if len(sys.argv) > 1 else 2.0, 3)
