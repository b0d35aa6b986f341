"""Named leases on PostgreSQL (:class:`~lease_core.Lease`): :class:`PostgresNamedLeases`.

A lease is one row of ``<table>_meta`` (key ``lease:<name>``), so it needs no table of its
own; each call is one short statement, a call of the store function ``<table>_lease_v4``
(``postgres_sql/lease_v4.sql``, created with the store's other functions), in autocommit,
keeping no session state (PgBouncer in transaction mode works). The function's plans are
kept per connection, so the server neither parses nor plans the lease's statements at
every call. See :mod:`lease_core._named_leases` for the contract.
"""

from __future__ import annotations

from typing import Any

from adapters.sql import SqlAdapter
from lease_core._named_leases import LeaseAnswer, check_lease

from .statements import LEASE_SUFFIX, NOW, QUERIES, quote_ident

__all__ = ["PostgresNamedLeases", "lease_statements"]


def lease_statements(schema: str | None, name: str) -> dict[str, str]:
    """The named-lease statements of the store ``table`` (``schema``, ``name``), filled:
    ``lease_acquire``, ``lease_renew``, ``lease_release``, ``lease_read`` (see
    ``leases.sql``) and ``grant_lease``.

    Public for the benchmarks, which run the very same statements through a raw driver.
    """
    prefix = quote_ident(schema) + "." if schema else ""
    names = {"lease": prefix + quote_ident(name + LEASE_SUFFIX),
             "meta": prefix + quote_ident(name + "_meta"), "now": NOW}
    return {key: QUERIES[key].format(**names).strip()
            for key in ("lease_acquire", "lease_renew", "lease_release", "lease_read",
                        "grant_lease")}


class PostgresNamedLeases:
    """The named-lease calls of :class:`~backends.postgres.PostgresBackend`."""

    _sql: Any

    @property
    def _adapter(self) -> SqlAdapter:
        raise NotImplementedError  # pragma: no cover - PostgresBackend's own

    async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
        """Take ``name`` when it is free: one call (an ``INSERT … ON CONFLICT`` on
        ``<table>_meta``)."""
        check_lease(name, holder=holder, ttl_ms=ttl_ms)
        [(held, token, expires, now, current)] = await self._adapter.all(
            self._sql.lease_acquire, (name, holder, ttl_ms))
        return LeaseAnswer(bool(held), int(token), int(expires), int(now), current)

    async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
        """Extend the live hold of ``token``: one call (an ``UPDATE`` on ``<table>_meta``)."""
        check_lease(name, ttl_ms=ttl_ms, token=token)
        [(expires,)] = await self._adapter.all(self._sql.lease_renew,
                                               (name, str(token), ttl_ms))
        return None if expires is None else int(expires)

    async def read_lease(self, name: str) -> LeaseAnswer:
        """Who holds ``name`` now: one plain read of its ``<table>_meta`` row, the
        store's failover row and the server's clock; nothing changes.

        A name nobody holds during the quarantine after a detected failover (when no
        name is taken) answers its end as ``expires_ms``, as an acquire does: free no
        earlier (at least then: an acquire waits its own ttl past the failover too)."""
        check_lease(name)
        [(now, value, failover)] = await self._adapter.all(self._sql.lease_read, (name,))
        now = int(now)
        token, expires, holder = (str(value).split(" ", 2) if value is not None
                                  else ("0", "0", ""))
        if int(expires) > now and holder:
            return LeaseAnswer(True, int(token), int(expires), now, holder)
        quiet = str(failover).split(" ") if failover is not None else []
        ends = max(int(expires), int(quiet[2]) if len(quiet) == 3 else 0)
        return LeaseAnswer(False, int(token), ends, now, None)

    async def release_lease(self, name: str, token: int) -> bool:
        """Free ``name`` if ``token`` holds it live: one call (an ``UPDATE`` on
        ``<table>_meta``)."""
        check_lease(name, token=token)
        [(held,)] = await self._adapter.all(self._sql.lease_release, (name, str(token)))
        return bool(held)
