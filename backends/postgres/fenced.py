"""Fenced transactions of the PostgreSQL backend (``ctx.transaction()``).

:func:`fenced_transaction` locks a held run's row, hands the block a
:class:`FencedTransaction` to write its effects through, and completes the run in the
same commit (unless told not to).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from adapters.sql import Executor, SqlAdapter
from lease_core._structures import Lease, Outcome
from lease_core.abc import encode_checkpoint
from lease_core.errors import ConfigurationError, LeaseLost

from .statements import Statements

__all__ = ["RESET_SESSION", "FencedTransaction", "fenced_transaction"]

#: Run at the end of a fenced transaction on the connections the backend opened itself
#: (a DSN's pool), before the run's own statements and the commit: what the block left
#: in the session (a plain ``SET`` such as ``statement_timeout`` or ``search_path``, a
#: ``SET ROLE``, a ``PREPARE``, a ``LISTEN``, a session advisory lock, a temporary table)
#: would otherwise outlive the commit on the pooled connection, where the backend's
#: claims and heartbeats run next, and through PgBouncer in transaction mode on a server
#: connection another client gets. One statement (a ``DO`` block), so one round trip.
#: Only the statements ``PREPARE`` made are dropped (``from_sql``), not ``DEALLOCATE ALL``:
#: those prepared through the protocol belong to the driver or to PgBouncer (>= 1.21, with
#: ``max_prepared_statements``), which count them as prepared on that server connection and
#: notice a ``DEALLOCATE ALL`` only as a top-level command, not inside a ``DO`` block: its
#: other clients then failed with 'prepared statement "PGBOUNCER_n" does not exist'.
RESET_SESSION = ("DO $$DECLARE s text; BEGIN RESET ALL; RESET ROLE; "
                 "FOR s IN SELECT name FROM pg_prepared_statements WHERE from_sql LOOP "
                 "EXECUTE 'DEALLOCATE ' || quote_ident(s); END LOOP; UNLISTEN *; "
                 "PERFORM pg_advisory_unlock_all(); DISCARD TEMP; END$$")


@dataclass
class FencedTransaction:
    """The handle of :meth:`PostgresBackend.transaction`: write your effects through it.

    Placeholders are ``%s`` with positional parameters, or ``%(name)s`` with a mapping,
    whatever the driver.
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

    async def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None
                      ) -> list[tuple[Any, ...]]:
        """Run ``sql`` inside the fenced transaction; return its rows (empty when none).

        ``params``: a sequence for ``%s`` placeholders, a mapping for ``%(name)s`` ones.
        """
        if isinstance(params, Mapping):  # not tuple(params): that would pass its keys
            return await self._tx.all(sql, params)
        return await self._tx.all(sql, tuple(params or ()))


@asynccontextmanager
async def fenced_transaction(adapter: SqlAdapter, sql: Statements, lease: Lease,
                             complete: bool) -> AsyncIterator[FencedTransaction]:
    """The transaction of :meth:`PostgresBackend.transaction
    <backends.postgres.PostgresBackend.transaction>` on ``adapter``."""
    if not adapter.concurrent:
        raise ConfigurationError(
            "ctx.transaction() needs a PostgresBackend built on a pool or a DSN: on one "
            "connection, the instance's heartbeats wait for the transaction to end, so "
            "its other runs could be taken over; pass a DSN or a psycopg pool"
        )
    # On the backend's own pool, a block that raises resets the session before the
    # rollback (a session advisory lock or a PREPARE outlives a ROLLBACK); one whose
    # statement failed, aborted, can run no reset and closes its connection instead: the
    # server session ends, and through PgBouncer in transaction mode so does the server
    # connection (a reset after the ROLLBACK could reach another server connection there).
    opened = (adapter.discarding_transaction(RESET_SESSION) if adapter.owned
              else adapter.transaction())
    async with opened as tx:
        held = await tx.all(sql.lock_held_run, (lease.job, lease.slot, lease.token))
        if held:  # else ends the (empty) transaction without closing the connection
            yield FencedTransaction(tx, lease, sql.set_checkpoint)
            await _finish(tx, adapter, sql, lease, complete)
    if not held:
        raise LeaseLost(
            f"run {lease.job!r} slot {lease.slot} is no longer held by token "
            f"{lease.token!r}; the fenced transaction did not start"
        )


async def _finish(tx: Executor, adapter: SqlAdapter, sql: Statements, lease: Lease,
                  complete: bool) -> None:
    """End a fenced transaction whose block returned: reset the session, complete or
    extend the run (the commit follows)."""
    if adapter.owned:  # a pool passed in keeps its own reset (its settings are its own)
        await tx.all(RESET_SESSION)
    if not complete:
        # The lease runs from the commit (the lock kept backups out meanwhile).
        await tx.all(sql.extend_held_run, (lease.lease_ms, lease.job, lease.slot,
                                           lease.token))
        return
    done = await tx.all(sql.finish, (
        lease.job, lease.slot, lease.token, Outcome.COMPLETED.value, None))
    if not (done and int(done[0][0])):  # pragma: no cover - the row is locked
        raise LeaseLost(f"run {lease.job!r} slot {lease.slot} was lost mid-transaction")
