"""The protocol every SQL connection adapter implements, and the factory that picks one.

:class:`~backends.postgres.PostgresBackend` talks to PostgreSQL only through an
:class:`SqlAdapter`. SQL text uses ``%s`` placeholders with positional parameters (and
``%%`` for a literal percent sign), whatever the driver.

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
"""

from __future__ import annotations

import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar
from urllib.parse import unquote, urlsplit

import anyio

from lease_core._redact import redact
from lease_core.errors import BackendUnavailable, ConfigurationError

__all__ = [
    "CANCEL_GRACE_S",
    "Executor",
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

T = TypeVar("T")
Row = tuple[Any, ...]

#: Seconds a driver call may still take after its caller's deadline (or cancellation)
#: before the adapter gives the call up and closes its connection.
CANCEL_GRACE_S = 5.0


def settle_scope(grace: float | None = None) -> anyio.CancelScope:
    """A shielded cancel scope for one driver call, ending ``grace`` s after the caller's.

    Inside it the call is not interrupted when its caller is cancelled; it is only when
    the caller's effective deadline (now, if the caller is already cancelled; never, if
    it has none) plus ``grace`` (default :data:`CANCEL_GRACE_S`) passes. Interrupting a
    call mid-statement costs its connection, so adapters let a cancelled caller wait for
    the answer instead.
    """
    if grace is None:
        grace = CANCEL_GRACE_S
    deadline = anyio.current_effective_deadline()
    if math.isinf(deadline) and deadline > 0:
        return anyio.CancelScope(shield=True)
    return anyio.CancelScope(shield=True, deadline=max(deadline, anyio.current_time()) + grace)


def pooler_hint(message: str) -> str:
    """What to do about a connection error whose ``message`` came from PgBouncer ('' if none).

    PgBouncer answers every query with "server login has been failing, try again later
    (server_login_retry)" for ``server_login_retry`` seconds after its login to the
    database failed, which happens at each database restart (its first reconnect reaches
    a server still shutting down or starting up): the database is unreachable through it
    for that long, however soon it is back.
    """
    if "server_login_retry" not in message:
        return ""
    return ("; PgBouncer refuses every query for server_login_retry seconds after a login "
            "to the database failed, as at each database restart: lower server_login_retry "
            "in pgbouncer.ini below your shortest lease and job interval (the default is "
            "15 in PgBouncer 1.18; fractions such as 0.2 work)")


class TransientError(BackendUnavailable):
    """Raised when PostgreSQL aborted a transaction (deadlock, serialization); retry it."""


class Executor(Protocol):
    """What runs statements inside one transaction."""

    @property
    def connection(self) -> Any:
        """The raw driver connection the transaction runs on."""

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Execute ``sql`` and return its rows (an empty list when it returns none)."""


class SqlAdapter(ABC):
    """One way of reaching PostgreSQL: runs single statements and transactions.

    ``owned`` says whether the adapter opened its connections itself (then :meth:`close`
    closes them) or was given them by the user (then it never closes them).
    """

    #: Event loops this adapter works on.
    anyio_backends: tuple[str, ...] = ("asyncio",)
    #: Whether a statement can run while a transaction is open (False for one connection,
    #: where the statement waits for the transaction to end).
    concurrent: bool = True

    def __init__(self, *, owned: bool) -> None:
        self.owned = owned

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Prepare the adapter (open the pool it owns)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Close what the adapter opened itself; user-provided resources stay open."""

    @abstractmethod
    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement in its own transaction and return its rows."""

    async def all_reserved(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement on a connection kept for it, never queued behind other work.

        Heartbeats use it, so that renewals do not wait for a pooled connection while
        claims and fenced transactions hold them all. Adapters that open their own pool
        keep one extra connection for it; the others run it as :meth:`all`.
        """
        return await self.all(sql, params)

    @abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[Executor]:
        """Open a transaction: committed when the block ends, rolled back on an exception."""

    async def run_transaction(self, fn: Callable[[Executor], Awaitable[T]]) -> T:
        """Run ``await fn(tx)`` inside one transaction and return its result."""
        async with self.transaction() as tx:
            return await fn(tx)


_PLACEHOLDER = re.compile(r"%s|%%")
_numbered: dict[str, str] = {}


def numbered_placeholders(sql: str) -> str:
    """Rewrite ``%s`` placeholders as ``$1, $2, …`` (and ``%%`` as ``%``).

    For drivers that number their parameters, such as pg8000's core API or asyncpg.
    """
    cached = _numbered.get(sql)
    if cached is None:
        counter = iter(range(1, 1 << 16))

        def sub(match: re.Match[str]) -> str:
            return "%" if match.group() == "%%" else f"${next(counter)}"

        cached = _numbered[sql] = _PLACEHOLDER.sub(sub, sql)
    return cached


def conninfo_params(dsn: str | None) -> dict[str, Any]:
    """Split a ``postgresql://`` URL into host, port, user, password and database.

    Missing parts come from ``PGHOST``, ``PGPORT``, ``PGUSER``, ``PGPASSWORD`` and
    ``PGDATABASE``, then from ``localhost``, ``5432``, the OS user and ``postgres``.
    """
    host = port = user = password = database = None
    if dsn:
        try:
            parts = urlsplit(dsn)
            port = parts.port
        except ValueError as exc:
            raise ConfigurationError(f"invalid PostgreSQL URL {redact(dsn)!r}: {exc}") from None
        if parts.scheme.split("+")[0] not in ("postgresql", "postgres"):
            raise ConfigurationError(
                f"invalid PostgreSQL URL {redact(dsn)!r}: expected postgresql://user:pass@host/db"
            )
        host = unquote(parts.hostname) if parts.hostname else None
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else None
        database = unquote(parts.path.lstrip("/")) or None
    env = os.environ
    return {
        "host": host or env.get("PGHOST") or "localhost",
        "port": int(port or env.get("PGPORT") or 5432),
        "user": user or env.get("PGUSER") or _os_user(),
        "password": password if password is not None else env.get("PGPASSWORD"),
        "database": database or env.get("PGDATABASE") or "postgres",
    }


def dsn_query(dsn: str) -> dict[str, str]:
    """Return the query parameters of a ``postgresql://`` URL, percent-decoded.

    A parameter given twice keeps its last value, as in libpq; ``+`` stays a plus sign.
    """
    params: dict[str, str] = {}
    for pair in urlsplit(dsn).query.split("&"):
        if not pair:
            continue
        name, sep, value = pair.partition("=")
        if not sep:
            raise ConfigurationError(
                f"invalid parameter {unquote(name)!r} in the PostgreSQL URL {redact(dsn)!r}: "
                "write it as name=value"
            )
        params[unquote(name)] = unquote(value)
    return params


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # pragma: no cover - no user name at all
        return "postgres"


def _module_of(obj: object) -> str:
    return type(obj).__module__.split(".")[0]


def adapter_for(connection: Any, *, driver: str | None = None, **options: Any) -> SqlAdapter:
    """Return the adapter for ``connection`` (see the module docs for what is accepted).

    ``driver`` (``"psycopg"`` or ``"pg8000"``) chooses the driver for a DSN or ``None``;
    ``options`` go to the pool the library opens (``min_size``, ``max_size``).
    """
    if driver not in (None, "psycopg", "pg8000"):
        raise ConfigurationError(f"unknown PostgreSQL driver {driver!r}; use 'psycopg' or 'pg8000'")
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
