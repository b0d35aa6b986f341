"""Your own adapter: any object with ``all(sql, params)`` and ``transaction(fn)``.

The protocol, exactly:

``async def all(sql: str, params: Sequence[Any]) -> Sequence[Sequence[Any]]``
    Execute one statement in its own transaction (autocommit) and return its rows, or an
    empty sequence when the statement returns none. ``sql`` uses ``%s`` placeholders with
    positional ``params``, a list (``%%`` is a literal percent sign); use
    :func:`adapters.sql.numbered_placeholders` to turn them into ``$1, $2, …``.
    Parameters are ``str``, ``int``, ``None`` and lists of them (sent as arrays; the SQL
    casts them, such as ``%s::text[]``). That is all your adapter ever receives: the
    backend's statements that name a parameter used more than once (``%(job)s``, with a
    mapping; psycopg and pg8000 send each such value once) reach it rewritten, each
    ``%(name)s`` as ``%s`` and its value repeated in the list at each of its places.

``async def transaction(fn: Callable[[Tx], Awaitable[T]]) -> T``
    Open a transaction, call ``await fn(tx)``, commit and return its result; roll back
    and re-raise when ``fn`` raises. ``tx`` has the same ``all(sql, params)`` coroutine
    (run inside the transaction) and, optionally, a ``connection`` attribute exposed to
    fenced transactions. Isolation level READ COMMITTED, the PostgreSQL default.

Example with asyncpg::

    from adapters.sql import numbered_placeholders as numbered

    class AsyncpgAdapter:
        def __init__(self, pool):
            self.pool = pool

        async def all(self, sql, params):
            async with self.pool.acquire() as conn:
                return await conn.fetch(numbered(sql), *params)

        async def transaction(self, fn):
            async with self.pool.acquire() as conn, conn.transaction():
                return await fn(_Tx(conn))

    class _Tx:
        def __init__(self, conn):
            self.connection = conn

        async def all(self, sql, params=()):
            return await self.connection.fetch(numbered(sql), *params)

    backend = PostgresBackend(AsyncpgAdapter(pool))

asyncpg prepares every statement it runs and keeps it on the connection. Behind PgBouncer
in transaction mode, create the pool with ``statement_cache_size=0`` (asyncpg's own advice
for PgBouncer), unless PgBouncer is 1.21 or later with ``max_prepared_statements`` set:
otherwise a statement prepared on one server connection is looked for on another.

Errors your adapter raises reach the caller unchanged, so raise
:class:`~lease_core.errors.BackendUnavailable` for connection failures if the scheduler
should retry. The object is never closed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from ._placeholders import positional
from .base import Executor, Params, Row, SqlAdapter

__all__ = ["CustomAdapter"]


class _Tx:
    """Executor wrapping the ``tx`` object a user's ``transaction(fn)`` passes to ``fn``."""

    def __init__(self, tx: Any) -> None:
        self._tx = tx

    @property
    def connection(self) -> Any:
        return getattr(self._tx, "connection", self._tx)

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        text, values = positional(sql, params)
        return [tuple(row) for row in await self._tx.all(text, list(values))]


class _Rollback(Exception):
    """Raised inside the user's ``fn`` so that their ``transaction`` rolls back."""


class CustomAdapter(SqlAdapter):
    """Use an object with ``all(sql, params)`` and ``transaction(fn)``; never closed."""

    anyio_backends = ("asyncio", "trio")

    def __init__(self, user: Any) -> None:
        super().__init__(owned=False)
        self.user = user

    async def all(self, sql: str, params: Params = ()) -> list[Row]:
        """Run one statement through the user's ``all`` (``%s`` placeholders, a list)."""
        text, values = positional(sql, params)
        return [tuple(row) for row in await self.user.all(text, list(values))]

    async def run_transaction(self, fn: Any) -> Any:
        """Run ``fn`` inside the user's ``transaction``."""

        async def body(tx: Any) -> Any:
            return await fn(_Tx(tx))

        return await self.user.transaction(body)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Executor]:
        # The user's transaction(fn) is callback-shaped; a child task holds it open while
        # the caller's block runs, and the block's outcome decides commit or rollback.
        entered = anyio.Event()
        finished = anyio.Event()
        state: dict[str, Any] = {}

        async def body(tx: Any) -> None:
            state["tx"] = tx
            entered.set()
            await finished.wait()
            if state.get("rollback"):
                raise _Rollback

        async def runner() -> None:
            try:
                await self.user.transaction(body)
            except _Rollback:
                pass
            except Exception as exc:
                state["error"] = exc
            finally:
                entered.set()

        block_error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner)
            await entered.wait()
            if "tx" in state and "error" not in state:
                try:
                    yield _Tx(state["tx"])
                except BaseException as exc:
                    block_error = exc
                    state["rollback"] = True
            finished.set()
        if block_error is not None:
            raise block_error
        if "error" in state:
            raise state["error"]

    def transaction(self) -> Any:
        """Hold the user's transaction open for the ``async with`` block."""
        return self._transaction()
