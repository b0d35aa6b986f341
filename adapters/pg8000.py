"""pg8000 adapters: a user's connection (any pg8000 API), or a small pool from a DSN.

pg8000 is blocking, so every call runs in an anyio worker thread; that works under asyncio
and trio. Statements use pg8000's unnamed prepared statements (``execute_unnamed``), which
PgBouncer in transaction mode accepts, and run on the connection's core protocol, so the
DB-API ``autocommit`` setting of a user's connection does not matter.

A transaction's ``COMMIT`` runs shielded once its block has ended (the commit is reported
as done; a cancellation pending then comes at the caller's next checkpoint), and its
``ROLLBACK`` whenever the block raised or was cancelled (a fenced transaction's
session is reset first, or its connection closed when aborted, see
:meth:`SqlAdapter.discarding_transaction
<adapters.base.SqlAdapter.discarding_transaction>`). The pool lends no connection
left in a transaction: one found so as it is given back is closed. A statement whose
placeholders do not match its parameters raises
:class:`~lease_core.errors.ConfigurationError` before a connection is taken.

A ``postgresql+pg8000://`` URL may carry the query parameters in :data:`PG8000_PARAMS`
(``?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem``); any other parameter raises
:class:`~lease_core.errors.ConfigurationError`. ``sslmode`` follows libpq:

- ``disable``: no TLS;
- ``prefer`` (the default): TLS when the server offers it, without verification;
- ``require``: TLS or no connection, without verification (with ``sslrootcert``, the chain
  is verified as for ``verify-ca``, like libpq);
- ``verify-ca``: TLS with the server's chain verified against ``sslrootcert`` (the system's
  trusted CAs when absent or ``system``), whatever the host name;
- ``verify-full``: as ``verify-ca``, and the certificate must name the host.

``allow`` (plain first, TLS only when refused) is not supported. As in libpq, ``sslmode``
does not apply to a Unix socket (``host`` naming a directory). ``sslcert`` and ``sslkey``
present a client certificate. ``PGSSLMODE``, ``PGSSLROOTCERT``, ``PGSSLCERT``, ``PGSSLKEY``,
``PGCONNECT_TIMEOUT`` and ``PGAPPNAME`` fill gaps, as ``PGHOST`` and the others do.
``connect_timeout`` (seconds, ``0`` for none) replaces the pool's ``timeout`` as pg8000's
socket timeout, which pg8000 applies to every read and write, not only to connecting.

.. note:: A connection passed in is never closed. Connections the pool opened from a DSN
   are closed by :meth:`Pg8000PoolAdapter.close`.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import pg8000.exceptions
import pg8000.native

from lease_core.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    ConfigurationError,
    StoreRefused,
)

from ._pg8000_params import PG8000_PARAMS, SSL_MODES, pg8000_params, refuses_tls, tls_error
from ._placeholders import inline_parameters, numbered, sql_literal
from .base import (
    CONFIG_STATES,
    GAVE_UP_STATES,
    LIMIT_CLASS,
    UNKNOWN_COMPLETION_STATE,
    ConnectionLock,
    Executor,
    Params,
    Row,
    Slots,
    SqlAdapter,
    TransientError,
    WorkerThreads,
    gave_up,
    in_users_transaction,
    over_limit,
    pooler_hint,
    read_only,
    redact,
    refused,
    refuses_writes,
    unknown_completion,
)

__all__ = [
    "PG8000_PARAMS",
    "SSL_MODES",
    "Pg8000ConnectionAdapter",
    "Pg8000PoolAdapter",
    "inline_parameters",
    "pg8000_params",
    "sql_literal",
    "translate_error",
]

def translate_error(exc: Exception, *, where: str = "", secret: str | None = None) -> Exception:
    """Map a pg8000 (or socket) error to anarchon's error types; others return unchanged."""
    at = f" at {where}" if where else ""
    if isinstance(exc, pg8000.exceptions.DatabaseError) and exc.args and isinstance(
        exc.args[0], dict
    ):
        info: dict[str, str] = dict(exc.args[0])
        state = info.get("C", "")
        text = redact(f"{info.get('S', 'ERROR')}: {info.get('M', '')}", secret)
        if state in ("40001", "40P01"):
            return TransientError(f"PostgreSQL aborted the transaction{at}: {text}")
        if state in CONFIG_STATES:
            return StoreRefused(refused(at, text, state))
        if refuses_writes(state, text):
            return BackendUnavailable(read_only(at, text))
        if state in ("28P01", "28000"):
            return AuthenticationFailed(
                f"PostgreSQL{at} refused the login: {text} (check the user and password)"
            )
        if state in GAVE_UP_STATES:
            return BackendUnavailable(gave_up(at, text))
        if state == UNKNOWN_COMPLETION_STATE:
            return BackendUnavailable(unknown_completion(at, text))
        if state[:2] == LIMIT_CLASS:
            return over_limit(at, text, state)
        if state[:2] in ("08", "53", "57", "58"):
            return BackendUnavailable(f"cannot reach PostgreSQL{at}: {text}{pooler_hint(text)}")
        return exc  # type: ignore[no-any-return]
    if isinstance(exc, pg8000.exceptions.InterfaceError | OSError):
        return BackendUnavailable(f"cannot reach PostgreSQL{at}: {redact(str(exc), secret)}")
    return exc


