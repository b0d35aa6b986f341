"""Throwaway servers for demos and tests: PostgreSQL and Redis/Valkey from pip packages.

This is tooling, not part of the library: no backend or adapter imports it. Use
:mod:`backends.embedded.postgres` and :mod:`backends.embedded.redis`.
"""
