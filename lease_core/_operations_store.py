"""The operations' part of the backend contract: :class:`OperationsStore`.

:class:`~lease_core.abc.Backend` derives from it. See :mod:`lease_core.operations` for
what each operation writes; a backend implements :meth:`OperationsStore.operate` (and
overrides the two reads when it has a cheaper one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._structures import RunInfo, RunStatus
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .operations import Operation, OperationResult

__all__ = ["QUEUED_LIMIT", "OperationsStore"]

#: The most runs one :meth:`OperationsStore.queued` read returns (PostgreSQL's ``queued``
#: statement has the same ``LIMIT``).
QUEUED_LIMIT = 1000


class OperationsStore:
    """Operations on a store: one call, and the two reads the engine and the API make."""

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:  # pragma: no cover - Backend's
        """Return runs as the store holds them now (see :meth:`Backend.runs`)."""
        raise NotImplementedError

    async def operate(self, op: Operation) -> OperationResult:
        """Make the operation ``op`` atomically, or refuse it changing nothing.

        See :mod:`lease_core.operations`. The default raises
        :class:`~lease_core.errors.ConfigurationError`: a backend without operations.
        """
        raise ConfigurationError(
            f"{type(self).__name__} has no operations ({op.kind} of {op.job!r}); the "
            "memory, PostgreSQL and Redis backends have them")

    async def paused(self) -> dict[str, str]:
        """Return the paused jobs, each with who paused it (the default: none)."""
        return {}

    async def heartbeats(self, runs: Sequence[tuple[str, int]],
                         ) -> dict[tuple[str, int], int | None]:
        """Return when the lease of each run was last renewed, for the status API.

        ``None`` for a run never renewed. A claim does not reset it: after a takeover,
        hand-over or retry it may be an earlier attempt's renewal, older than the current
        attempt's claim (the status API shows the later of the two). The runs of a store
        that keeps no such record are left out (the default: every run).
        """
        return {}

    async def queued(self, jobs: Sequence[str]) -> list[tuple[str, int]]:
        """Return the triggered and retried runs of ``jobs`` that no attempt claimed yet.

        The engine reads it once per heartbeat to run them (no instance watches them).
        Sorted by job, then slot; at most :data:`QUEUED_LIMIT` (the rest come in later
        reads, as these are claimed). The built-in backends return only those; the
        default, derived from :meth:`runs`, returns every ``handed_over`` run (a plain
        hand-over too, which the backups watching it claim anyway).
        """
        wanted = set(jobs)
        return sorted((r.job, r.slot)
                      for r in await self.runs(open_only=True, limit=QUEUED_LIMIT)
                      if r.job in wanted and r.status is RunStatus.HANDED_OVER)
