"""The parts of a ``redis+sentinel://`` URL (private to :mod:`adapters.redis` and the
Redis backend, which re-check a URL before connecting), and how the adapter names the
Sentinels' primary in its errors (:class:`Sentinels`)."""

from __future__ import annotations

import contextlib
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from lease_core._redact import redact
from lease_core.errors import AnarchonError, BackendUnavailable, ConfigurationError

__all__ = ["SENTINEL_SCHEME", "Sentinels", "sentinel_parts"]


#: The scheme of a Redis reached through Sentinel (see :func:`sentinel_parts`).
SENTINEL_SCHEME = "redis+sentinel"
#: Query parameters of a Sentinel URL passed to the primary's connections, read as
#: redis-py reads them from a ``redis://`` URL (besides ``sentinel_password`` and the
#: pool's bounds, ``max_connections`` and ``timeout``).
_SENTINEL_PRIMARY_OPTIONS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive",
                             "socket_read_size", "health_check_interval", "retry_on_timeout",
                             "client_name", "lib_name", "lib_version", "protocol")


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """Split ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]``
    (an IPv6 host in brackets, ``[::1]:26379``).

    Returns the Sentinels' addresses (port 26379 when none is given), the service name
    (the primary's name in the Sentinels' ``sentinel monitor``) and the keyword arguments
    of the primary's client: ``db``, ``username`` and ``password`` (of the primary;
    the Sentinels' own is ``?sentinel_password=``), the pool's bounds ``max_connections``
    and ``timeout``, and the connections' options of :data:`_SENTINEL_PRIMARY_OPTIONS`
    (``socket_timeout``, ``client_name``, ...) from the query. Any other query parameter
    (TLS's ``ssl_*`` among them: a Sentinel URL has no TLS) raises
    :class:`~lease_core.errors.ConfigurationError` rather than being dropped.
    """
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    user, _, password = auth.partition(":")
    sentinels = []
    for host in hosts.split(","):
        if host.startswith("["):  # an IPv6 address, [::1] or [::1]:26379
            name, _, port = host[1:].partition("]")
            port = port.removeprefix(":")
        else:
            name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        sentinels.append((name or "127.0.0.1", int(port or 26379)))
    path = [unquote(part) for part in parts.path.split("/") if part]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ConfigurationError(
            f"the Sentinel URL {redact(url)!r} must name the service and may name the db: "
            "redis+sentinel://host:26379,host2:26379/mymaster/0")
    query = dict(parse_qsl(parts.query))
    kwargs: dict[str, Any] = {"db": int(path[1]) if len(path) == 2 else 0}
    if user:
        kwargs["username"] = unquote(user)
    if password:
        kwargs["password"] = unquote(password)
    parsers: dict[str, Any] = {}
    with contextlib.suppress(ImportError):  # the driver's absence is reported when connecting
        from redis.connection import URL_QUERY_ARGUMENT_PARSERS

        parsers.update(URL_QUERY_ARGUMENT_PARSERS)
    for key, value in query.items():
        if key == "sentinel_password":
            kwargs["sentinel_kwargs"] = {"password": value}
        elif key in (*_SENTINEL_PRIMARY_OPTIONS, "max_connections", "timeout"):
            try:
                kwargs[key] = parsers.get(key, str)(value)
            except ValueError:
                raise ConfigurationError(
                    f"the Sentinel URL {redact(url)!r} has {key}={value!r}, which redis-py "
                    "cannot read") from None
        else:
            raise ConfigurationError(
                f"the Sentinel URL {redact(url)!r} takes no parameter {key!r} (it would be "
                "dropped); a redis+sentinel:// URL takes sentinel_password, max_connections, "
                f"timeout, {', '.join(_SENTINEL_PRIMARY_OPTIONS)}; the primary's user and "
                "password go before the hosts, its db after the service. For TLS through "
                "Sentinel, pass a client: redis.asyncio.Sentinel(..., ssl=True)"
                ".master_for(service, ssl=True, ...)")
    return sentinels, path[0], kwargs


class Sentinels:
    """Where a Sentinel-found primary is, for messages, and a clear error when the
    Sentinels named none: redis-py's ``MasterNotFoundError`` holds each Sentinel client's
    whole repr, and the primary's client names no host (its errors said "at Redis")."""

    def __init__(self, watcher: Any, sentinels: list[tuple[str, int]], service: str) -> None:
        self.watcher = watcher
        self.addresses = ", ".join(f"{host}:{port}" for host, port in sentinels)
        self.service = service

    def where(self) -> str:
        return f"the primary of {self.service!r} (Sentinel {self.addresses})"

    def translate(self, exc: BaseException, password: str | None) -> AnarchonError | None:
        if "MasterNotFoundError" not in {cls.__name__ for cls in type(exc).__mro__}:
            return None
        text = str(exc)
        for sentinel in self.watcher.sentinels:  # its repr, some 900 characters: its address
            options = getattr(sentinel.connection_pool, "connection_kwargs", None) or {}
            text = text.replace(str(sentinel), f"{options.get('host')}:{options.get('port')}")
        return BackendUnavailable(
            f"no Sentinel at {self.addresses} named a primary for the service "
            f"{self.service!r} ({redact(text, password)}); check that the Sentinels run, "
            f"that {self.service!r} is the name in their 'sentinel monitor' (the URL's path: "
            "redis+sentinel://host:26379/<service>/<db>), and that they see the primary")
