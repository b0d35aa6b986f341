"""Held leases on Redis: renewals, finishes, hand-overs, backups' checks, checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adapters.redis import Command
from lease_core._structures import CheckResult, HeartbeatResult, Lease, Outcome, RunState, RunStatus
from lease_core.abc import decode_checkpoint, encode_checkpoint, finish_status

from .core import RedisStore
from .replies import as_text, time_ms
from .scripts import HEARTBEAT_BATCH, SCRIPT_BATCH, SCRIPTS

__all__ = ["RedisLeases"]

_FINISH_SHA = SCRIPTS["finish"].sha
_FINISH_MANY_SHA = SCRIPTS["finish_many"].sha
#: The run status each outcome finish() takes ends a run with (finish_status, cached).
_FINISH_STATUS: dict[object, str] = {
    o: finish_status(o).value for o in (Outcome.COMPLETED, Outcome.FAILED, Outcome.TIMED_OUT)}


def _any_done(replies: list[Any]) -> bool:
    """True when a script of ``replies`` wrote (answered a number other than 0)."""
    return any(int(reply) != 0 for reply in replies)


class RedisLeases(RedisStore):
    """What a :class:`~backends.redis.RedisBackend` does with the runs it holds or watches."""

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        """Renew every lease to ``now + lease_ms`` in one round trip.

        On a server that is not a Cluster, one script call renews up to
        :data:`HEARTBEAT_BATCH` leases of any jobs; on a Cluster, one script call per
        job renews all of that job's leases (their keys share the job's hash tag, so one
        slot). The calls go in one pipeline.
        """
        if not leases:
            return HeartbeatResult(await self.now_ms())
        adapter = await self._require()
        groups: list[list[Lease]]
        if adapter.cluster:
            by_job: dict[str, list[Lease]] = {}
            for lease in leases:
                by_job.setdefault(lease.job, []).append(lease)
            groups = list(by_job.values())
        else:
            groups = [list(leases[at:at + HEARTBEAT_BATCH])
                      for at in range(0, len(leases), HEARTBEAT_BATCH)]
        commands = []
        for group in groups:
            args: list[str | int] = []
            for lease in group:
                args += [lease.token, int(lease.lease_ms)]
                self._longest_ms = max(self._longest_ms, int(lease.lease_ms))
            commands.append(self._eval(
                "heartbeat", [self._run_key(lease.job, lease.slot) for lease in group], args))
        replies = await self._run([*commands, *self._wait()])
        held: set[str] = set()
        cancelled: dict[str, int] = {}
        now = 0
        for group, (at, flags, graces) in zip(groups, replies, strict=False):
            now = max(now, int(at))
            left = iter(graces)
            for lease, flag in zip(group, as_text(flags), strict=True):
                if flag == "1":
                    held.add(lease.token)
                elif flag == "c":  # cancel(grace=): the grace left, in order
                    cancelled[lease.token] = int(next(left))
        if held and self.wait_replicas is not None:
            self._check_wait(replies[-1], f"the heartbeat of {len(held)} lease(s)")
        return HeartbeatResult(now, frozenset(held), cancelled=cancelled)

    async def finish(self, lease: Lease, outcome: Outcome, error: str | None = None) -> bool:
        """End the attempt with ``outcome``: one ``finish.lua`` call (see
        :meth:`~lease_core.abc.Backend.finish`)."""
        status = (_FINISH_STATUS.get(outcome) if isinstance(outcome, str) else None
                  ) or finish_status(outcome).value
        (done,) = await self._run_acked(
            (self._finish_command(lease, status, error),),
            f"the finish of {lease.job!r} slot {lease.slot}", _any_done)
        return int(done) == 1

    async def finish_many(
        self, items: Sequence[tuple[Lease, Outcome, str | None]]
    ) -> list[bool]:
        """End the attempts in order, in one round trip
        (:meth:`~lease_core.abc.Backend.finish` is inherited: a batch of one).

        On a server that is not a Cluster, one ``finish_many.lua`` call ends up to
        :data:`SCRIPT_BATCH` attempts (each exactly as ``finish.lua`` would), sent as one
        argument per finish and answered as one string of flags: packing a dozen values
        per finish cost the client more than the finishes cost the server. On a Cluster
        each finish is its own ``finish.lua`` call, routed to its job's slot, as is every
        finish of a batch with a token holding ``|`` (the fields' separator).
        """
        if not items:
            return []
        ended = [(lease, finish_status(outcome).value, error) for lease, outcome, error in items]
        adapter = await self._require()
        if len(ended) == 1 or adapter.cluster or any("|" in lease.token for lease, _, _ in ended):
            commands = [self._finish_command(*item) for item in ended]
            replies = await self._run_acked(commands, f"the finishes of {len(commands)} runs",
                                            _any_done)
            return [int(done) == 1 for done in replies]
        commands = [self._finishes_command(ended[at:at + SCRIPT_BATCH])
                    for at in range(0, len(ended), SCRIPT_BATCH)]
        replies = await self._run_acked(commands, f"the finishes of {len(ended)} runs",
                                        lambda found: "1" in "".join(map(as_text, found)))
        return [flag == "1" for flag in "".join(map(as_text, replies))]

    def _finishes_command(self, items: Sequence[tuple[Lease, str, str | None]]) -> Command:
        """One ``finish_many.lua`` call for ``items`` (a server that is not a Cluster)."""
        keys = []
        args = []
        for lease, status, error in items:
            slot = int(lease.slot)
            keys.append(f"{self._tag(lease.job)}:run:{slot}")
            args.append(f"{lease.token}|{slot}|{status}|" + ("" if error is None
                                                             else "E" + error))
        return ("EVALSHA", _FINISH_MANY_SHA, len(keys), *keys, *args)

    def _finish_command(self, lease: Lease, status: str, error: str | None) -> Command:
        tag = self._tag(lease.job)
        slot = int(lease.slot)
        if error is None:
            return ("EVALSHA", _FINISH_SHA, 4, f"{tag}:run:{slot}", f"{tag}:open",
                    f"{tag}:att", f"{tag}:done", lease.token, slot, status)
        return ("EVALSHA", _FINISH_SHA, 4, f"{tag}:run:{slot}", f"{tag}:open", f"{tag}:att",
                f"{tag}:done", lease.token, slot, status, error)

    # -- retries within a run (issue 19, part 1)
    async def retry_later(
        self, items: Sequence[tuple[Lease, Outcome, str | None, Sequence[int]]]
    ) -> list[int]:
        """End the failed attempts, one ``retry_later.lua`` call each, in one round trip."""
        commands = []
        for lease, outcome, error, delays in items:
            tag, slot = self._tag(lease.job), int(lease.slot)
            commands.append(self._eval(
                "retry_later", [f"{tag}:run:{slot}", f"{tag}:open", f"{tag}:att", f"{tag}:done"],
                [lease.token, slot, finish_status(outcome).value,
                 "" if error is None else "E" + error, *(int(d) for d in delays)]))
        if not commands:
            return []
        # Not sent again after a failed connection: a second end of the same attempt
        # would answer that the token lost its run (the engine then watches it instead).
        replies = await self._run_acked(commands, f"the retries of {len(commands)} runs",
                                        lambda found: any(int(r) >= 0 for r in found),
                                        resend=False)
        return [int(answer) for answer in replies]

    async def hand_over(self, leases: Sequence[Lease]) -> frozenset[str]:
        """Mark each held run ``handed_over``, in one pipelined round trip."""
        if not leases:
            return frozenset()
        commands = []
        for lease in leases:
            keys = self._job_keys(lease.job)
            commands.append(self._eval(
                "hand_over", [self._run_key(lease.job, lease.slot), keys["att"], keys["done"]],
                [lease.token, int(lease.slot)],
            ))
        replies = await self._run(commands)
        return frozenset(lease.token for lease, r in zip(leases, replies, strict=True)
                         if int(r) == 1)

    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        """Read the watched runs and the server time in one pipelined round trip.

        The same round trip reads the data markers of the runs' jobs: a missing run of a
        job whose marker is gone or changed, or whose quarantine is not over, or whose
        last win was on another server (``moved.lua``: a promoted replica, a restarted
        server, before any claim there found the move), was lost with the data
        (``lost``): the scheduler claims it again, and that claim finds the loss.
        """
        commands: list[Command] = [("TIME",)]
        commands += [("HMGET", self._run_key(job, slot), "st", "att", "exp", "inst")
                     for job, slot in runs]
        # Every job's marker: a known one tells a loss, an unknown one is learnt (a backup
        # ranked after the job's first claimer may never have claimed it itself).
        jobs = list(dict.fromkeys(job for job, _ in runs))
        known = [job for job in jobs if job in self._markers]
        commands += [("HGET", f"{self._tag(job)}:job", "sid") for job in jobs]
        # Jobs whose last win was on another server (a promoted replica, a restarted
        # one): a run missing there may be a claim the failover lost, not a deletion,
        # before any claim there has found the move. One call per job on a Cluster.
        adapter = self._adapter or await self._require()
        groups = [[job] for job in jobs] if adapter.cluster else [jobs] if jobs else []
        commands += [self._eval("moved", [f"{self._tag(job)}:job" for job in group], [])
                     for group in groups]
        replies = await self._run(commands)
        found = {}
        for (job, slot), reply in zip(runs, replies[1:], strict=False):
            st, att, exp, inst = (None if v is None else as_text(v) for v in reply)
            if st is not None:
                found[(job, slot)] = RunState(job, slot, RunStatus(st), int(att or 0),
                                              int(exp) if exp else None, inst)
        now = time_ms(replies[0])
        at = 1 + len(runs) + len(jobs)
        markers = dict(zip(jobs, replies[1 + len(runs):at], strict=True))
        moved = "".join(as_text(flags) for flags in replies[at:])
        changed = {job for job in known
                   if markers[job] is None or as_text(markers[job]) != self._markers.get(job)
                   or now < self._quiet.get(job, 0)}
        changed.update(job for job, flag in zip(jobs, moved, strict=True) if flag == "1")
        for job in jobs:
            if job not in self._markers and markers[job] is not None:
                self._markers[job] = as_text(markers[job])
        lost = frozenset(run for run in runs if run[0] in changed and run not in found)
        return CheckResult(now, found, lost)

    async def get_checkpoint(self, job: str, slot: int) -> Any:
        """Return the run's checkpoint, or ``None``."""
        (text,) = await self._run([("HGET", self._run_key(job, slot), "cp")])
        return decode_checkpoint(None if text is None else as_text(text))

    async def set_checkpoint(self, lease: Lease, value: Any) -> bool:
        """Store the checkpoint as JSON text, fenced by the lease's token."""
        text = encode_checkpoint(value)
        (done,) = await self._run_acked([self._eval(
            "checkpoint", [self._run_key(lease.job, lease.slot)], [lease.token, "set", text]
        )], f"the checkpoint of {lease.job!r} slot {lease.slot}", _any_done)
        return int(done) == 1

    async def delete_checkpoint(self, lease: Lease) -> bool:
        """Remove the checkpoint, fenced by the lease's token."""
        (done,) = await self._run_acked([self._eval(
            "checkpoint", [self._run_key(lease.job, lease.slot)], [lease.token, "del", ""]
        )], f"the checkpoint deletion of {lease.job!r} slot {lease.slot}", _any_done)
        return int(done) == 1
