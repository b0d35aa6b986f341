"""The PostgreSQL backend: runs, attempts, jobs and the format version in four tables.

Where a claim happens: :meth:`PostgresBackend.claim` is **one statement**, a call of the
PL/pgSQL function ``<table>_claim`` (``CREATE_CLAIM_FUNCTION``) in autocommit, so it takes
one round trip on every adapter. The function runs the claim of ``lease_core.abc`` in the
statement's own transaction:

1. a run that is finished, or held by a live lease, is reported from a plain read, with
   no lock and no write (backups standing by write nothing);
2. otherwise the job's row in ``<table>_jobs`` is locked (``SELECT … FOR UPDATE``,
   inserted when missing); the lock serialises the claims of one job, and since each
   statement of a VOLATILE function in READ COMMITTED takes a new snapshot, the second
   claimer always sees the winner's run;
3. the run is read ``FOR UPDATE`` (a fenced transaction or a finish in flight completes
   first), then inserted, skipped, taken over or escalated with its attempt rows;
4. the job row gets a new version only when ``last_slot`` grows or an attempt is written
   (taking the next ``seq``, the order trimming keeps);
5. after writing an attempt, a bounded number of old attempts and finished runs are
   deleted through the indexes.

The function is created with the tables (``start()`` by a privileged user, or
``anarchon migrate``), under the same advisory lock; it is ``SECURITY INVOKER``, so the
application's user needs only EXECUTE (granted to PUBLIC) and its table privileges.

Every other call is one statement too: heartbeats and hand-overs of many leases, a finish,
a batched check. All lease arithmetic uses the server's ``clock_timestamp()``; times are
stored as ``bigint`` epoch milliseconds. Nothing keeps session state (only
transaction-scoped advisory locks, at creation), so PgBouncer in transaction mode works.
The SQL keeps to PostgreSQL 9.5 syntax; PostgreSQL 15, 16 and 18 are tested.

Table names are validated, then quoted by :func:`quote_ident`, the one quoting helper;
statements are named module-level templates filled only with quoted identifiers.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from lease_core._packages import require_own

require_own("adapters")  # before importing from it: a foreign one may shadow it

from adapters.sql import Executor, Row, SqlAdapter, TransientError, adapter_for
from lease_core._durations import parse_duration
from lease_core._redact import redact
from lease_core._registry import merge_options, split_url_options
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
    RunInfo,
    RunState,
    RunStatus,
    ms_to_datetime,
)
from lease_core.abc import Backend, decode_checkpoint, encode_checkpoint
from lease_core.errors import ConfigurationError, LeaseLost, StoreFormatError

__all__ = [
    "FORMAT_VERSION",
    "TRIM_BATCH",
    "FencedTransaction",
    "PostgresBackend",
    "Statements",
    "migrate",
    "quote_ident",
]

#: The store format this code writes; a store with a newer one is refused.
FORMAT_VERSION = 1
#: The most old attempts one claim deletes (trimming is incremental).
TRIM_BATCH = 100
_CLAIM_RETRIES = 5

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Suffixes of the names derived from ``table`` (tables and indexes).
_SUFFIXES = ("", "_attempts", "_jobs", "_meta", "_open", "_a_seq", "_a_claimed", "_a_job",
             "_a_fin", "_claim")

NOW = "(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)"

# --- creation ---------------------------------------------------------------------------

FIND_TABLES = """
SELECT n.nspname::text,
       ARRAY(SELECT c.relname::text FROM pg_catalog.pg_class c
             WHERE c.relnamespace = n.oid AND c.relname = ANY(%s::text[])),
       EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.pronamespace = n.oid AND p.proname = %s::text)
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

#: The claim function's parameters, in order (also its signature for GRANT).
CLAIM_ARGS = ("p_job text, p_slot bigint, p_instance text, p_token text, p_lease_ms bigint, "
              "p_reason text, p_overlap_skip boolean, p_max_attempts bigint, "
              "p_history_size bigint, p_history_ttl_ms bigint, p_trim_batch bigint")
CLAIM_ARG_TYPES = ("text, bigint, text, text, bigint, text, boolean, bigint, bigint, bigint, "
                   "bigint")
