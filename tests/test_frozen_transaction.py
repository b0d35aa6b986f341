"""A process frozen inside a fenced transaction stops no claim (PostgreSQL).

A real OS process opens ``PostgresBackend.transaction(lease)`` and is frozen (SIGSTOP)
inside it, holding its run's row lock on the server. Claims of that run answer
``running`` at once instead of waiting for the lock, claims of the job's other slots win
at once, and a claim its client gave up on never takes effect on the server later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import psycopg
import pytest
from anyio.abc import Process

from adapters.sql import TransientError
from backends.postgres import PostgresBackend
from lease_core._structures import ClaimRequest, ClaimStatus, Reason
from tests.helpers import wait_for
from tests.stores.postgres import PgServer, drop_tables, unique_table

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]

PROMPT = 2.0  # seconds: "at once" on a loaded machine (a lock wait would last forever)

FROZEN = """
import sys
import anyio
from backends.postgres import PostgresBackend
from lease_core._structures import Lease

async def main(dsn: str, table: str, slot: str, token: str) -> None:
    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    async with backend.transaction(Lease("j", int(slot), token, 60_000)) as tx:
        await tx.execute("SELECT 1")
        print("inside", flush=True)
        await anyio.sleep(3600)

anyio.run(main, *sys.argv[1:])
"""


@pytest.fixture(params=["pg16_server", "pgsys_server", "pgbouncer_server"])
def server(request: pytest.FixtureRequest) -> PgServer:
    """PostgreSQL 16, the system's PostgreSQL (15) and PgBouncer in front of 16."""
    found: PgServer = request.getfixturevalue(request.param)
    return found


@pytest.fixture
async def table(server: PgServer) -> AsyncIterator[str]:
    name = unique_table()
    yield name
    await drop_tables(server.admin_dsn, name)


def admin(server: PgServer, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


async def timed_claim(backend: PostgresBackend, request: ClaimRequest) -> tuple[Any, float]:
    started = time.monotonic()
    with anyio.fail_after(30):
        result = await backend.claim(request)
    return result, time.monotonic() - started


async def test_a_frozen_fenced_transaction_blocks_no_claim(
    server: PgServer, table: str, anyio_backend: str
) -> None:
    backend = PostgresBackend(server.dsn, table=table)
    await backend.start()
    proc: Process | None = None
    try:
        # Long enough for the frozen process to start and open its transaction on a
        # loaded machine (its fencing needs a live lease); the test waits it out below.
        won = await backend.claim(ClaimRequest("j", 1, "a", "held", 5000))
        assert won.status is ClaimStatus.WON
        proc = await anyio.open_process(
            [sys.executable, "-c", FROZEN, server.dsn, table, "1", "held"],
            stdout=subprocess.PIPE, stderr=None,
        )
        assert proc.stdout is not None
        line = b""
        with anyio.fail_after(60):
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive()
        assert line.strip() == b"inside"
        os.kill(proc.pid, signal.SIGSTOP)

        async def expired() -> bool:
            return await backend.now_ms() > (won.expires_ms or 0)

        await wait_for(expired, timeout=15, what="the frozen run's lease expiry")

        # The run's lease expired but its row is locked: running elsewhere, at once.
        same, took = await timed_claim(backend, ClaimRequest("j", 1, "b", "b1", 1500))
        assert same.status is ClaimStatus.RUNNING and took < PROMPT, (same, took)
        # Other slots of the job are not blocked by it.
        other, took = await timed_claim(backend, ClaimRequest("j", 2, "b", "b2", 60_000))
        assert other.status is ClaimStatus.WON and took < PROMPT, (other, took)
        again, took = await timed_claim(backend, ClaimRequest("j", 1, "c", "c1", 1500))
        assert again.status is ClaimStatus.RUNNING and took < PROMPT, (again, took)

        # A claim that must wait for a lock (here the job row, held by another
        # transaction) gives up on the server before its client would (half a lease),
        # and writes nothing even when the lock is freed afterwards.
        with psycopg.connect(server.admin_dsn) as locker:
            locker.execute(f'SELECT 1 FROM "{table}_jobs" WHERE job = %s FOR UPDATE', ("j",))
            outcome: Any = None
            started = time.monotonic()
            with anyio.move_on_after(0.8):  # the client's timeout: half the lease
                try:
                    outcome = await backend.claim(ClaimRequest("j", 3, "d", "d3", 1600))
                except TransientError as exc:
                    outcome = exc
            assert isinstance(outcome, TransientError), outcome
            assert time.monotonic() - started < 0.8
            await anyio.sleep(1.0)  # past the client's abandon, the lock is still held
            locker.rollback()

        def claims_in_flight() -> list[tuple[Any, ...]]:
            return admin(server, "SELECT pid FROM pg_stat_activity WHERE state = 'active' "
                                 "AND query LIKE %s AND pid <> pg_backend_pid()",
                         (f"%{table}_claim_v%",))

        await wait_for(lambda: not claims_in_flight(), what="no claim statement in flight")
        assert admin(server, f'SELECT count(*) FROM "{table}" WHERE slot = 3') == [(0,)]
        assert admin(server, f'SELECT count(*) FROM "{table}_attempts" WHERE slot = 3') == [
            (0,)]

        # Killed, the process's transaction ends and the run is taken over.
        proc.kill()
        await proc.wait()

        async def taken_over() -> Any:
            result = await backend.claim(ClaimRequest("j", 1, "e", "e1", 60_000))
            return result if result.status is ClaimStatus.WON else None

        taken = await wait_for(taken_over, what="takeover after the process died")
        assert (taken.attempt, taken.reason) == (2, Reason.TAKEOVER)
    finally:
        if proc is not None:
            if proc.returncode is None:
                proc.kill()
            with anyio.fail_after(10):
                await proc.aclose()
        await backend.close()
