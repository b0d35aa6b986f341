"""Retries within a run on PostgreSQL (issue 19, part 1): ``retry_later``.

A failed attempt with retries left ends in one fenced statement (``retry_later`` in
``postgres_sql/queries.sql``) that leaves its run ``retrying`` until the retry is due; the
claim function (``claim_v4.sql``) then hands it to the next claim, reason ``retry``.
"""

from __future__ import annotations

from collections.abc import Sequence

from adapters.sql import SqlAdapter
from lease_core._structures import Lease, Outcome
from lease_core.abc import Backend, finish_status

from .statements import Statements

__all__ = ["StoreRetries"]


class StoreRetries(Backend):
    """:meth:`~lease_core.abc.Backend.retry_later` of the PostgreSQL backend."""

    _sql: Statements

    @property
    def _adapter(self) -> SqlAdapter:  # pragma: no cover - PostgresBackend's is used
        raise NotImplementedError

    async def retry_later(
        self, items: Sequence[tuple[Lease, Outcome, str | None, Sequence[int]]]
    ) -> list[int]:
        """End each failed attempt in one fenced statement (failures are rare: one each)."""
        statuses = [finish_status(outcome) for _, outcome, _, _ in items]
        answers = []
        for (lease, _, error, delays), status in zip(items, statuses, strict=True):
            rows = await self._adapter.all(self._sql.retry_later, (
                lease.job, lease.slot, lease.token, status.value, error, list(delays)))
            answers.append(int(rows[0][0]) if rows else -1)
        return answers
