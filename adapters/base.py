"""The protocol every SQL connection adapter implements, and what the drivers share.

:class:`~backends.postgres.PostgresBackend` talks to PostgreSQL only through an
:class:`SqlAdapter`. SQL text uses ``%s`` placeholders with positional parameters, or
``%(name)s`` placeholders with a mapping (a statement that uses a value more than once
names it, so the value is passed once), and ``%%`` for a literal percent sign, whatever
the driver and whether parameters are given or not (a ``%`` that starts neither is
refused); see :mod:`adapters._placeholders` for how each driver gets them.

The driver modules (:mod:`adapters.psycopg`, :mod:`adapters.pg8000`,
:mod:`adapters.custom`) build on this module only; :mod:`adapters.sql` re-exports it and
holds the factory that picks a driver, :func:`~adapters.sql.adapter_for`.
"""

from __future__ import annotations

import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar
from urllib.parse import unquote, urlsplit

import anyio
import anyio.to_thread

from lease_core._per_loop import PerLoop
from lease_core._redact import redact
from lease_core.errors import BackendUnavailable, ConfigurationError

__all__ = [
    "CANCEL_GRACE_S",
    "CONFIG_STATES",
    "GAVE_UP_STATES",
    "LIMIT_CLASS",
    "READ_ONLY_STATE",
    "ConnectionLock",
    "Executor",
    "Params",
    "PerLoop",
    "Row",
    "Slots",
    "SqlAdapter",
    "TransientError",
    "WorkerThreads",
    "conninfo_params",
    "dsn_query",
    "gave_up",
    "in_users_transaction",
    "over_limit",
    "pooler_hint",
    "read_only",
    "redact",
    "refused",
    "refuses_writes",
    "settle_scope",
]

T = TypeVar("T")
Row = tuple[Any, ...]
#: A statement's parameters: a sequence for ``%s`` placeholders, a mapping for
#: ``%(name)s`` ones.
Params = Sequence[Any] | Mapping[str, Any]

#: Seconds a driver call may still take after its caller's deadline (or cancellation)
#: before the adapter gives the call up and closes its connection. (Read here by
#: :func:`settle_scope`; ``adapters.sql.CANCEL_GRACE_S`` is a copy of its value.)
CANCEL_GRACE_S = 5.0


def settle_scope(grace: float | None = None) -> anyio.CancelScope:
    """A shielded cancel scope for one driver call, ending ``grace`` s after the caller's.

    Inside it the call is not interrupted when its caller is cancelled; it is only when
    the caller's effective deadline (now, if the caller is already cancelled; never, if
    it has none) plus ``grace`` (default :data:`CANCEL_GRACE_S`) passes. Interrupting a
    call mid-statement costs its connection, so adapters let a cancelled caller wait for
    the answer instead.
    """
    if grace is None:
        grace = CANCEL_GRACE_S
    deadline = anyio.current_effective_deadline()
    if math.isinf(deadline) and deadline > 0:
        return anyio.CancelScope(shield=True)
    return anyio.CancelScope(shield=True, deadline=max(deadline, anyio.current_time()) + grace)


def pooler_hint(message: str) -> str:
    """What to do about a connection error whose ``message`` came from PgBouncer ('' if none).

    PgBouncer answers every query with "server login has been failing, try again later
    (server_login_retry)" for ``server_login_retry`` seconds after its login to the
    database failed, which happens at each database restart (its first reconnect reaches
    a server still shutting down or starting up): the database is unreachable through it
    for that long, however soon it is back. In ``pool_mode = statement`` it refuses every
    transaction (and closes the connection).
    """
    if "statement pooling mode" in message:
        return ("; PgBouncer's pool_mode = statement refuses transactions, which anarchon "
                "needs (start(), migrations and fenced transactions run in one): use "
                "pool_mode = transaction (or session) for this database")
    if "server_login_retry" not in message:
        return ""
    return ("; PgBouncer refuses every query for server_login_retry seconds after a login "
            "to the database failed, as at each database restart: lower server_login_retry "
            "in pgbouncer.ini below your shortest lease and job interval (the default is "
            "15 in PgBouncer 1.18; fractions such as 0.2 work)")


#: SQLSTATEs of a statement the server gave up on a timeout of its own: 57014
#: (``statement_timeout``, or a cancel request) and 55P03 (``lock_timeout``, ``NOWAIT``).
#: The connection is fine; both drivers raise :class:`BackendUnavailable` saying so.
GAVE_UP_STATES = frozenset({"57014", "55P03"})
#: SQLSTATE read_only_sql_transaction: a write sent to a server that takes none now.
READ_ONLY_STATE = "25006"


