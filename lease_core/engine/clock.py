"""The store's clock as one instance estimates it, and whether the store answers."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from .. import events as ev
from .base import Settings, logger
from .outages import OutageLog

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

    A store may answer reads while it refuses every write (a PostgreSQL standby, a full
    disk, Redis out of memory or short of ``min-replicas-to-write``). So once a write has
    failed, only a write the store accepts (a claim, a heartbeat, a membership renewal)
    ends the outage: a clock read alone would report the store back at every heartbeat
    while no slot can run. That holds once :attr:`writes_probed` (the backend keeps a
    membership, which the instance renews at the next tick after a failed write); with a
    backend that keeps none, any answer ends an outage, as an idle instance may make no
    write for a long time.
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
        self.writes_probed = False
        """True when the instance writes to the store at every tick while a write has
        failed (the membership renewal), so a read alone need not end an outage."""
        self.awaits_write = False
        """True from a failed write until the store accepts one (with
        :attr:`writes_probed`): until then no answer ends the outage."""
        self.log = OutageLog(settings.instance_id)
        """What the instance logs of the store's outages."""

    @property
    def down(self) -> bool:
        """True from a failed call until the store answers (or accepts a write)."""
        return self._down_since is not None

    def now_ms(self) -> int:
        """The store's clock as this instance estimates it, in epoch milliseconds."""
        return int(self._clock() * 1000 + self.offset_ms)

    def note(self, store_ms: int, sent: float, received: float, *,
             wrote: bool = False) -> None:
        """Record an answer of the store: its time, and when it was asked and answered;
        ``wrote``: the call wrote to the store (a claim, a heartbeat)."""
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
        self.offset_ms = min(self._samples)[1]
        if wrote or not self.awaits_write:
            self._answered(received)

    def wrote(self) -> None:
        """The store accepted a write that carried no time sample (a membership renewal)."""
        self._answered(self._clock())

    def _answered(self, received: float) -> None:
        self.awaits_write = False
        self.last_answer = received
        if self._down_since is not None:
            downtime, self._down_since = received - self._down_since, None
            before = self.answered_before_outage
            self.log.ended(received, None if before is None else received - before)
            self._emit(ev.StoreBack(instance_id=self._instance_id, downtime=downtime))

    async def sample(self) -> None:
        """Ask the store for its time."""
        sent = self._clock()
        now = await self._settings.backend.now_ms()
        self.note(now, sent, self._clock())

    def failed(self, what: str, exc: Exception, *, write: bool = False) -> None:
        """A call to the store failed: log it (see :class:`OutageLog`), and report the
        outage when it begins; ``write``: the call would have written to the store."""
        self.last_failure = self._clock()
        self.log.failed(what, exc, self.last_failure, starting=self._down_since is None)
        if write and self.writes_probed:
            self.awaits_write = True
        if self._down_since is None:
            self._down_since = self._clock()
            self.answered_before_outage = self.last_answer
            self._emit(ev.StoreUnreachable(instance_id=self._instance_id, error=exc))
