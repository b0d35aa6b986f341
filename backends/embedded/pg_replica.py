"""A streaming replica of an :class:`~backends.embedded.postgres.EmbeddedPostgres` (for tests).

:class:`EmbeddedReplica` copies a running primary with ``pg_basebackup -R`` (which writes
``standby.signal`` and ``primary_conninfo``) and starts the copy on its own port, as the
same OS user and with the same binaries as the primary (so it runs as root too, see
:mod:`backends.embedded.postgres`). The primary needs ``wal_level=replica``, free
``max_wal_senders`` and a ``replication`` entry in ``pg_hba.conf``: PostgreSQL's defaults
and ``initdb``'s generated ``pg_hba.conf`` (``host replication all 127.0.0.1/32``) have
them, on PostgreSQL 15, 16 and 18 alike.

Two ways to make a replica lag:

- :meth:`EmbeddedReplica.pause_replay` (``pg_wal_replay_pause()``): the WAL still
  arrives, so a promotion replays it first and loses nothing; reads on the replica are
  stale meanwhile;
- :meth:`EmbeddedReplica.detach` (``primary_conninfo = ''``): the WAL stops arriving, so
  every commit the primary acknowledges afterwards is lost by a promotion, as with an
  asynchronous standby cut off from its primary.

Then :meth:`EmbeddedPostgres.kill` crashes the primary and :meth:`EmbeddedReplica.promote`
(``pg_promote()``) makes the replica a primary on a new timeline. Every wait is for a
state, with a deadline.

Example::

    primary = EmbeddedPostgres()
    primary.start()
    replica = EmbeddedReplica(primary)
    replica.start()
    replica.detach()          # writes from here on are not replicated
    primary.kill()
    replica.promote()         # replica.dsn now reaches a primary on timeline 2
    replica.stop(); primary.stop()
"""

from __future__ import annotations

import time
from typing import Any

from . import EmbeddedServerError
from .postgres import EmbeddedPostgres, find_free_port, owned_dir

__all__ = ["EmbeddedReplica", "timeline_of"]


def timeline_of(dsn: str) -> int:
    """The timeline a server at ``dsn`` writes (a primary) or last checkpointed (a standby)."""
    row = _one(dsn, "SELECT CASE WHEN pg_is_in_recovery() "
                    "THEN lpad(to_hex((pg_control_checkpoint()).timeline_id), 8, '0') "
                    "ELSE pg_walfile_name(pg_current_wal_lsn()) END")
    return int(str(row[0])[:8], 16)


def _one(dsn: str, sql: str) -> tuple[Any, ...]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(sql)
        row = cur.fetchone() if cur.description else ()
    assert row is not None
    return tuple(row)


class EmbeddedReplica(EmbeddedPostgres):
    """A streaming replica of ``primary``, owned by this object (:meth:`start`, :meth:`stop`).

    It uses the primary's binaries, OS user and superuser password; :attr:`dsn` reaches
    it. ``settings`` are extra server settings, as for :class:`EmbeddedPostgres`. Before
    :meth:`promote` it is a hot standby: it answers reads, refuses writes.
    """

    def __init__(self, primary: EmbeddedPostgres, *,
                 settings: dict[str, str] | None = None) -> None:
        super().__init__(primary.bindir, host=primary.host,
                         settings={**primary.settings, **(settings or {})})
        self.primary = primary
        self.password = primary.password
        self.conninfo = ""

    def start(self, timeout: float = 60) -> str:
        """Copy the primary (``pg_basebackup -R``), start the copy and wait until it streams."""
        if self.root is not None:
            self._pg_ctl_start()
            return self.dsn
        if self.primary.root is None:
            raise EmbeddedServerError("start the primary before its replica")
        self.root = owned_dir("anarchon-pgreplica-", self.os_user)
        self.conninfo = (f"host={self.primary.host} port={self.primary.port} user=postgres "
                         f"password={self.primary.password} application_name=anarchon_replica")
        self._run("pg_basebackup", "-D", str(self.datadir), "-R", "-X", "stream", "-c", "fast",
                  "--no-sync", "-d", self.conninfo, timeout=timeout)
        self.port = find_free_port(self.host)
        self._pg_ctl_start()
        self.wait_streaming(timeout)
        return self.dsn

    def _query(self, sql: str) -> tuple[Any, ...]:
        return _one(self.dsn, sql)

    def _wait(self, what: str, check: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._query(check)[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replica at port {self.port}: {what} timed out")
            time.sleep(0.02)

    def wait_streaming(self, timeout: float = 30) -> None:
        """Block until the replica's WAL receiver streams from the primary."""
        self._wait("streaming", "SELECT EXISTS (SELECT 1 FROM pg_stat_wal_receiver "
                                "WHERE status = 'streaming')", timeout)

    def wait_replayed(self, timeout: float = 30) -> None:
        """Block until the replica has replayed everything the primary has written so far.

        "Written" is the primary's WAL insert position: with ``synchronous_commit=off`` (the
        embedded server's setting) a commit is acknowledged before its WAL is written out.
        """
        lsn = _one(self.primary.dsn, "SELECT pg_current_wal_insert_lsn()::text")[0]
        self._wait("replay", f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn", timeout)

    def pause_replay(self) -> None:
        """Stop applying WAL (``pg_wal_replay_pause()``); it still arrives and is kept."""
        self._query("SELECT pg_wal_replay_pause()")
        self._wait("pause", "SELECT pg_get_wal_replay_pause_state() = 'paused'", 30)

    def resume_replay(self) -> None:
        """Apply WAL again (``pg_wal_replay_resume()``)."""
        self._query("SELECT pg_wal_replay_resume()")

    def detach(self, timeout: float = 30) -> None:
        """Stop receiving WAL: the primary's later commits never reach this replica."""
        self._query("ALTER SYSTEM SET primary_conninfo = ''")
        self._query("SELECT pg_reload_conf()")
        self._wait("detach", "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_wal_receiver)", timeout)

    def attach(self, timeout: float = 30) -> None:
        """Stream from the primary again after :meth:`detach`; wait until it streams."""
        self._query(f"ALTER SYSTEM SET primary_conninfo = '{self.conninfo}'")
        self._query("SELECT pg_reload_conf()")
        self.wait_streaming(timeout)

    def promote(self, timeout: float = 60) -> None:
        """Make this replica a primary (``pg_promote()``); return once it accepts writes."""
        self._query(f"SELECT pg_promote(true, {int(timeout)})")
        self._wait("promotion", "SELECT NOT pg_is_in_recovery()", timeout)

    def timeline(self) -> int:
        """The timeline this server replays (a standby) or writes (once promoted)."""
        return timeline_of(self.dsn)
