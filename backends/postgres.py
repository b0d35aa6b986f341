"""The PostgreSQL backend: runs, attempts, jobs and the format version in four tables.

Where a claim happens: :meth:`PostgresBackend.claim` runs one short transaction,

1. ``UPSERT_JOB`` upserts the job's row in ``<table>_jobs``; the row lock serialises the
   claims of one job, and the second claimer always sees the winner's row;
2. ``READ_RUN`` reads the run ``FOR UPDATE`` (so a fenced transaction or a finish in
   flight completes first) and whether an earlier slot still holds a live lease;
3. ``INSERT_RUN``, ``TAKE_OVER`` or ``ESCALATE`` writes the run and its attempt;
4. ``TRIM_HISTORY`` deletes a bounded number of old attempts and finished runs.

Every other call is one statement: heartbeats and hand-overs of many leases, a finish,
a batched check. All lease arithmetic uses the server's ``clock_timestamp()``; times are
stored as ``bigint`` epoch milliseconds. Nothing keeps session state (only
transaction-scoped advisory locks, at creation), so PgBouncer in transaction mode works.
The SQL stays within PostgreSQL 9.5.

Table names are validated, then quoted by :func:`quote_ident`, the one quoting helper;
statements are named module-level templates filled only with quoted identifiers.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from adapters.sql import Executor, Row, SqlAdapter, TransientError, adapter_for
from lease_core._structures import (
    Attempt,
    CheckResult,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    HeartbeatResult,
    JobInfo,
    Lease,
    Outcome,
    Reason,
    RunState,
    RunStatus,
    ms_to_datetime,
)
from lease_core.abc import Backend, decode_checkpoint, encode_checkpoint
from lease_core.errors import ConfigurationError, LeaseLost, StoreFormatError

__all__ = ["FORMAT_VERSION", "FencedTransaction", "PostgresBackend", "migrate", "quote_ident"]

T = TypeVar("T")

#: The store format this code writes; a store with a newer one is refused.
FORMAT_VERSION = 1
#: The most old attempts one claim deletes (trimming is incremental).
TRIM_BATCH = 100
_CLAIM_RETRIES = 5

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Suffixes of the names derived from ``table`` (tables and indexes).
_SUFFIXES = ("", "_attempts", "_jobs", "_meta", "_open", "_a_seq", "_a_claimed", "_a_job",
             "_a_fin")

NOW = "(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)"

# --- creation ---------------------------------------------------------------------------

FIND_TABLES = """
SELECT n.nspname::text,
       ARRAY(SELECT c.relname::text FROM pg_catalog.pg_class c
             WHERE c.relnamespace = n.oid AND c.relname = ANY(%s::text[]))
