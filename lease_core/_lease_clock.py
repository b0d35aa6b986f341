"""The clock a :class:`~lease_core.Lease` measures its holds with (private).

A hold is surely live in the store until a ttl after its last renewal was sent, on the
store's clock; the process measures that interval with :func:`lease_clock`. It must
count the time the machine spent suspended (a laptop's lid closed, a VM paused by its
host): the store's clock ran on meanwhile, and may have given the name to another
holder. :func:`time.monotonic` does not count it on Linux (``CLOCK_MONOTONIC``) nor on
macOS (``mach_absolute_time``), so a lease woke up believing itself held, and its body
ran on until the next renewal was due. ``CLOCK_BOOTTIME`` (Linux) and macOS's
``CLOCK_MONOTONIC`` count it; elsewhere (Windows' counter counts it too) this is
:func:`time.monotonic`.

The clock is looked up at each call (``time.clock_gettime``), so a test can stand in for a
suspend by shifting it.
"""

from __future__ import annotations

import sys
import time

__all__ = ["RESUME_CHECK", "lease_clock"]

#: The longest the renewal task sleeps while it renews a hold, in seconds: an event
#: loop's timers do not count a suspend, so after one the task wakes this soon at most,
#: finds the holds past their deadline on :func:`lease_clock` and marks them lost.
RESUME_CHECK = 1.0

_ID: int | None = getattr(time, "CLOCK_BOOTTIME", None)
if _ID is None and sys.platform == "darwin":  # pragma: no cover - macOS
    _ID = time.CLOCK_MONOTONIC


def lease_clock() -> float:
    """Seconds on a monotonic clock that counts the time the machine was suspended."""
    if _ID is None:  # pragma: no cover - neither Linux nor macOS
        return time.monotonic()
    return time.clock_gettime(_ID)
