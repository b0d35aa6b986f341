"""The clock a :class:`~lease_core.Lease` measures its holds with (private).

A hold is surely live in the store until a ttl after its last renewal was sent, on the
store's clock; the process measures that interval with :func:`lease_clock`. It must
count the time the machine spent suspended (a laptop's lid closed, a VM paused by its
host): the store's clock ran on meanwhile, and may have given the name to another
holder. :func:`time.monotonic` does not count it on Linux (``CLOCK_MONOTONIC``) nor on
macOS (``mach_absolute_time``), so a lease woke up believing itself held, and its body
ran on until the next renewal was due. ``CLOCK_BOOTTIME`` (Linux) and macOS's
``CLOCK_MONOTONIC`` (unlike Linux's) count it: Apple's ``clock_gettime(3)`` says it
"will continue to increment while the system is asleep". Windows has no
``clock_gettime``: this is :func:`time.monotonic` there, ``GetTickCount64`` up to Python
3.12 (documented to count sleep and hibernation) and ``QueryPerformanceCounter`` from
3.13. Elsewhere (a Unix with neither clock) it is :func:`time.monotonic` too, which may
not count a suspend.

The clock is looked up at each call (``time.clock_gettime``), so a test can stand in for a
suspend by shifting it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["RESUME_CHECK", "clock_id", "lease_clock"]

#: The longest the renewal task sleeps while it renews a hold, in seconds: an event
#: loop's timers do not count a suspend, so after one the task wakes this soon at most,
#: finds the holds past their deadline on :func:`lease_clock` and marks them lost.
RESUME_CHECK = 1.0


def clock_id(clocks: Any = time, platform: str = sys.platform) -> int | None:
    """The ``clock_gettime`` clock that counts a suspend where ``clocks`` (the
    :mod:`time` module) runs on ``platform``, or ``None`` for :func:`time.monotonic`."""
    if not hasattr(clocks, "clock_gettime"):  # Windows; or macOS before 10.12
        return None
    boot: int | None = getattr(clocks, "CLOCK_BOOTTIME", None)
    if boot is None and platform == "darwin":
        boot = getattr(clocks, "CLOCK_MONOTONIC", None)
    return boot


_ID = clock_id()


def lease_clock() -> float:
    """Seconds on a monotonic clock that counts the time the machine was suspended."""
    if _ID is None:
        return time.monotonic()
    return time.clock_gettime(_ID)