FROM pg_catalog.pg_namespace n
WHERE n.nspname = COALESCE(%s::text, current_schema())
"""
READ_FORMAT = "SELECT value FROM {meta} WHERE key = 'format'"
LOCK_CREATION = "SELECT pg_advisory_xact_lock(%s::bigint)"
CREATE_RUNS = """
CREATE TABLE IF NOT EXISTS {runs} (
    job text NOT NULL,
    slot bigint NOT NULL,
    status text NOT NULL,
    attempt integer NOT NULL,
    token text,
    instance_id text,
    expires_ms bigint,
    checkpoint text,
    PRIMARY KEY (job, slot)
)"""
CREATE_RUNS_OPEN = """
CREATE INDEX IF NOT EXISTS {open_idx} ON {runs} (job, slot)
WHERE status IN ('running', 'handed_over')"""
CREATE_ATTEMPTS = """
CREATE TABLE IF NOT EXISTS {attempts} (
    job text NOT NULL,
    slot bigint NOT NULL,
    attempt integer NOT NULL,
    seq bigint NOT NULL,
    instance_id text NOT NULL,
    reason text NOT NULL,
    claimed_ms bigint NOT NULL,
    finished_ms bigint,
    outcome text,
    error text,
    PRIMARY KEY (job, slot, attempt)
)"""
CREATE_ATTEMPTS_SEQ = "CREATE INDEX IF NOT EXISTS {seq_idx} ON {attempts} (job, seq)"
CREATE_ATTEMPTS_CLAIMED = """
CREATE INDEX IF NOT EXISTS {claimed_idx} ON {attempts} (claimed_ms, slot, attempt)"""
CREATE_ATTEMPTS_JOB = """
CREATE INDEX IF NOT EXISTS {job_idx} ON {attempts} (job, claimed_ms, slot, attempt)"""
CREATE_ATTEMPTS_FINISHED = """
CREATE INDEX IF NOT EXISTS {fin_idx} ON {attempts} (job, finished_ms)
WHERE finished_ms IS NOT NULL"""
CREATE_JOBS = """
CREATE TABLE IF NOT EXISTS {jobs} (
    job text PRIMARY KEY,
    first_seen_ms bigint NOT NULL,
    last_slot bigint,
    seq bigint NOT NULL DEFAULT 0
)"""
CREATE_META = """
CREATE TABLE IF NOT EXISTS {meta} (
    key text PRIMARY KEY,
    value text NOT NULL
)"""
WRITE_FORMAT = """
INSERT INTO {meta} (key, value) VALUES ('format', %s::text) ON CONFLICT (key) DO NOTHING"""
DDL = (CREATE_META, CREATE_JOBS, CREATE_RUNS, CREATE_RUNS_OPEN, CREATE_ATTEMPTS,
       CREATE_ATTEMPTS_SEQ, CREATE_ATTEMPTS_CLAIMED, CREATE_ATTEMPTS_JOB,
       CREATE_ATTEMPTS_FINISHED)

# --- claims -----------------------------------------------------------------------------

UPSERT_JOB = """
INSERT INTO {jobs} AS j (job, first_seen_ms, last_slot, seq)
VALUES (%s::text, {now}, %s::bigint, 1)
ON CONFLICT (job) DO UPDATE
    SET last_slot = GREATEST(j.last_slot, EXCLUDED.last_slot), seq = j.seq + 1
RETURNING {now}, j.seq"""
READ_RUN = """
SELECT b.blocked, r.status, r.attempt, r.token, r.instance_id, r.expires_ms
FROM (SELECT EXISTS (
        SELECT 1 FROM {runs} o
        WHERE o.job = %s::text AND o.slot < %s::bigint AND o.status = 'running'
          AND o.expires_ms > %s::bigint) AS blocked) AS b
LEFT JOIN LATERAL (
    SELECT status, attempt, token, instance_id, expires_ms FROM {runs}
    WHERE job = %s::text AND slot = %s::bigint
    FOR UPDATE) AS r ON true"""
INSERT_RUN = """
WITH run AS (
    INSERT INTO {runs} (job, slot, status, attempt, token, instance_id, expires_ms)
    VALUES (%s::text, %s::bigint, %s::text, 1, %s::text, %s::text, %s::bigint)
    RETURNING job, slot)
INSERT INTO {attempts}
    (job, slot, attempt, seq, instance_id, reason, claimed_ms, finished_ms, outcome, error)
SELECT run.job, run.slot, 1, %s::bigint, %s::text, %s::text, %s::bigint, %s::bigint, %s::text,
       %s::text
FROM run"""
TAKE_OVER = """
WITH prev AS (
    UPDATE {attempts} SET outcome = %s::text, error = %s::text, finished_ms = %s::bigint
    WHERE job = %s::text AND slot = %s::bigint AND attempt = %s::integer AND outcome IS NULL
    RETURNING 1),
run AS (
    UPDATE {runs}
    SET status = 'running', attempt = attempt + 1, token = %s::text, instance_id = %s::text,
        expires_ms = %s::bigint
    WHERE job = %s::text AND slot = %s::bigint
    RETURNING job, slot, attempt)
INSERT INTO {attempts}
    (job, slot, attempt, seq, instance_id, reason, claimed_ms)
