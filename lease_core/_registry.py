"""Choosing a backend by URL scheme, for applications that configure it as a string."""

from __future__ import annotations

import importlib
import re
from collections.abc import Collection, Iterable
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ._packages import require_own
from ._redact import redact
from .abc import Backend
from .errors import ConfigurationError

__all__ = [
    "ENTRY_POINT_GROUP",
    "backend_from_url",
    "check_options",
    "check_url",
    "known_schemes",
    "merge_options",
    "positive_whole",
    "split_url_options",
]

#: Third-party backends register here: ``scheme = "package.module:BackendClass"``.
ENTRY_POINT_GROUP = "anarchon.backends"

#: What to write instead of a scheme of another tool's for a store anarchon supports.
_SCHEME_HINTS = {
    "valkey": " (for Valkey, write redis://: the Redis backend speaks to Valkey too)",
    "valkeys": " (for Valkey with TLS, write rediss://)",
    "pg": " (for PostgreSQL, write postgresql://)",
    "postgresql+asyncpg": " (asyncpg is not supported: write postgresql:// for psycopg, or "
                          "postgresql+pg8000://)",
    # SQLAlchemy's default PostgreSQL URL, copied from an application's settings.
    "postgresql+psycopg2": " (psycopg2 is not supported: write postgresql:// for psycopg 3, "
                           "or postgresql+pg8000://)",
    "redis+tls": " (for Redis over TLS, write rediss://)",
    "redis+ssl": " (for Redis over TLS, write rediss://)",
}

_BUILTIN: dict[str, tuple[str, str, str]] = {
    # scheme: (module, class, extra to install)
    "memory": ("backends.memory", "MemoryBackend", ""),
    "postgresql": ("backends.postgres", "PostgresBackend", "postgres"),
    "postgres": ("backends.postgres", "PostgresBackend", "postgres"),
    "postgresql+psycopg": ("backends.postgres", "PostgresBackend", "postgres"),
    "postgresql+pg8000": ("backends.postgres", "PostgresBackend", "pg8000"),
    # the short scheme with a driver, as PostgresBackend accepts it
    "postgres+psycopg": ("backends.postgres", "PostgresBackend", "postgres"),
    "postgres+pg8000": ("backends.postgres", "PostgresBackend", "pg8000"),
    "redis": ("backends.redis", "RedisBackend", "redis"),
    "rediss": ("backends.redis", "RedisBackend", "redis"),
    "redis+sentinel": ("backends.redis", "RedisBackend", "redis"),
    "redis+cluster": ("backends.redis", "RedisBackend", "redis"),
    "rediss+cluster": ("backends.redis", "RedisBackend", "redis"),
    "unix": ("backends.redis", "RedisBackend", "redis"),
}


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    """Every URL scheme :func:`backend_from_url` accepts: built-in and installed plugins."""
    return sorted(set(_BUILTIN) | set(_plugins()))


def _load_builtin(scheme: str) -> type[Backend]:
    module_name, class_name, extra = _BUILTIN[scheme]
    require_own("backends")
    if extra:
        require_own("adapters")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("backends", "lease_core", "adapters"):
            raise ConfigurationError(
                f"the {scheme}:// backend is not available in this version of anarchon"
            ) from None
        raise ConfigurationError(
            f"the {scheme}:// backend needs the driver {exc.name!r}; "
            f"install it with: pip install 'anarchon[{extra}]'"
        ) from None
    cls: type[Backend] = getattr(module, class_name)
    return cls


