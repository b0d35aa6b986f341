"""One command of a plain asyncio client, sent without ``execute_command``'s machinery.

The Redis backend's hot calls (a claim, a finish, a named lease's acquire and release)
are one command each. redis-py's ``execute_command`` spends 15-25 % of such a call's
client CPU on what those commands never use: the single-connection client's lock,
``HIMPORT SET`` detection, the per-call options, closures for its retry. :func:`lean_sender`
returns a :class:`LeanSender`, whose :meth:`~LeanSender.send` does the rest of it, in the
same order, with the driver's own objects:

- a connection from the client's pool (``get_connection``: a bounded pool still waits,
  up to its timeout; the pool's health check of the connection still runs) and back to
  it (``release``) whatever happens;
- ``send_command`` / ``read_response`` on it (connecting, ``AUTH``, TLS, the
  connection's health check, ``socket_timeout``, decoding: the connection's own), except
  that on a connection that is open, without a periodic health check, the packed command
  is written to the connection's stream directly: the driver's ``send_packed_command``
  wraps every write in ``asyncio.wait_for(..., socket_timeout)`` (redis-py's default is
  5 s), which on Python 3.11 makes a task and costs a loop turn per command, although a
  write the socket takes at once cannot time out. A write the socket did not take
  whole still waits for the rest through ``send_packed_command`` (its timeout and its
  errors);
- the connection's own ``retry`` (redis-py's default ``Retry`` of a connection error or
  a timeout), disconnecting the connection before each new try, as ``execute_command``
  does;
- the client's response callback for the command, when it has one;
- redis-py's own operation metrics (``record_operation_duration``,
  ``record_error_count``), which cost nothing unless its observability is switched on.

And, where it is safe (see :class:`LeanSender`), the connection of a call that
succeeded is kept for the next call rather than given back to the pool and taken again
(the pool's lock, its accounting and its check of the connection cost as much as the
rest of the call).

It applies only to a client of exactly ``redis.asyncio.Redis`` or
``valkey.asyncio.Valkey`` (not a subclass, whose ``execute_command`` may do more),
neither a single-connection client nor one holding a connection, on a pool of exactly
the driver's ``ConnectionPool`` or ``BlockingConnectionPool`` (not Sentinel's), and, for
valkey-py, without client-side caching. Anything else (Cluster, Sentinel, a subclass, a
sync client) gets ``None`` and the adapter keeps ``execute_command``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["KEEP_MIN_CONNECTIONS", "LeanSender", "lean_sender"]

#: A pool passed in (a ``ConnectionPool``, which raises when it has no connection left
#: rather than wait) lends a connection to be kept between calls only if it allows at
#: least this many.
KEEP_MIN_CONNECTIONS = 100

_CLIENTS = {("redis", "Redis"), ("valkey", "Valkey")}
_POOLS = ("ConnectionPool", "BlockingConnectionPool")


def _pack(command: tuple[Any, ...], encoder: Any) -> bytes | None:
    """``command`` in the protocol, as the driver's ``pack_command`` packs it, or ``None``
    (the driver packs it) for an argument that is not a ``str``, ``int`` (``bool`` is
    refused by the driver) or ``bytes``, or a name of two words ("CONFIG GET").

    The driver's packer costs 13 µs for a claim's 20 arguments, this one 5.
    """
    if " " in command[0]:
        return None
    encoding, errors = encoder.encoding, encoder.encoding_errors
    parts = [b"*%d\r\n" % len(command)]
    for arg in command:
        kind = type(arg)
        if kind is str:
            data = arg.encode(encoding, errors)
        elif kind is int:
            data = b"%d" % arg
        elif kind is bytes:
            data = arg
        else:
            return None
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _open(conn: Any) -> bool:
    """Whether a kept connection is still open: the server has not closed it (its stream
    is not at EOF) and neither has the driver, as the pool's own check would find."""
    reader, writer = getattr(conn, "_reader", None), getattr(conn, "_writer", None)
    return not (reader is None or writer is None or reader.at_eof()
                or writer.transport.is_closing())


async def _no_record(**_: Any) -> None:
    """Stands in for redis-py's metric recorders on a driver without them."""


def _recorders(root: str) -> tuple[Callable[..., Awaitable[None]],
                                    Callable[..., Awaitable[None]]]:
    """The driver's ``record_operation_duration`` and ``record_error_count``, if any."""
    if root != "redis":
        return _no_record, _no_record
    try:
        from redis.asyncio.observability.recorder import (
            record_error_count,
            record_operation_duration,
        )
    except ImportError:  # redis-py before its observability (< 7)
        return _no_record, _no_record
    return record_operation_duration, record_error_count