SELECT run.job, run.slot, run.attempt, %s::bigint, %s::text, %s::text, %s::bigint
FROM run"""
ESCALATE = """
WITH prev AS (
    UPDATE {attempts} SET outcome = 'escalated', error = %s::text, finished_ms = %s::bigint
    WHERE job = %s::text AND slot = %s::bigint AND attempt = %s::integer AND outcome IS NULL
    RETURNING 1)
UPDATE {runs} SET status = 'escalated', token = NULL, expires_ms = NULL
WHERE job = %s::text AND slot = %s::bigint"""
TRIM_HISTORY = """
WITH doomed AS (
    (SELECT slot, attempt FROM {attempts} WHERE job = %s::text
     ORDER BY seq DESC OFFSET %s::bigint LIMIT %s::bigint)
    UNION
    (SELECT slot, attempt FROM {attempts}
     WHERE job = %s::text AND finished_ms < %s::bigint LIMIT %s::bigint)),
gone AS (
    DELETE FROM {attempts} a USING doomed d
    WHERE a.job = %s::text AND a.slot = d.slot AND a.attempt = d.attempt
    RETURNING a.slot, a.attempt)
DELETE FROM {runs} r
WHERE r.job = %s::text AND r.slot IN (SELECT slot FROM gone)
  AND r.status NOT IN ('running', 'handed_over')
  AND NOT EXISTS (
      SELECT 1 FROM {attempts} a
      WHERE a.job = r.job AND a.slot = r.slot
        AND (a.slot, a.attempt) NOT IN (SELECT slot, attempt FROM gone))"""

# --- single statements ------------------------------------------------------------------

SELECT_NOW = "SELECT {now}"
REGISTER_JOBS = """
WITH j AS (
    INSERT INTO {jobs} AS j (job, first_seen_ms, seq)
    SELECT x.job, {now}, 0 FROM unnest(%s::text[]) AS x(job) ORDER BY x.job
    ON CONFLICT (job) DO UPDATE SET job = EXCLUDED.job
    RETURNING j.job, j.first_seen_ms, j.last_slot, (j.xmax = 0) AS new)
SELECT j.job, j.first_seen_ms, j.last_slot, j.new,
       ARRAY(SELECT r.slot FROM {runs} r
             WHERE r.job = j.job AND r.status IN ('running', 'handed_over') ORDER BY r.slot)
FROM j"""
HEARTBEAT = """
WITH u AS (
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::bigint[])
        AS u(job, slot, token, lease_ms)),
renewed AS (
    UPDATE {runs} r SET expires_ms = {now} + u.lease_ms
    FROM u
    WHERE r.job = u.job AND r.slot = u.slot AND r.token = u.token AND r.status = 'running'
      AND r.expires_ms > {now}
    RETURNING r.token)
SELECT {now}, ARRAY(SELECT token FROM renewed)"""
FINISH = """
WITH run AS (
    UPDATE {runs} SET status = %s::text, token = NULL, expires_ms = NULL
    WHERE job = %s::text AND slot = %s::bigint AND token = %s::text AND status = 'running'
    RETURNING job, slot, attempt),
att AS (
    UPDATE {attempts} a SET outcome = %s::text, error = %s::text, finished_ms = {now}
    FROM run
    WHERE a.job = run.job AND a.slot = run.slot AND a.attempt = run.attempt
      AND a.outcome IS NULL
    RETURNING 1)
SELECT count(*) FROM run"""
HAND_OVER = """
WITH u AS (
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[]) AS u(job, slot, token)),
run AS (
    UPDATE {runs} r SET status = 'handed_over', token = NULL, expires_ms = {now}
    FROM u
    WHERE r.job = u.job AND r.slot = u.slot AND r.token = u.token AND r.status = 'running'
    RETURNING u.token, r.job, r.slot, r.attempt),
att AS (
    UPDATE {attempts} a SET outcome = 'handed_over', finished_ms = {now}
    FROM run
    WHERE a.job = run.job AND a.slot = run.slot AND a.attempt = run.attempt
      AND a.outcome IS NULL
    RETURNING 1)
