"""psycopg 3 adapters: a pool from a DSN, a user's pool (async or sync), a user's connection.

Statements are sent with ``prepare=False``: server-side prepared statements do not survive
PgBouncer in transaction mode before version 1.21, and a user's default-configured pool
would otherwise prepare them after five executions.

Sync pools and connections run their blocking calls in anyio worker threads, so they work
under asyncio and trio; psycopg's async objects need asyncio. A transaction on one is
never left open by a cancelled caller: a caller cancelled while a statement runs gets its
cancellation as the statement returns, inside the block, which rolls back; a block that
ended commits, shielded (the commit is reported as done), and the cancellation comes at
the caller's next checkpoint.

With or without parameters, psycopg gets them (an empty tuple for none), so ``%%`` is a
literal percent sign and a ``%`` that starts no placeholder is refused as with pg8000
(:mod:`adapters._placeholders`).

A statement is never interrupted because its caller was cancelled (a scheduler's deadline,
a lost lease): psycopg would then send a cancel request on a new connection and, cancelled
again while waiting for it, close the connection, which through PgBouncer costs a new
login and a new server connection for every cancelled call; under load that feeds itself.
Each driver call (a statement, ``BEGIN``, ``COMMIT``, ``ROLLBACK``) runs shielded until
the caller's own deadline plus :data:`~adapters.sql.CANCEL_GRACE_S`, so a cancelled caller
waits for the answer, the connection goes back to the pool, and the cancellation is
delivered afterwards. Only a call still unanswered then is given up: its connection is
closed and :class:`BackendUnavailable` raised. Waiting for a pooled connection stays
cancellable.

.. note:: Pools and connections passed in are never closed. The pool opened from a DSN
   is closed by :meth:`PsycopgDsnAdapter.close`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import psycopg
import psycopg.conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from lease_core.errors import BackendUnavailable, ConfigurationError

from ._psycopg_base import (
    _STORE_CHARACTERISTICS,
    _async_all,
    _async_single,
    _mapped,
    _refuse_open,
    _secret_of,
    _sync_all,
    _sync_single,
    _where,
    _where_of,
    set_async_characteristics,
    set_sync_characteristics,
    translate_error,
    users_characteristics,
)
from ._psycopg_pools import check_after, dsn_pools, give_back, refuse_unopened
from .base import (
    ConnectionLock,
    Executor,
    Params,
    Row,
    Slots,
    SqlAdapter,
    WorkerThreads,
    conninfo_params,
    redact,
    settle_scope,
)

__all__ = [
    "PsycopgConnectionAdapter",
    "PsycopgDsnAdapter",
    "PsycopgPoolAdapter",
    "PsycopgSyncConnectionAdapter",
    "PsycopgSyncPoolAdapter",
    "translate_error",
]

logger = logging.getLogger("anarchon")


class _AsyncTx:
    """Executor over one psycopg async connection inside a transaction."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], where: str) -> None:
        self._conn = conn
        self._where = where

    @property
    def connection(self) -> psycopg.AsyncConnection[Any]:
        return self._conn

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        with _mapped(self._where):
            async with _settled(self._conn, self._where):
                return await _async_all(self._conn, sql, params)
        raise AssertionError("unreachable")  # pragma: no cover - _settled raises


class _SyncTx:
    """Executor over one sync psycopg connection; each statement runs in a worker thread."""

    def __init__(self, conn: psycopg.Connection[Any], where: str, threads: WorkerThreads) -> None:
        self._conn = conn
        self._where = where
        self._threads = threads

    @property
    def connection(self) -> psycopg.Connection[Any]:
        return self._conn

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        with _mapped(self._where):
            rows = await self._threads.run(_sync_all, self._conn, sql, params)
        # A caller cancelled while the statement ran gets its cancellation here, inside
        # the block, which then rolls back; not the rows, so its code goes no further.
        await anyio.lowlevel.checkpoint_if_cancelled()
        return rows


