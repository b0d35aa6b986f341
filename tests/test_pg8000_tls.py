"""pg8000 from a URL: ``sslmode`` and the other query parameters, against real servers.

The TLS server is the system's PostgreSQL (the pgserver build has no TLS), with a CA, a
server certificate naming only ``localhost`` and a client certificate, all made here with
the ``openssl`` command. The server without TLS is the session's PostgreSQL 16.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from adapters.pg8000 import pg8000_params
from adapters.sql import adapter_for
from backends.embedded.postgres import EmbeddedPostgres
from backends.postgres import PostgresBackend
from lease_core.errors import BackendUnavailable, ConfigurationError
from tests.stores import missing_service
from tests.stores.postgres import SYSTEM_BINDIR, PgServer, drop_tables, unique_table

pytestmark = pytest.mark.anyio

SSL_ROW = "SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()"


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(cwd: Path, name: str) -> None:
    _openssl(cwd, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def _make_cert(cwd: Path, name: str, subject: str, extensions: str) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl(cwd, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
    _openssl(cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", str(uuid.uuid4().int >> 65), "-days", "2", "-out", f"{name}.crt",
             "-extfile", f"{name}.ext")


@dataclass
class TlsServer:
    """A PostgreSQL server with TLS on, and the files a client needs."""

    server: EmbeddedPostgres
    certs: Path

    def url(self, host: str = "127.0.0.1", **query: str) -> str:
        """A ``postgresql+pg8000://`` superuser URL with ``query`` parameters."""
        s = self.server
        params = "&".join(f"{name}={value}" for name, value in query.items())
        return f"postgresql+pg8000://postgres:{s.password}@{host}:{s.port}/postgres?{params}"


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsServer]:
    """The system's PostgreSQL with ``ssl=on``; its certificate's only name is localhost."""
    if not (SYSTEM_BINDIR / "postgres").exists() or shutil.which("openssl") is None:
        missing_service("a system PostgreSQL built with TLS, and the openssl command")
    certs = Path(tempfile.mkdtemp(prefix="anarchon-tls-"))
    try:
        certs.chmod(0o755)
        _make_ca(certs, "ca")
        _make_ca(certs, "other-ca")
        _make_cert(certs, "server", "/CN=localhost",
                   "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n")
        _make_cert(certs, "client", "/CN=postgres", "extendedKeyUsage=clientAuth\n")
        server = EmbeddedPostgres(SYSTEM_BINDIR, settings={
            "ssl": "on", "ssl_cert_file": str(certs / "server.crt"),
            "ssl_key_file": str(certs / "server.key"), "ssl_ca_file": str(certs / "ca.crt"),
        })
        for path in certs.iterdir():
            path.chmod(0o600 if path.suffix == ".key" else 0o644)
        if server.os_user is not None:
            shutil.chown(certs / "server.key", server.os_user, server.os_user)
        server.start()
        try:
            yield TlsServer(server, certs)
        finally:
            server.stop()
    finally:
        shutil.rmtree(certs, ignore_errors=True)


async def session(url: str, sql: str = SSL_ROW) -> tuple[Any, ...]:
    """Open the library's pg8000 pool from ``url`` and return the first row of ``sql``."""
    adapter = adapter_for(url)
    await adapter.open()
    try:
        return (await adapter.all(sql))[0]
    finally:
        await adapter.close()


async def refused(url: str, secret: str) -> str:
    """Check that ``url`` cannot connect; return the message, which never holds ``secret``."""
    with pytest.raises(BackendUnavailable) as info:
        await session(url)
    message = str(info.value)
    assert secret not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    return message


def plain_url(pg: PgServer, **query: str) -> str:
    """A ``postgresql+pg8000://`` URL to the server without TLS."""
    params = "&".join(f"{name}={value}" for name, value in query.items())
    return pg.dsn.replace("postgresql://", "postgresql+pg8000://", 1) + f"?{params}"


def test_unknown_and_bad_parameters_are_refused_by_name(tmp_path: Path) -> None:
    secret = "pw-" + uuid.uuid4().hex
    base = f"postgresql+pg8000://app:{secret}@db.example:5432/app"
    cases = {
        "?sslmod=require": "'sslmod'.*the driver's: application_name, .*sslmode",
        "?sslmode=require&table=x&foo=1": "parameter 'foo'",  # table is the backend's
        "?sslmode=verify": "unknown sslmode 'verify'; use one of disable, prefer, require",
        "?sslmode=allow": "sslmode 'allow' is not supported .* use 'prefer'",
        "?host=/run/postgresql&sslmode=verify": "unknown sslmode 'verify'",
        "?port=54x": "port '54x'",
        "?host=a,b": "one host",
        "?connect_timeout=soon": "connect_timeout 'soon'",
        # as psycopg refuses them; they raised the socket's ValueError (OverflowError) at
        # start()
        "?connect_timeout=nan": "connect_timeout 'nan' is not a number of seconds",
        "?connect_timeout=inf": "connect_timeout 'inf' is not a number of seconds",
        "?sslmode=require&sslkey=/k.pem": "sslkey .* set sslcert too",
        f"?sslmode=verify-ca&sslrootcert={tmp_path}/none.pem": "cannot load sslrootcert .*none.pem",
        f"?sslmode=require&sslcert={tmp_path}/none.pem": "cannot load sslcert",
        "?sslmode": "'sslmode' .* name=value",
    }
    for query, pattern in cases.items():
        with pytest.raises(ConfigurationError, match=pattern) as info:
            PostgresBackend(base + query)
        assert secret not in str(info.value)
    with pytest.raises(ConfigurationError, match="'sslmod'"):
        PostgresBackend(base.replace("+pg8000", "") + "?sslmod=require", driver="pg8000")


