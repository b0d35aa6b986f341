"""The bank-close demo: a workflow whose agent dies halfway, and a backup that finishes it.

Three instances (A, B, C), each an OS process, share a PostgreSQL store and run the
workflow ``bank-close`` in three steps over a few thousand accounts:

1. ``snapshot`` copies every balance into ``<ns>_snapshot`` (keyed by (run, account)), in
   the step's fenced transaction, so the snapshot and the step's completion commit together;
2. ``interest`` credits 0.5 % on every positive balance of the snapshot, in batches. Each
   credit is a row of ``<ns>_interest`` keyed by (run, account), written in the same
   transaction as the balance it changes, so a batch written twice credits nothing twice;
   each batch commits with the step's progress in a fenced transaction
   (``ctx.transaction(complete=False)``), and the last one with the step's completion;
3. ``publish`` writes one statement per account, keyed by (run, account), in the step's
   fenced transaction.

The demo SIGKILLs the process applying interest once about half the accounts are
credited. A backup takes the step over with attempt 2 when the lease expires and
continues from where the effects stopped (the highest account credited for the run). The
verdict is checked in the store: every positive balance credited exactly once, one
snapshot, statements published once; then the recovery log is printed.

Every table the demo creates, its own and the store's, is named under a namespace of the
run's own (``<ns>``, ``<ns>_accounts``, ...; see :mod:`lease_core.demo.namespace`),
claimed only while no such name exists, and removed when the demo ends unless kept.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import anyio

from backends.postgres import driver_dsn
from backends.postgres.statements import quote_ident
from lease_core import Backend, RunContext, Scheduler, backend_from_url
from lease_core.errors import ConfigurationError
from lease_core.recovery import recovery_log, step_job

from .fleet import ProcessFleet, until_stopped
from .namespace import DEMO_TABLES, PostgresNamespace, claimed, namespace_for, new_name

__all__ = ["build_scheduler", "run_bank_close", "worker_main"]

WORKFLOW = "bank-close"
STEPS = ("snapshot", "interest", "publish")
NAMES = ("A", "B", "C")
ACCOUNTS = 3000
BATCH = 100
BATCH_PAUSE_S = 0.12
LEASE = "3s"
HEARTBEAT = "0.5s"
#: The demo's own tables, each named ``<namespace>_<name>``.
TABLES = DEMO_TABLES
#: How long after the demo starts the workflow run is due (seconds).
DUE_IN_S = 5


def tables(namespace: str) -> dict[str, str]:
    """The quoted names of the demo's tables in ``namespace`` (a validated name).

    Quoted by :func:`backends.postgres.statements.quote_ident`, the one helper that turns
    identifiers into SQL text; the demo's statements only compose these quoted names.
    """
    return {name: quote_ident(f"{namespace}_{name}") for name in TABLES}


def credit_sql(t: dict[str, str]) -> str:
    """One statement that credits a range of accounts.

    The credit rows are inserted where missing (keyed by (run, account)) and only the
    balances of rows inserted now are changed.
    """
    return f"""
