"""The connection parameters of a ``postgresql+pg8000://`` URL, TLS included.

:func:`pg8000_params` turns a URL (and the ``PG*`` variables) into what
:class:`~adapters.pg8000.Pg8000PoolAdapter` connects with; :mod:`adapters.pg8000`
re-exports it and documents the parameters. It needs no driver.
"""

from __future__ import annotations

import math
import os
import ssl
from typing import Any

from lease_core._redact import redact
from lease_core.errors import BackendUnavailable, ConfigurationError

from .base import conninfo_params, dsn_query

__all__ = ["PG8000_PARAMS", "SSL_MODES", "pg8000_params", "refuse_multi_host"]

#: URL query parameters the pg8000 pool understands, each with the environment variable
#: that fills it when the URL leaves it out (``None``: no variable).
PG8000_PARAMS: dict[str, str | None] = {
    "host": "PGHOST",
    "port": "PGPORT",
    "user": "PGUSER",
    "password": "PGPASSWORD",
    "dbname": "PGDATABASE",
    "database": None,
    "sslmode": "PGSSLMODE",
    "sslrootcert": "PGSSLROOTCERT",
    "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "application_name": "PGAPPNAME",
}

#: The ``sslmode`` values the pg8000 pool accepts.
SSL_MODES = ("disable", "prefer", "require", "verify-ca", "verify-full")


def refuse_multi_host(dsn: str) -> None:
    """Raise :class:`ConfigurationError` for a URL naming several hosts: pg8000 takes one."""
    hosts = dsn.partition("://")[2].partition("/")[0].rpartition("@")[2]  # (not a password)
    if "," in hosts + dsn_query(dsn).get("host", ""):
        raise ConfigurationError(
            f"the pg8000 driver connects to one host, and {redact(dsn)!r} names several: "
            "for a multi-host URL (host1,host2 with target_session_attrs=read-write, to reach "
            "the primary after a failover) use psycopg: postgresql://... with "
            "pip install 'anarchon[postgres]'"
        )


def pg8000_params(dsn: str | None) -> dict[str, Any]:
    """Return the pg8000 connection parameters of a ``postgresql+pg8000://`` URL (or ``None``).

    Query parameters override the URL's parts; :data:`PG8000_PARAMS` lists the accepted
    ones and the ``PG*`` variables that fill gaps. The result holds ``host``, ``port``,
    ``user``, ``password``, ``database``, ``unix_sock``, ``ssl_context`` (``False`` for no
    TLS, ``None`` for pg8000's opportunistic TLS, or an :class:`ssl.SSLContext`),
    ``sslmode``, ``connect_timeout`` and ``application_name``. Raises
    :class:`~lease_core.errors.ConfigurationError` on an unknown parameter or a bad value.
    """
    if dsn:
        refuse_multi_host(dsn)
    params = conninfo_params(dsn)
    query = dsn_query(dsn) if dsn else {}
    unknown = sorted(set(query) - PG8000_PARAMS.keys())
    if unknown:
        raise ConfigurationError(
            f"the pg8000 driver does not understand the URL parameter "
            f"{', '.join(repr(name) for name in unknown)}; it accepts "
            f"{', '.join(PG8000_PARAMS)}"
        )

    def setting(name: str) -> tuple[str | None, str]:
        if query.get(name):
            return query[name], name
        var = PG8000_PARAMS[name]
        return (os.environ.get(var) or None, var) if var else (None, name)

    for name, key in (("host", "host"), ("user", "user"), ("dbname", "database"),
                      ("database", "database")):
        if query.get(name):
            params[key] = query[name]
    if "password" in query:
        params["password"] = query["password"]
    if query.get("port"):
        try:
            params["port"] = int(query["port"])
        except ValueError:
            raise ConfigurationError(
                f"port {query['port']!r} in the PostgreSQL URL is not a number"
            ) from None
    host = str(params["host"])
    if "," in host:
        raise ConfigurationError(
            f"host {host!r}: the pg8000 driver connects to one host; name only one"
        )
    params["unix_sock"] = f"{host.rstrip('/')}/.s.PGSQL.{params['port']}" if host.startswith(
        "/") else None

    timeout, source = setting("connect_timeout")
    params["connect_timeout"] = None
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < math.inf:  # (nan, inf: a ValueError of the socket at start)
            raise ConfigurationError(
                f"{source} {timeout!r} is not a number of seconds (0 waits forever)"
            )
        params["connect_timeout"] = seconds
    params["application_name"] = setting("application_name")[0]

    mode, mode_source = setting("sslmode")
    mode = mode or "prefer"
    params["sslmode"] = mode
    params["ssl_context"] = _ssl_context(
        mode, mode_source, setting("sslrootcert"), setting("sslcert"), setting("sslkey")
    )
    if params["unix_sock"] is not None:
        params["ssl_context"] = False  # libpq ignores sslmode on Unix sockets too
    return params