def refuses_writes(state: str, text: str) -> bool:
    """Whether an error (SQLSTATE ``state``, message ``text``) says the server takes no
    writes now: ``25006`` (read_only_sql_transaction), or ``55000`` "recovery is in
    progress", which a hot standby answers to the WAL functions the store's claims and
    named leases call (``pg_current_wal_lsn()``, failover detection) before any write."""
    return state == READ_ONLY_STATE or (state == "55000"
                                        and "recovery is in progress" in text)


#: SQLSTATEs the store's statements are refused with as a configuration error
#: (:class:`~lease_core.errors.StoreRefused`): no privilege, no such table, schema,
#: database or function, a table that exists already.
CONFIG_STATES = frozenset({"42501", "42P01", "3F000", "3D000", "42P07", "42883"})


def refused(at: str, text: str, state: str) -> str:
    """The message of a statement refused with one of :data:`CONFIG_STATES`: a missing
    table or function says what else than a missing store it may be."""
    hint = ""
    if state in ("42P01", "42883"):
        hint = ("; if the store's tables and functions exist (`anarchon migrate` makes "
                "them), this connection's search_path does not reach them: behind a "
                "PgBouncer other applications share, one's SET search_path reaches the "
                "next client of its server connection; give the table with its schema "
                "(table=public.anarchon_runs)")
    return f"PostgreSQL refused the statement{at}: {text}{hint}"


#: SQLSTATE class 54, program_limit_exceeded: a statement over one of the server's fixed
#: limits (54000 an index row or a value too large, 54001 too complex or nested too
#: deeply, 54011 too many columns, 54023 too many arguments). Sent again it fails again:
#: both drivers raise :class:`~lease_core.errors.ConfigurationError` (:func:`over_limit`),
#: never :class:`~lease_core.errors.BackendUnavailable` (psycopg files the class under
#: ``OperationalError``, which read as "cannot reach PostgreSQL", retried as an outage).
LIMIT_CLASS = "54"


def over_limit(at: str, text: str, state: str) -> ConfigurationError:
    """The error of a statement refused with a SQLSTATE of :data:`LIMIT_CLASS`."""
    return ConfigurationError(
        f"PostgreSQL refused the statement{at} as over one of its limits (SQLSTATE "
        f"{state}, program_limit_exceeded): {text}; sent again it would fail again, so it "
        "is not retried: make the value smaller or flatter (a checkpoint, a step's result), "
        "or the statement simpler (a fenced transaction's own SQL)")


def in_users_transaction(driver: str) -> ConfigurationError:
    """The error for a connection passed in that the application left in a transaction.

    Run in it, the store's statements would be seen by no other instance until the
    application commits (a claim's row locks held as long), and undone by its rollback;
    the store's own ``COMMIT`` would commit the application's work.
    """
    return ConfigurationError(
        f"the {driver} connection passed to the backend is in a transaction the application "
        "opened (autocommit is off and a statement of its own ran without a commit): the "
        "backend's statements would run inside it, seen by no other instance until it "
        "commits and undone by its rollback; commit or roll it back first, open the "
        "connection in autocommit mode, or give the backend a connection (or a pool) of "
        "its own")


def read_only(at: str, text: str) -> str:
    """The message of a write a server in read-only mode refused (``at``: where)."""
    return (f"PostgreSQL takes no writes now{at}: {text} (a standby, or "
            "default_transaction_read_only is on; point the URL at the primary: after a "
            "failover, point PgBouncer at the promoted server, or list every host with "
            "target_session_attrs=read-write)")


#: SQLSTATE statement_completion_unknown: the server cannot say whether the statement
#: (a commit) took effect, as some PostgreSQL-compatible servers answer an ambiguous
#: commit. A lost answer, as a dropped connection's: :class:`BackendUnavailable`, so the
#: engine reads back what the store has.
UNKNOWN_COMPLETION_STATE = "40003"


def unknown_completion(at: str, text: str) -> str:
    """The message of an error of :data:`UNKNOWN_COMPLETION_STATE`."""
    return (f"PostgreSQL{at} could not say whether the statement completed: {text}; "
            "treated as a lost answer")


def gave_up(at: str, text: str) -> str:
    """The message of an error of :data:`GAVE_UP_STATES` (``at``: `` at host:port``)."""
    return (f"PostgreSQL{at} gave the statement up: {text} (a statement_timeout or "
            "lock_timeout ran out, or it was cancelled); the connection is kept")


class TransientError(BackendUnavailable):
    """Raised when PostgreSQL aborted a transaction (deadlock, serialization); retry it."""

    changed_nothing = True