def _broken(exc: BaseException) -> bool:
    return isinstance(exc, pg8000.exceptions.InterfaceError | OSError) or (
        isinstance(exc, pg8000.exceptions.DatabaseError)
        and bool(exc.args)
        and isinstance(exc.args[0], dict)
        and exc.args[0].get("C", "")[:2] in ("08", "57")
        and exc.args[0].get("C", "") not in GAVE_UP_STATES
    )


def _execute(conn: Any, sql: str, params: Params) -> list[Row]:
    text, values = numbered(sql, params)
    context = conn.execute_unnamed(text, vals=values)
    rows = context.rows
    return [] if rows is None else [tuple(row) for row in rows]


def _alone(sql: str, params: Params) -> tuple[str, tuple[Any, ...] | None]:
    """How :func:`_execute_alone` sends ``sql``: the text with the parameters written as
    literals and None, or (a value with no literal form) ``$n`` text and the values.

    Called before a connection is taken: a statement whose placeholders do not match its
    parameters raises :class:`ConfigurationError` here.
    """
    try:
        return inline_parameters(sql, params), None
    except TypeError:
        return numbered(sql, params)


def _execute_alone(conn: Any, sql: str, params: Params) -> list[Row]:
    """Run one statement outside a transaction in one message (the simple protocol).

    pg8000's extended protocol syncs between parsing and binding, and PgBouncer in
    transaction mode may give those messages to different server connections, so a
    statement outside a transaction must travel whole: the parameters are written as
    literals (every statement of the library casts each one). A value with no literal
    form falls back to the extended protocol.
    """
    return _run_alone(conn, *_alone(sql, params))


def _run_alone(conn: Any, text: str, values: tuple[Any, ...] | None) -> list[Row]:
    """Run what :func:`_alone` made of a statement."""
    if values is None:
        context = conn.execute_simple(text)
    else:
        context = conn.execute_unnamed(text, vals=values)
    rows = context.rows
    return [] if rows is None else [tuple(row) for row in rows]


class _Connection(pg8000.native.Connection):  # type: ignore[misc]
    """pg8000's connection, keeping the server's error when the server then hangs up.

    PgBouncer answers some statements with an error and closes the connection at once
    ("server login has been failing, try again later (server_login_retry)", "transaction
    blocks not allowed in statement pooling mode", a ``KILL`` or ``query_wait_timeout``);
    pg8000 keeps reading for the ReadyForQuery that never comes and raises "network
    error", dropping the error it read. Here that error is raised instead (the network
    error as its cause): its SQLSTATE (``08P01``) marks the connection broken all the same.
    """

    def handle_messages(self, context: Any) -> None:
        try:
            super().handle_messages(context)
        except pg8000.exceptions.InterfaceError as exc:
            error = getattr(context, "error", None)
            if isinstance(error, pg8000.exceptions.DatabaseError):
                raise error from exc
            raise


def _idle(conn: Any) -> bool:
    """Whether ``conn`` is in no transaction, as its server's last ReadyForQuery said
    (``b"I"``; ``b"T"`` in a transaction, ``b"E"`` in a failed one; pg8000 sets None
    at the end of its connect, before any statement: idle too)."""
    return getattr(conn, "_transaction_status", b"I") in (b"I", None)


