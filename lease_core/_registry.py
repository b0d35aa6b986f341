"""Choosing a backend by URL scheme, for applications that configure it as a string."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from .abc import Backend
from .errors import ConfigurationError

__all__ = ["ENTRY_POINT_GROUP", "backend_from_url", "known_schemes"]

#: Third-party backends register here: ``scheme = "package.module:BackendClass"``.
ENTRY_POINT_GROUP = "anarchon.backends"

_BUILTIN: dict[str, tuple[str, str, str]] = {
    # scheme: (module, class, extra to install)
    "memory": ("backends.memory", "MemoryBackend", ""),
    "postgresql": ("backends.postgres", "PostgresBackend", "postgres"),
    "postgres": ("backends.postgres", "PostgresBackend", "postgres"),
    "postgresql+psycopg": ("backends.postgres", "PostgresBackend", "postgres"),
    "postgresql+pg8000": ("backends.postgres", "PostgresBackend", "pg8000"),
    "redis": ("backends.redis", "RedisBackend", "redis"),
    "rediss": ("backends.redis", "RedisBackend", "redis"),
    "unix": ("backends.redis", "RedisBackend", "redis"),
}


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    """Every URL scheme :func:`backend_from_url` accepts: built-in and installed plugins."""
    return sorted(set(_BUILTIN) | set(_plugins()))


def _load_builtin(scheme: str) -> type[Backend]:
    module_name, class_name, extra = _BUILTIN[scheme]
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

    Built in: ``memory://``, ``postgresql://`` and ``postgres://`` (also
    ``postgresql+pg8000://``), ``redis://``, ``rediss://`` and ``unix://``. Other packages
    add schemes through the entry-point group ``anarchon.backends``; the entry point names
    the scheme and loads the backend class, which is built with ``cls.from_url(url,
    **options)`` when it has that classmethod, else ``cls(url, **options)``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"backend URL {url!r} has no scheme; use one of: "
            + ", ".join(f"{s}://" for s in known_schemes())
        )
    scheme = urlsplit(url).scheme.lower()
    cls: type[Backend]
    if scheme in _BUILTIN:
        cls = _load_builtin(scheme)
    else:
        plugin = _plugins().get(scheme)
        if plugin is None:
            raise ConfigurationError(
                f"backend URL scheme {scheme!r} (in {_redact(url)!r}) is unknown; known schemes: "
                + ", ".join(f"{s}://" for s in known_schemes())
            )
        cls = plugin.load()
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ConfigurationError(
                f"entry point {plugin.value!r} for scheme {scheme!r} is not a Backend subclass"
            )
    factory = getattr(cls, "from_url", None)
    if factory is not None:
        backend: Backend = factory(url, **options)
    elif cls.__name__ == "MemoryBackend":
        backend = cls(**options)
    else:
        backend = cls(url, **options)  # type: ignore[call-arg]
    return backend


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()
    return url