# The whole claim (abc module docs) as one PL/pgSQL function, so that a claim is one
# statement: one round trip in autocommit on every adapter. It is VOLATILE and runs in
# READ COMMITTED, so every statement takes a fresh snapshot: after waiting for the job
# row's lock, the read of the run sees what the previous claimer committed.
#
# - Fast path: a run that is finished, or running with a live lease, is reported from a
#   plain read, without any lock or write (backups standing by write nothing).
# - Otherwise the job row is locked (``SELECT ... FOR UPDATE``; inserted when missing,
#   race-safe through ``ON CONFLICT DO NOTHING``), which serialises the claims of one job;
#   the run is read ``FOR UPDATE`` (a fenced transaction or a finish in flight completes
#   first), then won, skipped, taken over or escalated.
# - The job row gets a new version only when ``last_slot`` grows or an attempt is written
#   (which takes the next ``seq``, the order trimming keeps), in one UPDATE at most.
# - After writing an attempt, a bounded, index-backed trim (TRIM_BATCH rows per query).
#
# The body has no ``%`` and no braces (it goes through str.format and placeholder
# rewriting). A change of its parameters or meaning needs a new function name: a store is
# only checked for the function's presence.
CREATE_CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION {claim_fn}(
    {claim_args},
    OUT c_status text, OUT c_now bigint, OUT c_attempt integer, OUT c_reason text,
    OUT c_expires bigint, OUT c_run_status text, OUT c_instance text)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $anarchon$
DECLARE
    v_now bigint;
    v_found boolean;
    v_status text;
    v_attempt integer;
    v_instance text;
    v_expires bigint;
    v_last bigint;
    v_seq bigint;
    v_row_seq bigint;
    v_reason text;
    v_wrote boolean := false;
