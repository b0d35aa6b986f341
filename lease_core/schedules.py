"""Schedules: which slots a job fires at.

A slot is the scheduled time of one occurrence in epoch milliseconds (UTC). Every
instance computes the same slots without talking to the others.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, CroniterError, croniter

from ._durations import Duration, parse_duration, to_ms
from ._structures import ms_to_datetime
from .errors import ConfigurationError

__all__ = ["CronSchedule", "IntervalSchedule", "Schedule"]


class Schedule(ABC):
    """Maps time to slots."""

    @abstractmethod
    def next_after(self, ms: int) -> int:
        """Return the first slot strictly after ``ms`` (epoch milliseconds)."""

    @abstractmethod
    def previous_at_or_before(self, ms: int) -> int | None:
        """Return the last slot at or before ``ms``, or ``None`` when there is none."""

    @property
    @abstractmethod
    def period_ms(self) -> int:
        """A typical gap between slots, used to bound catch-up windows."""

    def slots_between(self, after: int, until: int, limit: int) -> list[int]:
        """Return at most ``limit`` of the newest slots in ``(after, until]``, oldest first."""
        out: list[int] = []
        slot = self.previous_at_or_before(until)
        while slot is not None and slot > after and len(out) < limit:
            out.append(slot)
            slot = self.previous_at_or_before(slot - 1)
        out.reverse()
        return out


class IntervalSchedule(Schedule):
    """Slots every ``interval``, aligned to the epoch and shifted by ``offset``."""

    def __init__(self, interval: Duration, offset: Duration = 0) -> None:
        self.interval_ms = to_ms(parse_duration(interval, what="interval"))
        offset_s = parse_duration(offset, what="offset", allow_zero=True)
        self.offset_ms = to_ms(offset_s) if offset_s else 0
        if self.offset_ms >= self.interval_ms:
            raise ConfigurationError(
                f"offset={offset!r} must be shorter than the interval ({interval!r})"
            )

    @property
    def period_ms(self) -> int:
        """The interval in milliseconds."""
        return self.interval_ms

    def next_after(self, ms: int) -> int:
        """Return the first aligned slot strictly after ``ms``."""
        k = (ms - self.offset_ms) // self.interval_ms + 1
        return k * self.interval_ms + self.offset_ms

    def previous_at_or_before(self, ms: int) -> int:
        """Return the last aligned slot at or before ``ms``."""
        return ((ms - self.offset_ms) // self.interval_ms) * self.interval_ms + self.offset_ms

    def __repr__(self) -> str:
        return f"IntervalSchedule({self.interval_ms}ms, offset={self.offset_ms}ms)"


_CRON_FIELDS = re.compile(r"^\S+(\s+\S+){4,5}$")


class CronSchedule(Schedule):
    """Slots at the fire times of a cron expression, evaluated in time zone ``tz``."""

    def __init__(self, expression: str, tz: str = "UTC") -> None:
        if not isinstance(expression, str) or not _CRON_FIELDS.match(expression.strip()):
            raise ConfigurationError(
                f"cron expression {expression!r} is invalid; use five fields "
                "'minute hour day month weekday' (or six, with seconds last), e.g. '*/5 * * * *'"
            )
        try:
            self.tz = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise ConfigurationError(
                f"time zone {tz!r} is unknown; use an IANA name such as 'UTC' or 'Europe/Lisbon'"
            ) from None
        self.expression = expression.strip()
        try:
            it = croniter(self.expression, datetime.now(self.tz))
            first = it.get_next(datetime)
            second = it.get_next(datetime)
        except (CroniterBadCronError, CroniterBadDateError, CroniterError, ValueError,
                KeyError) as exc:
            raise ConfigurationError(
                f"cron expression {expression!r} is invalid ({exc}); "
                "use five fields 'minute hour day month weekday', e.g. '0 3 * * *'"
            ) from None
        self._period = max(1000, int((second - first).total_seconds() * 1000))

    @property
    def period_ms(self) -> int:
        """The gap between the next two fire times."""
        return self._period

    def _local(self, ms: int) -> datetime:
        return ms_to_datetime(ms).astimezone(self.tz)

    def next_after(self, ms: int) -> int:
        """Return the first fire time strictly after ``ms``."""
        nxt: datetime = croniter(self.expression, self._local(ms)).get_next(datetime)
        return int(nxt.timestamp() * 1000)

    def previous_at_or_before(self, ms: int) -> int | None:
        """Return the last fire time at or before ``ms``."""
        try:
            prev: datetime = croniter(self.expression, self._local(ms + 1)).get_prev(datetime)
        except CroniterBadDateError:
            return None
        return int(prev.timestamp() * 1000)

    def __repr__(self) -> str:
        return f"CronSchedule({self.expression!r}, tz={self.tz.key!r})"
