"""The psycopg pools' part of :mod:`adapters.psycopg`: the ``AsyncConnectionPool``
subclasses of :class:`~adapters.psycopg.PsycopgDsnAdapter`, and what the pool adapters
do with a pool.

Both subclasses hook psycopg_pool internals (it has no public option for either); a
psycopg_pool without the hook behaves as its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool

from lease_core.errors import BackendUnavailable, ConfigurationError

from .base import CANCEL_GRACE_S, TransientError

__all__ = ["RECONNECT_MAX_DELAY_S", "CappedReconnectPool", "RecentFirstPool", "check_after",
           "dsn_pools", "give_back", "refuse_unopened"]

#: The longest wait (seconds) between two reconnection attempts of a pool opened from a DSN.
RECONNECT_MAX_DELAY_S = 2.0

try:  # psycopg_pool >= 3.2.1 (the declared minimum); 3.1 and 3.2.0 call it ConnectionAttempt
    from psycopg_pool.base import AttemptWithBackoff as _Attempt
except ImportError:  # pragma: no cover - depends on the install
    try:
        from psycopg_pool.base import (  # type: ignore[attr-defined,no-redef]
            ConnectionAttempt as _Attempt,
        )
    except ImportError:
        _Attempt = None  # type: ignore[assignment,misc]


class CappedReconnectPool(AsyncConnectionPool[Any]):
    """An ``AsyncConnectionPool`` whose reconnection attempts are at most
    :data:`RECONNECT_MAX_DELAY_S` apart.

    psycopg_pool doubles the wait between two attempts to reconnect a lost connection (1s,
    2s, 4s, ... until its ``reconnect_timeout``, 5 minutes): after an outage of a minute
    the pool tried again up to a minute after the server was back, and the scheduler
    could reach its store (``health().ready``, any claim) only then.
    """

    async def _add_connection(self, attempt: Any = None, *args: Any, **kwargs: Any) -> None:
        if attempt is None and _Attempt is not None:
            try:
                attempt = _CappedAttempt(timeout=self.reconnect_timeout)
            except TypeError:  # another psycopg_pool's signature: its own backoff, as is
                attempt = None
        try:
            await super()._add_connection(attempt, *args, **kwargs)
        finally:
            _cancel_again_if_swallowed()


def _cancel_again_if_swallowed() -> None:
    """Cancel the current task again if it was cancelled during a connection attempt.

    psycopg_pool catches the cancellation of its connection attempts, and its workers
    that of their tasks, so that a worker never dies: a loop that ended (``asyncio.run``
    returning, say with a lease left held) while one of the pool's connections was being
    made cancelled that worker, which went back to wait for its next task, and
    ``asyncio.run`` waited for it for ever. Cancelled again, the worker's next wait (outside
    psycopg_pool's catch) ends it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.cancel()


if _Attempt is not None:
    class _CappedAttempt(_Attempt):
        """psycopg_pool's backoff, its wait capped at :data:`RECONNECT_MAX_DELAY_S`."""

        def update_delay(self, now: float) -> None:
            super().update_delay(now)
            self.delay = min(self.delay, RECONNECT_MAX_DELAY_S)


class RecentFirstPool(CappedReconnectPool):
    """An ``AsyncConnectionPool`` that lends the idle connection given back last first.

    psycopg_pool lends idle connections in turn (first in, first out). A pool that grew
    in a burst then spreads sequential statements over every server process it holds,
    each woken from sleep: +265-437 µs of wall time per acquire + release measured on a
    pool of 3 against a pool of 1. Lent last-in first, sequential work stays on one
    server process, and the idle ones left are those the pool closes first when it
    shrinks (from the other end). A psycopg_pool without this hook lends in turn.
    """

    async def _get_ready_connection(self, timeout: float | None) -> Any:  # noqa: ASYNC109
        idle = self._pool  # (called under the pool's lock)
        if len(idle) > 1:
            idle.rotate(1)  # the last given back to the front, the others in order
        return await super()._get_ready_connection(timeout)


def dsn_pools(conninfo: str, min_size: int, max_size: int, timeout: float,
              ) -> tuple[AsyncConnectionPool[Any], AsyncConnectionPool[Any]]:
    """The two pools of a :class:`~adapters.psycopg.PsycopgDsnAdapter`, unopened: its pool
    of ``max_size`` connections, and its one reserved connection (heartbeats). Made anew
    at each open after a close: a psycopg pool closed is never opened again."""
    kwargs = {"autocommit": True, "prepare_threshold": None}
    return (RecentFirstPool(conninfo, min_size=min_size, max_size=max_size, open=False,
                            timeout=timeout, kwargs=kwargs, name="anarchon"),
            CappedReconnectPool(conninfo, min_size=1, max_size=1, open=False,
                                timeout=timeout, kwargs=kwargs, name="anarchon-reserved"))


def refuse_unopened(pool: Any) -> None:
    """Refuse a pool passed in that is not open (never opened, or closed): psycopg fails
    each statement on it ("not open yet"), which read as a store that cannot be reached,
    and a scheduler waited for it for ever."""
    if pool.closed:
        raise ConfigurationError(
            f"the psycopg pool {pool.name!r} passed to the backend is not open: open it "
            "before the backend starts (await pool.open(), pool.open(), or 'async with' / "
            "'with' the pool), or give the backend a DSN and it makes a pool of its own")


async def give_back(pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]) -> None:
    """Return ``conn`` to ``pool``, shielded: a connection lost between the pool and its
    borrower would shrink the pool."""
    with anyio.CancelScope(shield=True):
        await pool.putconn(conn)


async def check_after(exc: BackendUnavailable, pool: AsyncConnectionPool[Any]) -> None:
    """After a connection failure, test the other pool's idle connections (a restart of the
    server broke them too), so that each is not found broken by a call of its own."""
    if isinstance(exc, TransientError) or pool.closed:
        return
    with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_GRACE_S):
        await pool.check()