@asynccontextmanager
async def _settled(conn: psycopg.AsyncConnection[Any], where: str, *,
                   deliver: bool = True) -> AsyncIterator[None]:
    """Run the block's driver call to its end even if the caller is cancelled meanwhile.

    The call is shielded until the caller's deadline plus the grace period (see the module
    docs); a call still running then is interrupted, its connection closed, and
    :class:`BackendUnavailable` raised. With ``deliver``, a caller cancelled meanwhile gets
    its cancellation, not the call's result, so that no code of a handler past its
    deadline runs on it.
    """
    scope = settle_scope()
    with scope:
        yield
    if deliver and not scope.cancelled_caught:
        await anyio.lowlevel.checkpoint_if_cancelled()
    if scope.cancelled_caught:
        await _abandon(conn, where)


async def _single_settled(conn: psycopg.AsyncConnection[Any], where: str, sql: str,
                          params: Params) -> list[Row]:
    """:func:`_async_single` under :func:`_settled` (a plain coroutine: the hot path)."""
    scope = settle_scope()
    with scope:
        rows = await _async_single(conn, sql, params)
    if not scope.cancelled_caught:
        await anyio.lowlevel.checkpoint_if_cancelled()
        return rows
    await _abandon(conn, where)
    raise AssertionError("unreachable")  # pragma: no cover - _abandon raises


async def _abandon(conn: psycopg.AsyncConnection[Any], where: str) -> None:
    """Close ``conn``, whose call outlived its grace period, and raise BackendUnavailable.

    (psycopg, interrupted, would cancel the statement in the server and keep the
    connection, but the cancel scope interrupts that too, and psycopg then closes it.) A
    pool replaces the connection; a backend made on one connection needs a new one, which
    the error says."""
    await conn.close()
    logger.warning("PostgreSQL%s did not answer in time after its caller gave up; "
                   "connection closed", f" at {where}" if where else "")
    raise BackendUnavailable(
        f"PostgreSQL{' at ' + where if where else ''} did not answer in time after its "
        "caller gave up; the connection was closed (a pool replaces it; a backend made "
        "on one connection needs a new connection)"
    )