def test_a_comma_in_the_password_is_not_a_second_host() -> None:
    """A comma may stand unencoded in a URL's user and password (libpq reads it so): it
    was refused as a multi-host URL, which pg8000 cannot reach."""
    params = pg8000_params("postgresql+pg8000://app,x:pa,ss@db.example:5433/app")
    assert (params["user"], params["password"], params["host"], params["port"]) == (
        "app,x", "pa,ss", "db.example", 5433)
    assert isinstance(PostgresBackend("postgresql+pg8000://app:pa,ss@db/app"), PostgresBackend)
    with pytest.raises(ConfigurationError, match="names several"):
        PostgresBackend("postgresql+pg8000://app:pa,ss@db1,db2/app")


def test_bad_pgsslmode_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGSSLMODE", "always")
    with pytest.raises(ConfigurationError, match="PGSSLMODE 'always'"):
        PostgresBackend("postgresql+pg8000://app:pw@db/app")
    PostgresBackend("postgresql+pg8000://app:pw@db/app?sslmode=disable")  # the URL wins


async def test_server_without_tls_refuses_require(
    pg16_server: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = pg16_server.server.password
    for mode in ("require", "verify-ca", "verify-full"):
        message = await refused(plain_url(pg16_server, sslmode=mode), secret)
        assert f"does not accept TLS, which sslmode={mode} requires" in message
    backend = PostgresBackend(plain_url(pg16_server, sslmode="require"), table=unique_table())
    with pytest.raises(BackendUnavailable, match="does not accept TLS"):
        await backend.start()
    monkeypatch.setenv("PGSSLMODE", "require")
    with pytest.raises(BackendUnavailable, match="does not accept TLS"):
        await session(plain_url(pg16_server))
    assert (await session(plain_url(pg16_server, sslmode="prefer")))[0] is False
    assert (await session(plain_url(pg16_server, sslmode="disable")))[0] is False


async def test_require_prefer_and_disable_on_a_tls_server(tls_server: TlsServer) -> None:
    assert (await session(tls_server.url(sslmode="require")))[0] is True
    assert (await session(tls_server.url()))[0] is True  # prefer, as libpq's default
    assert (await session(tls_server.url(sslmode="disable")))[0] is False


async def test_verify_full_checks_the_chain_and_the_host_name(tls_server: TlsServer) -> None:
    ca = tls_server.certs / "ca.crt"
    ssl, _ = await session(tls_server.url("localhost", sslmode="verify-full", sslrootcert=ca))
    assert ssl is True
    # The certificate names localhost only: verify-ca accepts the IP, verify-full does not.
    ssl, _ = await session(tls_server.url(sslmode="verify-ca", sslrootcert=ca))
    assert ssl is True
    secret = tls_server.server.password
    message = await refused(tls_server.url(sslmode="verify-full", sslrootcert=ca), secret)
    assert "failed verification (sslmode=verify-full)" in message
    assert "127.0.0.1" in message


async def test_a_wrong_ca_is_refused_clearly(tls_server: TlsServer) -> None:
    other = tls_server.certs / "other-ca.crt"
    secret = tls_server.server.password
    for mode in ("verify-full", "verify-ca", "require"):  # require + sslrootcert = verify-ca
        message = await refused(tls_server.url("localhost", sslmode=mode, sslrootcert=other),
                                secret)
        assert "TLS certificate of PostgreSQL at localhost:" in message
        assert "check sslrootcert" in message
    # Without sslrootcert, verify-ca trusts the system's CAs, which never signed this one.
    await refused(tls_server.url("localhost", sslmode="verify-ca"), secret)


async def test_client_certificate_is_presented(tls_server: TlsServer) -> None:
    certs = tls_server.certs
    ssl, client_dn = await session(tls_server.url(
        "localhost", sslmode="verify-full", sslrootcert=certs / "ca.crt",
        sslcert=certs / "client.crt", sslkey=certs / "client.key",
    ))
    assert ssl is True
    assert "CN=postgres" in client_dn


async def test_backend_connections_use_verified_tls(tls_server: TlsServer) -> None:
    table, app = unique_table(), f"anarchon-{uuid.uuid4().hex[:8]}"
    certs = tls_server.certs
    backend = PostgresBackend(tls_server.url(
        "localhost", sslmode="verify-full", sslrootcert=certs / "ca.crt",
        sslcert=certs / "client.crt", sslkey=certs / "client.key", application_name=app,
    ), table=table)
    await backend.start()
    try:
        assert await backend.now_ms() > 0
        # The pool keeps its connection; the server says how it was made.
        with psycopg.connect(tls_server.server.dsn, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT s.ssl, s.client_dn FROM pg_stat_ssl s JOIN pg_stat_activity a "
                "USING (pid) WHERE a.application_name = %s", (app,)
            ).fetchall()
        assert rows and all(ssl and "CN=postgres" in dn for ssl, dn in rows)
    finally:
        await backend.close()
        await drop_tables(tls_server.server.dsn, table)


async def test_query_parameters_reach_the_connection(pg16_server: PgServer) -> None:
    s = pg16_server.server
    assert s.root is not None
    # host= naming a directory: the Unix socket there (sslmode does not apply, as in libpq).
    url = (f"postgresql+pg8000:///ignored?host={s.root}&port={s.port}&user=postgres"
           f"&dbname=postgres&sslmode=require&application_name=tls-test&connect_timeout=5")
    addr, app, db = await session(
        url, "SELECT inet_server_addr(), current_setting('application_name'), current_database()"
    )
    assert (addr, app, db) == (None, "tls-test", "postgres")
    missing = f"postgresql+pg8000://postgres@/postgres?host={s.root}&port=1"
    message = await refused(missing, s.password)
    assert os.path.join(str(s.root), ".s.PGSQL.1") in message
