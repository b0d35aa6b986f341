"""What the psycopg adapters share: error mapping, parameters, where a connection goes.

Split from :mod:`adapters.psycopg` (which re-exports :func:`translate_error`) to keep each
module small; nothing here is public beyond that function.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, LiteralString, cast

import psycopg
import psycopg.conninfo
from psycopg.rows import tuple_row
from psycopg_pool import PoolTimeout

from lease_core.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    ConfigurationError,
    StoreRefused,
)

from .base import (
    CONFIG_STATES,
    GAVE_UP_STATES,
    LIMIT_CLASS,
    UNKNOWN_COMPLETION_STATE,
    Params,
    Row,
    TransientError,
    gave_up,
    in_users_transaction,
    over_limit,
    pooler_hint,
    read_only,
    redact,
    refused,
    refuses_writes,
    unknown_completion,
)

__all__ = ["translate_error"]

_UNAVAILABLE_CLASSES = ("08", "53", "57", "58", "28")
#: libpq's refusals of a connection parameter's value, made before it connects
#: (``invalid sslmode value: "x"``, ``invalid integer value "x" for connection option
#: "keepalives"``, ``invalid port number: "x"``): the URL is wrong, no server is at fault.
_BAD_PARAMETER = re.compile(r'\binvalid (?:[a-z_]+ value: "|integer value "[^"]*" for '
                            r'connection option "|port number: ")')
#: The server's refusal of a connection to a database it has not (SQLSTATE 3D000, which
#: libpq does not give at connect time: only the text). pg8000 gets the SQLSTATE, and
#: files it as a setup error; psycopg said "cannot reach PostgreSQL".
_NO_DATABASE = re.compile(r'\bFATAL:\s+database "[^"]*" does not exist')


def _query(sql: str) -> LiteralString:
    # Statements are the backend's constants (or a fenced transaction's own SQL).
    return cast(LiteralString, sql)  # type: ignore[redundant-cast]


def _params(params: Params) -> Sequence[Any] | Mapping[str, Any]:
    """The parameters as psycopg takes them: a mapping for ``%(name)s`` placeholders (each
    value sent once), a tuple for ``%s`` ones.

    Never None, even for no parameters: psycopg then sends the text untouched, so ``%%``
    would reach the server as two percent signs, where pg8000 (and psycopg with
    parameters) sends one. An empty tuple still goes out as a simple query.
    """
    if isinstance(params, Mapping):
        return params
    return tuple(params)


def _where(conninfo: object) -> str:
    if not isinstance(conninfo, str):
        return ""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        params = {}
    host = params.get("host") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    return f"{host}:{port}"


def translate_error(
    exc: psycopg.Error, *, where: str = "", secret: str | None = None
) -> Exception:
    """Map a psycopg error to anarchon's error types (the driver error stays the cause).

    Connection failures, authentication failures and server shutdowns become
    :class:`BackendUnavailable`; deadlocks and serialization failures
    :class:`~adapters.sql.TransientError`; missing privileges or objects, and statements
    over one of the server's limits (class 54), :class:`ConfigurationError`. Other errors
    (bugs in SQL, and a server's error of no outage class though psycopg files it under
    ``OperationalError``) are returned unchanged.
    """
    state = exc.sqlstate or ""
    text = redact(str(exc).strip(), secret)
    at = f" at {where}" if where else ""
    if state in ("40001", "40P01"):
        return TransientError(f"PostgreSQL aborted the transaction{at}: {text}")
    if state in CONFIG_STATES:
        return StoreRefused(refused(at, text, state))
    if refuses_writes(state, text):
        return BackendUnavailable(read_only(at, text))
    if state in GAVE_UP_STATES:
        return BackendUnavailable(gave_up(at, text))
    if state == UNKNOWN_COMPLETION_STATE:
        return BackendUnavailable(unknown_completion(at, text))
    if state[:2] == LIMIT_CLASS:  # an OperationalError to psycopg, but no outage
        return over_limit(at, text, state)
    if isinstance(exc, PoolTimeout):
        return BackendUnavailable(
            f"no pooled connection to PostgreSQL{at} became free in time ({text}): every "
            "connection of the pool was busy, or the pool could not open one (the server "
            "down or out of reach: the psycopg.pool logger says why); if the server "
            "answers, raise max_size (?max_size= in the URL, default 4) or timeout "
            "(?timeout=, default 10s), or pass a larger pool"
        )
    if state and state[:2] not in _UNAVAILABLE_CLASSES:
        # A server's error of no outage class (3B001 a bad savepoint in a fenced
        # transaction's own SQL, 2F005, 55006, 40003, F0000...): psycopg files some of them
        # under OperationalError, which read as "cannot reach PostgreSQL". Returned as
        # they are, as pg8000's.
        return exc
    if isinstance(exc, psycopg.InterfaceError) and "ProactorEventLoop" in text:
        # Windows' default asyncio loop: no outage, and no attempt will ever connect.
        return ConfigurationError(
            f"psycopg cannot connect to PostgreSQL{at} on Windows' default asyncio loop "
            "(ProactorEventLoop): run the application on a selector loop (loop_factory="
            "asyncio.SelectorEventLoop, given to asyncio.run on Python 3.12 or later, or in "
            "anyio.run's backend_options), or use pg8000 (postgresql+pg8000://)")
    if (
        isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
        or state[:2] in _UNAVAILABLE_CLASSES
    ):
        # At connect time libpq gives no SQLSTATE, only the server's message.
        if not state and _BAD_PARAMETER.search(text):
            return ConfigurationError(f"PostgreSQL connection parameters{at} refused by "
                                      f"libpq: {text}; correct the value in the URL or DSN")
        if not state and _NO_DATABASE.search(text):
            return StoreRefused(f"PostgreSQL{at} refused the connection: {text} (check the "
                                "database name in the URL or DSN)")
        if state in ("28P01", "28000") or "authentication failed" in text or (
            "no password supplied" in text
        ):
            return AuthenticationFailed(
                f"PostgreSQL{at} refused the login: {text} (check the user and password)"
            )
        return BackendUnavailable(f"cannot reach PostgreSQL{at}: {text}{pooler_hint(text)}")
    return exc


class _mapped:
    """Raise the driver errors of the block as anarchon's (a class: on every statement)."""

    __slots__ = ("secret", "where")

    def __init__(self, where: str, secret: str | None = None) -> None:
        self.where = where
        self.secret = secret

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> None:
        if isinstance(exc, psycopg.Error):
            mapped = translate_error(exc, where=self.where, secret=self.secret)
            if mapped is not exc:
                raise mapped from exc


