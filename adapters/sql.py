"""The protocol every SQL connection adapter implements, and the factory that picks one.

:class:`~backends.postgres.PostgresBackend` talks to PostgreSQL only through an
:class:`SqlAdapter`. SQL text uses ``%s`` placeholders with positional parameters, or
``%(name)s`` placeholders with a mapping (where a statement uses a value more than once),
and ``%%`` for a literal percent sign, whatever the driver and whether parameters are
given or not (a ``%`` that starts neither is refused). The protocol itself is
defined in :mod:`adapters.base` (re-exported here), which the driver modules build on;
this module adds the factory, so that no driver module imports it.

:func:`adapter_for` accepts what section 3.4 of the design lists:

- ``None``: a pool on ``postgresql://localhost:5432/postgres``, with the ``PG*``
  environment variables filling gaps;
- a DSN string: a small psycopg pool (``postgresql+pg8000://`` or ``driver="pg8000"``
  selects pg8000), closed on close;
- a psycopg ``AsyncConnectionPool`` or ``ConnectionPool``: used as is, never closed;
- one psycopg ``AsyncConnection`` or ``Connection``: commands queued one at a time, never
  closed;
- a pg8000 connection (any of its APIs): blocking calls in worker threads, queued, never
  closed;
- an object with ``all(sql, params)`` and ``transaction(fn)``: your own adapter
  (:mod:`adapters.custom` states the protocol).

A subclass of a driver's pool or connection is taken as the driver's own.
"""

from __future__ import annotations

from typing import Any

from lease_core.errors import ConfigurationError

from ._placeholders import numbered_placeholders
from .base import (
    CANCEL_GRACE_S,
    Executor,
    Params,
    Row,
    SqlAdapter,
    TransientError,
    conninfo_params,
    dsn_query,
    pooler_hint,
    redact,
    settle_scope,
)

__all__ = [
    "CANCEL_GRACE_S",
    "Executor",
    "Params",
    "Row",
    "SqlAdapter",
    "TransientError",
    "adapter_for",
    "conninfo_params",
    "dsn_query",
    "numbered_placeholders",
    "pooler_hint",
    "redact",
    "settle_scope",
]


_DRIVERS = ("psycopg_pool", "psycopg", "pg8000")


def _module_of(obj: object) -> str:
    """The driver package of ``obj``'s class, or of its nearest base from one: a
    subclass of a driver's pool or connection is used as one ("" = none)."""
    for cls in type(obj).__mro__:
        if (top := cls.__module__.split(".")[0]) in _DRIVERS:
            return top
    return ""


def adapter_for(connection: Any, *, driver: str | None = None, **options: Any) -> SqlAdapter:
    """Return the adapter for ``connection`` (see the module docs for what is accepted).

    ``driver`` (``"psycopg"`` or ``"pg8000"``) chooses the driver for a DSN or ``None``;
    ``options`` go to the pool the library opens (``min_size``, ``max_size``).
    """
    if driver not in (None, "psycopg", "pg8000"):
        raise ConfigurationError(f"unknown PostgreSQL driver {driver!r}; use 'psycopg' or 'pg8000'")
    named = connection.split("://", 1)[0].lower().partition("+")[2] if isinstance(
        connection, str) and "://" in connection else ""
    if driver is not None and named in ("psycopg", "pg8000") and named != driver:
        # (the URL's driver won over the keyword's, or the keyword over the URL's, silently)
        raise ConfigurationError(
            f"driver={driver!r} contradicts the URL {redact(connection)!r}, which names "
            f"{named}; give the driver once")
    if isinstance(connection, str) and connection.startswith(
        ("postgresql+psycopg://", "postgres+psycopg://")
    ):
        connection = connection.replace("+psycopg://", "://", 1)
    if connection is None or isinstance(connection, str):
        if isinstance(connection, str) and connection.startswith(
            ("postgresql+pg8000://", "postgres+pg8000://")
        ):
            driver = "pg8000"
        elif isinstance(connection, str) and "+" in connection.split("://", 1)[0]:
            raise ConfigurationError(
                f"unknown PostgreSQL URL scheme in {redact(connection)!r}; use postgresql://, "
                "postgresql+psycopg:// or postgresql+pg8000://"
            )
        try:
            if driver == "pg8000":
                from .pg8000 import Pg8000PoolAdapter, pg8000_params

                return Pg8000PoolAdapter(pg8000_params(connection), **options)
            from .psycopg import PsycopgDsnAdapter
        except ModuleNotFoundError as exc:
            extra = "pg8000" if driver == "pg8000" else "postgres"
            raise ConfigurationError(
                f"PostgresBackend needs the driver {exc.name!r}; "
                f"install it with: pip install 'anarchon[{extra}]'"
            ) from None
        return PsycopgDsnAdapter(connection, **options)
    module = _module_of(connection)
    if module == "psycopg_pool":
        import psycopg_pool

        from .psycopg import PsycopgPoolAdapter, PsycopgSyncPoolAdapter

        if isinstance(connection, psycopg_pool.AsyncConnectionPool):
            return PsycopgPoolAdapter(connection, owned=False)
        if isinstance(connection, psycopg_pool.ConnectionPool):
            return PsycopgSyncPoolAdapter(connection)
    if module == "psycopg":
        import psycopg

        from .psycopg import PsycopgConnectionAdapter, PsycopgSyncConnectionAdapter

        if isinstance(connection, psycopg.AsyncConnection):
            return PsycopgConnectionAdapter(connection)
        if isinstance(connection, psycopg.Connection):
            return PsycopgSyncConnectionAdapter(connection)
    if module == "pg8000":
        from .pg8000 import Pg8000ConnectionAdapter

        return Pg8000ConnectionAdapter(connection)
    if isinstance(connection, SqlAdapter):
        return connection
    if callable(getattr(connection, "all", None)) and callable(
        getattr(connection, "transaction", None)
    ):
        from .custom import CustomAdapter

        return CustomAdapter(connection)
    raise ConfigurationError(
        f"cannot use {type(connection).__module__}.{type(connection).__qualname__} as a "
        "PostgreSQL connection; pass a DSN, a psycopg pool or connection, a pg8000 connection "
        "or an object with all(sql, params) and transaction(fn)"
    )