BEGIN
    SELECT r.status, r.attempt, r.instance_id, r.expires_ms
      INTO v_status, v_attempt, v_instance, v_expires
      FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot;
    v_found := FOUND;
    v_now := {now};
    IF v_found AND (v_status NOT IN ('running', 'handed_over')
                    OR (v_status = 'running' AND v_expires > v_now)) THEN
        c_status := CASE WHEN v_status = 'running' THEN 'running' ELSE 'finished' END;
        c_now := v_now; c_attempt := v_attempt; c_expires := v_expires;
        c_run_status := v_status; c_instance := v_instance;
        RETURN;
    END IF;

    SELECT j.last_slot, j.seq INTO v_last, v_seq
      FROM {jobs} j WHERE j.job = p_job FOR UPDATE;
    IF FOUND THEN
        v_row_seq := v_seq;
    ELSE
        INSERT INTO {jobs} AS j (job, first_seen_ms, last_slot, seq)
        VALUES (p_job, {now}, p_slot, 1)
        ON CONFLICT (job) DO NOTHING;
        IF FOUND THEN
            v_last := p_slot; v_seq := 0; v_row_seq := 1;
        ELSE
            SELECT j.last_slot, j.seq INTO v_last, v_seq
              FROM {jobs} j WHERE j.job = p_job FOR UPDATE;
            v_row_seq := v_seq;
        END IF;
    END IF;

    v_now := {now};
    SELECT r.status, r.attempt, r.instance_id, r.expires_ms
      INTO v_status, v_attempt, v_instance, v_expires
      FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot FOR UPDATE;
    c_now := v_now;
    IF NOT FOUND THEN
        v_seq := v_seq + 1;
        v_wrote := true;
        IF p_overlap_skip AND EXISTS (
                SELECT 1 FROM {runs} o
                WHERE o.job = p_job AND o.slot < p_slot AND o.status = 'running'
                  AND o.expires_ms > v_now) THEN
            INSERT INTO {runs} (job, slot, status, attempt, token, instance_id, expires_ms)
            VALUES (p_job, p_slot, 'skipped', 1, NULL, p_instance, NULL);
            INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms,
                                    finished_ms, outcome, error)
            VALUES (p_job, p_slot, 1, v_seq, p_instance, p_reason, v_now, v_now, 'skipped',
                    'an earlier run of the job still holds its lease');
            c_status := 'skipped'; c_attempt := 1; c_run_status := 'skipped';
            c_instance := p_instance;
        ELSE
            c_expires := v_now + p_lease_ms;
            INSERT INTO {runs} (job, slot, status, attempt, token, instance_id, expires_ms)
            VALUES (p_job, p_slot, 'running', 1, p_token, p_instance, c_expires);
            INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms)
            VALUES (p_job, p_slot, 1, v_seq, p_instance, p_reason, v_now);
            c_status := 'won'; c_attempt := 1; c_reason := p_reason;
            c_run_status := 'running'; c_instance := p_instance;
        END IF;
    ELSIF v_status NOT IN ('running', 'handed_over') THEN
        c_status := 'finished'; c_attempt := v_attempt; c_expires := v_expires;
        c_run_status := v_status; c_instance := v_instance;
    ELSIF v_status = 'running' AND v_expires > v_now THEN
        c_status := 'running'; c_attempt := v_attempt; c_expires := v_expires;
        c_run_status := v_status; c_instance := v_instance;
    ELSIF v_status = 'running' AND p_max_attempts IS NOT NULL
          AND v_attempt >= p_max_attempts THEN
        UPDATE {attempts}
        SET outcome = 'escalated', finished_ms = v_now,
            error = 'lease lost on attempt ' || v_attempt || ' of max_attempts='
                    || p_max_attempts || '; escalated'
        WHERE job = p_job AND slot = p_slot AND attempt = v_attempt AND outcome IS NULL;
        UPDATE {runs} SET status = 'escalated', token = NULL, expires_ms = NULL
        WHERE job = p_job AND slot = p_slot;
        c_status := 'escalated'; c_attempt := v_attempt; c_run_status := 'escalated';
        c_instance := v_instance;
    ELSE
        IF v_status = 'handed_over' THEN
            v_reason := 'hand-over';
        ELSE
            v_reason := 'takeover';
            UPDATE {attempts}
            SET outcome = 'lost', error = 'lease expired without renewal', finished_ms = v_now
            WHERE job = p_job AND slot = p_slot AND attempt = v_attempt AND outcome IS NULL;
        END IF;
        v_seq := v_seq + 1;
        v_wrote := true;
        c_expires := v_now + p_lease_ms;
        UPDATE {runs}
        SET status = 'running', attempt = v_attempt + 1, token = p_token,
            instance_id = p_instance, expires_ms = c_expires
        WHERE job = p_job AND slot = p_slot;
        INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms)
        VALUES (p_job, p_slot, v_attempt + 1, v_seq, p_instance, v_reason, v_now);
        c_status := 'won'; c_attempt := v_attempt + 1; c_reason := v_reason;
        c_run_status := 'running'; c_instance := p_instance;
    END IF;

    IF v_seq > v_row_seq OR v_last IS NULL OR p_slot > v_last THEN
        UPDATE {jobs} SET last_slot = GREATEST(last_slot, p_slot), seq = GREATEST(seq, v_seq)
        WHERE job = p_job;
    END IF;

    IF v_wrote THEN
        WITH doomed AS (
            (SELECT a.slot, a.attempt FROM {attempts} a WHERE a.job = p_job
             ORDER BY a.seq DESC OFFSET GREATEST(p_history_size, 0) LIMIT p_trim_batch)
            UNION
            (SELECT a.slot, a.attempt FROM {attempts} a
             WHERE a.job = p_job AND a.finished_ms < v_now - p_history_ttl_ms
             LIMIT p_trim_batch)),
        gone AS (
            DELETE FROM {attempts} a USING doomed d
            WHERE a.job = p_job AND a.slot = d.slot AND a.attempt = d.attempt
            RETURNING a.slot, a.attempt)
        DELETE FROM {runs} r
        WHERE r.job = p_job AND r.slot IN (SELECT g.slot FROM gone g)
          AND r.status NOT IN ('running', 'handed_over')
          AND NOT EXISTS (
              SELECT 1 FROM {attempts} a
              WHERE a.job = r.job AND a.slot = r.slot
                AND (a.slot, a.attempt) NOT IN (SELECT g.slot, g.attempt FROM gone g));
    END IF;