def _secret_of(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> str | None:
    try:
        return conn.info.password or None
    except psycopg.Error:  # pragma: no cover - closed connection
        return None


def _where_of(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> str:
    try:
        return f"{conn.info.host}:{conn.info.port}"
    except psycopg.Error:  # pragma: no cover - closed connection
        return ""

def _refuse_open(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> None:
    """Raise :func:`~adapters.base.in_users_transaction` for a connection in a transaction
    (or a failed one) before the store runs anything on it: a connection passed in that the
    application left so (the adapters' own transactions always end)."""
    if conn.info.transaction_status in (psycopg.pq.TransactionStatus.INTRANS,
                                        psycopg.pq.TransactionStatus.INERROR):
        raise in_users_transaction("psycopg")


#: The transaction characteristics the store's transactions run with: read committed, the
#: claims' row locks and ``SKIP LOCKED`` rely on it, and read write.
_STORE_CHARACTERISTICS: tuple[psycopg.IsolationLevel | None, bool | None] = (
    psycopg.IsolationLevel.READ_COMMITTED, False)


def users_characteristics(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]
                          ) -> tuple[psycopg.IsolationLevel | None, bool | None] | None:
    """The isolation level and read-only flag the application set on a connection (or a
    pool's) that would reach the store's transactions, or None when they are the store's.

    psycopg begins every transaction of a connection with them: under repeatable read or
    serializable, claims racing for a run fail with serialization errors; read only, every
    write is refused as if the server were a standby. The store's transactions run with
    :data:`_STORE_CHARACTERISTICS` instead, and the application's are put back after (both
    are client-side flags: no round trip)."""
    level, read_only_ = conn.isolation_level, conn.read_only
    if (level is None or level == psycopg.IsolationLevel.READ_COMMITTED) and not read_only_:
        return None
    return level, read_only_


async def set_async_characteristics(conn: psycopg.AsyncConnection[Any],
                                    values: tuple[psycopg.IsolationLevel | None, bool | None],
                                    ) -> None:
    """Set ``values`` (see :func:`users_characteristics`) on an idle connection; a closed
    one is left (it is given back broken, and never used again)."""
    if conn.closed:
        return
    await conn.set_isolation_level(values[0])
    await conn.set_read_only(values[1])


def set_sync_characteristics(conn: psycopg.Connection[Any],
                             values: tuple[psycopg.IsolationLevel | None, bool | None]) -> None:
    """:func:`set_async_characteristics` for a sync connection."""
    if conn.closed:
        return
    conn.isolation_level = values[0]
    conn.read_only = values[1]


def _has_rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    # The result's status, not ``cur.description``: that builds a Column per column.
    result = cur.pgresult
    return result is not None and result.status == psycopg.pq.ExecStatus.TUPLES_OK


# Each statement on a cursor of psycopg's own class with tuple rows, whatever the user's
# connection or pool says (row_factory=dict_row gave rows of column names; a RawCursor
# refused %s placeholders).


async def _async_all(
    conn: psycopg.AsyncConnection[Any], sql: str, params: Params
) -> list[Row]:
    cur = psycopg.AsyncCursor(conn, row_factory=tuple_row)
    await cur.execute(_query(sql), _params(params), prepare=False)
    if not _has_rows(cur):
        return []
    return await cur.fetchall()


def _sync_all(conn: psycopg.Connection[Any], sql: str, params: Params) -> list[Row]:
    cur = psycopg.Cursor(conn, row_factory=tuple_row)
    cur.execute(_query(sql), _params(params), prepare=False)
    if not _has_rows(cur):
        return []
    return cur.fetchall()


# A single statement runs in autocommit mode: one round trip, where BEGIN ... COMMIT
# around it would take three. The connection's own setting is restored afterwards; the
# switch is a client-side flag and costs no round trip while the connection is idle.


async def _async_single(
    conn: psycopg.AsyncConnection[Any], sql: str, params: Params
) -> list[Row]:
    _refuse_open(conn)
    if conn.autocommit:
        return await _async_all(conn, sql, params)
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        await conn.set_autocommit(True)
        try:
            return await _async_all(conn, sql, params)
        finally:
            with contextlib.suppress(psycopg.Error):  # a broken connection stays broken
                await conn.set_autocommit(False)
    async with conn.transaction():
        return await _async_all(conn, sql, params)


def _sync_single(conn: psycopg.Connection[Any], sql: str, params: Params) -> list[Row]:
    _refuse_open(conn)
    if conn.autocommit:
        return _sync_all(conn, sql, params)
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        conn.autocommit = True
        try:
            return _sync_all(conn, sql, params)
        finally:
            with contextlib.suppress(psycopg.Error):  # a broken connection stays broken
                conn.autocommit = False
    with conn.transaction():
        return _sync_all(conn, sql, params)
