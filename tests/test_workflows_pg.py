"""Workflow steps with fenced transactions, on PostgreSQL: effect, result and completion
commit together, and a late agent's transaction is refused."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import psycopg
import pytest

from lease_core import LeaseLost, PostgresBackend, Reason, RunContext, Scheduler
from lease_core.abc import Lease
from lease_core.errors import BackendUnavailable
from lease_core.testing import claim_now
from tests.helpers import Instance, quiet_offset_now, wait_for
from tests.stores.postgres import PgServer, drop_tables, unique_table

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


@pytest.fixture
async def table(pg16_server: PgServer) -> AsyncIterator[str]:
    name = unique_table()

    def create() -> None:
        with psycopg.connect(pg16_server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {name}_fx (slot bigint, account int, by text, "
                         "PRIMARY KEY (slot, account))")

    await anyio.to_thread.run_sync(create)
    yield name

    def drop() -> None:
        with psycopg.connect(pg16_server.dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {name}_fx")

    await anyio.to_thread.run_sync(drop)
    await drop_tables(pg16_server.admin_dsn, name)


def build(server: PgServer, table: str, name: str, seen: list[Any]) -> Scheduler:
    s = Scheduler(PostgresBackend(server.dsn, table=table), instance_id=name, **FAST)
    close = s.workflow("close", every="1h", offset=quiet_offset_now())
    close.step("snapshot", lambda ctx: [1, 2, 3])

    @close.step("interest")
    async def interest(ctx: RunContext) -> None:
        seen.append((name, "interest", ctx.attempt, ctx))
        if name == "a":
            await anyio.sleep_forever()  # a stalls before its transaction
        async with ctx.transaction() as tx:
            for account in ctx.results["snapshot"]:
                await tx.execute(f"INSERT INTO {table}_fx VALUES (%s, %s, %s)",
                                 (ctx.slot, account, name))
            ctx.set_result({"credited": len(ctx.results["snapshot"])})

    @close.step("publish")
    async def publish(ctx: RunContext) -> None:
        seen.append((name, "publish", ctx.attempt, ctx.results["interest"]))

    return s


async def effects(server: PgServer, table: str) -> list[tuple[Any, ...]]:
    def read() -> list[tuple[Any, ...]]:
        with psycopg.connect(server.dsn) as conn:
            return conn.execute(f"SELECT account, by FROM {table}_fx ORDER BY 1").fetchall()

    return await anyio.to_thread.run_sync(read)


async def test_a_step_s_effect_result_and_completion_commit_together_and_a_zombie_is_refused(
    pg16_server: PgServer, table: str,
) -> None:
    seen: list[Any] = []
    a, b = build(pg16_server, table, "a", seen), build(pg16_server, table, "b", seen)
    async with anyio.create_task_group() as tg:
        ia = await Instance(a).start(tg)
        slot = a.workflows["close"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "close", slot)
        await wait_for(lambda: seen, what="a in interest")
        ib = await Instance(b).start(tg)
        await claim_now(b, "close", slot)
        assert b.watching == [("close/interest", slot)]
        ia.crash()
        await wait_for(lambda: any(x[1] == "publish" for x in seen), what="publish")
        await ib.stop()
    assert [x[:3] for x in seen] == [("a", "interest", 1), ("b", "interest", 2),
                                    ("b", "publish", 1)]
    assert seen[-1][3] == {"credited": 3}
    assert await effects(pg16_server, table) == [(1, "b"), (2, "b"), (3, "b")]
    # The late agent wakes up: its fenced transaction is refused, its effect rolled back.
    zombie: RunContext = seen[0][3]
    backend = PostgresBackend(pg16_server.dsn, table=table)
    await backend.start()
    try:
        lease = Lease(zombie.job, zombie.slot, zombie.token, a.jobs[zombie.job].lease_ms)
        late = RunContext(backend=backend, lease=lease, attempt=1,
                          reason=Reason.SCHEDULED, instance_id="a",
                          logger=logging.getLogger("test"), workflow="close", step="interest")
        with pytest.raises(LeaseLost):
            async with late.transaction() as tx:
                await tx.execute(f"INSERT INTO {table}_fx VALUES (%s, 99, 'a')", (slot,))
        assert await backend.get_checkpoint("close/interest", slot) == {
            "result": {"credited": 3}, "next": "publish",
            "steps": ["snapshot", "interest", "publish"]}
    finally:
        await backend.close()
    assert await effects(pg16_server, table) == [(1, "b"), (2, "b"), (3, "b")]
    history = {(h.job, h.attempt): h.outcome for h in await a.history()}
    assert history[("close/interest", 1)] == "lost"
    assert history[("close/interest", 2)] == "completed"


async def run_through_step_two(s: Scheduler, wf: Any, ran: list[str]) -> list[tuple[str, str]]:
    """Add step "two" (it records the result of step "one" in ``ran``) to ``wf``, run
    one run of it on ``s``, and return the events seen, as (kind, job)."""

    @wf.step("two")
    async def two(ctx: RunContext) -> None:
        ran.append(f"two saw {ctx.results['one']}")

    kinds: list[tuple[str, str]] = []
    s.subscribe(lambda e: kinds.append((type(e).__name__, getattr(e, "job", ""))))
    async with s:
        slot = s.workflows["wf"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "wf", slot)
        await wait_for(lambda: "two saw r1" in ran, timeout=10, what="step two")
        await wait_for(lambda: ("Completed", "wf/two") in kinds, what="two's event")
    return kinds


async def test_a_step_that_raises_after_its_completing_transaction_stays_completed(
    pg16_server: PgServer, table: str,
) -> None:
    """The store recorded the step completed at the commit: a later error (a notification
    that fails) must not report it failed, nor stop the workflow before its next step."""
    from lease_core import events as ev

    s = Scheduler(PostgresBackend(pg16_server.dsn, table=table), instance_id="a", **FAST)
    wf = s.workflow("wf", every="1h", offset=quiet_offset_now())
    ran: list[str] = []

    @wf.step("one")
    async def one(ctx: RunContext) -> None:
        async with ctx.transaction() as tx:
            await tx.execute(f"INSERT INTO {table}_fx VALUES (%s, 1, 'a')", (ctx.slot,))
            ctx.set_result("r1")
        ran.append("one")
        raise RuntimeError("the notification after the commit failed")

    kinds = await run_through_step_two(s, wf, ran)
    assert ran == ["one", "two saw r1"]
    assert ("Completed", "wf/one") in kinds and ("Failed", "wf/one") not in kinds
    history = {(h.job, h.attempt): h.outcome for h in await s.history()}
    assert history == {("wf/one", 1): "completed", ("wf/two", 1): "completed"}
    assert ev.Failed.__name__ == "Failed"


class CommitAnswerLost(PostgresBackend):
    """A backend whose first completing transaction of ``lost_job`` commits, and then
    raises as a connection lost while reading the COMMIT's answer would."""

    lost_job, done = "", False

    @asynccontextmanager
    async def transaction(self, lease: Lease, *, complete: bool = True) -> AsyncIterator[Any]:
        async with super().transaction(lease, complete=complete) as tx:
            yield tx
        if complete and lease.job == self.lost_job and not self.done:
            self.done = True
            raise BackendUnavailable("connection lost while reading COMMIT's answer")


