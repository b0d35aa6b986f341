"""``redis+cluster://`` and ``rediss+cluster://``: a Redis Cluster from a URL (private to
the Redis backend, :mod:`backends.redis.core`).

A ``redis://`` URL makes a client of one node, which reaches only that node's slots (the
backend refuses it on a Cluster node). ``redis+cluster://[[user]:password@]host[:port]``
names any node of the Cluster instead: redis-py's Cluster client finds the others from
it (``rediss+cluster://`` with TLS). So a URL, ``backend_from_url`` and the CLI
(``anarchon status --url redis+cluster://...``) reach a Cluster too. Under asyncio the
client is ``redis.asyncio.RedisCluster``, under trio the blocking
``redis.cluster.RedisCluster`` (in worker threads), as a ``redis://`` URL makes the one
or the other. The query takes redis-py's connection parameters (``socket_timeout``,
``max_connections`` per node, ...), besides the backend's own; a Cluster has database 0
only, so the path is empty or ``/0``.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from lease_core._redact import redact
from lease_core.errors import BackendUnavailable, ConfigurationError

from .redis import AsyncClientAdapter, RedisAdapter, SyncClientAdapter

__all__ = ["CLUSTER_SCHEMES", "check_cluster_url", "cluster_adapter", "is_cluster_url",
           "refuse_replica_reads"]

#: The Cluster schemes, and the scheme of one node's URL each stands for.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: object) -> bool:
    """Whether ``url`` is a ``redis+cluster://`` (or ``rediss+cluster://``) URL."""
    return isinstance(url, str) and url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def check_cluster_url(url: str) -> None:
    """Refuse a Cluster URL with no host, or a database other than 0."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    names = set(query)
    # (a ?db= other than 0 raised redis-py's own RedisClusterException at start() under
    # asyncio, and read as an unreachable Cluster under trio)
    for database in (unquote(parts.path).strip("/"), query.get("db", "")):
        if database not in ("", "0"):
            raise ConfigurationError(
                f"the Redis Cluster URL {redact(url)!r} names database {database!r}; a "
                "Cluster has database 0 only: write no path (or /0) and no ?db=")
    if "timeout" in names:
        raise ConfigurationError(
            f"the Redis Cluster URL {redact(url)!r} sets timeout=, the wait for a free "
            "connection of a redis:// URL's pool; a Cluster client has no such wait: drop "
            "it (max_connections= bounds each node's connections)")
    tls = sorted(name for name in names if name.startswith("ssl_"))
    if tls and parts.scheme.lower() != "rediss+cluster":
        raise ConfigurationError(
            f"the Redis Cluster URL {redact(url)!r} sets {', '.join(tls)} without TLS; "
            "write rediss+cluster:// for TLS")
    if not parts.hostname:
        raise ConfigurationError(
            f"the Redis Cluster URL {redact(url)!r} names no node; write "
            "redis+cluster://host:port (any node of the Cluster)")


def refuse_replica_reads(client: Any) -> None:
    """Refuse a Cluster client that reads from replicas (``read_from_replicas``, or a
    ``load_balancing_strategy``): a replica lags, so a backup would read a run or a
    checkpoint older than the primary's (a step's checkpoint from before its effect,
    which would be made again). A URL cannot ask for it (an unknown parameter)."""
    if not (getattr(client, "read_from_replicas", False)
            or getattr(client, "load_balancing_strategy", None) is not None):
        return
    raise ConfigurationError(
        f"the {type(client).__name__} client reads from replicas (read_from_replicas or "
        "load_balancing_strategy): anarchon reads runs and checkpoints from the primaries "
        "only (a replica lags: a backup would read a checkpoint older than the step's "
        "effect, and make it again); give RedisBackend a Cluster client without it")


def _node_url(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}"


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379} (a Redis Cluster)"


class _ClusterAsync(AsyncClientAdapter):
    """An asyncio ``RedisCluster`` the backend made from a URL (and closes)."""

    def __init__(self, client: Any, url: str) -> None:
        super().__init__(client, owned=True)
        self.where, self._password = _where(url), urlsplit(url).password


class _ClusterSync(SyncClientAdapter):
    """A blocking ``RedisCluster`` the backend made from a URL (and closes)."""

    def __init__(self, client: Any, url: str) -> None:
        super().__init__(client, owned=True)
        self.where, self._password = _where(url), urlsplit(url).password


def cluster_adapter(url: str) -> RedisAdapter:
    """The adapter of a new Cluster client of ``url`` (asyncio's under asyncio, else the
    blocking one)."""
    check_cluster_url(url)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        under_asyncio = False
    else:
        under_asyncio = True
    try:
        if under_asyncio:
            from redis.asyncio.cluster import RedisCluster

            return _ClusterAsync(RedisCluster.from_url(_node_url(url)), url)
        from redis.cluster import RedisCluster as SyncRedisCluster
        try:  # (this client connects at once: the backend makes it in a worker thread)
            client = SyncRedisCluster.from_url(_node_url(url))
        except (TypeError, ValueError):
            raise
        except Exception as exc:  # RedisClusterException, ConnectionError, ...
            raise BackendUnavailable(
                f"cannot reach Redis at {_where(url)} ({redact(str(exc))}); check that it is "
                "running and the address is right") from None
        return _ClusterSync(client, url)
    except ModuleNotFoundError as exc:
        raise ConfigurationError(
            "the Redis backend needs redis-py; install it with 'pip install anarchon[redis]'"
        ) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"the Redis Cluster URL {redact(url)!r} cannot be used ({exc})") from None