WITH credited AS (
    INSERT INTO {t['interest']} (run, account, amount_cents, attempt)
    SELECT run, account, (balance_cents * 5 + 500) / 1000, %s
    FROM {t['snapshot']}
    WHERE run = %s AND balance_cents > 0 AND account BETWEEN %s AND %s
    ON CONFLICT (run, account) DO NOTHING
    RETURNING account, amount_cents
)
UPDATE {t['accounts']} a SET balance_cents = a.balance_cents + c.amount_cents
FROM credited c WHERE a.id = c.account
"""


def setup_sql(t: dict[str, str]) -> list[str]:
    """The demo's tables and its accounts: ``CREATE TABLE``, never ``DROP`` or ``IF EXISTS``.

    They run in the transaction that claims the namespace, so a name that is taken makes
    it fail and change nothing.
    """
    return [
        f"CREATE TABLE {t['accounts']} (id int PRIMARY KEY, balance_cents bigint NOT NULL)",
        # Pseudo-random balances, some negative or zero: the same on every run of the demo.
        f"INSERT INTO {t['accounts']} SELECT i, (i * 7919) % 2000000 - 400000 "
        f"FROM generate_series(1, {ACCOUNTS}) AS i",
        f"CREATE TABLE {t['opening']} AS SELECT * FROM {t['accounts']}",
        f"CREATE TABLE {t['snapshot']} (run bigint, account int, balance_cents bigint "
        "NOT NULL, PRIMARY KEY (run, account))",
        f"CREATE TABLE {t['interest']} (run bigint, account int, amount_cents bigint "
        "NOT NULL, attempt int NOT NULL, PRIMARY KEY (run, account))",
        f"CREATE TABLE {t['statements']} (run bigint, account int, balance_cents bigint "
        "NOT NULL, PRIMARY KEY (run, account))",
    ]


def build_scheduler(backend: Backend, name: str, url: str, offset_ms: int,
                    namespace: str) -> Scheduler:
    """The scheduler every demo instance runs: the workflow, hourly at ``offset_ms``.

    Its steps use the demo's tables in ``namespace``, on the server at ``url``.
    """
    dsn = driver_dsn(url)
    t = tables(namespace)
    credit = credit_sql(t)
    scheduler = Scheduler(backend, instance_id=name, lease=LEASE, heartbeat=HEARTBEAT)
    close = scheduler.workflow(WORKFLOW, every="1h", offset=timedelta(milliseconds=offset_ms),
                               max_attempts=3)

    @close.step("snapshot")
    async def snapshot(ctx: RunContext) -> None:
        async with ctx.transaction() as tx:
            await tx.execute(
                f"INSERT INTO {t['snapshot']} SELECT %s, id, balance_cents "
                f"FROM {t['accounts']} ON CONFLICT DO NOTHING", (ctx.slot,))
            rows = await tx.execute(
                "SELECT count(*), count(*) FILTER (WHERE balance_cents > 0) "
                f"FROM {t['snapshot']} WHERE run = %s", (ctx.slot,))
            ctx.set_result({"accounts": int(rows[0][0]), "positive": int(rows[0][1])})

    @close.step("interest")
    async def interest(ctx: RunContext) -> None:
        import psycopg

        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            # Where the effects stopped: a backup continues after the last credited account.
            cur = await conn.execute(
                f"SELECT coalesce(max(account), 0), count(*) FROM {t['interest']} "
                "WHERE run = %s", (ctx.slot,))
            after, done = await cur.fetchone() or (0, 0)
            cur = await conn.execute(
                f"SELECT account FROM {t['snapshot']} WHERE run = %s AND balance_cents > 0 "
                "AND account > %s ORDER BY account", (ctx.slot, after))
            todo = [row[0] for row in await cur.fetchall()]
            await conn.commit()
        if done:
            ctx.log.info("resuming after account %s (%s already credited)", after, done)
        batches = [todo[i:i + BATCH] for i in range(0, len(todo), BATCH)] or [[]]
        for batch in batches[:-1]:
            ctx.raise_if_stopping()
            # One fenced transaction per batch: the credits and the step's progress commit
            # together, and only while this attempt still holds the step.
            async with ctx.transaction(complete=False) as tx:
                await tx.execute(credit, (ctx.attempt, ctx.slot, batch[0], batch[-1]))
                done += len(batch)
                await ctx.checkpoint.set({"after": batch[-1], "credited": done}, tx=tx)
            await anyio.sleep(BATCH_PAUSE_S)
        last = batches[-1]
        async with ctx.transaction() as tx:
            if last:
                await tx.execute(credit, (ctx.attempt, ctx.slot, last[0], last[-1]))
            rows = await tx.execute(
                f"SELECT count(*), coalesce(sum(amount_cents), 0) FROM {t['interest']} "
                "WHERE run = %s", (ctx.slot,))
            ctx.set_result({"credited": int(rows[0][0]), "cents": int(rows[0][1])})

    @close.step("publish")
    async def publish(ctx: RunContext) -> None:
        async with ctx.transaction() as tx:
            await tx.execute(
                f"INSERT INTO {t['statements']} SELECT %s, id, balance_cents "
                f"FROM {t['accounts']} ON CONFLICT DO NOTHING", (ctx.slot,))
            rows = await tx.execute(f"SELECT count(*) FROM {t['statements']} WHERE run = %s",
                                    (ctx.slot,))
            ctx.set_result({"statements": int(rows[0][0]),
                            "interest": ctx.results["interest"]})

    return scheduler


def worker_main(url: str, name: str, offset_ms: str, namespace: str) -> None:
    """Run one bank-close instance until SIGTERM (then stop gracefully) or SIGKILL, or
    until the demo that started it is gone."""

    parent = os.getppid()  # (read before "started": the demo may end right after)

    async def main() -> None:
        backend = backend_from_url(url, namespace=namespace)
        async with build_scheduler(backend, name, url, int(offset_ms),
                                   namespace) as scheduler:
            print("started", flush=True)
            await until_stopped(parent)
            await scheduler.stop(grace="2s")

    anyio.run(main)


# --------------------------------------------------------------------------- the parent


def _sql(url: str, statements: list[str], params: tuple[Any, ...] = ()) -> list[Any]:
    import psycopg

    with psycopg.connect(driver_dsn(url), autocommit=True) as conn:
        rows: list[Any] = []
        for statement in statements:
            cur = conn.execute(statement, params or None)
            rows = cur.fetchall() if cur.description else []
        return rows


class _Timeline:
    def __init__(self, backend: Backend, slot: int, out: Any) -> None:
        self.backend = backend
        self.slot = slot
        self.out = out
        self.t0 = time.monotonic()
        self.seen: dict[tuple[str, int], Any] = {}

    def say(self, text: str) -> None:
        print(f"  {time.monotonic() - self.t0:6.1f}s  {text}", file=self.out, flush=True)

    async def poll(self) -> dict[str, list[Any]]:
        by_step: dict[str, list[Any]] = {}
        for step in STEPS:
            attempts = [a for a in await self.backend.history(step_job(WORKFLOW, step), 100)
                        if a.slot == self.slot]
            by_step[step] = sorted(attempts, key=lambda a: a.attempt)
            for a in by_step[step]:
                key = (step, a.attempt)
                old = self.seen.get(key, "new")
                if old == "new":
                    self.say(f"{a.instance_id} runs {step:<8} attempt {a.attempt} ({a.reason})"
                             + (f" -> {a.outcome}" if a.outcome else ""))
                elif a.outcome is not None and old is None:
                    self.say(f"{a.instance_id} {step:<8} attempt {a.attempt} -> {a.outcome}")
                self.seen[key] = a.outcome
        return by_step

    async def until(self, predicate: Any, limit: float, what: str) -> Any:
        deadline = time.monotonic() + limit
        while True:
            found = await predicate(await self.poll())
            if found:
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(f"demo: timed out waiting for {what}")
            await anyio.sleep(0.1)


async def _scenario(url: str, ns: PostgresNamespace, out: Any, serve: bool) -> bool:
    backend = backend_from_url(url, **ns.backend_options)
    await backend.start()
    fleet = ProcessFleet(url)
    try:
        async with anyio.create_task_group() as tg:
            servers: list[Any] = []
            if serve:
                await tg.start(_serve, backend, out, servers)
            # The store sees the workflow now, so an instance that starts after the run is
            # due still runs it (catch-up covers runs due after the store first saw it).
            await backend.register_jobs([step_job(WORKFLOW, step) for step in STEPS])
            now = await backend.now_ms()
            slot = (now // 1000 + DUE_IN_S) * 1000
            offset = slot % 3_600_000
            timeline = _Timeline(backend, slot, out)
            timeline.say(f"{ACCOUNTS} accounts; run {WORKFLOW}@{slot} is due in "
                         f"{(slot - now) / 1000:.1f}s; starting instances {', '.join(NAMES)} "
                         f"(lease {LEASE}, heartbeat {HEARTBEAT})")
            fleet.command = ["-m", "lease_core.demo", "bank-worker", "-", "{name}", str(offset),
                             ns.name]
            async with anyio.create_task_group() as starting:
                for name in NAMES:
                    starting.start_soon(fleet.start, name)
            timeline.say("instances started")
            ok = await _run(timeline, backend, fleet, url, tables(ns.name), slot, out)
            for server in servers:
                server.should_exit = True
        return ok
    finally:
        fleet.close()
        await backend.close()


async def _run(timeline: _Timeline, backend: Backend, fleet: ProcessFleet, url: str,
               t: dict[str, str], slot: int, out: Any) -> bool:
    interest_job = step_job(WORKFLOW, "interest")

    async def halfway(by_step: dict[str, list[Any]]) -> Any:
        running = [a for a in by_step["interest"] if a.outcome is None and a.attempt == 1]
        if not running:
            return None
        snap = await backend.get_checkpoint(step_job(WORKFLOW, "snapshot"), slot)
        progress = (await backend.get_checkpoint(interest_job, slot) or {}).get("progress")
        if snap and progress and progress["credited"] * 2 >= snap["result"]["positive"]:
            return running[0], progress, snap["result"]["positive"]
        return None

    victim, progress, positive = await timeline.until(halfway, 40, "interest halfway")
    timeline.say(f"*** SIGKILL {victim.instance_id} while applying interest "
                 f"({progress['credited']}/{positive} accounts credited); no hand-over")
    await fleet.kill(victim.instance_id)

    async def finished(by_step: dict[str, list[Any]]) -> Any:
        return any(a.outcome == "completed" for a in by_step["publish"]) or any(
            a.outcome in ("failed", "timed_out", "escalated")
            for attempts in by_step.values() for a in attempts)

    await timeline.until(finished, 40, "the workflow run to end")
    by_step = await timeline.poll()
    await fleet.stop_all()
    return await _verdict(url, t, slot, by_step, out)


async def _verdict(url: str, t: dict[str, str], slot: int, by_step: dict[str, list[Any]],
                   out: Any) -> bool:
    checks = await anyio.to_thread.run_sync(_checks, url, t, slot)
    wrong, unchanged_ok, credited, by_attempt, snapshots, statements = checks
    attempts = [a for step in STEPS for a in by_step[step]]
    print(f"\nRecovery log of {WORKFLOW}@{slot} (oldest first):", file=out)
    for e in recovery_log(attempts, workflow=WORKFLOW, steps=STEPS):
        detail = f"  ({e.detail})" if e.detail else ""
        print(f"  {e.at:%H:%M:%S.%f}"[:-3] + f"  {e.step:<8} attempt {e.attempt}  "
              f"{e.event:<11} {e.instance_id}{detail}", file=out)
    problems = []
    positive = credited[1]
    if wrong:
        problems.append(f"{wrong} positive balances not credited exactly once")
    if not unchanged_ok:
        problems.append("a non-positive balance changed")
    if credited[0] != positive:
        problems.append(f"{credited[0]} credits for {positive} positive balances")
    if snapshots != ACCOUNTS or _completed(by_step["snapshot"]) != 1:
        problems.append(f"snapshot: {snapshots} rows, {_completed(by_step['snapshot'])} "
                        "completed attempts")
    if statements != ACCOUNTS or _completed(by_step["publish"]) != 1:
        problems.append(f"statements: {statements} rows, {_completed(by_step['publish'])} "
                        "completed attempts")
    interest = by_step["interest"]
    if not any(a.attempt == 2 and a.reason == "takeover" and a.outcome == "completed"
               for a in interest):
        problems.append("the interest step was not taken over by attempt 2")
    if problems:
        print(f"\nVERDICT: FAILED - {'; '.join(problems)}", file=out)
        return False
    split = ", ".join(f"attempt {n}: {c}" for n, c in by_attempt)
    print(f"\nVERDICT: OK - checked in the store: {positive} positive balances credited "
          f"exactly once ({split}), non-positive ones untouched; one snapshot of "
          f"{snapshots} accounts; {statements} statements published once.", file=out)
    return True


def _completed(attempts: list[Any]) -> int:
    return sum(1 for a in attempts if a.outcome == "completed")


def _checks(url: str, t: dict[str, str],
            slot: int) -> tuple[int, bool, tuple[int, int], list[Any], int, int]:
    wrong = _sql(url, [
        f"SELECT count(*) FROM {t['opening']} o JOIN {t['accounts']} a USING (id) "
        "WHERE o.balance_cents > 0 AND a.balance_cents <> o.balance_cents "
        "+ (o.balance_cents * 5 + 500) / 1000"])[0][0]
    unchanged = _sql(url, [
        f"SELECT count(*) FROM {t['opening']} o JOIN {t['accounts']} a USING (id) "
        "WHERE o.balance_cents <= 0 AND a.balance_cents <> o.balance_cents"])[0][0]
    credited = _sql(url, [
        f"SELECT (SELECT count(*) FROM {t['interest']} WHERE run = %s), "
        f"(SELECT count(*) FROM {t['opening']} WHERE balance_cents > 0)"], (slot,))[0]
    by_attempt = _sql(url, [f"SELECT attempt, count(*) FROM {t['interest']} WHERE run = %s "
                            "GROUP BY attempt ORDER BY attempt"], (slot,))
    snapshots = _sql(url, [f"SELECT count(*) FROM {t['snapshot']} WHERE run = %s"],
                     (slot,))[0][0]
    statements = _sql(url, [f"SELECT count(*) FROM {t['statements']} WHERE run = %s"],
                      (slot,))[0][0]
    return (int(wrong), int(unchanged) == 0, (int(credited[0]), int(credited[1])),
            by_attempt, int(snapshots), int(statements))


async def _serve(backend: Backend, out: Any, servers: list[Any], *, task_status: Any) -> None:
    import uvicorn

    from lease_core._serve import Limits
    from lease_core.http import LoopbackHostOnly, create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = LoopbackHostOnly(create_app(backend))  # no token: this machine only
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, access_log=False,
                                           log_level="warning", **Limits().uvicorn_options()))
    servers.append(server)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(10):
            while not server.started:  # noqa: ASYNC110 - uvicorn sets a plain flag
                await anyio.sleep(0.02)
        print(f"Status page: http://127.0.0.1:{port}/", file=out, flush=True)
        task_status.started()


def serve_available() -> bool:
    """True when ``--serve`` can start the status page (lease_core.http and its extra)."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("lease_core.http", "starlette", "uvicorn"))


