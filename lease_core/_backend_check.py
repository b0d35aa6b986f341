"""The check that an argument is a backend, shared by the scheduler, leases and operations."""

from __future__ import annotations

from ._redact import redact
from .abc import Backend
from .errors import ConfigurationError

__all__ = ["check_backend"]


def check_backend(backend: object) -> None:
    """Refuse what is not a :class:`Backend` (a URL string, ``None``, a driver's client),
    with a :class:`ConfigurationError` naming it (a URL's password masked) and what to
    pass instead: the check of :class:`~lease_core.Scheduler`, :class:`~lease_core.Lease`
    and :class:`~lease_core.Admin`."""
    if isinstance(backend, Backend):
        return
    if isinstance(backend, str):
        raise ConfigurationError(
            f"backend={redact(backend)!r} is a string, not an anarchon backend; pass "
            "backend_from_url(url) for a URL, or MemoryBackend(), PostgresBackend(...) or "
            "RedisBackend(...)"
        )
    raise ConfigurationError(
        f"backend={redact(repr(backend))} is not an anarchon backend; pass "
        "MemoryBackend(), PostgresBackend(...), RedisBackend(...) or backend_from_url(url) "
        "(a pool or client goes inside: PostgresBackend(pool), RedisBackend(client))"
    )