async def _reset(conn: psycopg.AsyncConnection[Any], where: str, reset: str) -> bool:
    """Run ``reset`` in the transaction a block left by raising; False if it cannot run
    (the transaction is aborted, or the connection failed)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
        return False
    with anyio.CancelScope(shield=True):
        try:
            await _AsyncTx(conn, where).all(reset)
        except Exception:
            return False
    return True


@asynccontextmanager
async def _async_transaction(
    conn: psycopg.AsyncConnection[Any], where: str, *, reset: str | None = None
) -> AsyncIterator[Executor]:
    with _mapped(where):
        _refuse_open(conn)
        users = users_characteristics(conn)  # the application's, put back after
        if users is not None:
            await set_async_characteristics(conn, _STORE_CHARACTERISTICS)
        try:
            tx = psycopg.AsyncTransaction(conn)
            async with _settled(conn, where, deliver=False):
                await tx.__aenter__()
            try:
                yield _AsyncTx(conn, where)
            except BaseException as exc:
                if reset is not None and not await _reset(conn, where, reset):
                    # closed in the transaction, not rolled back: its session ends
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await conn.close()  # (the pool replaces it)
                    raise
                # The rollback runs even when the block was cancelled (a connection left in a
                # transaction would be closed by its pool).
                with contextlib.suppress(BackendUnavailable):
                    async with _settled(conn, where, deliver=False):
                        await tx.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            async with _settled(conn, where, deliver=False):  # a commit is reported as done
                await tx.__aexit__(None, None, None)
        finally:
            if users is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(psycopg.Error):
                    await set_async_characteristics(conn, users)


@asynccontextmanager
async def _sync_transaction(conn: psycopg.Connection[Any], where: str, threads: WorkerThreads
                            ) -> AsyncIterator[Executor]:
    with _mapped(where):
        _refuse_open(conn)
        users = users_characteristics(conn)  # the application's, put back after
        if users is not None:
            await threads.run(set_sync_characteristics, conn, _STORE_CHARACTERISTICS)
        try:
            tx = conn.transaction()
            await threads.run(tx.__enter__)
            try:
                yield _SyncTx(conn, where, threads)
            except BaseException as exc:
                with anyio.CancelScope(shield=True):
                    await threads.run(tx.__exit__, type(exc), exc, exc.__traceback__)
                raise
            # Shielded, as the rollback: a cancellation pending as the block ends would
            # otherwise send no COMMIT and leave the connection in the transaction (a user's
            # connection for good: its later statements would become savepoints in it). A
            # commit is reported as done; the cancellation comes at the next checkpoint.
            with anyio.CancelScope(shield=True):
                await threads.run(tx.__exit__, None, None, None)
        finally:
            if users is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(psycopg.Error):
                    await threads.run(set_sync_characteristics, conn, users)


class PsycopgPoolAdapter(SqlAdapter):
    """Run statements on connections borrowed from a psycopg ``AsyncConnectionPool``.

    .. note:: A pool passed in is never opened or closed here; open it before use.
    """

    def __init__(self, pool: AsyncConnectionPool[Any], *, owned: bool = False,
                 where: str | None = None, secret: str | None = None) -> None:
        super().__init__(owned=owned)
        self.pool = pool
        self._where = where if where is not None else _where(pool.conninfo)
        self._secret = secret

    async def open(self) -> None:
        """Refuse a pool passed in that is not open (:func:`refuse_unopened`)."""
        if not self.owned:
            refuse_unopened(self.pool)

    async def close(self) -> None:
        """Close the pool if this adapter opened it."""
        if self.owned:
            await self.pool.close()

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement on a pooled connection (to its end; see the module docs)."""
        return await self._all_on(self.pool, sql, params)

    async def _all_on(self, pool: AsyncConnectionPool[Any], sql: str,
                      params: Params) -> list[Row]:
        with _mapped(self._where, self._secret):
            conn = await pool.getconn()
            if anyio.current_effective_deadline() == math.inf:
                # No deadline: the statement's settle scope would be a shield without end,
                # as the give-back's is, so one scope serves both (the same protection, one
                # scope less per call: the named leases' hot path); a cancellation that came
                # meanwhile is delivered once the connection is back.
                with anyio.CancelScope(shield=True):
                    try:
                        rows = await _async_single(conn, sql, params)
                    finally:
                        await pool.putconn(conn)
                await anyio.lowlevel.checkpoint_if_cancelled()
                return rows
            try:
                return await _single_settled(conn, self._where, sql, params)
            finally:
                await give_back(pool, conn)

    @asynccontextmanager
    async def _transaction(self, *, reset: str | None = None) -> AsyncIterator[Executor]:
        with _mapped(self._where, self._secret):
            conn = await self.pool.getconn()
            try:
                async with _async_transaction(conn, self._where, reset=reset) as tx:
                    yield tx
            finally:
                await give_back(self.pool, conn)

    def transaction(self) -> Any:
        """Open a transaction on a pooled connection."""
        return self._transaction()

    def discarding_transaction(self, reset: str) -> Any:
        """Open a transaction on a pooled connection that runs ``reset`` before rolling
        back, or is closed (the pool replaces it) when the reset cannot run; on a pool
        passed in, rolled back as :meth:`transaction`."""
        return self._transaction(reset=reset if self.owned else None)


