"""The engine behind :class:`~lease_core.Scheduler`, one component per module.

:mod:`.session` says what each component does and how they are wired; :mod:`.runs` holds
the phases of a run and every transition between them. Nothing here is public API: import
from :mod:`lease_core`.
"""
