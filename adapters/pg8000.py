"""pg8000 adapters: a user's connection (any pg8000 API), or a small pool from a DSN.

pg8000 is blocking, so every call runs in an anyio worker thread; that works under asyncio
and trio. Statements use pg8000's unnamed prepared statements (``execute_unnamed``), which
PgBouncer in transaction mode accepts, and run on the connection's core protocol, so the
DB-API ``autocommit`` setting of a user's connection does not matter.

.. note:: A connection passed in is never closed. Connections the pool opened from a DSN
   are closed by :meth:`Pg8000PoolAdapter.close`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio
import anyio.to_thread
import pg8000.exceptions
import pg8000.native

from lease_core.errors import AuthenticationFailed, BackendUnavailable, ConfigurationError

from .sql import Executor, Row, SqlAdapter, TransientError, numbered_placeholders, redact

__all__ = ["Pg8000ConnectionAdapter", "Pg8000PoolAdapter", "translate_error"]

_CONFIG_STATES = {"42501", "42P01", "3F000", "3D000", "42P07"}
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
        if state in _CONFIG_STATES:
            return ConfigurationError(f"PostgreSQL refused the statement{at}: {text}")
        if state in ("28P01", "28000"):
            return AuthenticationFailed(
                f"PostgreSQL{at} refused the login: {text} (check the user and password)"
            )
        if state[:2] in ("08", "53", "57", "58"):
            return BackendUnavailable(f"cannot reach PostgreSQL{at}: {text}")
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
    )


def _execute(conn: Any, sql: str, params: Sequence[Any]) -> list[Row]:
    context = conn.execute_unnamed(numbered_placeholders(sql), vals=tuple(params))
    rows = context.rows
    return [] if rows is None else [tuple(row) for row in rows]


def _in_transaction(conn: Any) -> bool:
    return bool(getattr(conn, "in_transaction", False))


class _Tx:
    """Executor over one pg8000 connection inside a transaction."""

    def __init__(self, conn: Any, where: str) -> None:
        self._conn = conn
        self._where = where

    @property
    def connection(self) -> Any:
        return self._conn

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        try:
            return await anyio.to_thread.run_sync(_execute, self._conn, sql, params)
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


@asynccontextmanager
async def _transaction(conn: Any, where: str) -> AsyncIterator[Executor]:
    tx = _Tx(conn, where)
    await tx.all("BEGIN")
    try:
        yield tx
    except BaseException:
        with anyio.CancelScope(shield=True):
            with suppress(Exception):
                await tx.all("ROLLBACK")
        raise
    else:
        await tx.all("COMMIT")


class Pg8000ConnectionAdapter(SqlAdapter):
    """Queue statements, one at a time, on one pg8000 connection; never closed."""

    anyio_backends = ("asyncio", "trio")

    def __init__(self, conn: Any) -> None:
        super().__init__(owned=False)
        if not hasattr(conn, "execute_unnamed"):
            raise ConfigurationError(
                f"{type(conn).__qualname__} is not a pg8000 connection this version supports"
            )
        self.conn = conn
        self._lock = anyio.Lock()
        self._where = _where_of(conn)

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement in a worker thread when the connection is free."""
        async with self._lock:
            return await _Tx(self.conn, self._where).all(sql, params)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Executor]:
        async with self._lock, _transaction(self.conn, self._where) as tx:
            yield tx

    def transaction(self) -> Any:
        """Open a transaction when the connection is free."""
        return self._transaction()


class Pg8000PoolAdapter(SqlAdapter):
    """Open up to ``max_size`` pg8000 connections from connection parameters; close them all.

    Connections are opened on demand; one that fails with a connection error is discarded,
    so the adapter recovers by itself after a server restart.
    """

    anyio_backends = ("asyncio", "trio")

    def __init__(self, params: dict[str, Any], *, min_size: int = 1, max_size: int = 4,
                 timeout: float = 10.0) -> None:
        super().__init__(owned=True)
        self.params = params
        self._where = f"{params['host']}:{params['port']}"
        self._secret: str | None = params.get("password")
        self._timeout = timeout
        self._min_size = min_size
        self._idle: list[Any] = []
        self._slots = anyio.Semaphore(max_size)
        self._closed = False

    def _connect(self) -> Any:
        p = self.params
        return pg8000.native.Connection(
            p["user"], host=p["host"], port=p["port"], database=p["database"],
            password=p["password"], timeout=self._timeout,
        )

    async def _acquire(self) -> Any:
        if self._idle:
            return self._idle.pop()
        try:
            return await anyio.to_thread.run_sync(self._connect)
        except (pg8000.exceptions.Error, OSError) as exc:
            mapped = translate_error(exc, where=self._where, secret=self._secret)
            if mapped is exc:
                raise
            raise mapped from None

    async def _release(self, conn: Any, exc: BaseException | None) -> None:
        if self._closed or (exc is not None and (_broken(exc) or _broken(exc.__cause__ or exc))):
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close_quietly, conn)
        else:
            self._idle.append(conn)

    async def open(self) -> None:
        """Open the first connection, so a bad login or host is reported at once."""
        async with self._slots:
            conn = await self._acquire()
            await self._release(conn, None)

    async def close(self) -> None:
        """Close every idle connection; busy ones close when they are released."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await anyio.to_thread.run_sync(_close_quietly, conn)

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement on a pooled connection."""
        async with self._slots:
            conn = await self._acquire()
            try:
                rows = await _Tx(conn, self._where).all(sql, params)
            except BaseException as exc:
                await self._release(conn, exc)
                raise
            await self._release(conn, None)
            return rows

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Executor]:
        async with self._slots:
            conn = await self._acquire()
            try:
                async with _transaction(conn, self._where) as tx:
                    yield tx
            except BaseException as exc:
                await self._release(conn, exc)
                raise
            await self._release(conn, None)

    def transaction(self) -> Any:
        """Open a transaction on a pooled connection."""
        return self._transaction()


def _close_quietly(conn: Any) -> None:
    with suppress(pg8000.exceptions.Error, OSError):
        conn.close()
