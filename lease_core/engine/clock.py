"""The store's clock as one instance estimates it, and whether the store answers."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from .. import events as ev
from .base import Settings, log_failure, logger

__all__ = ["StoreClock"]


#: How far a sample of the store's clock may disagree with the estimate, beyond what
#: the two round trips explain, before the store's clock is taken to have stepped.
_STEP_MARGIN_MS = 250


class StoreClock:
    """Estimates the store's clock from the answers of the store, and tracks outages.

    Every answer that carries the store's time (a claim, a heartbeat, a check) is a
    sample: the offset is taken from the sample with the shortest round trip of the last
    eight, so a slow answer never shifts the estimate much; ``offset_ms`` is the estimate
    to start from. ``emit`` reports
    :class:`~lease_core.events.StoreBack` and :class:`~lease_core.events.StoreUnreachable`.
    """

    def __init__(self, settings: Settings, emit: Callable[[ev.Event], None],
                 offset_ms: float = 0.0) -> None:
        self._settings = settings
        self._clock = settings.clock
        self._instance_id = settings.instance_id
        self._emit = emit
        self._samples: deque[tuple[float, float]] = deque(maxlen=8)
        self.last_sample = -math.inf
        """When the store's clock was last sampled (local clock)."""
        self.offset_ms = offset_ms
        """The store's clock minus the local clock, in milliseconds."""
        self.last_answer: float | None = None
        """When the store last answered (local clock), for health()."""
        self._down_since: float | None = None
        self.last_failure = -math.inf
        """When a call to the store last failed (local clock)."""
        self.answered_before_outage: float | None = None
        """When the store last answered before its latest outage began (local clock):
        a slot due before then was not missed while the store was unreachable."""

    def now_ms(self) -> int:
        """The store's clock as this instance estimates it, in epoch milliseconds."""
        return int(self._clock() * 1000 + self.offset_ms)

    def note(self, store_ms: int, sent: float, received: float) -> None:
        """Record an answer of the store: its time, and when it was asked and answered."""
        rtt = received - sent
        offset = store_ms - (sent + received) * 500
        if self._samples:
            best_rtt, best = min(self._samples)
            if abs(offset - best) > (rtt + best_rtt) * 500 + _STEP_MARGIN_MS:
                # The two samples cannot both be right: the store's clock stepped (an
                # operator, NTP). The older samples describe a clock that is gone;
                # kept, the best of them would stand for up to eight more answers, and
                # slots be claimed that far early (or late).
                logger.warning("the store's clock moved by %+.0f ms; following it",
                               offset - best)
                self._samples.clear()
        self._samples.append((rtt, offset))
        self.last_sample = received
        self.last_answer = received
        if self._down_since is not None:
            downtime, self._down_since = received - self._down_since, None
            logger.info("the store answers again after %.1fs", downtime)
            self._emit(ev.StoreBack(instance_id=self._instance_id, downtime=downtime))
        self.offset_ms = min(self._samples)[1]

    async def sample(self) -> None:
        """Ask the store for its time."""
        sent = self._clock()
        now = await self._settings.backend.now_ms()
        self.note(now, sent, self._clock())

    def failed(self, what: str, exc: Exception, *, log: bool = True) -> None:
        """A call to the store failed: log it, and report the outage when it begins."""
        if log:
            log_failure(what, exc)
        self.last_failure = self._clock()
        if self._down_since is None:
            self._down_since = self._clock()
            self.answered_before_outage = self.last_answer
            self._emit(ev.StoreUnreachable(instance_id=self._instance_id, error=exc))