class Executor(Protocol):
    """What runs statements inside one transaction."""

    @property
    def connection(self) -> Any:
        """The raw driver connection the transaction runs on."""

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Execute ``sql`` and return its rows (an empty list when it returns none)."""


def _sized(limiters: PerLoop[anyio.CapacityLimiter],
           size: Callable[[], int]) -> anyio.CapacityLimiter:
    """The running loop's limiter of ``limiters``, given ``size()`` tokens if it changed."""
    limiter = limiters.get()
    tokens = size()
    if limiter.total_tokens != tokens:
        limiter.total_tokens = tokens
    return limiter


class WorkerThreads:
    """The worker threads of one blocking driver (pg8000, sync psycopg, sync redis-py): a
    limiter of its own, ``tokens`` calls at a time, instead of anyio's default one.

    The application shares the default limiter (40 threads; a web framework's sync
    endpoints and the application's own ``anyio.to_thread`` calls take from it): 40 slow
    calls there would otherwise queue the store's heartbeats behind them until the
    leases lapse. One limiter per running event loop (:class:`PerLoop`), as anyio's
    default limiter is.
    """

    __slots__ = ("_limiters", "_tokens")

    def __init__(self, tokens: int | Callable[[], int]) -> None:
        if isinstance(tokens, int) and tokens < 1:
            raise ValueError(f"a driver needs at least one worker thread, not {tokens}")
        count: Callable[[], int] = tokens if callable(tokens) else (lambda: tokens)
        self._tokens = count
        self._limiters = PerLoop(lambda: anyio.CapacityLimiter(count()))

    def limiter(self) -> anyio.CapacityLimiter:
        """The limiter of the running event loop, with as many tokens as ``tokens`` says
        now (a callable is read again at each call: a resized pool is followed)."""
        return _sized(self._limiters, self._tokens)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread taken from this driver's own limiter."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter())


class Slots:
    """At most ``size()`` holders at a time on each running event loop, each waiting
    ``wait`` seconds at most: a pool's connection slots, or a user's pool's checkouts.

    ``size`` is read again at every :meth:`held`, so a pool resized after the adapter was
    made (psycopg's ``pool.resize()``) is followed. Holders are not tasks (anyio's
    limiters refuse a task holding two tokens, and a statement may run inside a
    transaction of the same adapter, in the same task).
    """

    __slots__ = ("_limiters", "_size")

    def __init__(self, size: Callable[[], int]) -> None:
        self._size = size
        self._limiters = PerLoop(lambda: anyio.CapacityLimiter(size()))

    def held(self, wait: float | None,
             timed_out: Callable[[], BaseException]) -> AbstractAsyncContextManager[None]:
        """Hold a slot; raise ``timed_out()`` when none is free within ``wait`` seconds."""
        return _Slot(_sized(self._limiters, self._size), wait, timed_out)


class _Slot:
    """One hold of :class:`Slots` (a class: on every statement; a free slot is taken
    without a yield, as the statement yields anyway)."""

    __slots__ = ("_limiter", "_timed_out", "_wait")

    def __init__(self, limiter: anyio.CapacityLimiter, wait: float | None,
                 timed_out: Callable[[], BaseException]) -> None:
        self._limiter = limiter
        self._wait = wait
        self._timed_out = timed_out

    async def __aenter__(self) -> None:
        try:
            self._limiter.acquire_on_behalf_of_nowait(self)
            return
        except anyio.WouldBlock:
            pass
        with anyio.move_on_after(self._wait) as waiting:
            await self._limiter.acquire_on_behalf_of(self)
        if waiting.cancelled_caught:
            raise self._timed_out()

    async def __aexit__(self, *exc: object) -> None:
        self._limiter.release_on_behalf_of(self)


class ConnectionLock:
    """The lock that queues an adapter's calls on its one connection.

    One anyio lock per running event loop (:class:`PerLoop`), so the adapter works under
    asyncio, then under trio. Two loops at once (two threads) would interleave their
    statements on the connection: a call from a loop while another loop's calls are in
    flight raises ``RuntimeError`` instead.
    """

    __slots__ = ("_active", "_guard", "_in_flight", "_locks", "_what")

    def __init__(self, what: str) -> None:
        self._what = what
        # Taken without a yield when free (the statement yields anyway): one event loop
        # pass less per statement.
        self._locks = PerLoop(lambda: anyio.Lock(fast_acquire=True))
        self._guard = threading.Lock()
        self._active: anyio.Lock | None = None
        self._in_flight = 0

    def held(self) -> AbstractAsyncContextManager[None]:
        """Hold the connection for one statement or transaction."""
        return _Held(self)

    def _enter(self, lock: anyio.Lock) -> None:
        with self._guard:
            if self._in_flight and self._active is not lock:
                raise RuntimeError(
                    f"{self._what} is in use by another event loop (thread): a connection "
                    "serves one running event loop at a time; give each thread's loop a "
                    "connection of its own, or pass a pool"
                )
            self._active = lock
            self._in_flight += 1

    def _leave(self) -> None:
        with self._guard:
            self._in_flight -= 1


