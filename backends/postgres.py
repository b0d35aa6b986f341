"""The PostgreSQL backend: runs, attempts, jobs and the format version in four tables.

Where the SQL lives: ``backends/postgres_sql/``. ``queries.sql`` holds every statement
under a ``-- name: <name>`` header, loaded once through :mod:`importlib.resources`; the
claim function has its own file, ``claim_v<N>.sql``, and its version in its name
(``<table>_claim_v<N>``, ``N`` being :data:`CODE_VERSION`, the one place the version is
written: the SQL files call it ``{claim}``); the names of older versions are redefined
as calls of it (``claim_v1.sql``, ``claim_v2.sql``, ``batch_v2.sql``). The store records
its code version in ``<table>_meta`` (``code``). ``start()`` finds an older store and
upgrades it in place when its user may (as it creates a missing store), or refuses it
with a one-line error naming ``anarchon migrate``; :func:`migrate` is that upgrade, with
runs in flight.

Where a claim happens: :meth:`PostgresBackend.claim` is **one statement**, a call of the
PL/pgSQL function ``<table>_claim_v<N>`` in autocommit, so it takes one round trip on every
adapter; :meth:`PostgresBackend.claim_many` is one statement too, a call of
``<table>_batch_v<N>``, which runs ``<table>_claim_v<N>`` for each claim in order, in
one transaction (``postgres_sql/batch_v<N>.sql``). The claim function runs the claim of
``lease_core.abc`` in the statement's own transaction:

1. a run that is finished, or held by a live lease, is reported from a plain read, with
   no lock and no write (backups standing by write nothing);
2. otherwise every later lock wait is bounded on the server (``lock_timeout``, an eighth
   of the lease, at most 4 s), so a claim its client gave up on never takes effect;
3. the job's row in ``<table>_jobs`` is locked (``SELECT … FOR UPDATE``, inserted when
   missing); the lock serialises the claims of one job, and since each statement of a
   VOLATILE function in READ COMMITTED takes a new snapshot, the second claimer always
   sees the winner's run;
4. the run is read ``FOR UPDATE SKIP LOCKED``: a run locked by a fenced transaction (or a
   write in flight) is answered ``running`` at once, never waited for, so a frozen
   ``ctx.transaction()`` blocks no other claim of its job; otherwise the run is inserted,
   skipped, taken over or escalated with its attempt rows (``max_attempts`` counts the
   first attempt and the takeovers, kept in ``runs.takeovers``, never hand-overs);
5. the job row gets a new version only when ``last_slot`` grows or an attempt is written
   (taking the next ``seq``, the order trimming keeps).

A claim trims no history (store code v2 did): :meth:`PostgresBackend.prune`, which the
scheduler's ticker calls for every job, deletes old attempts and finished runs in
bounded batches, off the claim path.

The function is created with the tables (``start()`` by a privileged user, or
``anarchon migrate``), under the same advisory lock; it is ``SECURITY INVOKER``, so the
application's user needs only EXECUTE (granted to PUBLIC) and its table privileges.

Every other call is one statement too: heartbeats and hand-overs of many leases, a finish,
a batched check. All lease arithmetic uses the server's ``clock_timestamp()``; times are
stored as ``bigint`` epoch milliseconds. Nothing keeps session state (only
transaction-scoped advisory locks and settings), so PgBouncer in transaction mode works.
The SQL keeps to PostgreSQL 9.5 syntax; PostgreSQL 15, 16 and 18 are tested.

Table names are validated, then quoted by :func:`quote_ident`, the one quoting helper;
statements are templates filled only with quoted identifiers by ``str.format``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
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
from lease_core.abc import (
    Backend,
    check_every,
    check_prune,
    decode_checkpoint,
    encode_checkpoint,
    finish_status,
)
from lease_core.errors import (
    BackendUnavailable,
    ConfigurationError,
    LeaseLost,
    StoreFormatError,
)

__all__ = [
    "CODE_VERSION",
    "FORMAT_VERSION",
    "TRIM_BATCH",
    "FencedTransaction",
    "PostgresBackend",
    "Statements",
    "migrate",
    "quote_ident",
]

#: The store format this code writes (the tables' layout, which an older release can still
#: use); a store with a newer one is refused.
FORMAT_VERSION = 1
#: The store code version: the claim function ``<table>_claim_v<N>`` of this release and
#: the columns it keeps. ``start()`` upgrades an older store (privileged user) or refuses
#: it with an error naming ``anarchon migrate``.
CODE_VERSION = 3
#: The suffixes of this release's claim functions, ``<table>_claim_v<CODE_VERSION>`` and
#: ``<table>_batch_v<CODE_VERSION>``: the only place their version is written (the SQL
#: files name them ``{claim}`` and ``{batch}``).
CLAIM_SUFFIX = f"_claim_v{CODE_VERSION}"
BATCH_SUFFIX = f"_batch_v{CODE_VERSION}"
#: OFFSET for "keep every attempt" (a NULL offset would keep none).
_NO_LIMIT = 2**62
#: The trim batch older releases pass to the claim function (the current one ignores it).
TRIM_BATCH = 100
#: How long (ms) creation and upgrades wait for a table lock held by work in flight.
MIGRATION_LOCK_TIMEOUT_MS = 5000
_CLAIM_RETRIES = 5
_MIGRATE_TRIES = 5
#: SQLSTATE of a lock wait that ran out (``lock_timeout``) or a NOWAIT lock refused.
_LOCK_NOT_AVAILABLE = "55P03"

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Suffixes of the names derived from ``table`` (tables, indexes, claim functions).
_SUFFIXES = ("", "_attempts", "_jobs", "_meta", "_open", "_a_seq", "_a_claimed", "_a_job",
             "_a_fin", "_claim", "_claim_v2", "_batch_v2", CLAIM_SUFFIX, BATCH_SUFFIX)

NOW = "(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)"

#: The claim function's parameters, in order (also its signature for GRANT).
CLAIM_ARGS = ("p_job text, p_slot bigint, p_instance text, p_token text, p_lease_ms bigint, "
              "p_reason text, p_overlap_skip boolean, p_max_attempts bigint")
CLAIM_ARG_TYPES = "text, bigint, text, text, bigint, text, boolean, bigint"
#: The parameters of the store code v1 and v2 claim functions (which also took the
#: history to keep and trimmed it); their names now call the current function.
CLAIM_ARGS_V2 = (CLAIM_ARGS + ", p_history_size bigint, p_history_ttl_ms bigint, "
                 "p_trim_batch bigint")
#: Their argument types (for GRANT).
CLAIM_ARG_TYPES_V2 = CLAIM_ARG_TYPES + ", bigint, bigint, bigint"

# --- the SQL files ----------------------------------------------------------------------

_SQL_PACKAGE = "postgres_sql"
_HEADER = re.compile(r"^-- name: ([a-z0-9_]+)[ \t]*$", re.MULTILINE)


def _sql_file(name: str) -> str:
    """The text of one file of ``backends/postgres_sql/`` (shipped in the wheel)."""
    return (importlib.resources.files("backends") / _SQL_PACKAGE / name).read_text("utf-8")


def parse_queries(text: str) -> dict[str, str]:
    """Split ``-- name: <name>`` sections into statements, dropping whole-line comments."""
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"statement {name!r} is defined twice")
        kept = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        queries[name] = "\n".join(kept).strip()
    return queries


#: Every statement of ``postgres_sql/queries.sql``, by name, as templates.
QUERIES = parse_queries(_sql_file("queries.sql"))
#: The claim function of this release (``postgres_sql/claim_v<CODE_VERSION>.sql``), as a
#: template.
CLAIM_FUNCTION = _sql_file(f"claim_v{CODE_VERSION}.sql")
#: The batched claim function of this release (``postgres_sql/batch_v<CODE_VERSION>.sql``),
#: as a template.
BATCH_FUNCTION = _sql_file(f"batch_v{CODE_VERSION}.sql")
#: The v1 name of the claim function, redefined as a call of the current one.
CLAIM_FUNCTION_V1 = _sql_file("claim_v1.sql")
#: The v2 name of the claim function, redefined as a call of the current one.
CLAIM_FUNCTION_V2 = _sql_file("claim_v2.sql")
#: The v2 name of the batched claim function, redefined as a call of the current one.
BATCH_FUNCTION_V2 = _sql_file("batch_v2.sql")
#: The tables and indexes, in creation order.
DDL = tuple(QUERIES[name] for name in (
    "create_meta", "create_jobs", "create_runs", "create_runs_open", "create_attempts",
    "create_attempts_seq", "create_attempts_claimed", "create_attempts_job",
    "create_attempts_finished"))

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


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error (psycopg or pg8000), or of the error that caused it."""
    seen: BaseException | None = exc
    while seen is not None:
        state = getattr(seen, "sqlstate", None)
        if isinstance(state, str):
            return state
        args = getattr(seen, "args", ())
        if args and isinstance(args[0], dict) and isinstance(args[0].get("C"), str):
            return str(args[0]["C"])
        seen = seen.__cause__
    return None


