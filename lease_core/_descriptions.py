"""The store's descriptions of declarations, part of the backend contract:
:class:`DescriptionStore`.

:class:`~lease_core.abc.Backend` derives from it. Schedulers record their workflows' steps
and their jobs' schedules at start, for readers of the store that have no declarations
(the status API and page, ``anarchon status``, the operations on a workflow by its name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["DescriptionStore"]


class DescriptionStore:
    """Workflows' steps and jobs' schedules, as recorded by the schedulers."""

    async def register_workflows(self, workflows: Mapping[str, Sequence[str]]) -> None:
        """Record each workflow's steps, in order, so readers of the store can show them.

        A workflow's steps run as jobs ``<workflow>/<step>`` (see :mod:`lease_core.recovery`);
        this records which jobs those are and their order, for status pages that have no
        declarations. A newer registration replaces an older one, and a name given no
        steps (``[]``) is no longer a workflow: its record is removed (a scheduler
        registers each of its plain jobs so, which ends the record of a workflow turned
        into a job of the same name). The default keeps them in this object only; the
        built-in backends keep them in the store.
        """
        known = self.__dict__.setdefault("_workflows_here", {})
        for name, steps in workflows.items():
            if steps:
                known[name] = list(steps)
            else:
                known.pop(name, None)

    async def workflows(self) -> dict[str, list[str]]:
        """Return every recorded workflow's steps, in order (see :meth:`register_workflows`)."""
        return dict(self.__dict__.get("_workflows_here", {}))

    async def register_schedules(self, schedules: Mapping[str, str]) -> None:
        """Record each job's schedule (a JSON :meth:`~lease_core.schedules.Schedule.spec`).

        For readers of the store that have no declarations: the status page shows each
        job's schedule and next slot from them. A newer registration replaces an older
        one. The scheduler adds ``since_ms`` to a spec, when its schedule took effect
        (it reads the record back at its start, so a changed schedule catches up no slot
        from before its release). The default keeps them in this object only; the
        built-in backends keep them in the store.
        """
        known = self.__dict__.setdefault("_schedules_here", {})
        known.update(schedules)

    async def schedules(self) -> dict[str, str]:
        """Return every recorded job's schedule spec (see :meth:`register_schedules`)."""
        return dict(self.__dict__.get("_schedules_here", {}))