END
$anarchon$"""
GRANT_CLAIM_FUNCTION = "GRANT EXECUTE ON FUNCTION {claim_fn}({claim_arg_types}) TO PUBLIC"
CLAIM = """
SELECT c_status, c_now, c_attempt, c_reason, c_expires, c_run_status, c_instance
FROM {claim_fn}(%s::text, %s::bigint, %s::text, %s::text, %s::bigint, %s::text, %s::boolean,
                %s::bigint, %s::bigint, %s::bigint, %s::bigint)"""

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
live AS (
    SELECT r.job, r.slot, r.token, u.lease_ms
    FROM {runs} r JOIN u ON r.job = u.job AND r.slot = u.slot AND r.token = u.token
    WHERE r.status = 'running' AND r.expires_ms > {now}),
lockable AS (
    SELECT r.job, r.slot
    FROM {runs} r JOIN live l ON r.job = l.job AND r.slot = l.slot AND r.token = l.token
    FOR NO KEY UPDATE OF r SKIP LOCKED),
renewed AS (
    UPDATE {runs} r SET expires_ms = {now} + l.lease_ms
    FROM live l JOIN lockable k ON k.job = l.job AND k.slot = l.slot
    WHERE r.job = l.job AND r.slot = l.slot AND r.token = l.token AND r.status = 'running'
    RETURNING r.token)
SELECT {now}, ARRAY(SELECT token FROM live), ARRAY(SELECT token FROM renewed)"""
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
LIST_JOBS = "SELECT job FROM {jobs} ORDER BY job"
LIST_RUNS = """
SELECT job, slot, status, attempt, instance_id, expires_ms FROM {runs}
WHERE (%s::text IS NULL OR job = %s::text)
  AND (NOT %s::boolean OR status IN ('running', 'handed_over'))
ORDER BY slot DESC, job LIMIT %s::bigint"""
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


def _count(name: str, value: object) -> int:
    try:
        number = int(str(value)) if isinstance(value, str) else value
    except ValueError:
        number = None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ConfigurationError(f"{name}={value!r} must be a whole number, at least 1")
    return number


def _seconds(name: str, value: object) -> float:
    return parse_duration(value, what=name)


#: Options of the pool the backend opens from a DSN, and how their values are read.
_POOL_OPTIONS: dict[str, Callable[[str, object], Any]] = {
    "min_size": _count, "max_size": _count, "timeout": _seconds,
}
#: Query parameters the backend takes out of a URL (the others go to the driver).
_URL_OPTIONS = ("table", "namespace", *_POOL_OPTIONS)
#: Every keyword option the backend accepts.
_OPTIONS = (*_URL_OPTIONS, "driver")


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


