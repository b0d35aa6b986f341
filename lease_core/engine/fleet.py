"""The fleet: which live instance claims each job's slots first (rendezvous ranking).

Every instance renews its membership every half lease, at a tick (:meth:`Backend.members
<lease_core.abc.Backend.members>`, timed by the store's clock; it lasts one lease) and
learns the live members.
For each job, the members are ranked by a hash of (job, instance id), the same on every
instance: the first claims a due slot at once; the one ranked *k* claims it only if nobody
has after *k* check intervals. A slot then costs about one claim whatever the number of
instances, jobs (and so bursts) spread evenly over the members, and a member joining or
leaving moves only its share of jobs. An instance stopping gracefully leaves at once
(:meth:`Backend.leave <lease_core.abc.Backend.leave>`), so the others re-rank its jobs at
their next renewal rather than once its membership lapses. Members that disagree about
the membership cost an extra claim or an interval's delay, never a second winner (the
store decides the claim).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from .._durations import to_ms

if TYPE_CHECKING:
    from .session import Session

__all__ = ["Fleet", "rendezvous_rank"]


def _score(job: str, member: str) -> bytes:
    return hashlib.blake2b(f"{job}\x00{member}".encode(), digest_size=8).digest()


def rendezvous_rank(job: str, member: str, members: tuple[str, ...]) -> int:
    """``member``'s rank for ``job`` among ``members`` (0: it claims first)."""
    mine = (_score(job, member), member)
    return sum(1 for other in members if other != member and (_score(job, other), other) > mine)


class Fleet:
    """This instance's view of the live members, and its rank per job."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self.members: tuple[str, ...] | None = None
        """The live members at the last renewal; ``None``: unknown (every rank is 0)."""
        self._ranks: dict[str, int] = {}
        self._renewed = -math.inf
        self._left = False

    def renewal_due(self) -> bool:
        """True when half a lease passed since the last renewal (the membership lasts one)."""
        settings = self._s.settings
        return settings.clock() - self._renewed >= settings.lease / 2

    def rank(self, job: str) -> int:
        """This instance's rank for ``job``: 0 when it claims first, or when unknown."""
        members = self.members
        if members is None or len(members) < 2:
            return 0
        rank = self._ranks.get(job)
        if rank is None:
            rank = self._ranks[job] = rendezvous_rank(
                job, self._s.settings.instance_id, members)
        return rank

    async def renew(self) -> None:
        """Renew this instance's membership and learn the live members."""
        settings = self._s.settings
        if self._left:
            return  # a stopping instance's ticks must not join again
        previous, self._renewed = self._renewed, settings.clock()
        try:
            members = await settings.backend.members(settings.instance_id,
                                                     to_ms(settings.lease))
        except BaseException:
            # Tried again at the next tick, not half a lease later: the membership may
            # lapse meanwhile, and the others would rank without this live member.
            self._renewed = previous
            raise
        if self._left:
            # It left while this renewal was in flight: the renewal may have landed after.
            await settings.backend.leave(settings.instance_id)
            return
        if members is None:
            self.members = None
        else:
            found = tuple(sorted({*members, settings.instance_id}))
            if found != self.members:
                self.members, self._ranks = found, {}

    async def leave(self) -> None:
        """End this instance's membership (a graceful stop, as it stops claiming)."""
        settings = self._s.settings
        self._left = True
        await settings.backend.leave(settings.instance_id)