def backend_from_url(url: str, **options: Any) -> Backend:
    """Make a backend from a URL; the scheme selects it.

    Built in: ``memory://``, ``postgresql://`` and ``postgres://`` (also with a driver:
    ``postgresql+pg8000://``, ``postgres+psycopg://``), ``redis://``, ``rediss://``,
    ``redis+sentinel://``, ``redis+cluster://``, ``rediss+cluster://`` and ``unix://``; a libpq
    key/value DSN (``host=db user=app password=...``) selects PostgreSQL. Other packages
    add schemes through the entry-point group ``anarchon.backends``; the entry point names
    the scheme and loads the backend class, which is built with ``cls.from_url(url,
    **options)`` when it has that classmethod, else ``cls(url, **options)``.

    ``options`` are the backend's keyword arguments; ``namespace=`` is accepted by every
    built-in backend (the table on PostgreSQL, the key prefix on Redis, ignored in memory),
    and the built-in backends also read their options from the URL's query
    (``?table=jobs``). An option the backend does not know raises
    :class:`ConfigurationError`, which names it and lists the accepted ones.
    """
    if isinstance(url, str) and "://" not in url and _KEY_VALUE.match(url):
        scheme = "postgresql"
    elif not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"backend URL {redact(repr(url))} has no scheme; use one of: "
            + ", ".join(f"{s}://" for s in known_schemes())
            + " (or a PostgreSQL key/value DSN such as 'host=db dbname=app')"
        )
    else:
        scheme = url.split("://", 1)[0].lower()
        try:
            urlsplit(url)
        except ValueError as exc:  # an unclosed IPv6 bracket, for one
            raise ConfigurationError(
                f"backend URL {redact(url)!r} cannot be read: {exc} (write an IPv6 host "
                "in brackets, [::1], and percent-encode reserved characters in the user "
                "and password)") from None
    cls: type[Backend]
    if scheme in _BUILTIN:
        cls = _load_builtin(scheme)
    else:
        plugin = _plugins().get(scheme)
        if plugin is None:
            hint = _SCHEME_HINTS.get(scheme, "")
            raise ConfigurationError(
                f"backend URL scheme {scheme!r} (in {redact(url)!r}) is unknown{hint}; known "
                "schemes: " + ", ".join(f"{s}://" for s in known_schemes())
            )
        try:
            cls = plugin.load()
        except Exception as exc:  # its module, or a driver it imports, is missing or broken
            dist = getattr(getattr(plugin, "dist", None), "name", None)
            raise ConfigurationError(
                f"the backend for {scheme}:// (entry point {plugin.value!r}"
                f"{f' of the package {dist!r}' if dist else ''}) failed to load: "
                f"{type(exc).__name__}: {exc}; install what it needs, or reinstall it"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ConfigurationError(
                f"entry point {plugin.value!r} for scheme {scheme!r} is not a Backend subclass"
            )
    factory = getattr(cls, "from_url", None)
    if factory is not None:
        backend: Backend = factory(url, **options)
    else:
        backend = cls(url, **options)  # type: ignore[call-arg]
    return backend


# --- options given in a URL or as keywords ----------------------------------------------

_KEY_VALUE = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
_PAIR = re.compile(r"""([A-Za-z_][A-Za-z0-9_]*)\s*=\s*('(?:[^'\\]|\\.)*'|[^\s']*)\s*""")


def split_url_options(url: str, names: Collection[str]) -> tuple[str, dict[str, str]]:
    """Take the parameters in ``names`` out of ``url``; return what is left and their values.

    ``url`` is a URL (its query is searched) or a libpq key/value DSN (its pairs are). The
    rest of the URL is returned as given, for the driver.
    """
    taken: dict[str, str] = {}
    if "://" not in url:
        if not _KEY_VALUE.match(url):
            return url, taken
        kept = []
        for match in _PAIR.finditer(url):
            key, value = match.group(1), match.group(2)
            if key in names:
                if value.startswith("'"):
                    value = re.sub(r"\\(.)", r"\1", value[1:-1])
                _take(taken, key, value, url)
            else:
                kept.append(match.group(0).strip())
        return " ".join(kept), taken
    parts = urlsplit(url)
    if not parts.query:
        return url, taken
    kept = []
    for piece in parts.query.split("&"):
        # Each parameter the driver gets is kept as written: decoded and encoded again, a
        # space (%20) would become '+', which libpq does not decode.
        pairs = parse_qsl(piece, keep_blank_values=True)
        if len(pairs) == 1 and pairs[0][0] in names:
            _take(taken, pairs[0][0], pairs[0][1], url)
        elif piece:
            kept.append(piece)
    if not taken:
        return url, taken
    rest = urlunsplit(parts._replace(query="&".join(kept)))
    if not parts.netloc and url.startswith(f"{parts.scheme}://"):
        # urlunsplit drops the '//' of an empty host (unix:///path/redis.sock,
        # postgresql:///app?host=/run/postgresql): the drivers need it
        rest = f"{parts.scheme}://{rest[len(parts.scheme) + 1:]}"
    return rest, taken


def _take(taken: dict[str, str], key: str, value: str, url: str) -> None:
    if key in taken and taken[key] != value:
        raise ConfigurationError(
            f"the backend URL {redact(url)!r} gives {key!r} twice, as {taken[key]!r} and "
            f"{value!r}; give it once"
        )
    taken[key] = value


def merge_options(
    owner: str,
    keywords: dict[str, Any],
    from_url: dict[str, str],
    accepted: Collection[str],
) -> dict[str, Any]:
    """Combine keyword options with the same options read from a URL.

    Raises :class:`ConfigurationError` for an option ``owner`` does not accept, and for
    one given both ways with different values.
    """
    check_options(owner, keywords, accepted)
    merged: dict[str, Any] = dict(from_url)
    for key, value in keywords.items():
        if value is None:
            continue
        if key in from_url and not _same(value, from_url[key]):
            raise ConfigurationError(
                f"{owner} got {key}={value!r} and {key}={from_url[key]!r} in the URL; "
                "give it once, or the same value both ways"
            )
        merged[key] = value
    return merged


def _same(value: Any, text: str) -> bool:
    """Whether a keyword option's ``value`` says what the URL's ``text`` says: the same
    text, or the same number (``timeout=10.0`` and ``?timeout=10``), or the same truth
    (``True`` and ``?x=true``)."""
    if str(value) == text:
        return True
    if isinstance(value, bool):
        return text.strip().lower() in (("true", "1", "yes", "on") if value
                                        else ("false", "0", "no", "off"))
    if isinstance(value, int | float):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return False


def check_options(owner: str, options: Collection[str], accepted: Collection[str]) -> None:
    """Raise :class:`ConfigurationError` naming any of ``options`` not in ``accepted``."""
    unknown = [name for name in options if name not in accepted]
    if unknown:
        raise ConfigurationError(
            f"{owner} does not accept the option {', '.join(map(repr, unknown))}; it accepts: "
            + ", ".join(sorted(accepted))
        )


#: A URL path with a host in it after an ``@`` (``/wd@db/x``, ``/wd@cache:6379/0``): the
#: rest of a password whose ``/`` ended the host; a database named ``team@prod`` passes.
_HOST_IN_PATH = re.compile(r"@[^/]*[/:]")


def check_url(
    kind: str,
    url: str,
    own: Collection[str],
    driver: Collection[str],
    *,
    read: dict[str, Any] | None = None,
) -> None:
    """The one check of a backend URL's port and query, shared by every backend.

    ``kind`` names the store in messages ("PostgreSQL", "Redis"); ``own`` are the
    parameters anarchon takes, ``driver`` those it passes to the driver; ``read`` maps a
    parameter to a function reading its text, which raises :class:`ValueError` for a bad
    value. A port that is not a number from 1 to 65535, a parameter in neither list and a
    value its reader refuses each raise one :class:`ConfigurationError` that names the
    value and, for an unknown parameter, every accepted one.
    """
    if "://" in url:
        parts = urlsplit(url)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if "@" in parts.netloc and (_HOST_IN_PATH.search(parts.path) or "@" in parts.fragment
                                    or any("@" in key for key, _ in pairs)):
            # user:pa@ss#wd@host: the URL parser ended the host at '#' ('/', '?') after
            # the password's own '@': the host read is a piece of the password, and the
            # rest shows the others. Not shown, not even masked.
            raise ConfigurationError(
                f"the {kind} URL {parts.scheme}://... cannot be read: it has an '@' after "
                "the host, so a password (or user name) with '@' and '/', '?' or '#' in "
                "it was not percent-encoded: write '@' as %40, '#' as %23, '/' as %2F, "
                "'?' as %3F")
        _check_ports(kind, url, (value for key, value in pairs if key == "port"))
        port = parts.netloc.rpartition("@")[2]
        for host in port.split(","):  # a multi-host URL: host1:5432,host2:5433
            text = host.rpartition("]")[2].partition(":")[2] if ":" in host else ""
            if text and not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
                if "@" in url.split("://", 1)[1] and "@" not in parts.netloc:
                    # user:pa#ss@host: the URL parser ended the host at '#' ('/', '?'),
                    # so the "port" is a piece of the password: never show it.
                    raise ConfigurationError(
                        f"the {kind} URL {redact(url)!r} cannot be read: a password (or "
                        "user name) with '/', '?', '#' or '@' in it must be "
                        "percent-encoded ('#' as %23, '/' as %2F, '?' as %3F, '@' as %40)"
                    )
                raise ConfigurationError(
                    f"the {kind} URL {redact(url)!r} has the port {text!r}, which is not a "
                    "number from 1 to 65535"
                )
    else:
        pairs = [(m.group(1), m.group(2).strip("'")) for m in _PAIR.finditer(url)]
        _check_ports(kind, url, (value for key, value in pairs if key == "port"))
    unknown = [key for key, _ in pairs if key not in own and key not in driver]
    if unknown:
        drivers = f"; the driver's: {', '.join(sorted(driver))}" if driver else ""
        raise ConfigurationError(
            f"the {kind} URL {redact(url)!r} has the unknown parameter "
            f"{', '.join(map(repr, unknown))}; anarchon's own: {', '.join(sorted(own))}"
            + drivers
        )
    for key, value in pairs:
        reader = (read or {}).get(key)
        if reader is None:
            continue
        try:
            reader(value)
        except (TypeError, ValueError) as exc:
            # One wording for every backend: "max_size='-1' must be a whole number, at
            # least 1". A reader raises ValueError("a whole number, at least 1"); a
            # driver's own int/float parser is described here, never by Python's text.
            what = _DESCRIBED.get(reader) or str(exc) or "a valid value"
            raise ConfigurationError(
                f"{key}={value!r} must be {what} (in the {kind} URL {redact(url)!r})"
            ) from None


def _check_ports(kind: str, url: str, values: Iterable[str]) -> None:
    """Refuse a ``port`` parameter (of a DSN, or of a URL's query, which overrides the
    URL's own port) that is not a number from 1 to 65535; a list (``5432,5433``) is each
    host's."""
    what = "URL" if "://" in url else "DSN"
    for text in (v for value in values for v in value.split(",")):
        if text and not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
            raise ConfigurationError(
                f"the {kind} {what} {redact(url)!r} has the port {text!r}, which is not a "
                "number from 1 to 65535"
            )


#: How :func:`check_url` words a bad value for a driver's plain parsers.
_DESCRIBED: dict[object, str] = {int: "a whole number", float: "a number"}


def positive_whole(text: str) -> int:
    """A URL option's text read as a whole number of at least 1 (for :func:`check_url`)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError("a whole number, at least 1")
    return number
