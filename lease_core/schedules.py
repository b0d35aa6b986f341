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

from ._durations import Duration, parse_duration
from ._structures import ms_to_datetime
from .errors import ConfigurationError

__all__ = ["CronSchedule", "IntervalSchedule", "Schedule", "schedule_from_spec"]


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

    @abstractmethod
    def spec(self) -> dict[str, str | int]:
        """The schedule as a JSON-ready dict, which :func:`schedule_from_spec` reads back.

        ``{"every_ms": 60000, "offset_ms": 0}`` or ``{"cron": "0 2 * * *", "tz": "UTC"}``:
        what the store records for readers that have no declarations (the status page).
        """

    @abstractmethod
    def describe(self) -> str:
        """The schedule in a few words: ``every 1m``, ``cron 0 2 * * * (Europe/Lisbon)``."""

    def slots_between(self, after: int, until: int, limit: int) -> list[int]:
        """Return at most ``limit`` of the newest slots in ``(after, until]``, oldest first."""
        out: list[int] = []
        slot = self.previous_at_or_before(until)
        while slot is not None and slot > after and len(out) < limit:
            out.append(slot)
            slot = self.previous_at_or_before(slot - 1)
        out.reverse()
        return out


#: The longest interval (and so offset), 1000 years: a slot further away than year 9999
#: has no date, and no status page could show it.
MAX_INTERVAL_MS = 365_250 * 86_400_000


class IntervalSchedule(Schedule):
    """Slots every ``interval``, aligned to the epoch and shifted by ``offset``.

    Both are whole numbers of milliseconds (``"1500ms"``, not ``"0.5ms"``), the interval at
    most 1000 years (:data:`MAX_INTERVAL_MS`), the offset shorter than the interval;
    anything else raises :class:`~lease_core.errors.ConfigurationError`.
    """

    def __init__(self, interval: Duration, offset: Duration = 0) -> None:
        self.interval_ms = _whole_ms(parse_duration(interval, what="interval"),
                                     "interval", interval)
        offset_s = parse_duration(offset, what="offset", allow_zero=True)
        self.offset_ms = _whole_ms(offset_s, "offset", offset) if offset_s else 0
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

    def spec(self) -> dict[str, str | int]:
        """``{"every_ms": ..., "offset_ms": ...}``."""
        return {"every_ms": self.interval_ms, "offset_ms": self.offset_ms}

    def describe(self) -> str:
        """``every 1m``, or ``every 1h +30s`` with an offset."""
        offset = f" +{_short(self.offset_ms)}" if self.offset_ms else ""
        return f"every {_short(self.interval_ms)}{offset}"

    def __repr__(self) -> str:
        return f"IntervalSchedule({self.interval_ms}ms, offset={self.offset_ms}ms)"


def _whole_ms(seconds: float, what: str, value: object) -> int:
    """``seconds`` in milliseconds; refused unless a whole number of them, at most 1000 years."""
    exact = seconds * 1000
    if exact > MAX_INTERVAL_MS:
        raise ConfigurationError(
            f"{what}={value!r} is too long: its slots would fall beyond the year 9999; "
            "use at most 1000 years ('365250d')"
        )
    ms = round(exact)
    if ms < 1 or abs(exact - ms) > 1e-6 + exact * 1e-12:  # float noise only: not even 1 µs
        raise ConfigurationError(
            f"{what}={value!r} is not a whole number of milliseconds; slots are kept in "
            f"milliseconds, so write e.g. '{max(1, ms)}ms'"
        )
    return ms


def _short(ms: int) -> str:
    """Milliseconds in the largest unit that divides them: 90000 -> ``90s``, 3600000 -> ``1h``."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


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

    def spec(self) -> dict[str, str | int]:
        """``{"cron": ..., "tz": ...}``."""
        return {"cron": self.expression, "tz": self.tz.key}

    def describe(self) -> str:
        """``cron 0 2 * * *``, with ``(tz)`` when not UTC."""
        return f"cron {self.expression}" + ("" if self.tz.key == "UTC" else f" ({self.tz.key})")

    def __repr__(self) -> str:
        return f"CronSchedule({self.expression!r}, tz={self.tz.key!r})"


def schedule_from_spec(spec: object) -> Schedule:
    """The schedule a :meth:`Schedule.spec` describes.

    Raises :class:`~lease_core.errors.ConfigurationError` for anything else.
    """
    if isinstance(spec, dict):
        if isinstance(spec.get("every_ms"), int):
            return IntervalSchedule(spec["every_ms"] / 1000, spec.get("offset_ms", 0) / 1000)
        if isinstance(spec.get("cron"), str):
            return CronSchedule(spec["cron"], str(spec.get("tz", "UTC")))
    raise ConfigurationError(f"{spec!r} is not a schedule's spec (see Schedule.spec)")
