"""The PostgreSQL backend: runs, attempts, jobs and the format version in four tables.

Where the code lives, in this package: :mod:`~backends.postgres.backend` (the backend
object, its options and the contract's calls, and :func:`migrate`),
:mod:`~backends.postgres.statements` (the SQL filled with a store's names, the versions),
:mod:`~backends.postgres.schema` (creating and upgrading the store) and
:mod:`~backends.postgres.fenced` (fenced transactions). Every public name is imported
from here.

Where the SQL lives: ``backends/postgres_sql/``. ``queries.sql`` holds every statement
under a ``-- name: <name>`` header, loaded once through :mod:`importlib.resources`; the
claim function has its own file, ``claim_v<N>.sql``, and its version in its name
(``<table>_claim_v<N>``, ``N`` being :data:`CODE_VERSION`, the one place the version is
written: the SQL files call it ``{claim}``), as has the finish function
(``finish_v<N>.sql``, ``<table>_end_v<N>``, from store code v4); the names of older
versions are redefined as calls of the current ones (``claim_v1.sql``, ``claim_v2.sql``,
``batch_v2.sql``, ``claim_v3.sql``, ``batch_v3.sql``). The store records
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
4. the run is read, and an open one locked ``FOR UPDATE SKIP LOCKED``: a run locked by a
   fenced transaction (or a write in flight) is answered ``running`` at once, never waited
   for, so a frozen ``ctx.transaction()`` blocks no other claim of its job; otherwise the
   run is inserted, skipped, taken over or escalated with its attempt rows
   (``max_attempts`` counts the first attempt and the takeovers, kept in
   ``runs.takeovers``, never hand-overs);
5. the job row gets a new version only when ``last_slot`` grows or an attempt is written
   (taking the next ``seq``, the order trimming keeps).

A claim trims no history (store code v2 did): :meth:`PostgresBackend.prune`, which the
scheduler's ticker calls for every job, deletes old attempts and finished runs in
bounded batches, off the claim path, keeping a workflow run's steps until it has ended
(the workflow's steps read from ``<table>_meta``, each attempt checked through the
primary keys of its steps' runs and attempts at its slot). These are statements sent
by the client (``trim_job``, ``trim_jobs``), not store code: a store of any build of code
v4 trims so.

The function is created with the tables (``start()`` by a privileged user, or
``anarchon migrate``), under the same advisory lock; it is ``SECURITY INVOKER``, so the
application's user needs only EXECUTE (granted to PUBLIC) and its table privileges.

Every other call is one statement too: heartbeats and hand-overs of many leases, a finish
(a call of ``<table>_end_v<N>``, whose plans PL/pgSQL caches per connection, where a
statement would be planned on every call), a batched check. All lease arithmetic uses
the server's ``clock_timestamp()``; times are stored as ``bigint`` epoch milliseconds.
Nothing keeps session state (only transaction-scoped advisory locks and settings), so
PgBouncer in transaction mode works.
The SQL keeps to PostgreSQL 9.5 syntax; PostgreSQL 15, 16 and 18 are tested.

Table names are validated, then quoted by :func:`quote_ident`, the one quoting helper;
statements are templates filled only with quoted identifiers by ``str.format``.
"""

from __future__ import annotations

from lease_core._packages import require_own

require_own("adapters")  # before importing from it: a foreign one may shadow it

from .backend import PostgresBackend, driver_dsn
from .fenced import FencedTransaction
from .schema import MIGRATION_LOCK_TIMEOUT_MS, StoreSchema
from .statements import (
    BATCH_FUNCTION,
    BATCH_FUNCTION_V2,
    BATCH_SUFFIX,
    CLAIM_ARG_TYPES,
    CLAIM_ARG_TYPES_V2,
    CLAIM_ARGS,
    CLAIM_ARGS_V2,
    CLAIM_FUNCTION,
    CLAIM_FUNCTION_V1,
    CLAIM_FUNCTION_V2,
    CLAIM_SUFFIX,
    CODE_VERSION,
    DDL,
    FINISH_FUNCTION,
    FINISH_SUFFIX,
    FORMAT_VERSION,
    NOW,
    QUERIES,
    TRIM_BATCH,
    Statements,
    parse_queries,
    quote_ident,
)
from .upgrade import migrate

__all__ = [
    "BATCH_FUNCTION",
    "BATCH_FUNCTION_V2",
    "BATCH_SUFFIX",
    "CLAIM_ARGS",
    "CLAIM_ARGS_V2",
    "CLAIM_ARG_TYPES",
    "CLAIM_ARG_TYPES_V2",
    "CLAIM_FUNCTION",
    "CLAIM_FUNCTION_V1",
    "CLAIM_FUNCTION_V2",
    "CLAIM_SUFFIX",
    "CODE_VERSION",
    "DDL",
    "FINISH_FUNCTION",
    "FINISH_SUFFIX",
    "FORMAT_VERSION",
    "MIGRATION_LOCK_TIMEOUT_MS",
    "NOW",
    "QUERIES",
    "TRIM_BATCH",
    "FencedTransaction",
    "PostgresBackend",
    "Statements",
    "StoreSchema",
    "driver_dsn",
    "migrate",
    "parse_queries",
    "quote_ident",
]