def _ssl_context(mode: str, mode_source: str, rootcert: tuple[str | None, str],
                 cert: tuple[str | None, str],
                 key: tuple[str | None, str]) -> ssl.SSLContext | bool | None:
    if mode == "allow":
        raise ConfigurationError(
            f"{mode_source} 'allow' is not supported by the pg8000 driver (it cannot retry with "
            "TLS after a refused plain login); use 'prefer' (TLS when the server offers it), "
            "'require' or 'disable'"
        )
    if mode not in SSL_MODES:
        raise ConfigurationError(
            f"unknown {mode_source} {mode!r}; use one of {', '.join(SSL_MODES)}"
        )
    if mode == "disable":
        return False
    if key[0] and not cert[0]:
        raise ConfigurationError(
            f"{key[1]} names a client key but no client certificate; set sslcert too"
        )
    if mode == "prefer" and not cert[0]:
        return None  # pg8000's own: TLS when the server offers it, no verification
    if mode == "require" and rootcert[0]:
        mode = "verify-ca"  # as libpq does when a root certificate is given
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if mode in ("prefer", "require"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.check_hostname = mode == "verify-full"
        if rootcert[0] and rootcert[0] != "system":
            _load(rootcert, lambda: context.load_verify_locations(cafile=rootcert[0]))
        else:
            context.load_default_certs()
    if cert[0]:
        _load(cert, lambda: context.load_cert_chain(str(cert[0]), key[0]))
    return context


def _load(setting: tuple[str | None, str], load: Any) -> None:
    try:
        load()
    except (OSError, ssl.SSLError) as exc:
        reason = str(exc) if isinstance(exc, ssl.SSLError) else exc.strerror or str(exc)
        raise ConfigurationError(
            f"cannot load {setting[1]} {setting[0]!r}: {reason}; give a readable PEM file"
        ) from None


def refuses_tls(exc: BaseException) -> bool:
    """Whether pg8000's ``exc`` says the server refused TLS."""
    return bool(exc.args) and exc.args[0] == "Server refuses SSL"


def tls_error(exc: Exception, where: str, mode: str | None, secret: str | None
              ) -> Exception | None:
    """The error of a TLS failure connecting to ``where`` (``sslmode=mode``), or None for
    another error."""
    import pg8000.exceptions  # (here: this module is read without the driver installed)

    if isinstance(exc, pg8000.exceptions.InterfaceError) and refuses_tls(exc):
        return BackendUnavailable(
            f"PostgreSQL at {where} does not accept TLS, which sslmode={mode} "
            "requires; turn ssl on in the server, or use sslmode=prefer or disable"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return BackendUnavailable(
            f"the TLS certificate of PostgreSQL at {where} failed verification "
            f"(sslmode={mode}): {exc.verify_message}; check sslrootcert names the CA "
            "that signed the server's certificate, and for verify-full that the "
            "certificate names the host"
        )
    if isinstance(exc, ssl.SSLError):
        return BackendUnavailable(
            f"TLS with PostgreSQL at {where} failed (sslmode={mode}): "
            f"{redact(str(exc), secret)}"
        )
    return None