@pytest.mark.parametrize(("retry", "caught"), [(None, False), (2, False), (None, True)])
async def test_a_step_whose_commit_answer_was_lost_goes_on_to_the_next_step(
    pg16_server: PgServer, table: str, retry: int | None, caught: bool,
) -> None:
    """The step's transaction committed (the store has it completed), but the handler saw
    an error: the store refuses the attempt's failure (or, the error ``caught``, its
    result), and the step is reported completed and its next step claimed, by this lone
    instance (it used to stall the run)."""
    backend = CommitAnswerLost(pg16_server.dsn, table=table)
    backend.lost_job = "wf/one"
    s = Scheduler(backend, instance_id="a", **FAST)
    wf = s.workflow("wf", every="1h", offset=quiet_offset_now(), retry=retry)
    ran: list[str] = []

    @wf.step("one")
    async def one(ctx: RunContext) -> None:
        ran.append("one")
        try:
            async with ctx.transaction() as tx:
                await tx.execute(f"INSERT INTO {table}_fx VALUES (%s, 1, 'a')", (ctx.slot,))
                ctx.set_result("r1")
        except BackendUnavailable:
            if not caught:
                raise

    kinds = await run_through_step_two(s, wf, ran)
    assert ran == ["one", "two saw r1"]
    ended = [k for k, job in kinds if job == "wf/one" and k in ("Completed", "Failed",
                                                                  "Retried", "Lost")]
    assert ended == ["Completed"], kinds
    history = {(h.job, h.attempt): h.outcome for h in await s.history()}
    assert history == {("wf/one", 1): "completed", ("wf/two", 1): "completed"}


