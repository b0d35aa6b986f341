"""The fleet: which live instance claims each job's slots first (rendezvous ranking).

Every instance renews its membership every half lease, at a tick (:meth:`Backend.members
<lease_core.abc.Backend.members>`, timed by the store's clock; it lasts one lease) and
learns the live members.
For each job, the members are ranked by a hash of (job, instance id), the same on every
instance: the first claims a due slot at once; the one ranked *k* claims it only if nobody
has after *k* check intervals (*k* at most half a lease's intervals plus one, so that
several members dying at once delay a slot by a bounded time: :meth:`Fleet.last_turn`).
A slot then costs about one claim whatever the number of instances, jobs (and so
bursts) spread evenly over the members, and a member joining or leaving moves only its
share of jobs. An instance stopping gracefully leaves at once
(:meth:`Backend.leave <lease_core.abc.Backend.leave>`), so the others re-rank its jobs at
their next renewal rather than once its membership lapses: a member that finds a slot
unclaimed at its turn renews at its next tick (:meth:`Fleet.renew_soon`), so only the
first slot after the stop is claimed a check interval late. Members that disagree about
the membership cost an extra claim or an interval's delay, never a second winner (the
store decides the claim).

Instances that declare different jobs (or the same jobs on different schedules) form
*groups*: each registers as ``<instance id>#<digest of its job names and schedules>`` and
ranks only the members of its own group.
A member that does not declare a job is never ranked ahead of one that does (which would
make every slot of that job wait for the next in rank), at the cost of one claim per group
for a job that several groups declare (during a rolling deploy that adds a job, for
instance). The ranks use the instance ids, so every member of a group agrees on them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from .._durations import to_ms

if TYPE_CHECKING:
    from .jobs import Job
    from .session import Session

__all__ = ["Fleet", "group_of", "member_name", "rendezvous_rank"]

_GROUP_CHARS = 8


def _score(job: str, member: str) -> bytes:
    return hashlib.blake2b(f"{job}\x00{member}".encode(), digest_size=8).digest()


def rendezvous_rank(job: str, member: str, members: tuple[str, ...]) -> int:
    """``member``'s rank for ``job`` among ``members`` (0: it claims first)."""
    mine = (_score(job, member), member)
    return sum(1 for other in members if other != member and (_score(job, other), other) > mine)