class _Tx:
    """Executor over one pg8000 connection: in a transaction, or one statement alone."""

    def __init__(self, conn: Any, where: str, threads: WorkerThreads, *,
                 alone: bool = False) -> None:
        self._conn = conn
        self._where = where
        self._threads = threads
        self._run = _execute_alone if alone else _execute

    @property
    def connection(self) -> Any:
        return self._conn

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        rows = await self.control(sql, params)
        await anyio.lowlevel.checkpoint_if_cancelled()  # not to a cancelled caller
        return rows

    async def control(self, sql: str, params: Params = ()) -> list[Row]:
        """Run ``sql`` to its end; a cancelled caller is told at its next checkpoint."""
        try:
            return await self._threads.run(self._run, self._conn, sql, params)
        except (pg8000.exceptions.Error, OSError) as exc:
            mapped = translate_error(exc, where=self._where)
            if mapped is exc:
                raise
            raise mapped from exc


def _where_of(conn: Any) -> str:
    sock = getattr(conn, "_usock", None)
    try:
        host, port = sock.getpeername()[:2] if sock is not None else ("", "")
    except (OSError, ValueError):
        return ""
    return f"{host}:{port}" if host else ""


async def _reset(tx: _Tx, reset: str) -> bool:
    """Run ``reset`` in the transaction a block left by raising; False if it cannot run
    (the transaction is aborted, or the connection failed)."""
    try:
        await tx.control(reset)
    except Exception:
        return False
    return True


@asynccontextmanager
async def _transaction(conn: Any, where: str, threads: WorkerThreads, *,
                       reset: str | None = None) -> AsyncIterator[Executor]:
    tx = _Tx(conn, where, threads)
    # BEGIN travels whole (the simple protocol): outside a transaction, PgBouncer in
    # transaction mode may hand the extended protocol's parse and bind to different
    # server connections. Once BEGIN ran, the transaction keeps its server connection.
    await _Tx(conn, where, threads, alone=True).control("BEGIN")
    try:
        yield tx
    except BaseException:
        with anyio.CancelScope(shield=True):
            if reset is not None and not await _reset(tx, reset):
                # closed in the transaction, not rolled back: its session ends
                await threads.run(_close_quietly, conn)
            else:
                with suppress(Exception):
                    await tx.control("ROLLBACK")
        raise
    # Shielded: a cancellation pending as the block ends would otherwise send nothing and
    # leave the connection in the transaction. A commit is reported as done; the
    # cancellation is delivered at the caller's next checkpoint.
    with anyio.CancelScope(shield=True):
        await tx.control("COMMIT")


