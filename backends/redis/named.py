"""Named leases on Redis (:class:`~lease_core.Lease`): :class:`RedisNamedLeases`.

Each call is one short script (``redis_lua/lease_*.lua``) on one key, the lease's hash
``{P/lease/E}`` (``E`` the name percent-encoded, as job names are): one key per call, so
valid on a Cluster. Time is the server's ``TIME``. See :mod:`lease_core._named_leases`
for the contract; the key is never deleted, so the token keeps growing.

Fences (issue 21): a token is :func:`lease_core.fence_of` ``(epoch, number)``. A name
whose key is missing, new to the server or lost with its data (a restart without
persistence, a failover to a lagging replica), starts a new epoch at the server's clock
in ms, with number 1: its next token is at or above ``epoch << 20``, so above every
token the name had before the loss. The script does not tell a new name from a lost
one (a marker per name would be lost with the name; a store-wide one could not be
trusted on a Cluster): it treats every missing key as lost, which costs nothing but
large tokens. A key that survives without its newest holders (a replica promoted a
little behind) is found by the server's replication id, kept in the key at each new
holder: a new holder on a server with another id (a promoted replica, a restarted
server) starts a new epoch too; on a promoted server (one that reports a
``master_replid2``) that acquire takes nothing and nobody holds the name until the
longest ttl known has passed (a quarantine, as PostgreSQL's after a promotion: a holder
whose acquire or renewals the failover lost may still run until its next renewal).

``wait_replicas`` (see :class:`~backends.redis.RedisBackend`): an acquire and a renewal
send ``WAIT`` in the same round trip. An acquire that took the name but too few replicas
acknowledged is not held: the hold is released at once (best-effort; unanswered, it
expires with its ttl) and :class:`~lease_core.errors.BackendUnavailable` is raised, which
:meth:`lease_core.Lease.acquire` raises to its caller. A renewal too few replicas
acknowledged raises it too, so it counts as failed: :class:`~lease_core.Lease` retries it
until the ttl since the last renewal runs out, then the lease is lost. A release does not
wait (a release a failover loses leaves the name held until its ttl runs out).
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Any
from urllib.parse import quote

from lease_core._named_leases import LeaseAnswer, check_lease
from lease_core._structures import FENCE_NUMBER_BITS
from lease_core.errors import BackendUnavailable

from .core import RedisStore
from .replies import as_text

__all__ = ["RedisNamedLeases", "lease_key"]


@lru_cache(maxsize=1024)
def lease_key(prefix: str, name: str) -> str:
    """The key of the named lease ``name`` under ``prefix`` (public for the benchmarks).

    Cached: a process takes the same few names again and again.
    """
    return "{" + prefix + "/lease/" + quote(name, safe="") + "}"


def _split(token: int) -> tuple[str, str]:
    """A token's epoch and number, as the lease scripts compare them."""
    return str(token >> FENCE_NUMBER_BITS), str(token & ((1 << FENCE_NUMBER_BITS) - 1))


class RedisNamedLeases(RedisStore):
    """The named-lease calls of :class:`~backends.redis.RedisBackend`."""

    async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
        """Take ``name`` when it is free: one ``lease_acquire.lua`` call."""
        check_lease(name, holder=holder, ttl_ms=ttl_ms)
        command = self._eval("lease_acquire", [lease_key(self.prefix, name)], [holder, ttl_ms])
        if self.wait_replicas is None:
            (reply,) = await self._run([command])
        else:
            reply, acks = await self._run([command, *self._wait()])
        # (not fence_of(): a key written before epochs has epoch 0 and a larger number)
        token = (int(reply[0]) << FENCE_NUMBER_BITS) + int(reply[1])
        if len(reply) == 3:  # taken or renewed: {epoch, number, expires}
            if self.wait_replicas is not None:
                await self._check_acquired(name, token, acks)
            expires = int(reply[2])
            return LeaseAnswer(True, token, expires, expires - ttl_ms, holder)
        _, _, expires, now, current = reply
        return LeaseAnswer(False, token, int(expires), int(now), as_text(current) or None)

    async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
        """Extend the live hold of ``token``: one ``lease_renew.lua`` call."""
        check_lease(name, ttl_ms=ttl_ms, token=token)
        (expires,) = await self._run_acked([self._eval(
            "lease_renew", [lease_key(self.prefix, name)], [*_split(token), ttl_ms])],
            f"the renewal of lease {name!r}", lambda found: found[0] is not None)
        return None if expires is None else int(expires)

    async def _check_acquired(self, name: str, token: int, acks: Any) -> None:
        """With ``wait_replicas``: a hold too few replicas acknowledged is not held. It is
        released (best-effort: a failure leaves it to expire with its ttl) and
        :class:`~lease_core.errors.BackendUnavailable` raised, as for a claim."""
        try:
            self._check_wait(acks, f"the acquire of lease {name!r}", undone=True)
        except BackendUnavailable:
            with contextlib.suppress(Exception):
                await self._run([self._eval(
                    "lease_release", [lease_key(self.prefix, name)], [*_split(token)])])
            raise

    async def read_lease(self, name: str) -> LeaseAnswer:
        """Who holds ``name`` now: one ``lease_read.lua`` call, which writes nothing."""
        check_lease(name)
        (reply,) = await self._run([self._eval("lease_read", [lease_key(self.prefix, name)],
                                               [])])
        epoch, number, expires, now, holder = reply
        token = (int(epoch) << FENCE_NUMBER_BITS) + int(number)
        current = as_text(holder) or None
        if int(expires) > int(now) and current is not None:
            return LeaseAnswer(True, token, int(expires), int(now), current)
        return LeaseAnswer(False, token, int(expires), int(now), None)

    async def release_lease(self, name: str, token: int) -> bool:
        """Free ``name`` if ``token`` holds it live: one ``lease_release.lua`` call."""
        check_lease(name, token=token)
        (done,) = await self._run([self._eval(
            "lease_release", [lease_key(self.prefix, name)], [*_split(token)])])
        return int(done) == 1