def run_bank_close(url: str | None = None, out: Any = None, *, serve: bool = False,
                   keep: bool = False, namespace: str | None = None) -> bool:
    """Run the bank-close demo; return True when the verdict checked in the store is OK.

    Without ``url`` it starts an embedded PostgreSQL. With ``serve``, the status page
    (``lease_core.http``) is served on 127.0.0.1 during the demo and its URL printed.

    The demo's tables and the store's are created under ``namespace`` (a new
    ``anarchon_demo_<hex>`` by default), refused with
    :class:`~lease_core.demo.namespace.NamespaceInUse` when any of its names exists, and
    removed when the demo ends, however it ends, unless ``keep``.
    """
    from lease_core._redact import redact

    out = out or sys.stdout
    if keep and url is None:
        raise ConfigurationError("--keep needs --url: the embedded server and all it holds "
                                 "are deleted when the demo ends")
    ns = namespace_for(url, namespace) if url is not None else None
    if ns is not None and not isinstance(ns, PostgresNamespace):
        raise ConfigurationError("the bank-close demo runs on PostgreSQL only")
    with contextlib.ExitStack() as stack:
        if url is None:
            from backends.embedded.postgres import embedded_postgres

            print("Starting embedded postgres ...", file=out, flush=True)
            url = stack.enter_context(embedded_postgres())
            ns = PostgresNamespace(url, namespace or new_name())
        assert isinstance(ns, PostgresNamespace)
        print(f"Store: {redact(url)}", file=out, flush=True)
        stack.enter_context(claimed(ns, WORKFLOW, out, keep=keep, shown_url=redact(url),
                                    statements=setup_sql(tables(ns.name))))
        print("\nTimeline:", file=out, flush=True)
        ok: bool = anyio.run(_scenario, url, ns, out, serve)
        return ok
