"""``anarchon demo``: tooling that shows the library at work, kept out of its import paths.

No library module imports this package; only the ``anarchon demo`` command does, when it
runs. :func:`run_demo` runs the fleet demo (winner, backups, takeover, hand-over).
"""

from __future__ import annotations

from .fleet import run_demo, worker_main

__all__ = ["run_demo", "worker_main"]