class Statements:
    """The SQL this backend sends, filled with one store's quoted table names.

    Public for tools that run the very same statements through a raw driver (the
    benchmarks compare the library with that); the statements' text is not a stable API.
    Every statement of ``postgres_sql/queries.sql`` is an attribute of the same name.
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
            "claim_v1": prefix + quote_ident(name + "_claim"),
            "claim_v2": prefix + quote_ident(name + "_claim_v2"),
            "batch_v2": prefix + quote_ident(name + "_batch_v2"),
            "claim": prefix + quote_ident(name + CLAIM_SUFFIX),
            "batch": prefix + quote_ident(name + BATCH_SUFFIX),
            "claim_args": CLAIM_ARGS,
            "claim_arg_types": CLAIM_ARG_TYPES,
            "claim_args_v2": CLAIM_ARGS_V2,
            "claim_arg_types_v2": CLAIM_ARG_TYPES_V2,
            "now": NOW,
        }

        def fill(template: str) -> str:
            return template.format(**names).strip()

        for key, template in QUERIES.items():
            setattr(self, key, fill(template))
        self.ddl = tuple(fill(statement) for statement in DDL)
        self.create_claim_function = fill(CLAIM_FUNCTION)
        self.create_batch_function = fill(BATCH_FUNCTION)
        self.create_claim_v1 = fill(CLAIM_FUNCTION_V1)
        self.create_claim_v2 = fill(CLAIM_FUNCTION_V2)
        self.create_batch_v2 = fill(BATCH_FUNCTION_V2)
        self.runs_table = names["runs"]

    def __getattr__(self, name: str) -> str:
        """Typed access to the statements set from ``queries.sql`` (unknown: AttributeError)."""
        raise AttributeError(f"no statement named {name!r} in postgres_sql/queries.sql")


@dataclass
class FencedTransaction:
    """The handle of :meth:`PostgresBackend.transaction`: write your effects through it.

    Placeholders are ``%s`` with positional parameters, whatever the driver.
    """

    _tx: Executor
    _lease: Lease | None = None
    _checkpoint_sql: str = ""

    async def set_checkpoint(self, value: Any) -> None:
        """Store the run's checkpoint inside this transaction: it commits with the effects.

        Raises :class:`LeaseLost` if the token no longer holds the run (it cannot, while
        the transaction holds the run's lock).
        """
        if self._lease is None:
            raise ConfigurationError("this transaction belongs to no run; it has no checkpoint")
        rows = await self._tx.all(self._checkpoint_sql, (
            encode_checkpoint(value), self._lease.job, self._lease.slot, self._lease.token))
        if not rows:  # pragma: no cover - the run's row is locked by this transaction
            raise LeaseLost(f"run {self._lease.job!r} slot {self._lease.slot} was lost")

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
        """The store's tables that exist, and whether this release's claim functions exist."""
        rows = await tx.all(self._sql.find_tables, (
            self._table_names(), [self._name + CLAIM_SUFFIX, self._name + BATCH_SUFFIX],
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

    async def _read_meta(self, tx: Executor | SqlAdapter) -> tuple[bool, int]:
        """Whether the store has a format, and its store code version (1 before v2).

        Raises :class:`StoreFormatError` for a format newer than this release's.
        """
        meta = {str(key): str(value) for key, value in await tx.all(self._sql.read_meta)}
        if "format" in meta:
            try:
                found = int(meta["format"])
            except ValueError:
                found = FORMAT_VERSION + 1
            if found > FORMAT_VERSION:
                raise StoreFormatError(
                    f"table {self.table!r} was written by store format {meta['format']!r}, "
                    f"newer than format {FORMAT_VERSION} this anarchon understands; upgrade "
                    "anarchon"
                )
        try:
            code = int(meta.get("code", "1"))
        except ValueError:
            code = 1
        return "format" in meta, code

    async def _ensure_tables(self, adapter: SqlAdapter) -> None:
        """Use the store as it is, or create or upgrade it (see :func:`migrate`).

        A user without the privileges to create or upgrade gets a one-line
        :class:`ConfigurationError` naming ``anarchon migrate``.
        """
        tables, function = await self._existing(adapter)
        complete, code = False, 1
        if len(tables) == 4:
            complete, code = await self._read_meta(adapter)
            if complete and function and code >= CODE_VERSION:
                return
        try:
            await self._upgrade(adapter)
        except ConfigurationError as exc:
            if _sqlstate(exc) != "42501" and not any(
                    text in str(exc) for text in ("permission denied", "must be owner", "42501")):
                raise
            command = (f"run `anarchon migrate --url <privileged URL> --table {self.table}` "
                       "once with a privileged user")
            reason = str(exc).strip().splitlines()[0]
            if complete and code < CODE_VERSION:
                raise ConfigurationError(
                    f"the anarchon store for table {self.table!r} has store code v{code}, "
                    f"older than v{CODE_VERSION} this anarchon needs, and this user may not "
                    f"upgrade it; {command} ({reason})"
                ) from exc
            what = (f"the claim function {self._function_name()} of the anarchon tables for "
                    f"{self.table!r} is missing and this user may not create it"
                    if len(tables) == 4 else
                    f"the anarchon tables for {self.table!r} are missing and this user may not "
                    "create them")
            raise ConfigurationError(
                f"{what}; {command}, then grant SELECT, INSERT, UPDATE, DELETE on "
                f"{', '.join(self._table_names())} ({reason})"
            ) from exc

    def _function_name(self) -> str:
        return (f"{self._schema}." if self._schema else "") + self._name + CLAIM_SUFFIX

    async def _upgrade(self, adapter: SqlAdapter) -> None:
        """Run :meth:`_create` in a transaction, again while a table lock timed out."""
        for attempt in range(_MIGRATE_TRIES):
            try:
                await adapter.run_transaction(self._create)
                return
            except Exception as exc:
                if _sqlstate(exc) != _LOCK_NOT_AVAILABLE:
                    raise
                if attempt == _MIGRATE_TRIES - 1:
                    raise BackendUnavailable(
                        f"could not create or upgrade the anarchon store for table "
                        f"{self.table!r}: transactions in flight held its tables for over "
                        f"{MIGRATION_LOCK_TIMEOUT_MS} ms {_MIGRATE_TRIES} times (a long "
                        "ctx.transaction()?); run `anarchon migrate` again"
                    ) from exc

    async def _create(self, tx: Executor) -> None:
        """Create the store, or upgrade it to store code ``CODE_VERSION``, in place.

        Under a transaction-scoped advisory lock (concurrent starts and migrates wait for
        each other) and a lock timeout (a lock held by work in flight fails this try
        instead of stalling every claim behind it). Runs in flight are kept: the upgrade
        adds a nullable column (catalog only), creates the new claim functions beside the
        old ones and points the old names at them, all in one commit.
        """
        key = int.from_bytes(
            hashlib.sha256(f"anarchon:{self._schema}.{self._name}".encode()).digest()[:8],
            "big", signed=True,
        )
        await tx.all(self._sql.lock_creation, (key,))
        await tx.all(self._sql.bound_lock_waits, (str(MIGRATION_LOCK_TIMEOUT_MS),))
        existing, function = await self._existing(tx)
        code = 0
        if self._name + "_meta" in existing:
            _, code = await self._read_meta(tx)
        if len(existing) < 4:
            for statement in self._sql.ddl:
                await tx.all(statement)
        [(has_takeovers,)] = await tx.all(self._sql.has_takeovers, (self._sql.runs_table,))
        if not has_takeovers:
            await tx.all(self._sql.add_takeovers)
        # SECURITY INVOKER: the caller's table privileges apply. EXECUTE is PUBLIC by
        # default; granted explicitly in case default privileges revoke it.
        if not function:
            await tx.all(self._sql.create_claim_function)
            await tx.all(self._sql.grant_claim)
            await tx.all(self._sql.create_batch_function)
            await tx.all(self._sql.grant_batch)
        if code <= CODE_VERSION:
            # The names older releases call, as calls of this release's functions.
            for create, grant in ((self._sql.create_claim_v1, self._sql.grant_claim_v1),
                                  (self._sql.create_claim_v2, self._sql.grant_claim_v2),
                                  (self._sql.create_batch_v2, self._sql.grant_batch_v2)):
                await tx.all(create)
                await tx.all(grant)
        await tx.all(self._sql.write_format, (str(FORMAT_VERSION),))
        await tx.all(self._sql.write_code, (str(CODE_VERSION),))

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

    async def _claim_one(self, request: ClaimRequest) -> ClaimResult:
        """Win, take over or inspect the run with one statement (see the module docs)."""
        req = request
        params = (req.job, req.slot, req.instance_id, req.token, req.lease_ms,
                  Reason(req.reason).value, bool(req.overlap_skip), req.max_attempts)
        try:
            [(status, now, attempt, reason, expires, run_status, instance)] = (
                await self._all_retrying(self._sql.claim, params))
        except Exception as exc:
            if _sqlstate(exc) != _LOCK_NOT_AVAILABLE:
                raise
            # The server gave up a lock wait (lock_timeout in the claim function): the
            # statement rolled back, nothing was written. Not retried here, so the whole
            # claim stays within the half lease a scheduler waits for it.
            raise TransientError(
                f"claim of {req.job!r} slot {req.slot} waited too long for a lock on the "
                "server and wrote nothing; retry later"
            ) from exc
        return ClaimResult(
            ClaimStatus(status), req.job, req.slot, int(now), int(attempt),
            None if reason is None else Reason(reason),
            None if expires is None else int(expires), RunStatus(run_status),
            None if instance is None else str(instance),
        )

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        """Make the claims with one statement, a call of ``<table>_batch_v<N>``.

        The claims run in order within one transaction, each as :meth:`claim` would run
        it; they are sent sorted by job (keeping the order of each job's claims) so that
        concurrent batches lock job rows in one order. When a lock wait runs out the
        statement writes nothing and the claims are made one at a time instead. A batch
        of one (and so :meth:`~lease_core.abc.Backend.claim`, inherited) is one call of
        the claim function itself, ``<table>_claim_v<N>``.
        """
        if not requests:
            return []
        if len(requests) == 1:
            return [await self._claim_one(requests[0])]
        order = sorted(range(len(requests)), key=lambda i: requests[i].job)
        reqs = [requests[i] for i in order]
        params = (
            [r.job for r in reqs], [int(r.slot) for r in reqs], [r.instance_id for r in reqs],
            [r.token for r in reqs], [int(r.lease_ms) for r in reqs],
            [Reason(r.reason).value for r in reqs], [bool(r.overlap_skip) for r in reqs],
            [r.max_attempts for r in reqs],
        )
        try:
            rows = await self._all_retrying(self._sql.claim_many, params)
        except Exception as exc:
            if _sqlstate(exc) != _LOCK_NOT_AVAILABLE:
                raise
            return [await self.claim(r) for r in requests]
        results: list[ClaimResult | None] = [None] * len(requests)
        for index, status, now, attempt, reason, expires, run_status, instance in rows:
            req = reqs[int(index) - 1]
            results[order[int(index) - 1]] = ClaimResult(
                ClaimStatus(status), req.job, req.slot, int(now), int(attempt),
                None if reason is None else Reason(reason),
                None if expires is None else int(expires), RunStatus(run_status),
                None if instance is None else str(instance),
            )
        if any(r is None for r in results):
            raise AssertionError("the batched claim answered fewer rows than claims")
        return [r for r in results if r is not None]

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        """Renew every lease in one ``UPDATE … FROM unnest(…)`` statement.

        A run locked by a fenced transaction is skipped (``SKIP LOCKED``), not waited for:
        it stays held, since the lock itself keeps every backup out, and the other leases
        are renewed at once.
        """
        if not leases:
            return HeartbeatResult(await self.now_ms())
        # On the adapter's reserved connection: renewals never queue behind claims and
        # fenced transactions for the pool's connections.
        rows = await self._adapter.all_reserved(self._sql.heartbeat, (
            [lease.job for lease in leases], [lease.slot for lease in leases],
            [lease.token for lease in leases], [lease.lease_ms for lease in leases],
        ))
        now, held, renewed = rows[0]
        return HeartbeatResult(int(now), frozenset(str(t) for t in held or ()),
                               frozenset(str(t) for t in renewed or ()))

    async def _finish_one(self, lease: Lease, status: RunStatus, error: str | None) -> bool:
        """End the attempt in one fenced ``UPDATE`` (the attempt row in the same statement)."""
        rows = await self._adapter.all(self._sql.finish, {
            "outcome": status.value, "job": lease.job, "slot": lease.slot,
            "token": lease.token, "error": error,
        })
        return bool(rows and int(rows[0][0]))

    async def finish_many(
        self, items: Sequence[tuple[Lease, Outcome, str | None]]
    ) -> list[bool]:
        """End the attempts in one fenced ``UPDATE`` of the runs and their attempt rows.

        A token given twice is sent once: its first item ends the attempt, the others
        answer False, as they would one after the other. A single attempt to end (and so
        :meth:`~lease_core.abc.Backend.finish`, inherited) goes through the one-run
        statement, whose plan is cheaper.
        """
        statuses = [finish_status(outcome) for _, outcome, _ in items]
        first: dict[str, int] = {}
        for i, (lease, _, _) in enumerate(items):
            first.setdefault(lease.token, i)
        sent = sorted(first.values(), key=lambda i: (items[i][0].job, items[i][0].slot))
        if not sent:
            return []
        if len(sent) == 1:
            (i,) = sent
            ended = ({items[i][0].token}
                     if await self._finish_one(items[i][0], statuses[i], items[i][2])
                     else set())
        else:
            rows = await self._all_retrying(self._sql.finish_many, (
                [items[i][0].job for i in sent], [items[i][0].slot for i in sent],
                [items[i][0].token for i in sent], [statuses[i].value for i in sent],
                [items[i][2] for i in sent],
            ))
            ended = {str(row[0]) for row in rows}
        return [first[lease.token] == i and lease.token in ended
                for i, (lease, _, _) in enumerate(items)]

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

    async def register_workflows(self, workflows: Mapping[str, Sequence[str]]) -> None:
        """Record each workflow's steps in ``<table>_meta`` (one statement; rewrites only
        what changed)."""
        if not workflows:
            return
        names = sorted(workflows)
        await self._adapter.all(self._sql.write_workflows, (
            names, [json.dumps(list(workflows[name])) for name in names]))

    async def workflows(self) -> dict[str, list[str]]:
        """Return every recorded workflow's steps, in order."""
        rows = await self._adapter.all(self._sql.read_workflows)
        return {str(name): [str(s) for s in json.loads(value)] for name, value in rows}

    async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                         older_than_ms: int | None = None,
                         batch: int = 1000) -> dict[str, int]:
        """Trim the jobs' histories with one statement (each job as :meth:`prune`).

        One job (and so :meth:`~lease_core.abc.Backend.prune`, inherited) goes through
        the one-job statement.
        """
        check_prune(keep, older_than_ms, batch)
        names = list(dict.fromkeys(jobs))
        if not names:
            return {}
        if len(names) == 1:
            (job,) = names
            rows = await self._adapter.all(self._sql.trim_job, {
                "job": job, "keep": _NO_LIMIT if keep is None else keep,
                "older_than_ms": older_than_ms, "batch": batch})
            return {job: int(rows[0][0])}
        rows = await self._adapter.all(self._sql.trim_jobs, {
            "jobs": names, "keep": _NO_LIMIT if keep is None else keep,
            "older_than_ms": older_than_ms, "batch": batch})
        counts = {str(job): int(count) for job, count in rows}
        return {job: counts.get(job, 0) for job in names}

    async def maintenance_due(self, instance_id: str, every_ms: int) -> bool:
        """Win the maintenance period with one conditional upsert of ``<table>_meta``."""
        check_every(every_ms)
        rows = await self._adapter.all(self._sql.maintenance_due, (every_ms, instance_id))
        return bool(rows)

    async def jobs(self) -> list[str]:
        """Return every job in ``<table>_jobs``, sorted."""
        return [str(row[0]) for row in await self._adapter.all(self._sql.list_jobs)]

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:
        """Return runs, newest slot first, with one plain ``SELECT``."""
        if limit < 0:
            raise ConfigurationError(f"limit={limit!r} must be 0 or more")
        rows = await self._adapter.all(self._sql.list_runs, {
            "job": job, "open_only": open_only, "limit": limit})
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

    def transaction(self, lease: Lease, *, complete: bool = True) -> Any:
        """Open a fenced transaction that completes the run when it commits.

        It first locks the run row where ``lease.token`` still holds it (``running``),
        raising :class:`LeaseLost` otherwise; the block writes its effects through
        :meth:`FencedTransaction.execute`; on a normal exit the run and its attempt are
        marked ``completed`` in the same commit. An exception rolls everything back.
        With ``complete=False`` the run is not completed: the effects (and a checkpoint
        written through :meth:`FencedTransaction.set_checkpoint`) commit, fenced, and the
        run goes on; one batch of a long run per transaction, say. While the transaction
        is open its lease is not renewed (the lock keeps backups out): keep each one
        shorter than the lease.

        A backend built on one connection refuses it (:class:`ConfigurationError`): the
        heartbeats of the instance's other runs would wait behind the transaction.
        """
        return self._fenced(lease, complete)

    @asynccontextmanager
    async def _fenced(self, lease: Lease, complete: bool) -> AsyncIterator[FencedTransaction]:
        if not self._adapter.concurrent:
            raise ConfigurationError(
                "ctx.transaction() needs a PostgresBackend built on a pool or a DSN: on one "
                "connection, the instance's heartbeats wait for the transaction to end, so "
                "its other runs could be taken over; pass a DSN or a psycopg pool"
            )
        async with self._adapter.transaction() as tx:
            held = await tx.all(self._sql.lock_held_run, (lease.job, lease.slot, lease.token))
            if not held:
                raise LeaseLost(
                    f"run {lease.job!r} slot {lease.slot} is no longer held by token "
                    f"{lease.token!r}; the fenced transaction did not start"
                )
            yield FencedTransaction(tx, lease, self._sql.set_checkpoint)
            if not complete:
                return
            done = await tx.all(self._sql.finish, {
                "outcome": Outcome.COMPLETED.value, "job": lease.job, "slot": lease.slot,
                "token": lease.token, "error": None,
            })
            if not (done and int(done[0][0])):  # pragma: no cover - the row is locked
                raise LeaseLost(f"run {lease.job!r} slot {lease.slot} was lost mid-transaction")


async def migrate(connection: Any = None, *, table: str | None = None) -> str:
    """Create the store, or upgrade it in place to store code ``CODE_VERSION``.

    ``table`` defaults to the one a DSN names (``?table=``), else ``anarchon_runs``;
    returns the table's name.

    Run it with a privileged user (owner of the tables). Afterwards the application's user
    needs only SELECT, INSERT, UPDATE and DELETE on the tables (EXECUTE on the claim
    functions is granted to PUBLIC; they run with the caller's rights).

    An older store is upgraded with runs in flight: held leases, hand-overs and history
    are kept, the claim function of this release is created beside the old one, and the
    old function's name becomes a call of the new one, so instances of the previous
    release still running claim with the current logic. A table lock held by a long
    transaction is waited for at most ``MIGRATION_LOCK_TIMEOUT_MS`` per try. Safe to run
    again, and concurrently; a store of a newer format is refused.
    """
    backend = PostgresBackend(connection, table=table)
    await backend.start()
    await backend.close()
    return backend.table
