"""Named leases on PostgreSQL (:class:`~lease_core.Lease`): :class:`PostgresNamedLeases`.

A lease is one row of ``<table>_meta`` (key ``lease:<name>``), so it needs no table or
migration of its own; each call is one statement of ``postgres_sql/leases.sql``, in
autocommit, keeping no session state (PgBouncer in transaction mode works). See
:mod:`lease_core._named_leases` for the contract.
"""

from __future__ import annotations

import importlib.resources

from adapters.sql import SqlAdapter
from lease_core._named_leases import LeaseAnswer, check_lease

from .statements import FAILOVER_SUFFIX, NOW, parse_queries, quote_ident

__all__ = ["LEASE_QUERIES", "PostgresNamedLeases", "lease_statements"]

#: The statements of ``postgres_sql/leases.sql``, by name, as templates.
LEASE_QUERIES = parse_queries(
    (importlib.resources.files("backends") / "postgres_sql" / "leases.sql").read_text("utf-8"))


def lease_statements(schema: str | None, name: str) -> dict[str, str]:
    """The named-lease statements of the store ``table`` (``schema``, ``name``), filled.

    Public for the benchmarks, which run the very same statements through a raw driver.
    """
    meta = (quote_ident(schema) + "." if schema else "") + quote_ident(name + "_meta")
    failover = (quote_ident(schema) + "." if schema else "") + quote_ident(
        name + FAILOVER_SUFFIX)
    return {key: template.format(meta=meta, now=NOW, failover=failover).strip()
            for key, template in LEASE_QUERIES.items()}


def _parse(value: object) -> tuple[int, int, str | None]:
    """A lease row's value, ``'<token> <expires_ms> <holder>'``, as its three parts."""
    token, expires, holder = str(value).split(" ", 2)
    return int(token), int(expires), holder or None


class PostgresNamedLeases:
    """The named-lease calls of :class:`~backends.postgres.PostgresBackend`."""

    _schema: str | None
    _name: str

    @property
    def _adapter(self) -> SqlAdapter:
        raise NotImplementedError  # pragma: no cover - PostgresBackend's own

    def _lease_sql(self) -> dict[str, str]:
        found: dict[str, str] | None = self.__dict__.get("_lease_statements")
        if found is None:
            found = self.__dict__["_lease_statements"] = lease_statements(
                self._schema, self._name)
        return found

    async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
        """Take ``name`` when it is free: one ``INSERT … ON CONFLICT`` on ``<table>_meta``."""
        check_lease(name, holder=holder, ttl_ms=ttl_ms)
        [(won, before, now, quiet)] = await self._adapter.all(
            self._lease_sql()["lease_acquire"],
            {"name": name, "holder": holder, "ttl_ms": ttl_ms})
        if won is not None:
            token, expires, _ = _parse(won)
            return LeaseAnswer(True, token, expires, int(now), holder)
        token, expires, current = _parse(before) if before is not None else (0, 0, None)
        if quiet is not None:  # failover quarantine: free no earlier than its end
            expires = max(expires, int(quiet))
        return LeaseAnswer(False, token, expires, int(now), current)

    async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
        """Extend the live hold of ``token``: one ``UPDATE`` on ``<table>_meta``."""
        check_lease(name, ttl_ms=ttl_ms, token=token)
        rows = await self._adapter.all(
            self._lease_sql()["lease_renew"],
            {"name": name, "token": str(token), "ttl_ms": ttl_ms})
        return int(rows[0][0]) if rows else None

    async def release_lease(self, name: str, token: int) -> bool:
        """Free ``name`` if ``token`` holds it live: one ``UPDATE`` on ``<table>_meta``."""
        check_lease(name, token=token)
        rows = await self._adapter.all(self._lease_sql()["lease_release"],
                                       {"name": name, "token": str(token)})
        return bool(rows)