SELECT token FROM run"""
CHECK = """
SELECT n.now, r.job, r.slot, r.status, r.attempt, r.expires_ms, r.instance_id
FROM (SELECT {now} AS now) AS n
LEFT JOIN ({runs} r JOIN unnest(%s::text[], %s::bigint[]) AS u(job, slot)
           ON r.job = u.job AND r.slot = u.slot) ON true"""
_HISTORY_COLUMNS = """
SELECT job, slot, attempt, instance_id, reason, claimed_ms, finished_ms, outcome, error
FROM {attempts}"""
HISTORY_OF_JOB = _HISTORY_COLUMNS + """
WHERE job = %s::text ORDER BY claimed_ms DESC, slot DESC, attempt DESC LIMIT %s::bigint"""
HISTORY_ALL = _HISTORY_COLUMNS + """
ORDER BY claimed_ms DESC, slot DESC, attempt DESC LIMIT %s::bigint"""
GET_CHECKPOINT = "SELECT checkpoint FROM {runs} WHERE job = %s::text AND slot = %s::bigint"
SET_CHECKPOINT = """
UPDATE {runs} SET checkpoint = %s::text
WHERE job = %s::text AND slot = %s::bigint AND token = %s::text AND status = 'running'
RETURNING 1"""
LOCK_HELD_RUN = """
SELECT attempt FROM {runs}
WHERE job = %s::text AND slot = %s::bigint AND token = %s::text AND status = 'running'
FOR UPDATE"""


def quote_ident(name: str) -> str:
    """Quote one SQL identifier (the only place identifiers are turned into SQL text)."""
    return '"' + name.replace('"', '""') + '"'


def _split_table(table: object) -> tuple[str | None, str]:
    if not isinstance(table, str):
        raise ConfigurationError(f"table must be a string such as 'anarchon_runs', not {table!r}")
    parts = table.split(".")
    if len(parts) > 2 or not all(_IDENT.match(part) for part in parts):
        raise ConfigurationError(
            f"invalid table name {table!r}: use letters, digits and underscores, optionally "
            "prefixed by a schema ('jobs.cron_runs'); no quotes, spaces or extra dots"
        )
    schema, name = (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    longest = max(_SUFFIXES, key=len)
    if len((name + longest).encode()) > 63 or (schema and len(schema.encode()) > 63):
        raise ConfigurationError(
            f"table name {table!r} is too long: PostgreSQL identifiers hold 63 bytes and "
            f"anarchon derives names such as {name + longest!r}; use at most "
            f"{63 - len(longest)} characters for the table"
        )
    return schema, name


class _Statements:
    """The module's SQL templates, filled with one store's quoted table names."""

    def __init__(self, schema: str | None, name: str) -> None:
        prefix = quote_ident(schema) + "." if schema else ""
        names = {
            "runs": prefix + quote_ident(name),
            "attempts": prefix + quote_ident(name + "_attempts"),
            "jobs": prefix + quote_ident(name + "_jobs"),
            "meta": prefix + quote_ident(name + "_meta"),
            "open_idx": quote_ident(name + "_open"),
            "seq_idx": quote_ident(name + "_a_seq"),
            "claimed_idx": quote_ident(name + "_a_claimed"),
            "job_idx": quote_ident(name + "_a_job"),
            "fin_idx": quote_ident(name + "_a_fin"),
            "now": NOW,
        }

        def fill(template: str) -> str:
            return template.format(**names).strip()

        self.read_format = fill(READ_FORMAT)
        self.ddl = tuple(fill(statement) for statement in DDL)
        self.write_format = fill(WRITE_FORMAT)
        self.upsert_job = fill(UPSERT_JOB)
        self.read_run = fill(READ_RUN)
        self.insert_run = fill(INSERT_RUN)
        self.take_over = fill(TAKE_OVER)
        self.escalate = fill(ESCALATE)
        self.trim_history = fill(TRIM_HISTORY)
        self.select_now = fill(SELECT_NOW)
        self.register_jobs = fill(REGISTER_JOBS)
        self.heartbeat = fill(HEARTBEAT)
        self.finish = fill(FINISH)
        self.hand_over = fill(HAND_OVER)
        self.check = fill(CHECK)
        self.history_of_job = fill(HISTORY_OF_JOB)
        self.history_all = fill(HISTORY_ALL)
        self.get_checkpoint = fill(GET_CHECKPOINT)
        self.set_checkpoint = fill(SET_CHECKPOINT)
        self.lock_held_run = fill(LOCK_HELD_RUN)


@dataclass
class FencedTransaction:
    """The handle of :meth:`PostgresBackend.transaction`: write your effects through it.

    Placeholders are ``%s`` with positional parameters, whatever the driver.
    """

    _tx: Executor

    @property
    def connection(self) -> Any:
        """The raw driver connection the transaction runs on (do not commit on it)."""
        return self._tx.connection

    async def execute(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run ``sql`` inside the fenced transaction; return its rows (empty when none)."""
        return await self._tx.all(sql, tuple(params or ()))


