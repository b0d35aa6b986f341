"""Named leases on Redis (:class:`~lease_core.Lease`): :class:`RedisNamedLeases`.

Each call is one short script (``redis_lua/lease_*.lua``) on one key, the lease's hash
``{P/lease/E}`` (``E`` the name percent-encoded, as job names are): one key per call, so
valid on a Cluster. Time is the server's ``TIME``. See :mod:`lease_core._named_leases`
for the contract; the key is never deleted, so the token keeps growing, and a name new
to the server starts at the server's clock in ms, so tokens keep growing even after the
server lost its data.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import quote

from lease_core._named_leases import LeaseAnswer, check_lease

from .core import RedisStore
from .replies import as_text

__all__ = ["RedisNamedLeases", "lease_key"]


@lru_cache(maxsize=1024)
def lease_key(prefix: str, name: str) -> str:
    """The key of the named lease ``name`` under ``prefix`` (public for the benchmarks).

    Cached: a process takes the same few names again and again.
    """
    return "{" + prefix + "/lease/" + quote(name, safe="") + "}"


class RedisNamedLeases(RedisStore):
    """The named-lease calls of :class:`~backends.redis.RedisBackend`."""

    async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
        """Take ``name`` when it is free: one ``lease_acquire.lua`` call."""
        check_lease(name, holder=holder, ttl_ms=ttl_ms)
        (reply,) = await self._run([self._eval(
            "lease_acquire", [lease_key(self.prefix, name)], [holder, ttl_ms])])
        if len(reply) == 2:  # taken or renewed: {token, expires}
            expires = int(reply[1])
            return LeaseAnswer(True, int(reply[0]), expires, expires - ttl_ms, holder)
        token, expires, now, current = reply
        return LeaseAnswer(False, int(token), int(expires), int(now), as_text(current) or None)

    async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
        """Extend the live hold of ``token``: one ``lease_renew.lua`` call."""
        check_lease(name, ttl_ms=ttl_ms, token=token)
        (expires,) = await self._run([self._eval(
            "lease_renew", [lease_key(self.prefix, name)], [str(token), ttl_ms])])
        return None if expires is None else int(expires)

    async def release_lease(self, name: str, token: int) -> bool:
        """Free ``name`` if ``token`` holds it live: one ``lease_release.lua`` call."""
        check_lease(name, token=token)
        (done,) = await self._run([self._eval(
            "lease_release", [lease_key(self.prefix, name)], [str(token)])])
        return int(done) == 1
