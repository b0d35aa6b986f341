"""``anarchon serve``'s bounds on its connections, and its checks of where it listens.

uvicorn closes a keep-alive connection that stays idle after a response, and nothing else:
a connection that never sends a request, or sends it a byte at a time, stays open for
ever, and it accepts as many as arrive (its ``limit_concurrency`` answers 503 only once a
request's head is in, and counts the asking connection itself). ``anarchon serve``
therefore runs uvicorn with :func:`bounded_protocol`, its h11 protocol with:

- a read timeout: a request must arrive in full (head and body) within ``read_timeout``
  seconds of the connection's opening, or of its first byte on a kept-alive connection,
  else the connection is closed (with a 408 when part of a request came);
- a cap: a connection opened while ``max_connections`` are open is answered 503 and
  closed at once, unread;
- a request head of at most :data:`MAX_HEAD` bytes (400 beyond), h11 being used even
  where httptools, which sets no such bound, is installed.

uvicorn's own ``timeout_keep_alive`` closes a connection idle after a response.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import socket
import sys
from dataclasses import dataclass
from typing import Any

from ._durations import parse_duration
from .errors import AnarchonError, ConfigurationError

__all__ = ["MAX_HEAD", "Limits", "add_limit_options", "bounded_protocol", "check_port",
           "limits_from", "loopback"]

#: The largest request head (request line and headers) read, in bytes: h11's default,
#: room for a bearer token and a browser's headers and cookies.
MAX_HEAD = 16 * 1024
#: The most a timeout or the cap may be: beyond, a typo rather than a wish.
_LONGEST_S = 3600.0
_MOST_CONNECTIONS = 100_000


@dataclass(frozen=True)
class Limits:
    """The bounds of one ``anarchon serve``: seconds, and a count of connections."""

    read_timeout: float = 10.0
    keep_alive: float = 5.0
    max_connections: int = 100

    def uvicorn_options(self) -> dict[str, Any]:
        """The keyword arguments of ``uvicorn.Config`` that apply them."""
        return {"http": bounded_protocol(self.read_timeout, self.max_connections),
                "timeout_keep_alive": self.keep_alive,
                "h11_max_incomplete_event_size": MAX_HEAD, "ws": "none"}


def add_limit_options(serve: argparse.ArgumentParser) -> None:
    """Add ``--read-timeout``, ``--keep-alive`` and ``--max-connections`` to ``serve``."""
    default = Limits()
    serve.add_argument("--read-timeout", default=f"{default.read_timeout:g}s", metavar="DURATION",
                       help="how long a client may take to send a request in full; a "
                            "connection that has not is closed (default %(default)s)")
    serve.add_argument("--keep-alive", default=f"{default.keep_alive:g}s", metavar="DURATION",
                       help="how long a connection may stay idle after a response "
                            "(default %(default)s)")
    serve.add_argument("--max-connections", default=str(default.max_connections),
                       metavar="N", help="connections open at once; one more is answered "
                                         "503 and closed (default %(default)s)")


def limits_from(args: argparse.Namespace) -> Limits:
    """The :class:`Limits` the options give; :class:`ConfigurationError` naming a bad value."""
    timeouts = {}
    for flag, zero in (("--read-timeout", False), ("--keep-alive", True)):
        text = getattr(args, flag[2:].replace("-", "_"))
        seconds = parse_duration(text, what=flag, allow_zero=zero)
        if seconds > _LONGEST_S:
            raise ConfigurationError(f"{flag}={text!r} is longer than an hour: give a "
                                     "duration such as '10s'")
        timeouts[flag] = seconds
    text = args.max_connections
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= _MOST_CONNECTIONS:
        raise ConfigurationError(f"--max-connections={text!r} is not a whole number from 1 "
                                 f"to {_MOST_CONNECTIONS:,}")
    return Limits(timeouts["--read-timeout"], timeouts["--keep-alive"], int(text))


def _answer(status: str, error: str) -> bytes:
    body = json.dumps({"error": error}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def bounded_protocol(read_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a read timeout and a cap on connections (the module's
    docstring says how); needs uvicorn (the extra ``http``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _answer("503 Service Unavailable",
                   f"too many connections: at most {max_connections} at a time")
    late = _answer("408 Request Timeout",
                   f"the request did not arrive in full within {read_timeout:g}s")
    reading = (h11.IDLE, h11.SEND_BODY)  # the client's states while a request comes in

    class BoundedH11Protocol(H11Protocol):
        reading_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:  # itself included
                transport.write(busy)
                transport.close()
                return
            self.reading_timer = self.loop.call_later(read_timeout, self.read_too_long)

        def data_received(self, data: bytes) -> None:
            if self.reading_timer is None and self.conn.their_state is h11.IDLE:
                # A next request's first bytes: its deadline starts now (until them,
                # the keep-alive timeout applies).
                self.reading_timer = self.loop.call_later(read_timeout, self.read_too_long)
            super().data_received(data)
            if self.conn.their_state not in reading:
                self.stop_reading_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_reading_timer()
            super().connection_lost(exc)

        def stop_reading_timer(self) -> None:
            if self.reading_timer is not None:
                self.reading_timer.cancel()
                self.reading_timer = None

        def read_too_long(self) -> None:
            self.reading_timer = None
            if self.transport.is_closing():
                return
            if self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:
                self.transport.write(late)  # part of a head came, and no answer started
            self.transport.close()

    return BoundedH11Protocol


def check_port(host: str, port: int) -> None:
    """Fail in one line when ``host:port`` cannot be listened on (uvicorn would exit 3)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigurationError(f"--host {host!r} is not an address to listen on ({exc})"
                                 ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        if sys.platform != "win32":  # as uvicorn's; on Windows it binds over a listener
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise AnarchonError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; is another server "
                "there? choose another --port"
            ) from None


def loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
