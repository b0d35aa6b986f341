"""What one instance logs of the store's outages: a few lines each, not one per call."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._structures import format_slot
from ..errors import AnarchonError
from .base import logger

__all__ = ["OUTAGE_ERRORS", "OUTAGE_REMINDER", "OutageLog"]

#: Seconds between the reminders of an outage that goes on.
OUTAGE_REMINDER = 60.0
#: The most distinct errors an outage logs, each once (later ones count in its reminders).
OUTAGE_ERRORS = 5


class OutageLog:
    """Logs one instance's outages of the store in a bounded number of lines.

    An outage logs its first failure (a warning saying the store cannot be reached), each
    other error it meets once (up to :data:`OUTAGE_ERRORS`: an outage that changes, as a
    pooler refusing queries once a failed-over server is up), a reminder every
    :data:`OUTAGE_REMINDER` seconds while it lasts, and its end, with how many calls
    failed and how many slots were missed meanwhile. Every other failure goes to DEBUG:
    with 100 jobs due every second, each failed claim, retry and missed slot logged a
    warning, about 6,000 lines for an outage of 30 s. An error that is not the store's
    (a bug) is logged at ERROR with its traceback, once per kind and outage (up to
    :data:`OUTAGE_ERRORS` kinds of bugs, however many of the store's errors came first).

    An outage that begins less than :data:`OUTAGE_REMINDER` after the end of the last one
    logged, or after relapses no line counted yet (a store that fails some calls and
    answers others, as one refusing heartbeats only), is a relapse: it logs no start or
    end of its own, only the reminders, which count the outages since the last line; a
    relapse that lasts past a reminder logs its end.
    """

    def __init__(self, instance_id: str) -> None:
        self._instance_id = instance_id
        self._failures = 0  # calls failed since the last line that counted them
        self._outage_failures = 0  # calls failed in the current (or last) outage
        self._outages = 0  # outages begun since the last line that counted them
        self._kinds: set[tuple[type[BaseException], str]] = set()  # the store's errors
        self._bugs: set[tuple[type[BaseException], str]] = set()  # and the others, apart
        self._logged_at = -math.inf  # when the last warning of outages was logged
        self._began = -math.inf  # when the current (or last) outage began
        self._ended_at = -math.inf  # when the end of the last outage was logged
        self._failed_at = -math.inf  # when the last call failed
        self._quiet = False  # the current outage is a relapse
        self._missed: dict[str, int] = {}

    def failed(self, what: str, exc: Exception, now: float, *, starting: bool) -> None:
        """Log (or count) a failed call: ``what`` failed with ``exc`` at ``now`` (local
        clock); ``starting``: the first failure of an outage."""
        if starting:
            self._began = now
            # Quiet too after relapses no line has counted yet: its reminder does.
            # A relapse: within a reminder's time of the last end logged, or of the last
            # failure (relapses that follow each other). Later, an outage of its own: the
            # relapses before it left _outages above 0, and the next outage, a day later,
            # began "the store keeps failing calls: 2 failed in 2 outages over the last
            # 86395s".
            self._quiet = now - max(self._ended_at, self._failed_at) < OUTAGE_REMINDER
            if not self._quiet:
                self._failures, self._outages, self._missed = 0, 0, {}
                self._kinds, self._bugs = set(), set()
            self._outages += 1
            self._outage_failures = 0
        self._failed_at = now
        self._failures += 1
        self._outage_failures += 1
        kind = (type(exc), str(exc))
        instance = self._instance_id
        # A bug's kinds are counted apart: the store's errors seen first must not leave
        # it without its traceback.
        seen = self._kinds if isinstance(exc, AnarchonError) else self._bugs
        if kind not in seen and len(seen) < OUTAGE_ERRORS:
            seen.add(kind)
            if seen is self._bugs:
                # Store errors are translated to AnarchonError: anything else is a bug.
                logger.error("instance %s: %s failed unexpectedly (a bug: please report "
                             "it with this traceback); the call is retried", instance,
                             what, exc_info=exc)
            elif starting and not self._quiet:
                logger.warning("instance %s cannot reach the store: %s failed: %s; its "
                               "calls are retried, and until it answers further failures "
                               "are summed up every %gs", instance, what, exc,
                               OUTAGE_REMINDER)
            else:
                logger.warning("instance %s: %s failed: %s (the store is unreachable)",
                               instance, what, exc)
            self._logged_at = now
        elif now - self._logged_at >= OUTAGE_REMINDER:
            if self._outages > 1:
                logger.warning("instance %s: the store keeps failing calls: %d failed in %d "
                               "outages over the last %.0fs%s, the latest: %s failed: %s",
                               instance, self._failures, self._outages,
                               now - self._logged_at, self._missed_text(), what, exc)
                self._failures, self._outages, self._missed = 0, 1, {}
            else:
                logger.warning("instance %s: the store is still unreachable, for %.0fs; %d "
                               "calls failed%s, the latest: %s failed: %s", instance,
                               now - self._began, self._outage_failures,
                               self._missed_text(), what, exc)
            self._logged_at = now
        else:
            logger.debug("instance %s: %s failed: %s", instance, what, exc)

    def missed(self, slots: Sequence[tuple[str, int]], *, down: bool) -> None:
        """Slots (job, slot) missed while the store was unreachable, not claimed since a
        newer slot of their job is: counted in the outage's lines while ``down``, else
        logged in one line."""
        for job, slot in slots:
            logger.debug("%s slot %s not claimed while the store was unreachable; "
                         "claiming the newer slot instead", job, format_slot(slot))
        if not slots:
            return
        if down:
            for job, _ in slots:
                self._missed[job] = self._missed.get(job, 0) + 1
            return
        jobs = sorted({job for job, _ in slots})
        logger.warning("instance %s: %d slot%s of %d job%s (%s%s) missed while the store "
                       "was unreachable %s not claimed: only the newest slot of each job "
                       "is (catch_up)", self._instance_id, len(slots),
                       "" if len(slots) == 1 else "s", len(jobs), "" if len(jobs) == 1 else "s",
                       ", ".join(jobs[:3]), ", ..." if len(jobs) > 3 else "",
                       "is" if len(slots) == 1 else "are")

    def ended(self, now: float, silent: float | None) -> None:
        """The outage ended at ``now``; the store last answered ``silent`` seconds
        before (None: never)."""
        if self._quiet and self._logged_at < self._began:
            logger.debug("instance %s: the store answers again after %.1fs (a relapse)",
                         self._instance_id, now - self._began)
            return
        logger.warning("instance %s: the store answers again after %.1fs (%d call%s "
                       "failed%s%s)", self._instance_id, now - self._began,
                       self._outage_failures, "" if self._outage_failures == 1 else "s",
                       "" if silent is None else f"; its previous answer was {silent:.1f}s ago",
                       self._missed_text())
        self._ended_at = self._logged_at = now
        self._failures, self._outages, self._missed = 0, 0, {}

    def _missed_text(self) -> str:
        if not self._missed:
            return ""
        slots = sum(self._missed.values())
        return (f"; {slots} slot{'' if slots == 1 else 's'} of {len(self._missed)} "
                f"job{'' if len(self._missed) == 1 else 's'} missed meanwhile, only the "
                "newest of each job is claimed (catch_up)")
