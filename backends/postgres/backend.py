"""The PostgreSQL backend object: :class:`PostgresBackend` and :func:`migrate`.

Its options and connection, and the contract of :mod:`lease_core.abc`, each call one
statement of :class:`~backends.postgres.statements.Statements`; creating and upgrading
the store is :class:`~backends.postgres.schema.StoreSchema`'s, fenced transactions
:mod:`backends.postgres.fenced`'s. See :mod:`backends.postgres` for the whole design.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import sniffio

from adapters._pg8000_params import PG8000_PARAMS, refuse_multi_host
from adapters.sql import Row, SqlAdapter, TransientError, adapter_for
from lease_core._durations import parse_duration
from lease_core._redact import redact
from lease_core._registry import check_url, merge_options, positive_whole, split_url_options
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
    MEMBER_RETENTION_MS,
    check_every,
    check_leave,
    check_limit,
    check_members,
    check_prune,
    decode_checkpoint,
    encode_checkpoint,
    finish_status,
)
from lease_core.errors import ConfigurationError

from .fenced import FencedTransaction, fenced_transaction
from .leases import PostgresNamedLeases
from .operations import StoreOperations
from .retries import StoreRetries
from .schema import StoreSchema
from .statements import (
    LOCK_NOT_AVAILABLE,
    Statements,
    bool_array,
    int_array,
    split_table,
    sqlstate,
    text_array,
)

__all__ = ["PostgresBackend", "driver_dsn"]

#: OFFSET for "keep every attempt" (a NULL offset would keep none), and the cap of every
#: limit (trims, history, runs): beyond any history, within a bigint (2**63 was refused).
_NO_LIMIT = 2**62
_CLAIM_RETRIES = 5


def _trim_limits(keep: int | None, older_than_ms: int | None, batch: int) -> dict[str, Any]:
    """The trim statements' limits: one beyond any history means the same at _NO_LIMIT,
    within a bigint (a larger one failed: bigint out of range)."""
    return {"keep": _NO_LIMIT if keep is None else min(keep, _NO_LIMIT),
            "older_than_ms": None if older_than_ms is None else min(older_than_ms, _NO_LIMIT),
            "batch": min(batch, _NO_LIMIT)}


def _claim_result(req: ClaimRequest, row: Sequence[Any]) -> ClaimResult:
    """A claim function's row (status, now, attempt, reason, expires, run status,
    instance, epoch) as the :class:`ClaimResult` of ``req``; no run status during a
    quarantine after a detected failover (see ``postgres_sql/failover_v4.sql``)."""
    status, now, attempt, reason, expires, run_status, instance, epoch = row
    return ClaimResult(
        ClaimStatus(status), req.job, req.slot, int(now), int(attempt),
        None if reason is None else Reason(reason),
        None if expires is None else int(expires),
        None if run_status is None else RunStatus(run_status),
        None if instance is None else str(instance), int(epoch or 0),
    )


def _count(name: str, value: object) -> int:
    try:
        number = int(str(value)) if isinstance(value, str) else value
    except ValueError:
        number = None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ConfigurationError(f"{name}={value!r} must be a whole number, at least 1")
    return number


def _seconds(name: str, value: object) -> float:
    if not isinstance(value, str):
        return parse_duration(value, what=name)
    try:  # text, as a URL's query gives it: a plain number is seconds there
        number = float(value)
    except ValueError:
        number = None
    if number is not None and number == number:  # (not NaN)
        return parse_duration(number, what=name)
    try:
        return parse_duration(value, what=name)
    except ConfigurationError:
        raise ConfigurationError(
            f"{name}={value!r} must be a duration such as 30s, 500ms or 1m, or a number of "
            "seconds (?timeout=30s)") from None


#: Options of the pool the backend opens from a DSN, and how their values are read.
_POOL_OPTIONS: dict[str, Callable[[str, object], Any]] = {
    "min_size": _count, "max_size": _count, "timeout": _seconds,
}
#: Query parameters the backend takes out of a URL (the others go to the driver).
_URL_OPTIONS = ("table", "namespace", *_POOL_OPTIONS)
#: Every keyword option the backend accepts.
_OPTIONS = (*_URL_OPTIONS, "driver")
#: The connection parameters of libpq (PostgreSQL 17's list), which a URL's query and a
#: key/value DSN may also carry; the driver reads them.
_LIBPQ = (
    "service", "user", "password", "passfile", "channel_binding", "connect_timeout",
    "dbname", "host", "hostaddr", "port", "client_encoding", "options", "application_name",
    "fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval",
    "keepalives_count", "tcp_user_timeout", "sslmode", "sslnegotiation", "sslcompression",
    "sslcert", "sslkey", "sslcertmode", "sslpassword", "sslrootcert", "sslcrl", "sslcrldir",
    "sslsni", "requirepeer", "require_auth", "min_protocol_version", "max_protocol_version",
    "ssl_min_protocol_version", "ssl_max_protocol_version", "gssencmode", "krbsrvname",
    "gsslib", "gssdelegation", "replication", "target_session_attrs", "load_balance_hosts",
)


def _split_url(url: str, schemes: Sequence[str]) -> tuple[str, dict[str, str]]:
    """Check a URL or DSN; return it without the backend's options, and those options."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else None
    if scheme is not None and scheme not in (*schemes, "postgres+psycopg", "postgres+pg8000"):
        raise ConfigurationError(
            f"{redact(url)!r} is not a PostgreSQL URL; use "
            "postgresql://user@host:5432/db (the password, if any, after the user) or a "
            "key/value DSN"
        )
    if scheme is not None:  # a scheme is case-insensitive (RFC 3986); libpq reads it lower
        url = scheme + url[len(scheme):]
    driver: tuple[str, ...] = _LIBPQ
    if scheme is not None and scheme.endswith("+pg8000"):
        refuse_multi_host(url)
        driver = tuple(PG8000_PARAMS)  # pg8000 understands fewer parameters than libpq
    check_url("PostgreSQL", url, _URL_OPTIONS, driver,  # gaps20: one wording of bad values
              read={"min_size": positive_whole, "max_size": positive_whole})
    return split_url_options(url, _URL_OPTIONS)