def group_of(jobs: Mapping[str, Job]) -> str:
    """The group of an instance declaring ``jobs``: a digest of their sorted names and
    their schedules. An instance of a release that changed a job's schedule is in
    another group than the older release's: ranked first for that job, the older one
    would not claim the new schedule's slots (nor the newer the old ones'), which would
    then wait a check interval for each member ranked before one that has them."""
    declared = "\x00".join(
        f"{name}\x01{json.dumps(jobs[name].schedule.spec(), sort_keys=True)}"
        for name in sorted(jobs)).encode()
    return hashlib.blake2b(declared, digest_size=_GROUP_CHARS // 2).hexdigest()


def member_name(instance_id: str, group: str) -> str:
    """The id under which an instance of ``group`` renews its membership."""
    return f"{instance_id}#{group}"


def _in_group(members: Iterable[str], group: str) -> set[str]:
    """The instance ids of the ``members`` of ``group`` (other groups, and ids without
    one, are left out)."""
    suffix = f"#{group}"
    return {m[:-len(suffix)] for m in members if m.endswith(suffix) and len(m) > len(suffix)}


def _instance_id(member: str) -> str:
    """The instance id of a member of any group (an id without one as it is)."""
    instance_id, hash_sign, _ = member.rpartition("#")
    return instance_id if hash_sign and instance_id else member


class Fleet:
    """This instance's view of the live members, and its rank per job."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self.members: tuple[str, ...] | None = None
        """The live members at the last renewal; ``None``: unknown (every rank is 0)."""
        self._ranks: dict[str, int] = {}
        self._renewed = -math.inf
        self._left = False
        self._soon = False
        self._group = ""
        """This instance's group, once it first renews (its jobs are declared by then)."""
        self.departed: set[str] = set()
        """The members that left or lapsed since a renewal saw them, of any group (one
        of another group may hold runs of jobs declared here too: during a rolling deploy
        that changes the jobs), whose open runs the lease keeper is yet to look for (kept
        until a listing of them answers)."""
        self._everyone: frozenset[str] = frozenset()
        """The instance ids of the live members of every group, at the last renewal."""

    @property
    def size(self) -> int | None:
        """The live members of this instance's group, itself included, at the last
        renewal; ``None`` when unknown, or once this instance left (it stops)."""
        return None if self._left or self.members is None else len(self.members)

    def renewal_due(self) -> bool:
        """True when half a lease passed since the last renewal (the membership lasts one),
        or a check interval since it when :meth:`renew_soon` asked for one."""
        settings = self._s.settings
        since = settings.clock() - self._renewed
        if self._soon and since >= settings.heartbeat:
            return True
        return since >= settings.lease / 2

    def renew_soon(self) -> None:
        """Renew at the next tick (at most once a check interval): a slot ranked to another
        member was found unclaimed at this member's turn, so the membership it was ranked
        by may be out of date (a member that stopped gracefully has left; the others
        would rank it first until their next renewal, half a lease later)."""
        self._soon = True

    def rank(self, job: str) -> int:
        """This instance's turn for ``job``, in check intervals: 0 when it claims first
        (or when the membership is unknown), else its rank, at most :meth:`last_turn`."""
        members = self.members
        if members is None or len(members) < 2:
            return 0
        rank = self._ranks.get(job)
        if rank is None:
            rank = self._ranks[job] = min(self.last_turn(job), rendezvous_rank(
                job, self._s.settings.instance_id, members))
        return rank

    def last_turn(self, job: str) -> int:
        """The latest turn of any member for ``job``: half the lease in check intervals,
        plus one (4 with the defaults), at least 1. The lease is the scheduler's (the
        membership's lifetime), or the job's when that is shorter.

        Members that died or froze stay in the membership until it lapses, a lease after
        their last renewal, so a member ranked after several of them at once would come
        a check interval later for each. From this turn on, every member left covers a
        slot still unclaimed together: that may cost extra claims (the store decides;
        one wins), but a slot whose first members all died is claimed within half a
        lease and a heartbeat of its time. A job's longer lease does not push it later:
        the dead members it would wait for lapse with the scheduler's lease.
        """
        settings = self._s.settings
        lease_ms = to_ms(settings.lease)
        declared = self._s.jobs.get(job)
        if declared is not None:
            lease_ms = min(lease_ms, declared.lease_ms)
        return max(1, lease_ms // (2 * to_ms(settings.heartbeat)) + 1)

    async def renew(self) -> None:
        """Renew this instance's membership and learn the live members; add the instance
        ids of the members that left or lapsed since the last renewal to :attr:`departed`
        (whoever renews: a tick, or a test's ``renew_membership``)."""
        settings = self._s.settings
        if self._left:
            return  # a stopping instance's ticks must not join again
        previous, self._renewed = self._renewed, settings.clock()
        self._group = self._group or group_of(self._s.jobs)
        try:
            members = await settings.backend.members(self._name, to_ms(settings.lease))
        except BaseException:
            # Tried again at the next tick, not half a lease later: the membership may
            # lapse meanwhile, and the others would rank without this live member.
            self._renewed = previous
            raise
        self._soon = False
        if self._left:
            # It left while this renewal was in flight: the renewal may have landed after.
            await settings.backend.leave(self._name)
            return
        if members is None:
            self.members = None
            return
        self._s.clock.writes_probed = True
        self._s.clock.wrote()
        everyone = frozenset(_instance_id(m) for m in members)
        self.departed |= self._everyone - everyone - {settings.instance_id}
        self._everyone = everyone
        found = tuple(sorted({*_in_group(members, self._group), settings.instance_id}))
        if found != self.members:
            self.members, self._ranks = found, {}

    @property
    def _name(self) -> str:
        return member_name(self._s.settings.instance_id,
                           self._group or group_of(self._s.jobs))

    async def leave(self) -> None:
        """End this instance's membership (a graceful stop, as it stops claiming)."""
        settings = self._s.settings
        self._left = True
        await settings.backend.leave(self._name)
