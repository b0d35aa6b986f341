"""Creating the PostgreSQL store, and upgrading an older one in place (``start()``,
:func:`~backends.postgres.migrate`).

:class:`StoreSchema` finds the store's tables, functions and versions, and creates or
upgrades what is missing or older, under an advisory lock and a lock timeout, with runs
in flight: see :meth:`StoreSchema.ensure`.
"""

from __future__ import annotations

import hashlib
import json
import logging

import anyio

from adapters.sql import Executor, SqlAdapter
from lease_core.errors import (
    BackendUnavailable,
    ConfigurationError,
    StoreFormatError,
    StoreNotFound,
)

from .statements import (
    BATCH_SUFFIX,
    BODY_MARKS,
    CLAIM_ARG_COUNT,
    CLAIM_SUFFIX,
    CODE_VERSION,
    FAILOVER_SUFFIX,
    FINISH_SUFFIX,
    FORMAT_VERSION,
    LEASE_SUFFIX,
    LOCK_NOT_AVAILABLE,
    OPEN_SUFFIX,
    OPERATE_SUFFIX,
    Statements,
    sqlstate,
)

__all__ = ["FILL_BATCHES", "MIGRATION_LOCK_TIMEOUT_MS", "StoreSchema"]

logger = logging.getLogger("anarchon")