def _pool_options(merged: dict[str, Any]) -> dict[str, Any]:
    """The backend's keyword options with the pool's read and checked."""
    options = {k: _POOL_OPTIONS[k](k, v) if k in _POOL_OPTIONS else v
               for k, v in merged.items()}
    low, high = options.get("min_size", 1), options.get("max_size", 4)
    if low > high:
        raise ConfigurationError(
            f"min_size={low} is more than max_size={high}"
            + ("" if "max_size" in options else " (its default)")
            + "; the pool keeps min_size connections open and opens up to max_size"
        )
    return options


def driver_dsn(url: str) -> str:
    """``url`` (a PostgreSQL URL or key/value DSN this backend accepts) as psycopg and
    libpq read it: anarchon's own parameters (``table``, ``min_size``...) taken out, and a
    driver-qualified scheme (``postgresql+pg8000://``) made plain ``postgresql://``."""
    plain, _ = _split_url(url, PostgresBackend.schemes)
    return re.sub(r"^postgres(?:ql)?\+\w+://", "postgresql://", plain)


def _check_loop(adapter: SqlAdapter) -> None:
    """Refuse an adapter whose driver does not work under the running event loop (psycopg's
    async pool under trio), naming what does."""
    running = sniffio.current_async_library()
    if running not in adapter.anyio_backends:
        raise ConfigurationError(
            f"this PostgreSQL connection ({type(adapter).__name__}) works under "
            f"{' and '.join(adapter.anyio_backends)} only, and this code runs under "
            f"{running}: use a postgresql+pg8000:// URL (or driver='pg8000'), or a sync "
            "psycopg pool or connection, which work under both"
        )