class PsycopgDsnAdapter(PsycopgPoolAdapter):
    """Open a small ``AsyncConnectionPool`` from a DSN (``None``: localhost and ``PG*``).

    The first connection is made directly, so a wrong password or an unreachable server is
    reported at once, with a clear message. The pool lends the idle connection given back
    last first, so sequential statements stay on one server process. Besides the pool
    (up to ``max_size`` connections) one connection is kept for :meth:`all_reserved`
    (heartbeats), in a pool of its own: ``max_size + 1`` connections at most. Both are
    closed by :meth:`close`.
    """

    def __init__(self, dsn: str | None, *, min_size: int = 1, max_size: int = 4,
                 timeout: float = 10.0) -> None:
        if dsn is None:
            params = conninfo_params(None)
            conninfo = psycopg.conninfo.make_conninfo(
                "", host=params["host"], port=str(params["port"]), dbname=params["database"]
            )
        else:
            try:
                conninfo = psycopg.conninfo.make_conninfo(dsn)
            except psycopg.ProgrammingError as exc:
                raise ConfigurationError(
                    f"invalid PostgreSQL DSN {redact(dsn)!r}: {redact(str(exc))}"
                ) from None
        given = psycopg.conninfo.conninfo_to_dict(conninfo)
        secret = given.get("password")
        try:
            # The first connection is made with a timeout of its own, so a connect_timeout
            # psycopg cannot read only showed in the pool: every connection it tried
            # failed, logged, until start() reported a pool "busy" for timeout seconds.
            psycopg.conninfo.timeout_from_conninfo(given)
        except psycopg.ProgrammingError:
            source = "connect_timeout" if "connect_timeout" in given else "PGCONNECT_TIMEOUT"
            value = given.get(source, os.environ.get(source))
            raise ConfigurationError(
                f"{source} {value!r} is not a number of seconds (0 waits forever)"
            ) from None
        self._sizes = (min_size, max_size, timeout)
        pool, self.reserved_pool = dsn_pools(conninfo, *self._sizes)
        super().__init__(pool, owned=True, where=_where(conninfo),
                         secret=str(secret) if secret else None)
        self._conninfo = conninfo
        self._opened = False  # once: a new open() after a close() makes new pools
        # The first login's own timeout: the one the DSN (or PGCONNECT_TIMEOUT) gives,
        # else 10 seconds (libpq's default is to wait for ever).
        self._first_timeout: dict[str, Any] = (
            {} if "connect_timeout" in given or os.environ.get("PGCONNECT_TIMEOUT")
            else {"connect_timeout": 10})
        self._reserved_busy = False

    async def open(self) -> None:
        """Check that a login works, then open the pool without waiting for it to fill."""
        with _mapped(self._where, self._secret):
            conn = await psycopg.AsyncConnection.connect(self._conninfo, **self._first_timeout)
            await conn.close()
            if self._opened and self.pool.closed:  # by close(): the backend's, passed in
                self.pool, self.reserved_pool = dsn_pools(self._conninfo, *self._sizes)
            self._opened = True
            await self.pool.open(wait=False)
            await self.reserved_pool.open(wait=False)

    async def close(self) -> None:
        """Close the pool and the reserved connection."""
        await self.reserved_pool.close()
        await super().close()

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement on a pooled connection (to its end; see the module docs)."""
        try:
            return await self._all_on(self.pool, sql, params)
        except BackendUnavailable as exc:
            await check_after(exc, self.reserved_pool)
            raise

    async def all_reserved(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement on the reserved connection (on the pool while it is busy)."""
        if self._reserved_busy:
            return await self.all(sql, params)
        self._reserved_busy = True
        try:
            return await self._all_on(self.reserved_pool, sql, params)
        except BackendUnavailable as exc:
            await check_after(exc, self.pool)
            raise
        finally:
            self._reserved_busy = False


