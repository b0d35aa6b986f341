"""Operations on a PostgreSQL store (lease_core/operations.py): one function call each.

An operation is one call of ``<table>_op_v<N>`` (``postgres_sql/operate_v4.sql``), made
under the job row's lock that every claim of the job takes first; the engine's read of
queued runs and the status API's read of paused jobs are one statement each
(``postgres_sql/operations.sql``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from adapters.sql import TransientError
from lease_core._structures import RunStatus
from lease_core.errors import ConfigurationError, StoreRefused
from lease_core.operations import Operation, OperationResult

from .descriptions import StoreDescriptions

if TYPE_CHECKING:
    from .schema import StoreSchema

__all__ = ["StoreOperations"]

#: How many times an operation PostgreSQL aborted (a deadlock) is made in all.
_ABORTED_RETRIES = 5


class StoreOperations(StoreDescriptions):
    """The operations of :class:`~backends.postgres.PostgresBackend`."""

    _store: StoreSchema

    async def _open_joined(self) -> None:
        """Upgrade a store read as it is (``start(create=False)``): at a ``start()``
        joining that reader's (see :meth:`lease_core.abc.Backend.start`), or an operation.
        A store user who may not gets :class:`~lease_core.errors.StoreRefused`."""
        try:
            await self._store.upgrade_read_as_is(self._adapter)
        except ConfigurationError as exc:
            if not isinstance(exc, StoreRefused):
                raise StoreRefused(str(exc)) from exc  # the store's setup, not the call
            raise

    async def operate(self, op: Operation) -> OperationResult:
        """Make ``op`` in one call of the operations function, or refuse it (see there).

        A backend opened with ``start(create=False)`` (``anarchon serve``, a reader) reads
        the store as it is, perhaps of older store code, without the operations function:
        the first operation upgrades it in place first, as ``start()`` does (it called a
        function that was not there: the driver's "function does not exist", a 500 of
        the status API). A store user who may not upgrade it gets
        :class:`~lease_core.errors.StoreRefused` naming ``anarchon migrate``.
        """
        if self._store.read_as_is:  # not upgraded: each operation tries until one did
            await self._open_joined()
        params = (str(op.kind), op.job, op.slot, op.by, op.grace_ms)
        for tries_left in reversed(range(_ABORTED_RETRIES)):
            try:
                [(refused, slot, status)] = await self._adapter.all(self._sql.operate, params)
                break
            except TransientError:
                # PostgreSQL aborted it (a deadlock with a claim, a resume or a trim: see
                # operate_v4.sql), so nothing was written: made again, as a claim is.
                if not tries_left:
                    raise
        return OperationResult(None if refused is None else str(refused),
                               None if slot is None else int(slot),
                               None if status is None else RunStatus(status))

    async def paused(self) -> dict[str, str]:
        """Return the paused jobs, each with who paused it."""
        return {str(job): str(by) for job, by in await self._adapter.all(self._sql.paused)}

    async def queued(self, jobs: Sequence[str]) -> list[tuple[str, int]]:
        """Return the ``handed_over`` runs of ``jobs`` (one read of the open runs' index)."""
        rows = await self._adapter.all(self._sql.queued, (list(jobs),))
        return [(str(job), int(slot)) for job, slot in rows]

    async def heartbeats(self, runs: Sequence[tuple[str, int]],
                         ) -> dict[tuple[str, int], int | None]:
        """Return each run's last renewal (``heartbeat_ms``), in one read."""
        rows = await self._adapter.all(self._sql.heartbeats,
                                       ([job for job, _ in runs], [slot for _, slot in runs]))
        return {(str(job), int(slot)): None if at is None else int(at)
                for job, slot, at in rows}