class PostgresBackend(StoreRetries, PostgresNamedLeases, StoreOperations):
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
            connection, from_url = _split_url(connection, self.schemes)
        keywords = {"table": table, "namespace": namespace, **options}
        merged = merge_options("PostgresBackend", keywords, from_url, _OPTIONS)
        names = [merged.pop(k) for k in ("table", "namespace") if merged.get(k) is not None]
        if len(names) > 1 and names[0] != names[1]:
            raise ConfigurationError(
                f"PostgresBackend got table={names[0]!r} and namespace={names[1]!r}; "
                "give one of them"
            )
        options = _pool_options(merged)
        self.table = names[0] if names else "anarchon_runs"
        self._schema, self._name = split_table(self.table)
        self._sql = Statements(self._schema, self._name)
        self._store = StoreSchema(self._sql, self._schema, self._name, self.table)
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
        await self._open_with(self._store.ensure)

    async def _open_existing(self) -> None:
        """Open a store that must exist: SELECTs only, :class:`StoreNotFound` if absent."""
        where = (redact(self._connection) if isinstance(self._connection, str)
                 else "the given connection")
        await self._open_with(lambda adapter: self._store.check(adapter, where))

    async def _open_with(self, prepare: Callable[[SqlAdapter], Awaitable[None]]) -> None:
        adapter = self._given or adapter_for(self._connection, **self._options)
        _check_loop(adapter)
        await adapter.open()
        try:
            await prepare(adapter)
        except BaseException:
            if adapter.owned:
                await adapter.close()
            raise
        self._adapter_now = adapter

    async def _close(self) -> None:
        adapter, self._adapter_now = self._adapter_now, self._given
        if adapter is not None and adapter.owned:
            await adapter.close()

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
                  Reason(req.reason).value, bool(req.overlap_skip), req.max_attempts,
                  bool(req.scheduled))
        try:
            [row] = await self._all_retrying(self._sql.claim, params)
        except Exception as exc:
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            # The server gave up a lock wait (lock_timeout in the claim function): the
            # statement rolled back, nothing was written. Not retried here, so the whole
            # claim stays within the half lease a scheduler waits for it.
            raise TransientError(
                f"claim of {req.job!r} slot {req.slot} waited too long for a lock on the "
                "server and wrote nothing; retry later"
            ) from exc
        return _claim_result(req, row)

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
            text_array([r.job for r in reqs]), int_array([r.slot for r in reqs]),
            text_array([r.instance_id for r in reqs]), text_array([r.token for r in reqs]),
            int_array([r.lease_ms for r in reqs]),
            text_array([Reason(r.reason).value for r in reqs]),
            bool_array([bool(r.overlap_skip) for r in reqs]),
            int_array([r.max_attempts for r in reqs]),
            bool_array([bool(r.scheduled) for r in reqs]),
        )
        try:
            rows = await self._all_retrying(self._sql.claim_many, params)
        except Exception as exc:
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            return [await self.claim(r) for r in requests]
        results: list[ClaimResult | None] = [None] * len(requests)
        for index, *row in rows:
            results[order[int(index) - 1]] = _claim_result(reqs[int(index) - 1], row)
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
            text_array([lease.job for lease in leases]),
            int_array([lease.slot for lease in leases]),
            text_array([lease.token for lease in leases]),
            int_array([lease.lease_ms for lease in leases]),
        ))
        now, held, renewed, cancelled, graces = rows[0]
        return HeartbeatResult(int(now), frozenset(str(t) for t in held or ()),
                               frozenset(str(t) for t in renewed or ()),
                               {str(t): int(g) for t, g in zip(cancelled or (), graces or (),
                                                               strict=True)})

    async def _finish_one(self, lease: Lease, status: RunStatus, error: str | None) -> bool:
        """End the attempt in one fenced ``UPDATE`` (the attempt row in the same statement)."""
        rows = await self._adapter.all(self._sql.finish, (
            lease.job, lease.slot, lease.token, status.value, error))
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
                text_array([items[i][0].job for i in sent]),
                int_array([items[i][0].slot for i in sent]),
                text_array([items[i][0].token for i in sent]),
                text_array([statuses[i].value for i in sent]),
                text_array([items[i][2] for i in sent]),
            ))
            ended = {str(row[0]) for row in rows}
        return [first[lease.token] == i and lease.token in ended
                for i, (lease, _, _) in enumerate(items)]

    async def hand_over(self, leases: Sequence[Lease]) -> frozenset[str]:
        """Release the runs in one fenced ``UPDATE``; return the tokens released."""
        if not leases:
            return frozenset()
        rows = await self._adapter.all(self._sql.hand_over, (
            text_array([lease.job for lease in leases]),
            int_array([lease.slot for lease in leases]),
            text_array([lease.token for lease in leases]),
        ))
        return frozenset(str(row[0]) for row in rows)

    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        """Read the watched runs with one plain ``SELECT``.

        During the quarantine after a detected failover, or after a promotion no claim
        has detected yet (the store last wrote on another timeline), a missing run is
        reported lost (``CheckResult.lost``), not deleted: the scheduler claims it again.
        """
        rows = await self._adapter.all(self._sql.check, (
            text_array([job for job, _ in runs]), int_array([slot for _, slot in runs]),
        ))
        now, quiet, moved = int(rows[0][0]), rows[0][-2], rows[0][-1]
        found: dict[tuple[str, int], RunState] = {}
        for _, job, slot, status, attempt, expires, instance, _, _ in rows:
            if job is None:
                continue
            key = (str(job), int(slot))
            found[key] = RunState(key[0], key[1], RunStatus(status), int(attempt),
                                  None if expires is None else int(expires),
                                  None if instance is None else str(instance))
        quarantined = quiet is not None and now < int(quiet)
        lost = (frozenset((job, int(slot)) for job, slot in runs) - found.keys()
                if quarantined or moved else frozenset())
        return CheckResult(now, found, lost)

    async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return at most ``limit`` attempts, newest claim first."""
        check_limit(limit)  # a negative LIMIT is the server's error, not a ConfigurationError
        if job is None:
            rows = await self._adapter.all(self._sql.history_all, (min(limit, _NO_LIMIT),))
        else:
            rows = await self._adapter.all(self._sql.history_of_job, (job, min(limit, _NO_LIMIT)))
        return [
            Attempt(str(j), int(slot), int(attempt), str(instance), Reason(reason),
                    ms_to_datetime(int(claimed)),
                    None if finished is None else ms_to_datetime(int(finished)),
                    None if outcome is None else Outcome(outcome),
                    None if error is None else str(error), None if by is None else str(by))
            for j, slot, attempt, instance, reason, claimed, finished, outcome, error, by in rows
        ]

    async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                         older_than_ms: int | None = None,
                         batch: int = 1000) -> dict[str, int]:
        """Trim the jobs' histories with one statement (each job as :meth:`prune`); one
        job (and so :meth:`~lease_core.abc.Backend.prune`) through the one-job statement."""
        check_prune(keep, older_than_ms, batch)
        names = list(dict.fromkeys(jobs))
        if not names:
            return {}
        limits = _trim_limits(keep, older_than_ms, batch)
        if len(names) == 1:
            (job,) = names
            rows = await self._adapter.all(self._sql.trim_job, {"job": job, **limits})
            return {job: int(rows[0][0])}
        rows = await self._adapter.all(self._sql.trim_jobs, {"jobs": names, **limits})
        counts = {str(job): int(count) for job, count in rows}
        return {job: counts.get(job, 0) for job in names}

    async def maintenance_due(self, instance_id: str, every_ms: int) -> bool:
        """Win the maintenance period with one conditional upsert of ``<table>_meta``; the
        winner goes on with an upgrade's ``claimed_at`` fill (``StoreSchema.fill_some``)."""
        check_every(every_ms)
        rows = await self._adapter.all(self._sql.maintenance_due,
                                       (min(every_ms, _NO_LIMIT), instance_id))
        if rows and self._store.fill_pending:
            await self._store.fill_some(self._adapter)
        return bool(rows)

    async def members(self, instance_id: str, ttl_ms: int) -> list[str]:
        """Renew the membership and list the live members: one statement on ``<table>_meta``."""
        check_members(instance_id, ttl_ms)
        rows = await self._adapter.all(self._sql.members, {
            "instance": instance_id, "ttl_ms": ttl_ms, "keep_ms": MEMBER_RETENTION_MS})
        return sorted(str(row[0]) for row in rows)

    async def leave(self, instance_id: str) -> None:
        """End the membership now: one ``DELETE`` of its row of ``<table>_meta``."""
        check_leave(instance_id)
        await self._adapter.all(self._sql.leave, (instance_id,))

    async def jobs(self) -> list[str]:
        """Return every job in ``<table>_jobs``, sorted."""
        return [str(row[0]) for row in await self._adapter.all(self._sql.list_jobs)]

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:
        """Return runs, newest slot first, with one plain ``SELECT``."""
        check_limit(limit)
        rows = await self._adapter.all(self._sql.list_runs, {
            "job": job, "open_only": open_only, "limit": min(limit, _NO_LIMIT)})
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
        async with fenced_transaction(self._adapter, self._sql, lease, complete) as tx:
            yield tx