class PostgresBackend(Backend):
    """Coordinate through PostgreSQL 9.5 or newer (see the module docs for the statements).

    ``connection`` is anything :func:`adapters.sql.adapter_for` accepts: ``None``
    (``postgresql://localhost:5432/postgres`` with ``PG*`` variables filling gaps), a DSN,
    a psycopg pool or connection, a pg8000 connection, or your own adapter. ``table`` names
    the runs table, optionally schema-qualified (``jobs.cron_runs``; the schema must exist);
    the others are ``<table>_attempts``, ``<table>_jobs`` and ``<table>_meta``.
    ``options`` (``driver="pg8000"``, ``min_size``, ``max_size``) apply to a DSN.

    .. note:: A pool or connection passed in is never closed; a pool opened from a DSN is
       closed when the last user calls :meth:`close`.
    """

    schemes = ("postgresql", "postgres", "postgresql+psycopg", "postgresql+pg8000")

    def __init__(self, connection: Any = None, *, table: str = "anarchon_runs",
                 **options: Any) -> None:
        super().__init__()
        self.table = table
        self._schema, self._name = _split_table(table)
        self._sql = _Statements(self._schema, self._name)
        self._connection = connection
        self._options = options
        self._given: SqlAdapter | None = None
        if connection is not None and not isinstance(connection, str):
            self._given = adapter_for(connection, **options)
        elif isinstance(connection, str) or options:
            adapter_for(connection, **options)  # validates the DSN and options now
        self._adapter_now: SqlAdapter | None = self._given

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        """Build a backend from a ``postgresql://`` (or ``postgresql+pg8000://``) URL."""
        return cls(url, **options)

    @property
    def anyio_backends(self) -> tuple[str, ...]:
        """The event loops this backend's connection works on."""
        adapter = self._given or adapter_for(self._connection, **self._options)
        return adapter.anyio_backends

    @property
    def _adapter(self) -> SqlAdapter:
        if self._adapter_now is None:
            raise ConfigurationError("PostgresBackend is not started; call await start() first")
        return self._adapter_now

    async def _open(self) -> None:
        adapter = self._given or adapter_for(self._connection, **self._options)
        await adapter.open()
        try:
            await self._ensure_tables(adapter)
        except BaseException:
            if adapter.owned:
                await adapter.close()
            raise
        self._adapter_now = adapter

    async def _close(self) -> None:
        adapter, self._adapter_now = self._adapter_now, self._given
        if adapter is not None and adapter.owned:
            await adapter.close()

    # --- creation -----------------------------------------------------------------------

    def _table_names(self) -> list[str]:
        return [self._name + suffix for suffix in ("", "_attempts", "_jobs", "_meta")]

    async def _existing(self, tx: Executor | SqlAdapter) -> set[str]:
        rows = await tx.all(FIND_TABLES, (self._table_names(), self._schema))
        if not rows:
            if self._schema is None:
                raise ConfigurationError(
                    f"no schema to create table {self.table!r} in: the search_path names no "
                    "existing schema; qualify the table as 'schema.table'"
                )
            raise ConfigurationError(
                f"schema {self._schema!r} of table {self.table!r} does not exist; create it "
                f"first (CREATE SCHEMA {self._schema}) or choose another table"
            )
        return set(rows[0][1])

    async def _check_format(self, tx: Executor | SqlAdapter) -> bool:
        rows = await tx.all(self._sql.read_format)
        if not rows:
            return False
        try:
            found = int(rows[0][0])
        except ValueError:
            found = FORMAT_VERSION + 1
        if found > FORMAT_VERSION:
            raise StoreFormatError(
                f"table {self.table!r} was written by store format {rows[0][0]!r}, newer than "
                f"format {FORMAT_VERSION} this anarchon understands; upgrade anarchon"
            )
        return True

    async def _ensure_tables(self, adapter: SqlAdapter) -> None:
        if len(await self._existing(adapter)) == 4 and await self._check_format(adapter):
            return
        try:
            await adapter.run_transaction(self._create)
        except ConfigurationError as exc:
            if "permission denied" not in str(exc) and "42501" not in str(exc):
                raise
            raise ConfigurationError(
                f"the anarchon tables for {self.table!r} are missing and this user may not "
                "create them; run `anarchon migrate --dsn <privileged DSN> --table "
                f"{self.table}` once with a privileged user, then grant SELECT, INSERT, UPDATE, "
                f"DELETE on {', '.join(self._table_names())} ({exc})"
            ) from exc

    async def _create(self, tx: Executor) -> None:
        key = int.from_bytes(
            hashlib.sha256(f"anarchon:{self._schema}.{self._name}".encode()).digest()[:8],
            "big", signed=True,
        )
        await tx.all(LOCK_CREATION, (key,))
        existing = await self._existing(tx)
        if self._name + "_meta" in existing:
            await self._check_format(tx)
        if len(existing) < 4:
            for statement in self._sql.ddl:
                await tx.all(statement)
        await tx.all(self._sql.write_format, (str(FORMAT_VERSION),))

    # --- contract -----------------------------------------------------------------------

    async def now_ms(self) -> int:
        """Return the server's ``clock_timestamp()`` in epoch milliseconds."""
        rows = await self._adapter.all(self._sql.select_now)
        return int(rows[0][0])

    async def _retry(self, fn: Callable[[Executor], Awaitable[T]]) -> T:
        for attempt in range(_CLAIM_RETRIES):
            try:
                return await self._adapter.run_transaction(fn)
            except TransientError:
                if attempt == _CLAIM_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def register_jobs(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """Record the jobs as seen, in one statement, and list their open runs."""
        names = sorted(set(jobs))
        if not names:
            return {}

        async def run(tx: Executor) -> list[Row]:
            return await tx.all(self._sql.register_jobs, (names,))

        rows = await self._retry(run)
        found = {
            str(job): JobInfo(str(job), int(first), None if last is None else int(last),
                              tuple(int(s) for s in (slots or ())), bool(new))
            for job, first, last, new, slots in rows
        }
        return {name: found[name] for name in jobs}

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        """Win, take over or inspect the run in one transaction (see the module docs)."""

        async def run(tx: Executor) -> ClaimResult:
            return await self._claim(tx, request)

        return await self._retry(run)

    async def _claim(self, tx: Executor, req: ClaimRequest) -> ClaimResult:
        sql = self._sql
        [(now_raw, seq_raw)] = await tx.all(sql.upsert_job, (req.job, req.slot))
        now, seq = int(now_raw), int(seq_raw)
        [(blocked, status_raw, attempt_raw, _token, holder, expires_raw)] = await tx.all(
            sql.read_run, (req.job, req.slot, now, req.job, req.slot)
        )

        def result(status: ClaimStatus, run_status: RunStatus, attempt: int,
                   expires: int | None, instance: str | None,
                   reason: Reason | None = None) -> ClaimResult:
            return ClaimResult(status, req.job, req.slot, now, attempt, reason, expires,
                               run_status, instance)

        if status_raw is None:
            if req.overlap_skip and blocked:
                await tx.all(sql.insert_run, (
                    req.job, req.slot, RunStatus.SKIPPED.value, None, req.instance_id, None,
                    seq, req.instance_id, req.reason.value, now, now, Outcome.SKIPPED.value,
                    "an earlier run of the job still holds its lease",
                ))
                await self._trim(tx, req, now)
                return result(ClaimStatus.SKIPPED, RunStatus.SKIPPED, 1, None, req.instance_id)
            expires = now + req.lease_ms
            await tx.all(sql.insert_run, (
                req.job, req.slot, RunStatus.RUNNING.value, req.token, req.instance_id, expires,
                seq, req.instance_id, req.reason.value, now, None, None, None,
            ))
            await self._trim(tx, req, now)
            return result(ClaimStatus.WON, RunStatus.RUNNING, 1, expires, req.instance_id,
                          req.reason)
        status = RunStatus(status_raw)
        attempt = int(attempt_raw)
        expires_ms = None if expires_raw is None else int(expires_raw)
        holder = None if holder is None else str(holder)
        if status.finished:
            return result(ClaimStatus.FINISHED, status, attempt, expires_ms, holder)
        if status is RunStatus.RUNNING and expires_ms is not None and expires_ms > now:
            return result(ClaimStatus.RUNNING, status, attempt, expires_ms, holder)
        if status is RunStatus.HANDED_OVER:
            reason = Reason.HAND_OVER
            ended: tuple[str | None, str | None] = (None, None)
        else:
            if req.max_attempts is not None and attempt >= req.max_attempts:
                await tx.all(sql.escalate, (
                    f"lease lost on attempt {attempt} of max_attempts={req.max_attempts}; "
                    "escalated", now, req.job, req.slot, attempt, req.job, req.slot,
                ))
                return result(ClaimStatus.ESCALATED, RunStatus.ESCALATED, attempt, None, holder)
            reason = Reason.TAKEOVER
            ended = (Outcome.LOST.value, "lease expired without renewal")
        expires = now + req.lease_ms
        await tx.all(sql.take_over, (
            ended[0] or Outcome.LOST.value, ended[1], now, req.job, req.slot,
            attempt if ended[0] else -1,
            req.token, req.instance_id, expires, req.job, req.slot,
            seq, req.instance_id, reason.value, now,
        ))
        await self._trim(tx, req, now)
        return result(ClaimStatus.WON, RunStatus.RUNNING, attempt + 1, expires,
                      req.instance_id, reason)

    async def _trim(self, tx: Executor, req: ClaimRequest, now: int) -> None:
        cutoff = None if req.history_ttl_ms is None else now - req.history_ttl_ms
        await tx.all(self._sql.trim_history, (
            req.job, max(req.history_size, 0), TRIM_BATCH,
            req.job, cutoff, TRIM_BATCH,
            req.job, req.job,
        ))

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        """Renew every lease in one ``UPDATE … FROM unnest(…)`` statement."""
        if not leases:
            return HeartbeatResult(await self.now_ms())
        rows = await self._adapter.all(self._sql.heartbeat, (
            [lease.job for lease in leases], [lease.slot for lease in leases],
            [lease.token for lease in leases], [lease.lease_ms for lease in leases],
        ))
        now, held = rows[0]
        return HeartbeatResult(int(now), frozenset(str(t) for t in held or ()))

    async def finish(self, lease: Lease, outcome: Outcome, error: str | None = None) -> bool:
        """End the attempt in one fenced ``UPDATE`` (the attempt row in the same statement)."""
        status = RunStatus(Outcome(outcome).value)
        rows = await self._adapter.all(self._sql.finish, (
            status.value, lease.job, lease.slot, lease.token, Outcome(outcome).value, error,
        ))
        return bool(rows and int(rows[0][0]))

    async def hand_over(self, leases: Sequence[Lease]) -> frozenset[str]:
        """Release the runs in one fenced ``UPDATE``; return the tokens released."""
        if not leases:
            return frozenset()
        rows = await self._adapter.all(self._sql.hand_over, (
            [lease.job for lease in leases], [lease.slot for lease in leases],
            [lease.token for lease in leases],
        ))
        return frozenset(str(row[0]) for row in rows)

    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        """Read the watched runs with one plain ``SELECT``."""
        rows = await self._adapter.all(self._sql.check, (
            [job for job, _ in runs], [slot for _, slot in runs],
        ))
        now = int(rows[0][0])
        found: dict[tuple[str, int], RunState] = {}
        for _, job, slot, status, attempt, expires, instance in rows:
            if job is None:
                continue
            key = (str(job), int(slot))
            found[key] = RunState(key[0], key[1], RunStatus(status), int(attempt),
                                  None if expires is None else int(expires),
                                  None if instance is None else str(instance))
        return CheckResult(now, found)

    async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return attempts, newest claim first."""
        if job is None:
            rows = await self._adapter.all(self._sql.history_all, (limit,))
        else:
            rows = await self._adapter.all(self._sql.history_of_job, (job, limit))
        return [
            Attempt(str(j), int(slot), int(attempt), str(instance), Reason(reason),
                    ms_to_datetime(int(claimed)),
                    None if finished is None else ms_to_datetime(int(finished)),
                    None if outcome is None else Outcome(outcome),
                    None if error is None else str(error))
            for j, slot, attempt, instance, reason, claimed, finished, outcome, error in rows
        ]

    async def get_checkpoint(self, job: str, slot: int) -> Any:
        """Return the run's checkpoint, or ``None``."""
        rows = await self._adapter.all(self._sql.get_checkpoint, (job, slot))
        return decode_checkpoint(rows[0][0] if rows else None)

    async def set_checkpoint(self, lease: Lease, value: Any) -> bool:
        """Store the checkpoint in one fenced ``UPDATE``."""
        text = encode_checkpoint(value)
        rows = await self._adapter.all(self._sql.set_checkpoint,
                                       (text, lease.job, lease.slot, lease.token))
        return bool(rows)

    async def delete_checkpoint(self, lease: Lease) -> bool:
        """Remove the checkpoint in one fenced ``UPDATE``."""
        rows = await self._adapter.all(self._sql.set_checkpoint,
                                       (None, lease.job, lease.slot, lease.token))
        return bool(rows)

    def transaction(self, lease: Lease) -> Any:
        """Open a fenced transaction that completes the run when it commits.

        It first locks the run row where ``lease.token`` still holds it (``running``),
        raising :class:`LeaseLost` otherwise; the block writes its effects through
        :meth:`FencedTransaction.execute`; on a normal exit the run and its attempt are
        marked ``completed`` in the same commit. An exception rolls everything back.
        """
        return self._fenced(lease)

    @asynccontextmanager
    async def _fenced(self, lease: Lease) -> AsyncIterator[FencedTransaction]:
        async with self._adapter.transaction() as tx:
            held = await tx.all(self._sql.lock_held_run, (lease.job, lease.slot, lease.token))
            if not held:
                raise LeaseLost(
                    f"run {lease.job!r} slot {lease.slot} is no longer held by token "
                    f"{lease.token!r}; the fenced transaction did not start"
                )
            yield FencedTransaction(tx)
            done = await tx.all(self._sql.finish, (
                RunStatus.COMPLETED.value, lease.job, lease.slot, lease.token,
                Outcome.COMPLETED.value, None,
            ))
            if not (done and int(done[0][0])):  # pragma: no cover - the row is locked
                raise LeaseLost(f"run {lease.job!r} slot {lease.slot} was lost mid-transaction")


async def migrate(connection: Any = None, *, table: str = "anarchon_runs") -> None:
    """Create the four tables (run with a privileged user), then release the connection.

    Afterwards the application's user needs only SELECT, INSERT, UPDATE and DELETE on
    them. Safe to run again, and concurrently; a store of a newer format is refused.
    """
    backend = PostgresBackend(connection, table=table)
    await backend.start()
    await backend.close()