class Pg8000ConnectionAdapter(SqlAdapter):
    """Queue statements, one at a time, on one pg8000 connection; never closed."""

    concurrent = False
    anyio_backends = ("asyncio", "trio")

    def __init__(self, conn: Any) -> None:
        super().__init__(owned=False)
        if not hasattr(conn, "execute_unnamed"):
            raise ConfigurationError(
                f"{type(conn).__qualname__} is not a pg8000 connection this version supports"
            )
        self.conn = conn
        self._lock = ConnectionLock("this pg8000 connection")
        self._left_open = False  # by a transaction of this adapter (see _refuse_open)
        self._where = _where_of(conn)
        # One statement at a time (the lock): its thread is never queued behind the
        # application's own (anyio's default limiter).
        self._threads = WorkerThreads(1)

    def _refuse_open(self) -> None:
        """Refuse a connection the application left in a transaction (not one broken here)."""
        if not (_idle(self.conn) or self._left_open):
            raise in_users_transaction("pg8000")

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement in a worker thread when the connection is free."""
        async with self._lock.held():
            self._refuse_open()
            return await _Tx(self.conn, self._where, self._threads, alone=True).all(sql, params)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Executor]:
        async with self._lock.held():
            self._refuse_open()
            try:
                async with _transaction(self.conn, self._where, self._threads) as tx:
                    yield tx
            finally:
                self._left_open = not _idle(self.conn)

    def transaction(self) -> Any:
        """Open a transaction when the connection is free."""
        return self._transaction()


@dataclass
class _Outcome:
    """What one worker-thread call of :class:`Pg8000PoolAdapter` did."""
    conn: Any  # the connection to keep, or None (none opened, or closed as broken)
    rows: list[Row]
    error: Exception | None
    connecting: bool = False


class Pg8000PoolAdapter(SqlAdapter):
    """Open up to ``max_size`` pg8000 connections from connection parameters; close them all.

    Connections are opened on demand; one that fails with a connection error is discarded,
    so the adapter recovers by itself after a server restart. One more connection is kept
    for :meth:`all_reserved` (heartbeats): ``max_size + 1`` connections at most.
    """

    anyio_backends = ("asyncio", "trio")

    def __init__(self, params: dict[str, Any], *, min_size: int = 1, max_size: int = 4,
                 timeout: float = 10.0) -> None:
        super().__init__(owned=True)
        self.params = params
        self._where = params.get("unix_sock") or f"{params['host']}:{params['port']}"
        self._secret: str | None = params.get("password")
        self._timeout: float | None = timeout
        if params.get("connect_timeout") is not None:
            self._timeout = params["connect_timeout"] or None
        self._min_size = min_size
        self._max_size = max_size
        self._pool_timeout = timeout
        self._idle: list[Any] = []
        self._slots = Slots(lambda: max_size)
        self._closed = False
        self._reserved: Any = None
        self._reserved_busy = False
        # The idle list and the reserved connection, taken and given back by event loops
        # on several threads (the sync front ends' and the application's): each take a
        # look and a change under this lock, so no two take one connection.
        self._guard = threading.Lock()
        # A thread for each connection slot, the reserved connection and a close: a call
        # holding a connection never waits for a thread (WorkerThreads).
        self._threads = WorkerThreads(max_size + 2)

    def _connect(self) -> Any:
        p = self.params
        ssl_context = p.get("ssl_context")
        try:
            return self._open(ssl_context)
        except pg8000.exceptions.InterfaceError as exc:
            # An SSLContext of our own makes pg8000 insist on TLS; "prefer" falls back.
            if p.get("sslmode") != "prefer" or not refuses_tls(exc):
                raise
        return self._open(False)

    def _open(self, ssl_context: Any) -> Any:
        p = self.params
        return _Connection(
            p["user"], host=p["host"], port=p["port"], database=p["database"],
            password=p["password"], timeout=self._timeout, unix_sock=p.get("unix_sock"),
            ssl_context=ssl_context, application_name=p.get("application_name"),
        )

    def _connect_error(self, exc: Exception) -> Exception:
        """A connection's error mapped to anarchon's types (``exc`` itself if none fits)."""
        return (tls_error(exc, self._where, self.params.get("sslmode"), self._secret)
                or translate_error(exc, where=self._where, secret=self._secret))

    def _take_idle(self) -> Any:
        """An idle connection, or None."""
        with self._guard:
            return self._idle.pop() if self._idle else None

    def _take_all_idle(self) -> list[Any]:
        """Every idle connection, and the reserved one when it is free."""
        with self._guard:
            idle, self._idle = self._idle, []
            if self._reserved is not None and not self._reserved_busy:
                idle.append(self._reserved)
                self._reserved = None
            return idle

    async def _acquire(self) -> Any:
        conn = self._take_idle()
        if conn is not None:
            return conn
        return await self._new()

    async def _new(self) -> Any:
        """A new connection, its errors mapped to anarchon's types."""
        try:
            return await self._threads.run(self._connect)
        except (pg8000.exceptions.Error, OSError) as exc:
            mapped = self._connect_error(exc)
            if mapped is exc:
                raise
            raise mapped from None

    def _slot(self) -> AbstractAsyncContextManager[None]:
        """Hold one of the ``max_size`` connection slots; wait ``timeout`` for it at most."""
        return self._slots.held(self._pool_timeout, self._no_slot)

    def _no_slot(self) -> BackendUnavailable:
        return BackendUnavailable(
            f"no pooled connection to PostgreSQL at {self._where} became free within "
            f"{self._pool_timeout:g}s: all {self._max_size} were busy; raise max_size "
            "(?max_size= in the URL, default 4) or timeout (?timeout=, default 10s)"
        )

    def _keeps(self, conn: Any, exc: BaseException | None) -> bool:
        """Whether ``conn`` may be lent again: the pool is open, ``exc`` (the error of its
        last use) did not break it, and it is in no transaction (a connection left in one
        would run the next borrower's statements inside it)."""
        return not self._closed and _idle(conn) and (
            exc is None or not (_broken(exc) or _broken(exc.__cause__ or exc)))

    async def _release(self, conn: Any, exc: BaseException | None) -> None:
        if not self._keeps(conn, exc):
            with anyio.CancelScope(shield=True):
                await self._threads.run(_close_quietly, conn)
        else:
            with self._guard:
                self._idle.append(conn)

    async def open(self) -> None:
        """Open ``min_size`` connections, the first alone, so a bad login or host is
        reported at once. (Connections opened later are kept too, up to ``max_size``.)"""
        self._closed = False  # (again after close(): its connections are kept again)
        async with self._slot():
            conn = await self._acquire()
            await self._release(conn, None)
        with self._guard:
            missing = self._min_size - len(self._idle)
        for _ in range(missing):
            await self._release(await self._new(), None)

    async def close(self) -> None:
        """Close every idle connection; busy ones close when they are released."""
        self._closed = True
        for conn in self._take_all_idle():
            await self._threads.run(_close_quietly, conn)

    def _all_blocking(self, conn: Any, text: str, values: tuple[Any, ...] | None) -> _Outcome:
        """Connect when ``conn`` is None, run the statement (as :func:`_alone` made it),
        close a broken connection. Any error is returned with the connection, never
        raised: the caller gives the connection back."""
        if conn is None:
            try:
                conn = self._connect()
            except (pg8000.exceptions.Error, OSError) as exc:
                return _Outcome(None, [], exc, connecting=True)
        try:
            return _Outcome(conn, _run_alone(conn, text, values), None)
        except Exception as exc:
            if _broken(exc):
                _close_quietly(conn)
                conn = None
            return _Outcome(conn, [], exc)

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement on a pooled connection, in one worker-thread call.

        Opening a connection (none idle), the statement and closing a connection it
        found broken all happen in that one call.
        """
        statement = _alone(sql, params)  # a placeholder mismatch raises before a connection
        async with self._slot():
            conn = self._take_idle()
            # The worker thread runs to its end whatever happens to the caller (pg8000's
            # socket timeout bounds it); shielded, its outcome is kept, so a cancelled
            # caller returns a healthy connection to the pool instead of closing it (and,
            # through PgBouncer, logging in again on the next call).
            with anyio.CancelScope(shield=True):
                done = await self._threads.run(self._all_blocking, conn, *statement)
                if done.conn is not None:
                    await self._release(done.conn, None)
        rows = await self._rows(done)
        await anyio.lowlevel.checkpoint_if_cancelled()  # not to a cancelled caller
        return rows

    async def all_reserved(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement on the reserved connection (on the pool while it is busy)."""
        statement = _alone(sql, params)
        with self._guard:
            taken = not self._reserved_busy
            if taken:
                self._reserved_busy = True
                conn, self._reserved = self._reserved, None
        if not taken:
            return await self.all(sql, params)
        try:
            with anyio.CancelScope(shield=True):  # as in all()
                done = await self._threads.run(self._all_blocking, conn, *statement)
                if done.conn is not None:
                    if not self._keeps(done.conn, None):
                        await self._threads.run(_close_quietly, done.conn)
                    else:
                        self._reserved = done.conn  # (busy: no other thread writes it)
        finally:
            self._reserved_busy = False
        rows = await self._rows(done)
        await anyio.lowlevel.checkpoint_if_cancelled()  # not to a cancelled caller
        return rows

    async def _discard_idle(self) -> None:
        """Close the idle connections (and the reserved one when free): a connection just
        found broken means a server restart probably broke them too."""
        idle = self._take_all_idle()
        if idle:
            with anyio.CancelScope(shield=True):
                await self._threads.run(_close_all, idle)

    async def _rows(self, done: _Outcome) -> list[Row]:
        """The rows of a worker-thread call, or its error mapped to anarchon's types."""
        exc = done.error
        if exc is None:
            return done.rows
        if done.conn is None:  # no connection, or closed as broken
            await self._discard_idle()
        if done.connecting:
            mapped = self._connect_error(exc)
            if mapped is exc:
                raise exc
            raise mapped from None
        mapped = translate_error(exc, where=self._where)
        if mapped is exc:
            raise exc
        raise mapped from exc

    @asynccontextmanager
    async def _transaction(self, *, reset: str | None = None) -> AsyncIterator[Executor]:
        async with self._slot():
            with anyio.CancelScope(shield=True):  # a connection opened is never dropped
                conn = await self._acquire()
            try:
                async with _transaction(conn, self._where, self._threads,
                                        reset=reset) as tx:
                    yield tx
            except BaseException as exc:
                # (A connection closed in its transaction is not idle: it is dropped.)
                await self._release(conn, exc)
                raise
            await self._release(conn, None)

    def transaction(self) -> Any:
        """Open a transaction on a pooled connection."""
        return self._transaction()

    def discarding_transaction(self, reset: str) -> Any:
        """Open a transaction on a pooled connection that runs ``reset`` before rolling
        back, or is closed (a new one is opened on demand) when the reset cannot run."""
        return self._transaction(reset=reset)


def _close_all(conns: list[Any]) -> None:
    for conn in conns:
        _close_quietly(conn)


def _close_quietly(conn: Any) -> None:
    with suppress(pg8000.exceptions.Error, OSError):
        conn.close()