class Statements:
    """The SQL this backend sends, filled with one store's quoted table names.

    Public for tools that run the very same statements through a raw driver (the
    benchmarks compare the library with that); the statements' text is not a stable API.
    """

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
            "claim_fn": prefix + quote_ident(name + "_claim"),
            "claim_args": CLAIM_ARGS,
            "claim_arg_types": CLAIM_ARG_TYPES,
            "now": NOW,
        }

        def fill(template: str) -> str:
            return template.format(**names).strip()

        self.read_format = fill(READ_FORMAT)
        self.ddl = tuple(fill(statement) for statement in DDL)
        self.write_format = fill(WRITE_FORMAT)
        self.create_claim_function = fill(CREATE_CLAIM_FUNCTION)
        self.grant_claim_function = fill(GRANT_CLAIM_FUNCTION)
        self.claim = fill(CLAIM)
        self.select_now = fill(SELECT_NOW)
        self.register_jobs = fill(REGISTER_JOBS)
        self.heartbeat = fill(HEARTBEAT)
        self.finish = fill(FINISH)
        self.hand_over = fill(HAND_OVER)
        self.check = fill(CHECK)
        self.history_of_job = fill(HISTORY_OF_JOB)
        self.history_all = fill(HISTORY_ALL)
        self.list_jobs = fill(LIST_JOBS)
        self.list_runs = fill(LIST_RUNS)
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
    """Coordinate through PostgreSQL (tested: 15, 16, 18; see the module docs for the SQL).

    ``connection`` is anything :func:`adapters.sql.adapter_for` accepts: ``None``
    (``postgresql://localhost:5432/postgres`` with ``PG*`` variables filling gaps), a DSN,
    a psycopg pool or connection, a pg8000 connection, or your own adapter. ``table`` names
    the runs table, optionally schema-qualified (``jobs.cron_runs``; the schema must exist);
    the others are ``<table>_attempts``, ``<table>_jobs`` and ``<table>_meta``.
    ``namespace`` is another name for ``table`` (the keyword every backend accepts).
    ``options`` (``driver="pg8000"``, ``min_size``, ``max_size``, ``timeout``) apply to a
    DSN; a DSN may carry them, and the table, as query parameters (``?table=jobs``). An
    unknown option raises :class:`~lease_core.errors.ConfigurationError`.

    .. note:: A pool or connection passed in is never closed; a pool opened from a DSN is
       closed when the last user calls :meth:`close`.
    """

    schemes = ("postgresql", "postgres", "postgresql+psycopg", "postgresql+pg8000")

    def __init__(self, connection: Any = None, *, table: str | None = None,
                 namespace: str | None = None, **options: Any) -> None:
        super().__init__()
        from_url: dict[str, str] = {}
        if isinstance(connection, str):
            scheme = connection.split("://", 1)[0].lower() if "://" in connection else None
            if scheme is not None and scheme not in (*self.schemes, "postgres+psycopg",
                                                     "postgres+pg8000"):
                raise ConfigurationError(
                    f"{redact(connection)!r} is not a PostgreSQL URL; use "
                    "postgresql://user:password@host:5432/db or a key/value DSN"
                )
            connection, from_url = split_url_options(connection, _URL_OPTIONS)
        keywords = {"table": table, "namespace": namespace, **options}
        merged = merge_options("PostgresBackend", keywords, from_url, _OPTIONS)
        names = [merged.pop(k) for k in ("table", "namespace") if merged.get(k) is not None]
        if len(names) > 1 and names[0] != names[1]:
            raise ConfigurationError(
                f"PostgresBackend got table={names[0]!r} and namespace={names[1]!r}; "
                "give one of them"
            )
        options = {k: _POOL_OPTIONS[k](k, v) if k in _POOL_OPTIONS else v
                   for k, v in merged.items()}
        self.table = names[0] if names else "anarchon_runs"
        self._schema, self._name = _split_table(self.table)
        self._sql = Statements(self._schema, self._name)
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
        """Build a backend from a ``postgresql://`` URL or a libpq key/value DSN.

        The table and the pool's options may be given in the URL's query (``?table=jobs``,
        ``min_size``, ``max_size``, ``timeout``) as well as keywords; other query
        parameters (``sslmode``, ``connect_timeout``, ...) go to the driver.
        """
        return cls(url, **options)

    def __repr__(self) -> str:
        where = (redact(self._connection) if isinstance(self._connection, str)
                 else type(self._given).__name__ if self._given else "PG* defaults")
        return f"{type(self).__name__}(table={self.table!r}, {where!r})"

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

    async def _existing(self, tx: Executor | SqlAdapter) -> tuple[set[str], bool]:
        """The store's tables that exist, and whether its claim function exists."""
        rows = await tx.all(FIND_TABLES, (self._table_names(), self._name + "_claim",
                                          self._schema))
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
        return set(rows[0][1]), bool(rows[0][2])

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
        tables, function = await self._existing(adapter)
        if len(tables) == 4 and function and await self._check_format(adapter):
            return
        try:
            await adapter.run_transaction(self._create)
        except ConfigurationError as exc:
            if "permission denied" not in str(exc) and "42501" not in str(exc):
                raise
            what = (f"the claim function {self._function_name()} of the anarchon tables for "
                    f"{self.table!r} is missing and this user may not create it"
                    if len(tables) == 4 else
                    f"the anarchon tables for {self.table!r} are missing and this user may not "
                    "create them")
            raise ConfigurationError(
                f"{what}; run `anarchon migrate --dsn "
                f"<privileged DSN> --table {self.table}` once with a privileged user, then "
                f"grant SELECT, INSERT, UPDATE, DELETE on {', '.join(self._table_names())} "
                f"({exc})"
            ) from exc

    def _function_name(self) -> str:
        return (f"{self._schema}." if self._schema else "") + self._name + "_claim"

    async def _create(self, tx: Executor) -> None:
        key = int.from_bytes(
            hashlib.sha256(f"anarchon:{self._schema}.{self._name}".encode()).digest()[:8],
            "big", signed=True,
        )
        await tx.all(LOCK_CREATION, (key,))
        existing, function = await self._existing(tx)
        if self._name + "_meta" in existing:
            await self._check_format(tx)
        if len(existing) < 4:
            for statement in self._sql.ddl:
                await tx.all(statement)
        if not function:
            # SECURITY INVOKER: the caller's table privileges apply. EXECUTE is PUBLIC by
            # default; granted explicitly in case default privileges revoke it.
            await tx.all(self._sql.create_claim_function)
            await tx.all(self._sql.grant_claim_function)
        await tx.all(self._sql.write_format, (str(FORMAT_VERSION),))

    # --- contract -----------------------------------------------------------------------

    async def now_ms(self) -> int:
        """Return the server's ``clock_timestamp()`` in epoch milliseconds."""
        rows = await self._adapter.all(self._sql.select_now)
        return int(rows[0][0])

    async def _all_retrying(self, sql: str, params: Sequence[Any]) -> list[Row]:
        """Run one statement (its own transaction), again when PostgreSQL aborted it."""
        for retry in range(_CLAIM_RETRIES):
            try:
                return await self._adapter.all(sql, params)
            except TransientError:
                if retry == _CLAIM_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def register_jobs(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """Record the jobs as seen, in one statement, and list their open runs."""
        names = sorted(set(jobs))
        if not names:
            return {}

        rows = await self._all_retrying(self._sql.register_jobs, (names,))
        found = {
            str(job): JobInfo(str(job), int(first), None if last is None else int(last),
                              tuple(int(s) for s in (slots or ())), bool(new))
            for job, first, last, new, slots in rows
        }
        return {name: found[name] for name in jobs}

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        """Win, take over or inspect the run with one statement (see the module docs)."""
        req = request
        params = (req.job, req.slot, req.instance_id, req.token, req.lease_ms,
                  Reason(req.reason).value, bool(req.overlap_skip), req.max_attempts,
                  req.history_size, req.history_ttl_ms, TRIM_BATCH)
        [(status, now, attempt, reason, expires, run_status, instance)] = (
            await self._all_retrying(self._sql.claim, params))
        return ClaimResult(
            ClaimStatus(status), req.job, req.slot, int(now), int(attempt),
            None if reason is None else Reason(reason),
            None if expires is None else int(expires), RunStatus(run_status),
            None if instance is None else str(instance),
        )

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        """Renew every lease in one ``UPDATE … FROM unnest(…)`` statement.

        A run locked by a fenced transaction is skipped (``SKIP LOCKED``), not waited for:
        it stays held, since the lock itself keeps every backup out, and the other leases
        are renewed at once.
        """
        if not leases:
            return HeartbeatResult(await self.now_ms())
        rows = await self._adapter.all(self._sql.heartbeat, (
            [lease.job for lease in leases], [lease.slot for lease in leases],
            [lease.token for lease in leases], [lease.lease_ms for lease in leases],
        ))
        now, held, renewed = rows[0]
        return HeartbeatResult(int(now), frozenset(str(t) for t in held or ()),
                               frozenset(str(t) for t in renewed or ()))

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

    async def jobs(self) -> list[str]:
        """Return every job in ``<table>_jobs``, sorted."""
        return [str(row[0]) for row in await self._adapter.all(self._sql.list_jobs)]

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:
        """Return runs, newest slot first, with one plain ``SELECT``."""
        if limit < 0:
            raise ConfigurationError(f"limit={limit!r} must be 0 or more")
        rows = await self._adapter.all(self._sql.list_runs, (job, job, open_only, limit))
        return [
            RunInfo(str(j), int(slot), RunStatus(status), int(attempt),
                    None if instance is None else str(instance),
                    None if expires is None or status != "running" else int(expires))
            for j, slot, status, attempt, instance, expires in rows
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


async def migrate(connection: Any = None, *, table: str | None = None) -> str:
    """Create the four tables and the claim function (run with a privileged user).

    ``table`` defaults to the one a DSN names (``?table=``), else ``anarchon_runs``;
    returns the table's name.

    Afterwards the application's user needs only SELECT, INSERT, UPDATE and DELETE on the
    tables (EXECUTE on the function is granted to PUBLIC; it runs with the caller's
    rights). Adds the function to a store created before it existed. Safe to run again,
    and concurrently; a store of a newer format is refused.
    """
    backend = PostgresBackend(connection, table=table)
    await backend.start()
    await backend.close()
    return backend.table
