"""One command of a plain asyncio client, sent without ``execute_command``'s machinery.

The Redis backend's hot calls (a claim, a finish, a named lease's acquire and release)
are one command each. redis-py's ``execute_command`` spends 15-25 % of such a call's
client CPU on what those commands never use: the single-connection client's lock,
``HIMPORT SET`` detection, the per-call options, closures for its retry. :func:`lean_sender`
returns a coroutine function that does the rest of it, in the same order, with the
driver's own objects:

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

__all__ = ["LeanSender", "lean_sender"]

#: Sends one command (a tuple of its name and arguments) and returns its parsed reply.
LeanSender = Callable[[tuple[Any, ...]], Awaitable[Any]]

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


def lean_sender(client: Any) -> LeanSender | None:
    """A lean sender of single commands for ``client``, or ``None`` (see the module docs)."""
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
    callbacks: dict[Any, Any] = client.response_callbacks
    get_connection = pool.get_connection
    release = pool.release
    # redis-py 5.3+ deprecates naming the command to get_connection; valkey-py needs it
    named = root != "redis"
    record_duration, record_error = _recorders(root)

    async def send(command: tuple[Any, ...]) -> Any:
        name = command[0]
        conn = await (get_connection(name) if named else get_connection())
        start = time.monotonic()
        retry = conn.retry
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

        try:
            try:
                reply = await retry.call_with_retry(attempt, failed)
            except Exception as exc:
                await record_error(server_address=getattr(conn, "host", None),
                                   server_port=getattr(conn, "port", None),
                                   network_peer_address=getattr(conn, "host", None),
                                   network_peer_port=getattr(conn, "port", None),
                                   error_type=exc, retry_attempts=failures, is_internal=False)
                raise
            await record_duration(command_name=name, duration_seconds=time.monotonic() - start,
                                  server_address=getattr(conn, "host", None),
                                  server_port=getattr(conn, "port", None),
                                  db_namespace=str(conn.db))
        finally:
            await release(conn)
        callback = callbacks.get(name)
        if callback is None:
            return reply
        parsed = callback(reply)
        return await parsed if isinstance(parsed, Awaitable) else parsed

    return send
