"""Throwaway servers for demos and tests: PostgreSQL and Redis/Valkey from pip packages.

This is tooling, not part of the library: no backend or adapter imports it. Use
:mod:`backends.embedded.postgres` and :mod:`backends.embedded.redis`.
"""

from lease_core.errors import AnarchonError

__all__ = ["EmbeddedServerError"]


class EmbeddedServerError(AnarchonError):
    """Raised when a throwaway server cannot be started on this machine; says why."""
