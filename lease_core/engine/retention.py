"""Retention: the fleet's history trimming, one instance per period, in a task of its own.

Renewals and backup checks never wait behind it, and a claim never trims: every
``prune_every`` the one instance whose :meth:`Backend.maintenance_due
<lease_core.abc.Backend.maintenance_due>` wins the period trims every job of the store,
:data:`~lease_core.engine.base.PRUNE_JOBS` jobs per ``prune_many`` call, for at most half
the period; the next period goes on where it stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from .. import events as ev
from .._durations import to_ms
from . import base
from .base import logger

if TYPE_CHECKING:
    from .session import Session

__all__ = ["Retention"]


class Retention:
    """Trims history for one scheduler, going on where its last trimming stopped."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self._carry = session.carry

    async def run(self) -> None:
        """Trim every ``prune_every`` until the scheduler stops (nothing if it is None)."""
        s = self._s
        every = s.settings.prune_every
        if every is None:
            return
        with s.stoppable():
            await anyio.sleep(min(s.settings.heartbeat, every))
            while not s.stopping:
                began = anyio.current_time()
                with anyio.move_on_after(every):
                    try:
                        await self.trim(began + every / 2)
                    except Exception as exc:
                        s.clock.failed("history trimming", exc, write=True)
                await anyio.sleep(max(0.0, began + every - anyio.current_time()))

    async def trim(self, budget_ends: float) -> None:
        """Trim every job of the store, if this instance wins the period's maintenance."""
        s = self._s
        settings = s.settings
        assert settings.prune_every is not None
        backend = settings.backend
        if not await backend.maintenance_due(settings.instance_id,
                                             to_ms(settings.prune_every)):
            return
        began = anyio.current_time()
        names = await backend.jobs()
        start = self._carry.prune_next
        if start is not None:  # go on where the last budget ran out
            names = [j for j in names if j >= start] + [j for j in names if j < start]
        deleted = 0
        trimmed: dict[str, None] = {}
        complete = False
        batch = base.PRUNE_BATCH
        try:
            # PRUNE_JOBS jobs per prune_many call (one statement or round trip); a job
            # that lost a full batch goes again first, in the next call.
            pending = names
            while pending:
                self._carry.prune_next = pending[0]
                if anyio.current_time() >= budget_ends:
                    break
                chunk = pending[:base.PRUNE_JOBS]
                counts = await backend.prune_many(
                    chunk, keep=settings.history_size,
                    older_than_ms=settings.history_ttl_ms, batch=batch)
                again = [name for name in chunk if counts.get(name, 0) >= batch]
                trimmed.update(dict.fromkeys(name for name in chunk if counts.get(name)))
                deleted += sum(counts.get(name, 0) for name in chunk)
                pending = again + pending[len(chunk):]
            else:
                self._carry.prune_next = None
                complete = True
        finally:
            # Also when a call failed or the period's deadline cut it short: what the
            # earlier calls deleted is reported.
            self._report(deleted, tuple(trimmed), complete, anyio.current_time() - began)

    def _report(self, deleted: int, jobs: tuple[str, ...], complete: bool,
                took: float) -> None:
        s = self._s
        settings = s.settings
        if deleted or not complete:
            logger.info("instance %s trimmed %d attempts of %d jobs in %.2fs%s",
                        settings.instance_id, deleted, len(jobs), took,
                        "" if complete else f"; {self._carry.prune_next} next")
        if deleted:
            s.bus.emit(ev.HistoryTrimmed(instance_id=settings.instance_id, attempts=deleted,
                                         jobs=jobs, complete=complete, duration=took))