class PsycopgSyncPoolAdapter(SqlAdapter):
    """Run statements on a sync psycopg ``ConnectionPool``, in worker threads; never closed."""

    anyio_backends = ("asyncio", "trio")

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        super().__init__(owned=False)
        self.pool = pool
        self._where = _where(pool.conninfo)
        # At most max_size of this adapter's calls hold or wait for a pooled connection
        # (a statement or a transaction, from before getconn to after putconn), and each
        # uses one thread at a time: with a thread for each, a transaction holding a
        # connection never waits for a thread that another call, blocked in getconn
        # for that connection, holds. Both follow pool.resize().
        self._checkouts = Slots(lambda: pool.max_size)
        self._threads = WorkerThreads(lambda: pool.max_size)

    async def open(self) -> None:
        """Refuse a pool passed in that is not open (:func:`refuse_unopened`)."""
        refuse_unopened(self.pool)

    def _checkout(self) -> AbstractAsyncContextManager[None]:
        """Hold one of the checkouts.

        Waited for the pool's ``timeout`` at most, as getconn waits, then raised as the
        pool's timeout: a statement run inside a transaction of the same adapter while
        every checkout is held (by that transaction among others) would otherwise wait
        for good, where getconn gives up.
        """
        return self._checkouts.held(self.pool.timeout, self._no_checkout)

    def _no_checkout(self) -> BaseException:
        timeout = PoolTimeout(f"couldn't get a connection after {self.pool.timeout:.2f} sec")
        mapped = translate_error(timeout, where=self._where)
        mapped.__cause__ = timeout
        return mapped

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement on a pooled connection in a worker thread."""

        def run() -> list[Row]:
            with self.pool.connection() as conn:
                return _sync_single(conn, sql, params)

        async with self._checkout():
            with _mapped(self._where):
                return await self._threads.run(run)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Executor]:
        async with self._checkout():
            with _mapped(self._where):
                conn = await self._threads.run(self.pool.getconn)
                try:
                    async with _sync_transaction(conn, self._where, self._threads) as tx:
                        yield tx
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._threads.run(self.pool.putconn, conn)

    def transaction(self) -> Any:
        """Open a transaction on a pooled connection."""
        return self._transaction()


class PsycopgConnectionAdapter(SqlAdapter):
    """Queue statements, one at a time, on one psycopg ``AsyncConnection``.

    The backend's ``close()`` leaves the connection open. A statement still running past
    its caller's deadline plus the grace period closes it, as any adapter's (its error
    says so): the backend then needs a new connection."""

    concurrent = False

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        super().__init__(owned=False)
        self.conn = conn
        # Taken without a yield when free (the statement yields anyway): one event loop
        # pass less per statement. (psycopg's AsyncConnection is asyncio's, one loop.)
        self._lock = anyio.Lock(fast_acquire=True)
        self._where = _where_of(conn)
        self._secret = _secret_of(conn)

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement when the connection is free."""
        async with self._lock:
            with _mapped(self._where, self._secret):
                return await _single_settled(self.conn, self._where, sql, params)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Executor]:
        async with self._lock, _async_transaction(self.conn, self._where) as tx:
            yield tx

    def transaction(self) -> Any:
        """Open a transaction when the connection is free."""
        return self._transaction()


class PsycopgSyncConnectionAdapter(SqlAdapter):
    """Queue statements on one sync psycopg ``Connection``, in worker threads; never closed."""

    concurrent = False

    anyio_backends = ("asyncio", "trio")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        super().__init__(owned=False)
        self.conn = conn
        self._lock = ConnectionLock("this psycopg connection")
        self._where = _where_of(conn)
        self._secret = _secret_of(conn)
        # One statement at a time (the lock): its thread is never queued behind the
        # application's own (anyio's default limiter).
        self._threads = WorkerThreads(1)

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement in a worker thread when the connection is free."""
        async with self._lock.held():
            with _mapped(self._where, self._secret):
                return await self._threads.run(_sync_single, self.conn, sql, params)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Executor]:
        async with self._lock.held(), _sync_transaction(
            self.conn, self._where, self._threads
        ) as tx:
            yield tx

    def transaction(self) -> Any:
        """Open a transaction when the connection is free."""
        return self._transaction()
