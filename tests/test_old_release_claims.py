"""An instance of anarchon 0.1.0 still claiming after the upgrade gets answers it can read.

0.1.0 claims through ``<table>_claim`` (store code v1), which the upgrade makes a call of
the current claim function, and reads its answer into its own enums: ``ClaimStatus``,
``Reason`` and ``RunStatus`` of that release (listed below). The current function knows
more: runs waiting for a retry (``retrying``), cancelled runs (``cancelled``), attempts
that a retry or a trigger started (``retry``, ``manual``), and no run at all during the
quarantine after a failover. Passed on as they are, each made 0.1.0's claim raise
``ValueError`` in the old instance; one that had *won* the run then left it unattended
until its lease expired, when another instance took it over as a lost attempt (which
``max_attempts`` counts). The old name answers in 0.1.0's words instead; the store
keeps the new ones.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from backends.postgres import PostgresBackend, migrate
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, Outcome
from lease_core.operations import Operation, OperationKind
from tests.helpers import wait_for
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.test_store_upgrade import FIXTURE, NOW, names, sql

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]

#: What anarchon 0.1.0 reads from a claim (its ClaimStatus, Reason and RunStatus).
OLD_CLAIM_STATUSES = {"won", "running", "finished", "skipped", "escalated"}
OLD_REASONS = {None, "scheduled", "takeover", "hand-over", "catch-up"}
OLD_RUN_STATUSES = {"running", "handed_over", "completed", "failed", "timed_out",
                    "escalated", "skipped"}
#: Every column of 0.1.0's claim, as it sent it.
OLD_CLAIM = """
SELECT c_status, c_now, c_attempt, c_reason, c_expires, c_run_status, c_instance
FROM {fn}(%s::text, %s::bigint, %s::text, %s::text, 60000, 'scheduled', false, NULL,
          100, 86400000, 100)"""


def old_claim(dsn: str, table: str, slot: int, token: str) -> dict[str, Any]:
    """One claim of job ``j`` as 0.1.0 sends it, checked against what 0.1.0 can read."""
    [row] = sql(dsn, OLD_CLAIM.format(fn=f'"{table}_claim"'), ("j", slot, f"old-{token}", token))
    answer = dict(zip(("status", "now", "attempt", "reason", "expires", "run_status",
                       "instance"), row, strict=True))
    assert answer["status"] in OLD_CLAIM_STATUSES, answer
    assert answer["reason"] in OLD_REASONS, answer
    assert answer["run_status"] in OLD_RUN_STATUSES, answer
    return answer


@pytest.fixture
async def upgraded(pg16_server: PgServer) -> AsyncIterator[tuple[str, PostgresBackend]]:
    """A store 0.1.0 made, upgraded, and a started backend of this release on it."""
    table = unique_table()
    sql(pg16_server.admin_dsn, FIXTURE.read_text().format(**names(table)))
    await migrate(pg16_server.admin_dsn, table=table)
    backend = PostgresBackend(pg16_server.admin_dsn, table=table)
    await backend.start()
    try:
        yield table, backend
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


async def test_an_old_instance_claims_a_run_waiting_for_a_retry_in_its_own_words(
    pg16_server: PgServer, upgraded: tuple[str, PostgresBackend]
) -> None:
    dsn, (table, backend) = pg16_server.admin_dsn, upgraded
    assert (await backend.claim(ClaimRequest("j", 1, "new", "n1", 60_000))).status \
        is ClaimStatus.WON
    assert await backend.retry_later(
        [(Lease("j", 1, "n1", 60_000), Outcome.FAILED, "boom", [1500])]) == [1]

    # Before the retry is due: a run standing by, as a live lease (0.1.0 watches it).
    waiting = old_claim(dsn, table, 1, "o1")
    assert (waiting["status"], waiting["run_status"]) == ("running", "running")
    [(due,)] = sql(dsn, f'SELECT expires_ms FROM "{table}" WHERE slot = 1')
    assert waiting["expires"] == due

    # Once due, the old instance takes the retry; the store records it as one.
    await wait_for(lambda: sql(dsn, NOW)[0][0] > due, what="the retry's due time")
    won = old_claim(dsn, table, 1, "o2")
    assert (won["status"], won["attempt"], won["reason"], won["run_status"]) == (
        "won", 2, "hand-over", "running")
    assert sql(dsn, f'SELECT reason, instance_id FROM "{table}_attempts" '
                    "WHERE slot = 1 AND attempt = 2") == [("retry", "old-o2")]


async def test_an_old_instance_claims_a_triggered_run_and_reads_a_cancelled_one(
    pg16_server: PgServer, upgraded: tuple[str, PostgresBackend]
) -> None:
    dsn, (table, backend) = pg16_server.admin_dsn, upgraded
    assert (await backend.claim(ClaimRequest("j", 1, "new", "n1", 60_000))).status \
        is ClaimStatus.WON
    assert await backend.finish(Lease("j", 1, "n1", 60_000), Outcome.COMPLETED)
    triggered = await backend.operate(Operation(OperationKind.TRIGGER, "j", None, "cli"))
    assert triggered.refused is None and triggered.slot is not None

    won = old_claim(dsn, table, triggered.slot, "o1")
    assert (won["status"], won["attempt"], won["reason"]) == ("won", 1, "hand-over")
    assert sql(dsn, f'SELECT reason, requested_by FROM "{table}_attempts" WHERE slot = %s',
               (triggered.slot,)) == [("manual", "cli")]

    cancelled = await backend.operate(Operation(OperationKind.CANCEL, "j", triggered.slot,
                                                "cli"))
    assert cancelled.refused is None
    assert sql(dsn, f'SELECT status FROM "{table}" WHERE slot = %s',
               (triggered.slot,)) == [("cancelled",)]
    # A backup of 0.1.0 watching it reads a finished run: it stops watching.
    ended = old_claim(dsn, table, triggered.slot, "o2")
    assert (ended["status"], ended["run_status"]) == ("finished", "failed")


async def test_an_old_instance_reads_the_quarantine_after_a_failover_as_a_live_lease(
    pg16_server: PgServer, upgraded: tuple[str, PostgresBackend]
) -> None:
    """After a promotion (the store's timeline differs from the server's), a claim past
    the fast path answers 'running' with no run until the quarantine ends."""
    dsn, (table, _) = pg16_server.admin_dsn, upgraded
    old_claim(dsn, table, 1, "o1")  # writes the store's 'failover' row
    sql(dsn, f"""UPDATE "{table}_meta" SET value = '7FFFFFFF 0 0' WHERE key = 'failover'""")
    quiet = old_claim(dsn, table, 2, "o2")
    assert (quiet["status"], quiet["attempt"], quiet["run_status"]) == ("running", 0, "running")
    assert quiet["expires"] > quiet["now"]


async def test_a_v4_store_whose_old_claim_name_an_earlier_build_made_gets_it_again(
    pg16_server: PgServer, upgraded: tuple[str, PostgresBackend]
) -> None:
    """A v4 store whose ``<table>_claim`` an earlier build made (passing the current
    function's answer on as it is, without BODY_MARKS' text) gets this one at start."""
    dsn, (table, _) = pg16_server.admin_dsn, upgraded
    name, mark = f"{table}_claim", "in the words of 0.1.0"  # BODY_MARKS["_claim"]
    [(definition,)] = sql(dsn, "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE proname = %s",
                          (name,))
    assert mark in definition
    sql(dsn, definition.replace(mark, "an earlier build"))
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    await backend.close()
    assert sql(dsn, "SELECT strpos(prosrc, %s) > 0 FROM pg_proc WHERE proname = %s",
               (mark, name)) == [(True,)]
