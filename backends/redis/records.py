"""The Redis store's records: history, runs, jobs, workflows, and their trimming."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from adapters.redis import Command
from lease_core._structures import Attempt, RunInfo, RunStatus
from lease_core.abc import (
    MEMBER_RETENTION_MS,
    check_every,
    check_leave,
    check_limit,
    check_members,
    check_prune,
)
from lease_core.recovery import STEP_SEPARATOR, sibling_steps, step_job

from .core import RedisStore
from .replies import as_text, attempt_record

__all__ = ["RedisRecords"]

#: Field prefix of a workflow's steps in the ``{P}:meta`` hash.
_WORKFLOW_FIELD = "workflow:"
#: The cap of the limits trimming, maintenance and history are given (a count, ms): beyond any
#: history, and a whole number to Lua's doubles and to Redis (a larger batch or period
#: was refused: 'value is not an integer or out of range').
_FOREVER = 2**53
_SCHEDULE_FIELD = "schedule:"


def _slot(attempt_id: str) -> str:
    """The slot of an attempt id ``<slot>:<attempt>``."""
    return attempt_id.rpartition(":")[0]


class RedisRecords(RedisStore):
    """The history, runs, jobs and workflows of a :class:`~backends.redis.RedisBackend`."""

    trim_round_trip: int = 4_000
    """About the most attempts one pipelined round trip of history trimming deletes
    (:meth:`prune_many`). A backlog (after ``history_size`` was lowered, or trimming was
    off) deleted in one round trip held the server for about a second per 50,000
    attempts, every other client of the server waiting."""

    async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return at most ``limit`` attempts, newest first, of one job or of every job under
        the prefix."""
        check_limit(limit)
        if limit == 0:
            return []
        if job is None:
            (members,) = await self._run([("SMEMBERS", self._jobs_key)])
            jobs = sorted(as_text(m) for m in members)
        else:
            jobs = [job]
        if not jobs:
            return []
        commands = []
        for name in jobs:
            keys = self._job_keys(name)
            commands.append(self._eval("history", [keys["hist"], keys["att"]],
                                       [min(limit, _FOREVER), f"{self._tag(name)}:run:"]))
        items = []
        for name, records in zip(jobs, await self._run(commands), strict=True):
            items += [attempt_record(name, as_text(raw)) for raw in records]
        items.sort(key=lambda a: (a.claimed_at, a.slot, a.attempt), reverse=True)
        return items[:limit]

    async def register_workflows(self, workflows: Mapping[str, Sequence[str]]) -> None:
        """Record each workflow's steps in the ``{P}:meta`` hash (``workflow:<name>``), and
        delete the field of a name given no steps (one round trip)."""
        fields: list[str] = []
        gone: list[str] = []
        for name, steps in workflows.items():
            if steps:
                fields += [_WORKFLOW_FIELD + name, json.dumps(list(steps))]
            else:
                gone.append(_WORKFLOW_FIELD + name)
        commands: list[Command] = []
        if gone:
            commands.append(("HDEL", self._meta_key, *gone))
        if fields:
            commands.append(("HSET", self._meta_key, *fields))
        if not commands:
            return
        await self._run(commands)
        self._remember_meta(fields, gone)

    async def workflows(self) -> dict[str, list[str]]:
        """Return every recorded workflow's steps, in order."""
        return {name: [str(s) for s in json.loads(value)]
                for name, value in (await self._meta_fields(_WORKFLOW_FIELD)).items()}

    async def register_schedules(self, schedules: Mapping[str, str]) -> None:
        """Record each job's schedule spec in the ``{P}:meta`` hash (``schedule:<job>``)."""
        if not schedules:
            return
        fields: list[str] = []
        for name, spec in schedules.items():
            fields += [_SCHEDULE_FIELD + name, spec]
        await self._run([("HSET", self._meta_key, *fields)])
        self._remember_meta(fields)

    def _remember_meta(self, fields: Sequence[str], gone: Sequence[str] = ()) -> None:
        """Keep the ``{P}:meta`` fields this backend recorded (and forget those it
        deleted), which :meth:`~backends.redis.claims.RedisClaims.register_jobs` records
        again after a loss of the data (a bound for processes that make up names)."""
        registered = dict(zip(self._registered[::2], self._registered[1::2], strict=True))
        for field in gone:
            registered.pop(field, None)
        registered.update(zip(fields[::2], fields[1::2], strict=True))
        if len(registered) <= 10_000:
            self._registered = [item for pair in registered.items() for item in pair]

    async def schedules(self) -> dict[str, str]:
        """Return every recorded job's schedule spec."""
        return await self._meta_fields(_SCHEDULE_FIELD)

    async def _meta_fields(self, prefix: str) -> dict[str, str]:
        """The fields of ``{P}:meta`` named ``<prefix><name>``, by name."""
        (raw,) = await self._run([("HGETALL", self._meta_key)])
        pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
        found = {}
        for key, value in pairs:
            name = as_text(key)
            if name.startswith(prefix):
                found[name[len(prefix):]] = as_text(value)
        return found

    async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                         older_than_ms: int | None = None,
                         batch: int = 1000) -> dict[str, int]:
        """Trim the jobs' histories with ``trim.lua`` calls, pipelined
        (:meth:`~lease_core.abc.Backend.prune` is inherited: a batch of one).

        Redis runs a pipeline's scripts back to back while every other client waits, so
        one round trip deletes about :attr:`trim_round_trip` attempts at most: the first
        gives each job an equal share of them (one round trip when no job has more to
        delete than its share), and the jobs that used theirs up go on in the next ones,
        up to ``batch`` of each kind.

        A workflow run's steps are kept while it goes on, and by age (not beyond the
        newest ``keep``) until ``older_than_ms`` after its end. Its steps' keys are in
        other Cluster slots than the job's, so a job named like a step
        (``<workflow>/<step>``) takes two more round trips: its attempts
        to trim are listed (and the recorded workflows read), the runs of its workflow's
        steps at their slots are read (``held.lua``), and the attempts of the workflow
        runs that go on are left out of those deleted. Their slots are kept in the job's
        hold set, whose attempts the next listing does not count toward its batch (a
        listing that found new ones is made again at once): the runs that go on never
        keep the attempts behind them from their turn.
        """
        check_prune(keep, older_than_ms, batch)
        names = list(dict.fromkeys(jobs))
        if not names:
            return {}
        limits = ["" if keep is None else min(keep, _FOREVER),
                  "" if older_than_ms is None else min(older_than_ms, _FOREVER)]
        batch = min(batch, _FOREVER)

        def trim(job: str, *mode: str | int, size: int = batch) -> Command:
            keys = self._job_keys(job)
            return self._eval("trim", [keys[k] for k in ("hist", "att", "done", "orphan",
                                                           "job", "hold")],
                              [*limits, f"{self._tag(job)}:run:", size, *mode])

        steps = [job for job in names if STEP_SEPARATOR in job]
        workflows = sorted({job.partition(STEP_SEPARATOR)[0] for job in steps})
        counts = dict.fromkeys(names, 0)
        # The other jobs in rounds of trim_round_trip attempts at most: the first round
        # (with the steps' listings) gives each job an equal share, the jobs that used
        # theirs up go on in the next rounds, up to ``batch`` of each kind.
        left = dict.fromkeys((job for job in names if job not in steps), batch)
        active, first = list(left), True
        lists: dict[str, Any] = {}
        described: Any = None
        while first or active:
            take = active[:max(1, self.trim_round_trip // 2)]
            share = max(1, self.trim_round_trip // (2 * max(1, len(active))))
            sizes = [min(share, left[job]) for job in take]
            commands = [trim(job, size=size) for job, size in zip(take, sizes, strict=True)]
            if first:
                commands += [trim(job, "list") for job in steps]
                if workflows:
                    commands.append(("HMGET", self._meta_key,
                                     *[_WORKFLOW_FIELD + name for name in workflows]))
            replies = await self._run(commands)
            if first:
                lists = dict(zip(steps, replies[len(take):], strict=False))
                described, first = (replies[-1] if workflows else None), False
            again = []
            for job, size, reply in zip(take, sizes, replies, strict=False):
                counts[job] += int(reply)
                left[job] -= size
                if int(reply) >= size and left[job] > 0:
                    again.append(job)
            active = again + active[len(take):]
        if not steps:
            return counts
        recorded = {name: [str(s) for s in json.loads(as_text(raw))]
                    for name, raw in zip(workflows, described, strict=True) if raw}
        kept_before: dict[str, set[str]] = {}
        while steps:
            listed = {job: ([as_text(i) for i in lists[job][0]],
                            [as_text(i) for i in lists[job][1]],
                            {as_text(i) for i in lists[job][2]})
                      for job in steps if lists[job][0] or lists[job][1]}
            held = await self._held({job: counted + skipped
                                     for job, (counted, skipped, _) in listed.items()},
                                    recorded, older_than_ms)
            final, again = [], []
            for job, (counted, skipped, beyond) in listed.items():
                ids = counted + skipped
                going, ended = held.get(job, (set(), set()))
                # a run that goes on keeps them all; one that ended within the ttl, those
                # found by age only (not beyond the newest history_size)
                kept_ids = {i for i in ids if _slot(i) in going
                            or (_slot(i) in ended and i not in beyond)}
                kept = {_slot(i) for i in kept_ids}
                doomed = [i for i in ids if i not in kept_ids]
                final.append((len(doomed), trim(job, "ids", len(doomed), *doomed,
                                                *sorted(kept))))
                if {_slot(i) for i in counted} & (kept - kept_before.setdefault(job, set())):
                    again.append(job)  # newly held: listed again, past them
                kept_before[job] |= kept
            replies = await self._in_rounds(final)
            for job, reply in zip(listed, replies, strict=True):
                counts[job] += int(reply)
            steps = [job for job in again if counts[job] < batch]
            if steps:
                lists = dict(zip(steps, await self._run([trim(job, "list") for job in steps]),
                                 strict=True))
        return counts

    async def _in_rounds(self, commands: Sequence[tuple[int, Command]]) -> list[Any]:
        """Run trims that delete the given numbers of attempts, pipelined in round trips
        of about :attr:`trim_round_trip` attempts (one trim a round trip at least)."""
        replies: list[Any] = []
        start = 0
        while start < len(commands):
            end, total = start, 0
            while end < len(commands) and (end == start
                                           or total + commands[end][0] <= self.trim_round_trip):
                total += commands[end][0]
                end += 1
            replies += await self._run([command for _, command in commands[start:end]])
            start = end
        return replies

    async def _held(self, listed: Mapping[str, list[str]],
                    recorded: Mapping[str, Sequence[str]],
                    older_than_ms: int | None) -> dict[str, tuple[set[str], set[str]]]:
        """The slots of the attempts ``listed`` (by job) whose workflow run goes on, and
        those whose run ended less than ``older_than_ms`` ago, by job: one ``held.lua``
        call per step of each workflow, in one round trip."""
        slots: dict[str, set[str]] = {}  # by workflow: the slots to look at
        for job, ids in listed.items():
            if sibling_steps(job, recorded):
                slots.setdefault(job.partition(STEP_SEPARATOR)[0], set()).update(
                    _slot(i) for i in ids)
        asked = [(name, step_job(name, step)) for name in sorted(slots)
                 for step in recorded[name]]
        if not asked:
            return {}
        ttl = "" if older_than_ms is None else older_than_ms
        replies = await self._run([
            self._eval("held", [self._job_keys(step)["att"]],
                       [f"{self._tag(step)}:run:", ttl, *sorted(slots[name])])
            for name, step in asked])
        going: dict[str, set[str]] = {}
        ended: dict[str, set[str]] = {}
        for (name, _), (open_slots, recent) in zip(asked, replies, strict=True):
            going.setdefault(name, set()).update(as_text(s) for s in open_slots)
            ended.setdefault(name, set()).update(as_text(s) for s in recent)
        return {job: (going.get(name, set()), ended.get(name, set()) - going.get(name, set()))
                for job in listed if sibling_steps(job, recorded)
                for name in [job.partition(STEP_SEPARATOR)[0]]}

    async def maintenance_due(self, instance_id: str, every_ms: int) -> bool:
        """Win the maintenance period with one ``SET NX PX`` (the key expires with it)."""
        check_every(every_ms)
        (reply,) = await self._run([("SET", self._maintenance_key, instance_id, "NX",
                                     "PX", min(every_ms, _FOREVER))])
        return reply is not None and reply is not False

    async def members(self, instance_id: str, ttl_ms: int) -> list[str]:
        """Renew the membership and list the live members: one ``members.lua`` call on
        the ``{P}:members`` sorted set (one key: one slot on a Cluster)."""
        check_members(instance_id, ttl_ms)
        (names,) = await self._run([self._eval(
            "members", [self._members_key], [instance_id, ttl_ms, MEMBER_RETENTION_MS])])
        return sorted(as_text(name) for name in names)

    async def leave(self, instance_id: str) -> None:
        """End the membership now: one ``ZREM`` from the ``{P}:members`` sorted set."""
        check_leave(instance_id)
        await self._run([("ZREM", self._members_key, instance_id)])

    async def jobs(self) -> list[str]:
        """Return every job under the prefix, sorted."""
        (members,) = await self._run([("SMEMBERS", self._jobs_key)])
        return sorted(as_text(m) for m in members)

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:
        """Return runs, newest slot first.

        Three pipelined round trips at most: the jobs, their open slots and the slots of
        their history (all of it: the newest attempts may be of older slots, so the
        newest slots cannot be told from a page of them; history is trimmed to
        ``history_size``), the runs themselves.
        """
        check_limit(limit)
        names = await self.jobs() if job is None else [job]
        if not names or limit == 0:
            return []
        commands: list[Command] = []
        for name in names:
            keys = self._job_keys(name)
            commands.append(("ZRANGE", keys["open"], 0, -1))
            if not open_only:
                commands.append(("ZRANGE", keys["hist"], 0, -1))
        replies = iter(await self._run(commands))
        wanted: list[tuple[str, int]] = []
        for name in names:
            slots = {int(as_text(s)) for s in next(replies)}
            if not open_only:
                slots |= {int(as_text(i).split(":")[0]) for i in next(replies)}
            wanted += [(name, slot) for slot in sorted(slots, reverse=True)[:limit]]
        if not wanted:
            return []
        rows = await self._run([("HMGET", self._run_key(name, slot), "st", "att", "inst", "exp")
                                for name, slot in wanted])
        found = []
        for (name, slot), row in zip(wanted, rows, strict=True):
            st, att, inst, exp = (None if v is None else as_text(v) for v in row)
            if st is None or (open_only and RunStatus(st).finished):
                continue
            found.append(RunInfo(name, slot, RunStatus(st), int(att or 0), inst,
                                 int(exp) if exp and st == "running" else None))
        found.sort(key=lambda r: (-r.slot, r.job))
        return found[:limit]

