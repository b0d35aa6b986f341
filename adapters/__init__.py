"""Connection adapters: one module per driver."""

#: Marks anarchon's own package (see :mod:`lease_core._packages`).
__anarchon__ = True
