"""RedisClaims on Redis: ``claim.lua`` alone, ``claim_many.lua`` for a batch, in one round trip."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence
from typing import Any

from adapters.redis import Command
from lease_core._structures import ClaimRequest, ClaimResult, ClaimStatus, JobInfo, Lease
from lease_core.errors import BackendUnavailable

from .core import RedisStore
from .replies import as_text, claim_fields, claim_result, counted_replies
from .scripts import SCRIPT_BATCH, SCRIPTS, STORE_FORMAT

__all__ = ["RedisClaims"]

_CLAIM_SHA = SCRIPTS["claim"].sha


class RedisClaims(RedisStore):
    """The claims of a :class:`~backends.redis.RedisBackend` (and the jobs' registration)."""

    async def register_jobs(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """Record the jobs as seen and list their open runs, in one round trip.

        The same scripts give each job its data marker if it has none, and this backend
        keeps the marker of each job it did not know yet: its first claim after a loss
        of the job's data finds the loss (see "Data loss" in the module docs), even if
        it never won the job. A marker it knows is kept, so that a listing made after a
        loss (the marker new) does not hide the loss from its claims.
        """
        names = list(dict.fromkeys(jobs))
        if not names:
            return {}
        commands = []
        seed = secrets.token_hex(16)
        for name in names:
            keys = self._job_keys(name)
            commands.append(self._eval("register", [keys["job"], keys["open"]], [seed]))
        commands.append(("SADD", self._jobs_key, *names))
        # The store-wide records a loss of the data took with it ({P}:meta: the format that
        # read-only tools and operations look for, the workflows' steps that trimming
        # reads, the schedules): the scheduler registers its jobs again at a new epoch.
        # Only the missing ones are recorded again (HSETNX): a new epoch without a loss
        # of {P}:meta (a failover, a Cluster shard's loss) must not write this process's
        # older records (an old release's steps) over newer ones.
        commands.append(("HSETNX", self._meta_key, "format", STORE_FORMAT))
        registered = self._registered
        commands += [("HSETNX", self._meta_key, registered[i], registered[i + 1])
                     for i in range(0, len(registered), 2)]
        replies = await self._run(commands)
        out = {}
        markers = self._markers
        for name, reply in zip(names, replies, strict=False):
            first, last, new, marker, *slots = (as_text(v) for v in reply)
            markers.setdefault(name, marker)
            out[name] = JobInfo(name, int(first), int(last) if last else None,
                                tuple(sorted(int(s) for s in slots)), new == "1")
        return out

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        """Make one claim: one ``claim.lua`` call, as a batch of one would.

        The common case (a job this process listed already, no ``wait_replicas``) skips
        the batch's bookkeeping; the others go through :meth:`claim_many`.
        """
        if self.wait_replicas is not None or request.job not in self._listed:
            (result,) = await self.claim_many([request])
            return result
        lease_ms = int(request.lease_ms)
        if lease_ms > self._longest_ms:
            self._longest_ms = lease_ms
        (reply,) = await self._run((self._claim_command(request),))
        fields = claim_fields(reply)
        result = claim_result(request, fields)
        self._remember([request], [fields], [result])
        return result

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        """Make the claims in order, in one pipelined round trip.

        A lone claim (:meth:`~lease_core.abc.Backend.claim`, inherited: a batch of one) is
        one ``claim.lua`` call.
        On a server that is not a Cluster, one ``claim_many.lua`` call makes up to
        :data:`SCRIPT_BATCH` claims (each exactly as ``claim.lua`` would), sent as one
        argument per claim and answered as one string for the call: packing and reading
        a value per field cost the client more than the claims cost the server. On a
        Cluster each claim is its own ``claim.lua`` call, routed to its job's slot, as is
        every claim of a batch with a token holding ``|`` (the fields' separator).
        """
        if not requests:
            return []
        adapter = await self._require()
        self._longest_ms = max(self._longest_ms, *(int(r.lease_ms) for r in requests))
        # One script call per SCRIPT_BATCH claims of one instance; on a Cluster one call
        # per claim (each job's keys are in the slot of its own hash tag).
        batched = not (len(requests) == 1 or adapter.cluster
                       or any(r.instance_id != requests[0].instance_id or "|" in r.token
                              for r in requests))
        if batched:
            commands = [self._claims_command(requests[at:at + SCRIPT_BATCH])
                        for at in range(0, len(requests), SCRIPT_BATCH)]
        else:
            commands = [self._claim_command(request) for request in requests]
        calls = len(commands)
        new = [job for job in dict.fromkeys(r.job for r in requests) if job not in self._listed]
        if new:
            commands.append(("SADD", self._jobs_key, *new))
        replies = await self._run([*commands, *self._wait()])
        if len(self._listed) > 100_000:  # a bound for processes that make up job names
            self._listed.clear()
        self._listed.update(new)
        if batched:  # one string of counted claim replies per script call
            replies = [*(reply for batch in replies[:calls]
                         for reply in counted_replies(batch, *adapter.encoding)),
                       *replies[calls:]]
        fields = [claim_fields(reply) for reply in replies[:len(requests)]]
        results = [claim_result(request, f)
                   for request, f in zip(requests, fields, strict=True)]
        self._remember(requests, fields, results)
        won = [r for r in results if r.status is ClaimStatus.WON]
        if won and self.wait_replicas is not None:
            what = (f"the claim of {won[0].job!r} slot {won[0].slot}" if len(won) == 1
                    else f"the claims of {len(won)} runs")
            try:
                self._check_wait(replies[-1], what, undone=True)
            except BackendUnavailable:
                await self._give_back(requests, results)
                raise
        return results

    async def _give_back(self, requests: Sequence[ClaimRequest],
                         results: Sequence[ClaimResult]) -> None:
        """Hand over the runs won by claims too few replicas acknowledged (best-effort).

        Not held, such a run would stay ``running`` with a token nobody holds until its
        lease expired, and the next claim would count a takeover (escalating it at once
        under ``max_attempts=1``, although it never ran). Handed over, a backup (or this
        instance's next claim) takes it over at once, and a hand-over is not counted
        toward ``max_attempts``. A hand-over that fails leaves the run to expire as before.
        """
        leases = [Lease(request.job, request.slot, request.token, int(request.lease_ms))
                  for request, result in zip(requests, results, strict=True)
                  if result.status is ClaimStatus.WON]
        with contextlib.suppress(Exception):
            await self.hand_over(leases)

    def _remember(self, requests: Sequence[ClaimRequest], fields: Sequence[Sequence[Any]],
                  results: Sequence[ClaimResult]) -> None:
        """Keep each job's data marker and quarantine end, as the claims' replies say."""
        if len(self._markers) > 100_000:  # a bound for processes that make up job names
            self._markers.clear()
            self._quiet.clear()
            self._seqs.clear()
        seqs = self._seqs
        for request, f in zip(requests, fields, strict=True):
            job = request.job
            if self._markers.get(job) != (marker := as_text(f[6])):
                self._markers[job] = marker
                seqs.pop(job, None)  # a new marker: a new sequence
            if f[8] and int(f[8]) > seqs.get(job, 0):
                seqs[job] = int(f[8])
        for result in results:
            if result.status is ClaimStatus.RUNNING and result.run_status is None:
                self._quiet[result.job] = result.expires_ms or 0

    def _claims_command(self, requests: Sequence[ClaimRequest]) -> Command:
        """One ``claim_many.lua`` call for ``requests`` (a server that is not a Cluster)."""
        args: list[str | int] = [requests[0].instance_id, self._longest_ms]
        keys = []
        markers, seqs = self._markers, self._seqs
        for request in requests:
            keys.append(f"{self._tag(request.job)}:job")
            limit = request.max_attempts
            args.append(f"{int(request.slot)}|{request.token}|{int(request.lease_ms)}|"
                        f"{request.reason.value}|{1 if request.overlap_skip else 0}|"
                        f"{'' if limit is None else int(limit)}|{markers.get(request.job, '')}|"
                        f"{seqs.get(request.job, '')}|{1 if request.scheduled else 0}")
        return self._eval("claim_many", keys, args)

    def _claim_command(self, request: ClaimRequest) -> Command:
        """One ``claim.lua`` call for ``request`` (a Cluster, or a token holding ``|``)."""
        tag = self._tag(request.job)
        limit = request.max_attempts
        return ("EVALSHA", _CLAIM_SHA, 6, f"{tag}:job", f"{tag}:run:{int(request.slot)}",
                f"{tag}:open", f"{tag}:hist", f"{tag}:att", f"{tag}:done",
                int(request.slot), request.instance_id, request.token, int(request.lease_ms),
                request.reason.value, 1 if request.overlap_skip else 0,
                "" if limit is None else int(limit), f"{tag}:run:",
                self._markers.get(request.job, ""), self._longest_ms,
                self._seqs.get(request.job, ""), 1 if request.scheduled else 0)
