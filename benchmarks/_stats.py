"""What the store executed: pg_stat_statements (or pg_stat_database), Redis commandstats."""

from __future__ import annotations

from typing import Any

import psycopg
import redis.asyncio

__all__ = ["PgCounter", "redis_commandstats", "redis_reset_stats"]


class PgCounter:
    """Counts statements executed in one database, read from another connection.

    With pg_stat_statements: top-level statements (BEGIN and COMMIT included) by kind.
    Without it: committed transactions and row counters from pg_stat_database.
    """

    def __init__(self, admin_dsn: str, database: str, pgss: bool) -> None:
        self.admin_dsn = admin_dsn
        self.database = database
        self.pgss = pgss

    async def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(self.admin_dsn, autocommit=True) as c:
            cur = await c.execute(sql, params)  # type: ignore[arg-type]
            return list(await cur.fetchall()) if cur.description else []

    async def reset(self) -> dict[str, int]:
        """Reset pg_stat_statements; return pg_stat_database counters as a baseline."""
        if self.pgss:
            await self._rows("SELECT pg_stat_statements_reset()")
        return await self._database()

    async def _database(self) -> dict[str, int]:
        await self._rows("SELECT pg_stat_clear_snapshot()")
        rows = await self._rows(
            "SELECT xact_commit, xact_rollback, tup_returned, tup_fetched, tup_inserted, "
            "tup_updated, tup_deleted FROM pg_stat_database WHERE datname = %s",
            (self.database,))
        names = ("xact_commit", "xact_rollback", "tup_returned", "tup_fetched", "tup_inserted",
                 "tup_updated", "tup_deleted")
        return {n: int(v) for n, v in zip(names, rows[0], strict=True)} if rows else {}

    async def read(self, baseline: dict[str, int]) -> dict[str, Any]:
        """Statements by kind since :meth:`reset`, and pg_stat_database deltas."""
        now = await self._database()
        out: dict[str, Any] = {
            "database": {k: now[k] - baseline.get(k, 0) for k in now},
        }
        if self.pgss:
            rows = await self._rows(
                "SELECT s.query, s.calls, s.rows FROM pg_stat_statements s "
                "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s "
                "AND s.query NOT ILIKE %s", (self.database, "%pg_stat%"))
            kinds: dict[str, int] = {}
            returned: dict[str, int] = {}
            for query, calls, n in rows:
                kind = classify(str(query))
                kinds[kind] = kinds.get(kind, 0) + int(calls)
                returned[kind] = returned.get(kind, 0) + int(n)
            out["statements"] = sum(kinds.values())
            out["by_kind"] = kinds
            # rows returned: a batched claim or finish returns one row per claim or ended run
            out["rows_by_kind"] = returned
        return out


def classify(query: str) -> str:
    """Name an anarchon statement from its text (as pg_stat_statements normalises it)."""
    q = " ".join(query.split())
    upper = q.upper()
    if upper in ("BEGIN", "COMMIT", "ROLLBACK"):
        return upper.lower()
    checks = (
        ("_claim(", "claim"),
        ("_claim_v", "claim"),
        ("_batch_v", "claim_many"),
        ("_end_v", "finish"),  # the finish function (store code v4 on)
        # before the heartbeat's needle: the membership upsert is also "WITH renewed AS"
        ("cleaner AS", "members"),
        ("renewed AS", "heartbeat"),
        ("AS n LEFT JOIN", "check"),
        ("first_seen_ms, last_slot, seq) VALUES", "claim.upsert_job"),
        ("SELECT b.blocked", "claim.read_run"),
        ("WITH run AS ( INSERT", "claim.insert_run"),
        ("WITH prev AS ( UPDATE", "claim.take_over_or_escalate"),
        ("WITH doomed AS", "claim.trim_history"),
        ("AS u(job, slot, token)", "hand_over"),
        ("att AS ( UPDATE", "finish"),
        ("unnest($1::text[]) AS x(job)", "register_jobs"),
        ("SELECT job, slot, attempt, instance_id", "history"),
    )
    for needle, kind in checks:
        if needle in q:
            return kind
    # PostgreSQL 15 normalises the 'epoch' literal of the clock read to $1
    return "now" if q.startswith("SELECT (floor(extract(") else "other"


async def redis_reset_stats(client: redis.asyncio.Redis) -> None:
    """CONFIG RESETSTAT: zero the command counters."""
    await client.execute_command("CONFIG", "RESETSTAT")


async def redis_commandstats(client: redis.asyncio.Redis) -> dict[str, int]:
    """Calls per command since the last reset (commands run inside scripts included)."""
    info = await client.info("commandstats")
    out = {}
    for name, value in info.items():
        command = name.removeprefix("cmdstat_")
        if command in ("info", "config"):
            continue
        out[command] = int(value["calls"]) if isinstance(value, dict) else 0
    return out