def lean_sender(client: Any, *, owned: bool) -> LeanSender | None:
    """A lean sender of single commands for ``client``, or ``None`` (see the module docs).

    ``owned``: the adapter opened the client, so nothing but the adapter uses its pool.
    """
    kind = type(client)
    root = kind.__module__.split(".")[0]
    if (root, kind.__name__) not in _CLIENTS or kind.__module__ != f"{root}.asyncio.client":
        return None
    pool: Any = getattr(client, "connection_pool", None)
    if getattr(client, "single_connection_client", True) or getattr(client, "connection", 1):
        return None
    if type(pool).__name__ not in _POOLS or type(pool).__module__ != f"{root}.asyncio.connection":
        return None
    options = getattr(pool, "connection_kwargs", None) or {}
    if options.get("cache_enabled") or options.get("client_cache") is not None:
        return None  # valkey-py's client-side cache answers some commands itself
    # Keeping a connection between calls (see LeanSender): on a pool only the adapter
    # uses, or on a pool passed in that never makes a caller wait (not a
    # BlockingConnectionPool) and is not bounded tightly (redis-py 8's default bound, 100,
    # or more: one connection counted in use while idle is then no one else's loss); and
    # on RESP2 only, where a connection between two replies has nothing to read.
    # A pool of one connection (?max_connections=1) is never held: the kept connection
    # would be all of it, for whoever else takes from the client's pool.
    bound = getattr(pool, "max_connections", 0) or 0
    roomy = type(pool).__name__ == "ConnectionPool" and bound >= KEEP_MIN_CONNECTIONS
    keep = ((owned and bound > 1) or roomy) and str(options.get("protocol") or 2) == "2"
    return LeanSender(client, root, keep=keep)


class LeanSender:
    """Sends single commands of one plain asyncio client (see the module docs).

    With ``keep``, the connection of a call that succeeded is kept for the next call
    instead of going back to the pool: it stays counted as in use by the pool (so the
    pool's bound holds), it is given back (:meth:`give_back`) before the adapter uses the
    client in any other way and when the adapter closes, and a call finishing while
    another call of the adapter waits for the pool gives it back too. A kept connection
    is checked before it is used as the pool checks an idle connection: one the server
    (or the driver) closed meanwhile goes back to the pool, which reconnects it (and fails
    at once, outside the driver's retry, if the server is down, as before). RESP2 only,
    where a connection between two replies has nothing to read.
    """

    def __init__(self, client: Any, root: str, *, keep: bool) -> None:
        pool = client.connection_pool
        self._pool = pool
        #: Whether a connection is kept between calls.
        self.keep = keep
        self._kept: Any = None
        #: The adapter's calls waiting for (or holding) connections of the pool outside
        #: this sender: while any does, no connection is kept.
        self.waiting = 0
        self._get_connection = pool.get_connection
        self._release = pool.release
        self._callbacks: dict[Any, Any] = client.response_callbacks
        # redis-py 5.3+ deprecates naming the command to get_connection; valkey-py needs it
        self._named = root != "redis"
        self._record_duration, self._record_error = _recorders(root)

    async def give_back(self) -> None:
        """Return the kept connection to the pool, if there is one."""
        conn, self._kept = self._kept, None
        if conn is not None:
            with anyio.CancelScope(shield=True):  # a cancelled give-back would lose it
                await self._release(conn)

    async def send(self, command: tuple[Any, ...]) -> Any:
        """Send ``command`` and return its reply, as ``execute_command(*command)`` would."""
        name = command[0]
        conn = self._kept
        if conn is not None:
            self._kept = None
            if not _open(conn):  # closed while kept: the pool checks and reconnects it
                with anyio.CancelScope(shield=True):
                    await self._release(conn)
                conn = None
        if conn is None:
            self.waiting += 1
            try:
                conn = await (self._get_connection(name) if self._named
                              else self._get_connection())
            finally:
                self.waiting -= 1
        named = self._named
        start = time.monotonic()
        encoder = conn.encoder
        failures = 0

        async def attempt() -> Any:
            writer = getattr(conn, "_writer", None)
            if writer is None or conn.health_check_interval or writer.transport.is_closing():
                await conn.send_command(*command)  # connects, checks health, ...
            else:
                packed = _pack(command, encoder)
                writer.writelines([packed] if packed is not None
                                  else conn.pack_command(*command))
                if writer.transport.get_write_buffer_size():
                    # the socket did not take it all: the driver waits for the rest (up to
                    # socket_timeout) and translates a failure, as for any command
                    await conn.send_packed_command([], check_health=False)
            return await conn.read_response()

        async def failed(error: BaseException) -> None:
            nonlocal failures
            failures += 1
            # as execute_command's failure callback: a connection that failed is closed
            # before the next try (it reconnects, with a health check, on the next send)
            await conn.disconnect()
            if named and (conn.retry_on_error is None
                          or not isinstance(error, tuple(conn.retry_on_error))):
                raise error  # valkey-py retries only the errors it was told to

        done = False
        try:
            try:
                reply = await conn.retry.call_with_retry(attempt, failed)
            except Exception as exc:
                await self._record_error(
                    server_address=getattr(conn, "host", None),
                    server_port=getattr(conn, "port", None),
                    network_peer_address=getattr(conn, "host", None),
                    network_peer_port=getattr(conn, "port", None),
                    error_type=exc, retry_attempts=failures, is_internal=False)
                raise
            await self._record_duration(
                command_name=name, duration_seconds=time.monotonic() - start,
                server_address=getattr(conn, "host", None),
                server_port=getattr(conn, "port", None), db_namespace=str(conn.db))
            done = True
        finally:
            # a failed or cancelled call's connection goes back to the pool (which checks
            # it before handing it out again), as execute_command's does
            if done and self.keep and self._kept is None and not self.waiting:
                self._kept = conn
            else:
                await self._release(conn)
        callback = self._callbacks.get(name)
        if callback is None:
            return reply
        parsed = callback(reply)
        return await parsed if isinstance(parsed, Awaitable) else parsed
