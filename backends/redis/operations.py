"""Operations on a Redis store (lease_core/operations.py): one script call each.

An operation is one call of ``operate.lua`` on the job's keys (one hash slot, so a Redis
Cluster runs it on one node), atomic like every script, with a key of its own that keeps
its answer for 10 minutes: sent again after a failed connection, it answers again and
changes nothing (a trigger sent twice makes one run). The paused jobs are read from
each job hash's ``paused`` field, in one pipelined round trip after the job list; the
last renewal of a run (``heartbeat.lua`` writes it) from the run hash's ``hb``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from lease_core._operations_store import QUEUED_LIMIT
from lease_core._structures import RunStatus
from lease_core.operations import Operation, OperationResult

from .core import RedisStore
from .replies import as_text

__all__ = ["RedisOperations"]


class RedisOperations(RedisStore):
    """The operations of :class:`~backends.redis.RedisBackend`."""

    async def operate(self, op: Operation) -> OperationResult:
        """Make ``op`` in one call of ``operate.lua``, or refuse it (see there)."""
        keys = self._job_keys(op.job)
        # The operation's own key makes the call safe to send twice (see operate.lua).
        once = f"{self._tag(op.job)}:op:{uuid.uuid4().hex}"
        (reply,) = await self._run_acked([self._eval(
            "operate", [keys["job"], keys["open"], keys["att"], keys["done"], once, keys["hist"]],
            [str(op.kind), "" if op.slot is None else int(op.slot), op.by,
             f"{self._tag(op.job)}:run:", int(op.grace_ms)])],
            f"the operation {op.kind} of {op.job!r}",
            lambda replies: as_text(replies[0]).startswith("|"))  # refused: 'why|...'
        refused, slot, status = as_text(reply).split("|")
        return OperationResult(refused or None, int(slot) if slot else None,
                               RunStatus(status) if status else None)

    async def paused(self) -> dict[str, str]:
        """Return the paused jobs, each with who paused it."""
        (members,) = await self._run([("SMEMBERS", self._jobs_key)])
        names = sorted(as_text(m) for m in members)
        if not names:
            return {}
        found = await self._run([("HGET", self._job_keys(name)["job"], "paused")
                                 for name in names])
        return {name: as_text(by) for name, by in zip(names, found, strict=True)
                if by is not None}

    async def queued(self, jobs: Sequence[str]) -> list[tuple[str, int]]:
        """Return the triggered and retried runs of ``jobs`` not claimed yet: the open
        slots of each job, then their ``st`` and ``q``, in two round trips."""
        if not jobs:
            return []
        opened = await self._run([("ZRANGE", self._job_keys(job)["open"], 0, -1)
                                  for job in jobs])
        keys = [(job, int(as_text(s))) for job, slots in zip(jobs, opened, strict=True)
                for s in slots]
        if not keys:
            return []
        rows = await self._run([("HMGET", self._run_key(job, slot), "st", "q")
                                for job, slot in keys])
        return sorted(key for key, (st, q) in zip(keys, rows, strict=True)
                      if q is not None and st is not None
                      and as_text(st) == "handed_over")[:QUEUED_LIMIT]

    async def heartbeats(self, runs: Sequence[tuple[str, int]],
                         ) -> dict[tuple[str, int], int | None]:
        """Return each run's last renewal (the run hash's ``hb``), in one round trip."""
        if not runs:
            return {}
        rows = await self._run([("HMGET", self._run_key(job, slot), "st", "hb")
                                for job, slot in runs])
        return {key: None if hb is None else int(as_text(hb))
                for key, (st, hb) in zip(runs, rows, strict=True) if st is not None}
