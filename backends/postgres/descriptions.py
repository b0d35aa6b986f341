"""What a PostgreSQL store records for readers without declarations: workflows, schedules.

Both live in ``<table>_meta``, one row per workflow (``workflow:<name>``, its steps as a
JSON array) and per job (``schedule:<job>``, its schedule spec as JSON), each written in
one statement that rewrites only what changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from adapters.sql import SqlAdapter
from lease_core.abc import Backend

from .statements import Statements

__all__ = ["StoreDescriptions"]


class StoreDescriptions(Backend):
    """The workflow and schedule records of :class:`~backends.postgres.PostgresBackend`."""

    _sql: Statements

    @property
    def _adapter(self) -> SqlAdapter:  # pragma: no cover - PostgresBackend's is used
        raise NotImplementedError

    async def register_workflows(self, workflows: Mapping[str, Sequence[str]]) -> None:
        """Record each workflow's steps in ``<table>_meta`` (one statement; rewrites only
        what changed, and deletes the row of a name given no steps)."""
        if not workflows:
            return
        names = sorted(workflows)
        await self._adapter.all(self._sql.write_workflows, (
            names, [json.dumps(list(workflows[name])) for name in names]))

    async def workflows(self) -> dict[str, list[str]]:
        """Return every recorded workflow's steps, in order."""
        rows = await self._adapter.all(self._sql.read_workflows)
        return {str(name): [str(s) for s in json.loads(value)] for name, value in rows}

    async def register_schedules(self, schedules: Mapping[str, str]) -> None:
        """Record each job's schedule spec in ``<table>_meta`` (one statement; rewrites only
        what changed)."""
        if not schedules:
            return
        names = sorted(schedules)
        await self._adapter.all(self._sql.write_schedules,
                                (names, [schedules[name] for name in names]))

    async def schedules(self) -> dict[str, str]:
        """Return every recorded job's schedule spec."""
        rows = await self._adapter.all(self._sql.read_schedules)
        return {str(name): str(value) for name, value in rows}