class _Held:
    """One hold of a :class:`ConnectionLock` (a class: on every statement)."""

    __slots__ = ("_lock", "_owner")

    def __init__(self, owner: ConnectionLock) -> None:
        self._owner = owner
        self._lock = owner._locks.get()

    async def __aenter__(self) -> None:
        self._owner._enter(self._lock)
        try:
            await self._lock.acquire()
        except BaseException:
            self._owner._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
        self._owner._leave()


class SqlAdapter(ABC):
    """One way of reaching PostgreSQL: runs single statements and transactions.

    ``owned`` says whether the adapter opened its connections itself (then :meth:`close`
    closes them) or was given them by the user (then it never closes them).
    """

    #: Event loops this adapter works on.
    anyio_backends: tuple[str, ...] = ("asyncio",)
    #: Whether a statement can run while a transaction is open (False for one connection,
    #: where the statement waits for the transaction to end).
    concurrent: bool = True

    def __init__(self, *, owned: bool) -> None:
        self.owned = owned

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Prepare the adapter (open the pool it owns)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Close what the adapter opened itself; user-provided resources stay open."""

    @abstractmethod
    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement in its own transaction and return its rows."""

    async def all_reserved(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement on a connection kept for it, never queued behind other work.

        Heartbeats use it, so that renewals do not wait for a pooled connection while
        claims and fenced transactions hold them all. Adapters that open their own pool
        keep one extra connection for it; the others run it as :meth:`all`.
        """
        return await self.all(sql, params)

    @abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[Executor]:
        """Open a transaction: committed when the block ends, rolled back on an exception."""

    def discarding_transaction(self, reset: str) -> AbstractAsyncContextManager[Executor]:
        """As :meth:`transaction`, but on an exception ``reset`` runs before the rollback,
        and the connection is closed instead (the server then rolls back) when it cannot
        run, so nothing of its session outlives the block.

        For a block that may leave session state a rollback keeps (a session advisory lock,
        a ``PREPARE``): ``reset`` clears it (its effects on those are not transactional).
        An aborted transaction (a statement of the block failed) runs no statement, so its
        connection is closed: its server session ends, and through PgBouncer in
        transaction mode so does the server connection (one left in a transaction is not
        reused); a reset sent after the rollback could reach another server connection.
        Adapters that own their pool override this; the others (a pool or connection
        passed in, not theirs to close) roll back as :meth:`transaction`.
        """
        return self.transaction()

    async def run_transaction(self, fn: Callable[[Executor], Awaitable[T]]) -> T:
        """Run ``await fn(tx)`` inside one transaction and return its result."""
        async with self.transaction() as tx:
            return await fn(tx)


def conninfo_params(dsn: str | None) -> dict[str, Any]:
    """Split a ``postgresql://`` URL into host, port, user, password and database.

    Missing parts come from ``PGHOST``, ``PGPORT``, ``PGUSER``, ``PGPASSWORD`` and
    ``PGDATABASE``, then from ``localhost``, ``5432``, the OS user and ``postgres``.
    """
    host = port = user = password = database = None
    if dsn:
        try:
            parts = urlsplit(dsn)
            port = parts.port
        except ValueError as exc:
            raise ConfigurationError(f"invalid PostgreSQL URL {redact(dsn)!r}: {exc}") from None
        if parts.scheme.split("+")[0] not in ("postgresql", "postgres"):
            raise ConfigurationError(
                f"invalid PostgreSQL URL {redact(dsn)!r}: expected postgresql://user:pass@host/db"
            )
        host = unquote(parts.hostname) if parts.hostname else None
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else None
        database = unquote(parts.path.lstrip("/")) or None
    env = os.environ
    return {
        "host": host or env.get("PGHOST") or "localhost",
        "port": int(port or env.get("PGPORT") or 5432),
        "user": user or env.get("PGUSER") or _os_user(),
        "password": password if password is not None else env.get("PGPASSWORD"),
        "database": database or env.get("PGDATABASE") or "postgres",
    }


def dsn_query(dsn: str) -> dict[str, str]:
    """Return the query parameters of a ``postgresql://`` URL, percent-decoded.

    A parameter given twice keeps its last value, as in libpq; ``+`` stays a plus sign.
    """
    params: dict[str, str] = {}
    for pair in urlsplit(dsn).query.split("&"):
        if not pair:
            continue
        name, sep, value = pair.partition("=")
        if not sep:
            raise ConfigurationError(
                f"invalid parameter {unquote(name)!r} in the PostgreSQL URL {redact(dsn)!r}: "
                "write it as name=value"
            )
        params[unquote(name)] = unquote(value)
    return params


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # pragma: no cover - no user name at all
        return "postgres"