async def test_a_value_returned_after_the_completing_transaction_is_reported_not_stored(
    pg16_server: PgServer, table: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The result commits with the transaction: a value returned after it cannot be the
    step's result; the next step reads the one set inside, and a warning says so (it was
    dropped without a word)."""
    s = Scheduler(PostgresBackend(pg16_server.dsn, table=table), instance_id="a", **FAST)
    wf = s.workflow("wf", every="1h", offset=quiet_offset_now())
    seen: list[Any] = []

    @wf.step("one")
    async def one(ctx: RunContext) -> dict[str, int]:
        async with ctx.transaction() as tx:
            await tx.execute(f"INSERT INTO {table}_fx VALUES (%s, 1, 'a')", (ctx.slot,))
        return {"credited": 3}

    @wf.step("two")
    async def two(ctx: RunContext) -> None:
        seen.append(ctx.results)

    with caplog.at_level(logging.WARNING, logger="anarchon"):
        async with s:
            slot = s.workflows["wf"].schedule.previous_at_or_before(s.store_now_ms())
            assert slot is not None
            await claim_now(s, "wf", slot)
            await wait_for(lambda: seen, what="step two")
    assert seen == [{"one": None}]
    assert any("returned {'credited': 3} after its transaction completed it" in r.message
               and "ctx.set_result()" in r.message for r in caplog.records), caplog.text


async def test_batch_transactions_about_as_long_as_the_lease_keep_the_run(
    pg16_server: PgServer, table: str,
) -> None:
    """Heartbeats skip a run while its fenced transaction is open: each batch of 1.0 s on
    a 1.2 s lease used to come back to a lapsed lease and lose the run, again and again."""
    s = Scheduler(PostgresBackend(pg16_server.dsn, table=table), instance_id="a", **FAST)
    log: list[str] = []

    @s.every("batch", "1h", offset=quiet_offset_now())
    async def batch(ctx: RunContext) -> None:
        for i in range(3):
            async with ctx.transaction(complete=False) as tx:
                await tx.execute("SELECT pg_sleep(1.0)")
                await ctx.checkpoint.set(i, tx=tx)
            log.append(f"batch {i}")
        log.append("done")

    async with s:
        slot = s.jobs["batch"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "batch", slot)
        await wait_for(lambda: "done" in log, timeout=20, what="three batches")

        async def ended() -> list[Any]:
            found = [a for a in await s.history("batch") if a.slot == slot]
            return found if all(a.outcome for a in found) else []

        history = await wait_for(ended, timeout=10, what="the run's end")
    assert log == ["batch 0", "batch 1", "batch 2", "done"]
    assert [(a.attempt, a.outcome) for a in history] == [(1, "completed")]
