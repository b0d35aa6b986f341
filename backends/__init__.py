"""Store backends: one module or package per store."""

#: Marks anarchon's own package (see :mod:`lease_core._packages`).
__anarchon__ = True