def _lock_key(schema: str | None, name: str) -> int:
    """The advisory lock key of creating or upgrading the store ``schema.name``."""
    digest = hashlib.sha256(f"anarchon:{schema}.{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)

#: How long (ms) creation and upgrades wait for a table lock held by work in flight.
MIGRATION_LOCK_TIMEOUT_MS = 5000
_MIGRATE_TRIES = 5
#: How many attempts one statement of :meth:`StoreSchema.fill` updates.
_FILL_BATCH = 10_000
#: Batches of an upgrade's ``claimed_at`` fill made at each maintenance period, by the
#: instance that wins it: a store of a million attempts is filled in ten periods.
FILL_BATCHES = 10
#: The fill's mark in ``<table>_meta`` (key ``fill``), and where it has got to after it.
_FILL_MARK = "claimed_at"


#: Columns each table of a store has had since store code v1 (see queries.sql).
_STORE_COLUMNS = {"runs": ("job", "slot", "status", "attempt"),
                  "attempts": ("job", "slot", "attempt", "outcome"),
                  "jobs": ("job",), "meta": ("key", "value")}


class StoreSchema:
    """The tables and claim functions of one store (``table``), and their creation.

    ``schema`` and ``name`` are the validated parts of ``table``; ``sql`` its statements.
    """

    def __init__(self, sql: Statements, schema: str | None, name: str, table: str) -> None:
        self._sql = sql
        self._schema = schema
        self._name = name
        self.table = table
        #: Whether an upgrade left attempts without ``claimed_at`` (:meth:`fill`), as the
        #: last :meth:`ensure` or :meth:`fill` found.
        self.fill_pending = False
        #: The store code the store has after the last :meth:`ensure`: this release's, or
        #: a newer release's (its store used as it is).
        self.code = CODE_VERSION
        #: Whether the store was last opened by :meth:`check` (read as it is, perhaps of
        #: older store code), not by :meth:`ensure`: an operation then upgrades it first.
        self.read_as_is = False
        self._upgrading: anyio.Lock | None = None  # created on the event loop using it

    def _table_names(self) -> list[str]:
        return [self._name + suffix for suffix in ("", "_attempts", "_jobs", "_meta")]

    async def _existing(self, tx: Executor | SqlAdapter) -> tuple[set[str], bool, bool]:
        """The store's tables that exist, whether this release's functions all exist as
        this build makes them, and whether they all exist by name (a store of newer store
        code keeps them, as calls of its own functions)."""
        rows = await tx.all(self._sql.find_tables, {
            "tables": self._table_names(),
            "functions": [self._name + suffix
                          for suffix in (CLAIM_SUFFIX, BATCH_SUFFIX, FINISH_SUFFIX,
                                         OPERATE_SUFFIX, FAILOVER_SUFFIX, LEASE_SUFFIX)],
            "claim_args": CLAIM_ARG_COUNT, "open_index": self._name + OPEN_SUFFIX,
            "marked": [self._name + suffix for suffix in BODY_MARKS],
            "marks": list(BODY_MARKS.values()),
            "schema": self._schema, "name": self._name})
        schema = self._schema or (str(rows[0][0]) if rows else "")
        if schema.startswith("pg_temp"):
            raise ConfigurationError(
                f"table {self.table!r} would be in the session's temporary schema "
                f"({schema}), dropped at disconnect: qualify the table as 'schema.table' "
                "with a schema of its own, or take pg_temp out of the search_path")
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
        return set(rows[0][1]), bool(rows[0][2]), bool(rows[0][3])

    async def _refuse_foreign(self, tx: Executor, existing: set[str]) -> None:
        """Refuse a table of the store's names that is not anarchon's (an application's
        table given as ``table=``): the upgrade failed on it with the server's "column
        "status" does not exist", read as an unexpected error. Nothing was changed."""
        for role, suffix in (("runs", ""), ("attempts", "_attempts"), ("jobs", "_jobs"),
                             ("meta", "_meta")):
            if self._name + suffix not in existing:
                continue
            [(columns,)] = await tx.all(self._sql.table_columns, (self._sql.tables[role],))
            missing = [c for c in _STORE_COLUMNS[role] if c not in set(columns or ())]
            if missing:
                raise ConfigurationError(
                    f"table {self._sql.tables[role]} exists and is not an anarchon store's "
                    f"(it has no column {', '.join(missing)}); give the store a table name "
                    f"of its own (table=, --table or --namespace), not {self.table!r}: "
                    "nothing was changed")
        # The columns alone do not tell: an application's settings table <name>_meta
        # (key, value) has the store's. Every store has its format there since v1.
        if existing and (self._name + "_meta" not in existing
                         or not (await self._read_meta(tx))[0]):
            schema = f"{self._schema}." if self._schema else ""
            found = ", ".join(schema + name for name in sorted(existing))
            raise ConfigurationError(
                f"table{'s' if len(existing) > 1 else ''} {found} exist"
                f"{'' if len(existing) > 1 else 's'} but hold no anarchon store (no store "
                f"format in {self._sql.tables['meta']}); give the store a table name of its "
                f"own (table=, --table or --namespace), not {self.table!r}: nothing was "
                "changed")

    def _use_newer(self, code: int, named: bool) -> None:
        """Accept a store of store code ``code``, newer than this release's, as it is.

        Its functions belong to the newer release, which keeps the names this one calls
        (as calls of its own functions, as this release keeps the older names): they are
        never made again here, which would put this release's logic back under the newer
        instances. A store that no longer has them raises :class:`StoreFormatError`.
        """
        self.code = code
        if not named:
            raise StoreFormatError(
                f"table {self.table!r} has store code v{code}, newer than v{CODE_VERSION} "
                f"this anarchon knows, and no function {self._function_name()} any more; "
                "upgrade anarchon (nothing was changed)"
            )

    async def _read_meta(self, tx: Executor | SqlAdapter) -> tuple[bool, int, bool]:
        """Whether the store has a format, its store code version (1 before v2), and
        whether an upgrade left its attempts' ``claimed_at`` to fill (:meth:`fill`).

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
        return "format" in meta, code, meta.get("fill", "").startswith(_FILL_MARK)

    async def check(self, adapter: SqlAdapter, where: str) -> None:
        """Make sure a complete store exists, writing nothing (for read-only tools).

        Raises :class:`StoreNotFound` naming ``where`` and the table when the tables are
        missing (or their schema is), and :class:`StoreFormatError` when a newer anarchon
        wrote them. A store of older store code is read as it is: the code version concerns
        the claim and finish functions, which reads do not call, so ``anarchon status``
        works during a rolling upgrade, before ``anarchon migrate``.
        """
        try:
            tables, _, _ = await self._existing(adapter)
        except ConfigurationError:
            tables = set()
        complete = len(tables) == 4 and (await self._read_meta(adapter))[0]
        if not complete:
            raise StoreNotFound(
                f"no anarchon store at {where} (table {self.table!r}); check --url and "
                "--namespace, or create it with `anarchon migrate`, or by starting a scheduler"
            )
        self.read_as_is = True

    async def ensure(self, adapter: SqlAdapter) -> None:
        """Use the store as it is, or create or upgrade it (see :func:`migrate`).

        A user without the privileges to create or upgrade gets a one-line
        :class:`ConfigurationError` naming ``anarchon migrate``.
        """
        await self._ensure(adapter)
        # Only once done: an operation at once with the one upgrading must wait for it
        # (upgrade_read_as_is), not call the function the upgrade is about to make.
        self.read_as_is = False

    async def upgrade_read_as_is(self, adapter: SqlAdapter) -> None:
        """:meth:`ensure` a store opened by :meth:`check` (read as it is), once: the
        operations at once on one backend wait for the one upgrading, then go on with
        the store upgraded (or each try again after a failure)."""
        if self._upgrading is None:
            self._upgrading = anyio.Lock()
        async with self._upgrading:
            if self.read_as_is:
                await self.ensure(adapter)

    async def _ensure(self, adapter: SqlAdapter) -> None:
        tables, function, named = await self._existing(adapter)
        complete, code = False, 1
        if len(tables) == 4:
            complete, code, self.fill_pending = await self._read_meta(adapter)
            if complete and function and code >= CODE_VERSION:
                self.code = code
                return
            if complete and code > CODE_VERSION:
                self._use_newer(code, named)
                return
        try:
            await self._upgrade(adapter)
            self.fill_pending = (await self._read_meta(adapter))[2]
        except ConfigurationError as exc:
            if sqlstate(exc) != "42501" and not any(
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
            what = (f"the functions (such as {self._function_name()}) or the open runs' "
                    f"index of the anarchon tables for {self.table!r} are missing or from an "
                    "earlier build, and this user may not create them"
                    if len(tables) == 4 else
                    f"the anarchon tables for {self.table!r} are missing and this user may not "
                    "create them")
            schema = f"{self._schema}." if self._schema else ""
            raise ConfigurationError(
                f"{what}; {command}, then grant SELECT, INSERT, UPDATE, DELETE on "
                f"{', '.join(schema + name for name in self._table_names())} ({reason})"
            ) from exc

    async def fill(self, adapter: SqlAdapter, batches: int | None = None) -> bool:
        """Give the attempts an upgrade found ``claimed_at``; True once all have it.

        At most ``batches`` batches of ``_FILL_BATCH`` attempts (None: to the end), in
        primary-key order, each one short transaction locking only its rows, so claims
        and heartbeats go on meanwhile. Where it got to is kept in the upgrade's mark
        after each batch, so the next call (the next maintenance, on any instance) goes
        on from there, even after an error; at the end the mark goes. Two calls at once
        only repeat each other's work.
        """
        rows = await adapter.all(self._sql.fill_position)
        if not rows or not str(rows[0][0]).startswith(_FILL_MARK):
            self.fill_pending = False
            return True
        position = str(rows[0][0])[len(_FILL_MARK) + 1:]
        key = (tuple(json.loads(position)) if position
               else ("", -(2 ** 63), -(2 ** 31)))
        done = 0
        while batches is None or done < batches:
            found = await adapter.all(self._sql.fill_claimed_at, (*key, _FILL_BATCH))
            if not found or int(found[0][3]) < _FILL_BATCH:
                await adapter.all(self._sql.claimed_at_filled)
                self.fill_pending = False
                return True
            key, done = tuple(found[0][:3]), done + 1
            # after each batch: a fill cut short (an error, a cancel) keeps its batches
            await adapter.all(self._sql.fill_moved,
                              (f"{_FILL_MARK}:{json.dumps(list(key))}",))
        return False

    async def fill_some(self, adapter: SqlAdapter) -> None:
        """:meth:`fill` ``FILL_BATCHES`` batches, at the maintenance an instance won; a
        failure is logged, not raised: it must not keep the period's trimming from
        running (the next maintenance goes on from the last batch filled)."""
        try:
            await self.fill(adapter, FILL_BATCHES)
        except Exception as exc:
            logger.warning("the claimed_at fill of table %s stopped (%s); the next "
                           "maintenance goes on from where it got to", self.table, exc)

    async def _store_index(self, tx: Executor, index: str, table: str) -> bool:
        """Whether ``index`` exists and is an index of the store's ``table``."""
        [(found,)] = await tx.all(self._sql.is_store_index, (index, table))
        return bool(found)

    def _function_name(self) -> str:
        return (f"{self._schema}." if self._schema else "") + self._name + CLAIM_SUFFIX

    async def _upgrade(self, adapter: SqlAdapter) -> None:
        """Run :meth:`_create` in a transaction, again while a table lock timed out."""
        for attempt in range(_MIGRATE_TRIES):
            try:
                await adapter.run_transaction(self._create)
                return
            except Exception as exc:
                if sqlstate(exc) != LOCK_NOT_AVAILABLE:
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
        adds a nullable column (catalog only, v1 to v2), drops the attempts' index by finish
        time (v3 to v4), creates the new functions beside the old ones and points the old
        names at them, all in one commit.

        The lock's key names the table with its schema as the server resolves it, so
        ``t`` (through the search_path) and ``public.t`` share it. A table spelled without
        a schema takes the key of that spelling first, as releases before this one took
        it, so they wait for each other too during a rolling deploy (always in that
        order: two creations never wait for each other's keys in opposite orders).
        """
        [(_, resolved)] = await tx.all(
            self._sql.lock_creation, (_lock_key(self._schema, self._name), self._schema,
                                      self._name))
        if self._schema is None and resolved is not None:
            await tx.all(self._sql.lock_creation,
                         (_lock_key(str(resolved), self._name), None, self._name))
            # What it makes goes where find_tables found the store, not in the path's
            # first schema (a store in public under "$user", public).
            await tx.all(self._sql.resolved_schema_first, (str(resolved),))
        await tx.all(self._sql.bound_lock_waits, (str(MIGRATION_LOCK_TIMEOUT_MS),))
        existing, function, named = await self._existing(tx)
        await self._refuse_foreign(tx, existing)
        code = 0
        if self._name + "_meta" in existing:
            _, code, _ = await self._read_meta(tx)
        if code > CODE_VERSION and len(existing) == 4:
            # A newer release upgraded the store meanwhile: its functions stay as it made them.
            self._use_newer(code, named)
            return
        if len(existing) == 4 and function and code == CODE_VERSION:
            # Made or upgraded meanwhile (a migrate or a start this one waited for): used
            # as it is, as ensure() would have; making it again needs its owner's rights.
            return
        if len(existing) < 4:
            for statement in self._sql.ddl:
                await tx.all(statement)
        [(has_takeovers,)] = await tx.all(self._sql.has_takeovers, (self._sql.runs_table,))
        if not has_takeovers:
            await tx.all(self._sql.add_takeovers)
        # Operations: nullable columns (catalog only) and the generated claimed_at.
        [(has_operations,)] = await tx.all(self._sql.has_operations,
                                           (self._sql.attempts_table,))
        if not has_operations:
            for statement in (self._sql.add_operations_runs, self._sql.add_operations_jobs,
                              self._sql.add_operations_attempts):
                await tx.all(statement)
            if self._name + "_attempts" in existing:
                # The attempts already stored get claimed_at after the commit (fill).
                await tx.all(self._sql.mark_claimed_at_fill)
        else:
            [(generated,)] = await tx.all(self._sql.claimed_at_generated,
                                          (self._sql.attempts_table,))
            if generated:
                await tx.all(self._sql.drop_claimed_at_expression)
        # Retries within a run: the run row's retry counter (queries.sql, retry_later).
        [(has_retry_counter,)] = await tx.all(self._sql.has_retry_counter,
                                              (self._sql.runs_table,))
        if not has_retry_counter:
            await tx.all(self._sql.add_retry_counter)
        # SECURITY INVOKER: the caller's table privileges apply. EXECUTE is PUBLIC by
        # default; granted explicitly in case default privileges revoke it.
        if not function:
            # Failover (issue 21): the detection function the claims call, and the claim
            # functions of an unreleased store of this version (without the epoch) dropped first.
            await tx.all(self._sql.create_failover_function)
            await tx.all(self._sql.grant_failover)
            await tx.all(self._sql.record_timeline)
            await tx.all(self._sql.drop_claim_unfenced)
            await tx.all(self._sql.drop_batch_unfenced)
            await tx.all(self._sql.create_claim_function)
            await tx.all(self._sql.grant_claim)
            await tx.all(self._sql.create_batch_function)
            await tx.all(self._sql.grant_batch)
            await tx.all(self._sql.create_finish_function)
            await tx.all(self._sql.grant_finish)
            await tx.all(self._sql.create_operate_function)
            await tx.all(self._sql.grant_operate)
            # Named leases (lease_core.Lease): one function call per acquire/renew/release.
            await tx.all(self._sql.create_lease_function)
            await tx.all(self._sql.grant_lease)
        # The indexes older releases made go, only when they are the store's: an index
        # of that name on another table is an application's.
        if code < 4 and await self._store_index(tx, self._sql.finished_index,
                                                self._sql.attempts_table):
            # Ending an attempt then changes no indexed column (see finish_v4.sql).
            await tx.all(self._sql.drop_attempts_finished)
        # The open runs' index with 'retrying' (overlap skips behind a pending retry).
        await tx.all(self._sql.create_runs_open)
        if await self._store_index(tx, self._sql.open_index_old, self._sql.runs_table):
            await tx.all(self._sql.drop_runs_open_old)
        if code <= CODE_VERSION:
            # The names older releases call, as calls of this release's functions.
            for create, grant in ((self._sql.create_claim_v1, self._sql.grant_claim_v1),
                                  (self._sql.create_claim_v2, self._sql.grant_claim_v2),
                                  (self._sql.create_batch_v2, self._sql.grant_batch_v2),
                                  (self._sql.create_claim_v3, self._sql.grant_claim_v3),
                                  (self._sql.create_batch_v3, self._sql.grant_batch_v3)):
                await tx.all(create)
                await tx.all(grant)
        await tx.all(self._sql.write_format, (str(FORMAT_VERSION),))
        await tx.all(self._sql.write_code, (str(CODE_VERSION),))
