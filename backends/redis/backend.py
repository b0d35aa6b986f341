"""The Redis backend object, :class:`RedisBackend`: its parts combined.

See :mod:`backends.redis` for the design and the key layout.
"""

from __future__ import annotations

from .claims import RedisClaims
from .leases import RedisLeases
from .named import RedisNamedLeases
from .operations import RedisOperations
from .records import RedisRecords

__all__ = ["RedisBackend"]


class RedisBackend(RedisNamedLeases, RedisOperations, RedisClaims, RedisLeases, RedisRecords):
    """Coordinate through Redis (or Valkey), 6.2 or newer, standalone or Cluster.

    ``connection`` is ``None`` (``redis://localhost:6379/0``), a URL, a redis-py or
    valkey-py client (asyncio or sync) or a connection pool; see :mod:`adapters.redis`.

    .. note:: A client or pool passed in is never closed; a client the backend made from
       a URL is closed by the last :meth:`close`.

    ``prefix`` starts every key (see the module docs for the layout); ``namespace`` is
    another name for it (the keyword every backend accepts). ``wait_replicas``
    makes claims, heartbeats, finishes, checkpoints, operations and named leases'
    acquires and renewals wait, up to ``wait_timeout``, for that many replicas to
    acknowledge them; a short count raises :class:`~lease_core.errors.BackendUnavailable`
    instead of winning, renewing, finishing or holding (the runs such a claim won are
    handed over at once, such a named lease released; see the module docs). A finish
    sent again after an unacknowledged one writes nothing and is not checked again.
    ``wait_replicas`` cannot be used on a Redis Cluster: it raises
    :class:`~lease_core.errors.ConfigurationError` (at construction for a Cluster client,
    else at :meth:`start`); use a standalone primary with replicas, or Sentinel, to wait
    for replicas, or drop ``wait_replicas``.

    Fencing across a failover assumes the Redis servers' clocks agree (the epochs are
    their clocks; see the module docs).

    A call made before :meth:`start` starts the backend itself; :meth:`close` then
    releases that hold like any other.
    """

    schemes = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "rediss+cluster")
