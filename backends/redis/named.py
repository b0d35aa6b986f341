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
server) starts a new epoch too.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import quote

from lease_core._named_leases import LeaseAnswer, check_lease
from lease_core._structures import FENCE_NUMBER_BITS

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
        (reply,) = await self._run([self._eval(
            "lease_acquire", [lease_key(self.prefix, name)], [holder, ttl_ms])])
        # (not fence_of(): a key written before epochs has epoch 0 and a larger number)
        token = (int(reply[0]) << FENCE_NUMBER_BITS) + int(reply[1])
        if len(reply) == 3:  # taken or renewed: {epoch, number, expires}
            expires = int(reply[2])
            return LeaseAnswer(True, token, expires, expires - ttl_ms, holder)
        _, _, expires, now, current = reply
        return LeaseAnswer(False, token, int(expires), int(now), as_text(current) or None)

    async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
        """Extend the live hold of ``token``: one ``lease_renew.lua`` call."""
        check_lease(name, ttl_ms=ttl_ms, token=token)
        (expires,) = await self._run([self._eval(
            "lease_renew", [lease_key(self.prefix, name)], [*_split(token), ttl_ms])])
        return None if expires is None else int(expires)

    async def release_lease(self, name: str, token: int) -> bool:
        """Free ``name`` if ``token`` holds it live: one ``lease_release.lua`` call."""
        check_lease(name, token=token)
        (done,) = await self._run([self._eval(
            "lease_release", [lease_key(self.prefix, name)], [*_split(token)])])
        return int(done) == 1
