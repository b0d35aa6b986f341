"""Schedules: which slots a job fires at.

A slot is the scheduled time of one occurrence in epoch milliseconds (UTC). Every
instance computes the same slots without talking to the others.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

# croniter's errors are ValueErrors, caught as such: its base class CroniterError is
# importable from the package only since croniter 6 (the bound is 2.0).
from croniter import CroniterBadCronError, CroniterBadDateError, croniter

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
#: croniter's aliases, refused (croniter would read them with random fields given a hash
#: id), with the five fields they stand for.
_ALIASES = {"@midnight": "0 0 * * *", "@hourly": "0 * * * *", "@daily": "0 0 * * *",
            "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *",
            "@annually": "0 0 1 1 *"}
_FIELD_NAMES = ("minute", "hour", "day", "month", "weekday", "second")
#: An item of a field that croniter reads as a random (``R``) or hashed (``H``) value; no
#: month or weekday name starts with either letter.
_RANDOM_OR_HASHED = re.compile(r"(?:^|,)([RrHh])")


def _check_expression(expression: object) -> str:
    """The expression, stripped; refused when it is no five- or six-field expression, an
    alias, or uses ``R`` or ``H``."""
    if isinstance(expression, str) and expression.strip().lower() in _ALIASES:
        raise ConfigurationError(
            f"cron expression {expression!r}: aliases are not supported; write the five "
            f"fields instead: {_ALIASES[expression.strip().lower()]!r}"
        )
    if isinstance(expression, str):
        _check_quartz(expression)
    if not isinstance(expression, str) or not _CRON_FIELDS.match(expression.strip()):
        raise ConfigurationError(
            f"cron expression {expression!r} is invalid; use five fields "
            "'minute hour day month weekday' (or six, with seconds last), e.g. '*/5 * * * *'"
        )
    for name, field in zip(_FIELD_NAMES, expression.split(), strict=False):
        found = _RANDOM_OR_HASHED.search(field)
        if found:
            kind = ("a random value, drawn again at every evaluation, so each instance "
                    "and each evaluation would find other slots" if found[1] in "Rr" else
                    "a hashed value, which needs a hash id the scheduler does not give")
            raise ConfigurationError(
                f"cron expression {expression!r}: {field!r} in the {name} field is "
                f"{kind}; write a fixed value (e.g. '17'), a list or a range with a step "
                "(e.g. '*/15' or '0-30/10') instead"
            )
    _check_every_second(expression.split())
    return expression.strip()


def _check_every_second(fields: list[str]) -> None:
    """Refuse six fields whose seconds (the last) are ``*`` and whose others are not all
    ``*``: Spring's ``0 0 2 * * *`` (02:00 daily, seconds first) reads here as every
    second of 00:00 on each month's 2nd, sixty runs. ``* * * * * *`` (every second), and
    ``*/1`` as the seconds (every second of the minutes matched, written out), pass; an
    expression croniter refuses is left to the error naming its bad field."""
    if len(fields) != 6 or fields[5] != "*" or all(field == "*" for field in fields[:5]):
        return
    minutes = " ".join(fields[:5])
    meant = " ".join(fields[1:] if fields[0] == "0" else [*fields[1:], fields[0]])
    try:
        croniter(" ".join(fields))
    except (CroniterBadCronError, ValueError, KeyError):
        return
    try:
        croniter(meant)
        seconds_first = f"with the seconds first (Quartz's and Spring's form), write {meant!r}; "
    except (CroniterBadCronError, ValueError, KeyError):
        seconds_first = ""
    raise ConfigurationError(
        f"cron expression {' '.join(fields)!r} runs every second of the minutes {minutes!r} "
        f"matches (six fields put the seconds last, here): {seconds_first}for once in "
        f"each of those minutes, write the five fields {minutes!r}; for every second, "
        f"'{minutes} */1'")


#: What each field takes, for an error naming the field refused.
_FIELD_VALUES = {"minute": "0-59", "hour": "0-23", "day": "1-31", "month": "1-12 or JAN-DEC",
                 "weekday": "0-7 (0 and 7 are Sunday) or SUN-SAT", "second": "0-59"}


def _bad_field(expression: str) -> str:
    """The first field of ``expression`` that croniter refuses on its own, said for an
    error message (``": '25' in the hour field ..."``); ``""`` when each field passes."""
    fields = expression.split()
    for i, (name, field) in enumerate(zip(_FIELD_NAMES, fields, strict=False)):
        alone = ["*"] * len(fields)
        alone[i] = field
        try:
            croniter(" ".join(alone))
        except (CroniterBadCronError, ValueError, KeyError):
            return (f": {field!r} in the {name} field is not accepted; the {name} field "
                    f"takes {_FIELD_VALUES[name]}, as single values, lists (1,15), ranges "
                    "(1-5) and steps (*/15)") + _seconds_first(fields)
    return ""


def _seconds_first(fields: list[str]) -> str:
    """For six fields that read well with the seconds first (Quartz's and Spring's
    ``0 30 9 * * MON-FRI``), the five fields meant, said for an error message."""
    if len(fields) != 6:
        return ""
    meant = " ".join(fields[1:] + ([] if fields[0] == "0" else [fields[0]]))
    try:
        croniter(meant)
    except (CroniterBadCronError, ValueError, KeyError):
        return ""
    return (f". Six fields put the seconds last, here; with the seconds first (Quartz's "
            f"and Spring's form), write {meant!r}"
            + (" (Quartz numbers the weekdays from 1, Sunday: one more than cron)"
               if any(c.isdigit() for c in fields[5]) else ""))


def _check_quartz(expression: str) -> None:
    """Refuse Quartz's and Spring's form (seconds first, '?' for "no value" in a day
    field, a year seventh), which croniter read with seconds last or refused as "Question
    mark can only used in day_of_month or day_of_week", naming the five fields meant."""
    fields = expression.split()
    # Six fields with seconds last have their day fields third and fifth: a '?' in the
    # fourth or sixth is Quartz's, in its day fields.
    if len(fields) not in (6, 7) or (len(fields) == 6 and "?" not in fields[3] + fields[5]):
        return
    meant = " ".join([field.replace("?", "*") for field in fields[1:6]]
                     + ([] if fields[0] == "0" else [fields[0]]))  # seconds last
    raise ConfigurationError(
        f"cron expression {expression!r} is in Quartz's or Spring's form (seconds first, "
        f"'?' for no value{', a year last' if len(fields) == 7 else ''}); here an "
        "expression has five fields 'minute hour day month weekday' (or six, with seconds "
        f"last): write {meant!r}"
        + (f" with the weekday's numbers ({fields[5]!r}) one lower, or as names (MON-FRI): "
           "Quartz numbers the weekdays 1 (Sunday) to 7, cron 0 (Sunday) to 6"
           if any(c.isdigit() for c in fields[5]) else ""))


def _zone(tz: object) -> ZoneInfo:
    """The time zone named ``tz``, an IANA name every instance reads alike; refused
    (:class:`~lease_core.errors.ConfigurationError`) otherwise, saying what to write."""
    if not isinstance(tz, str):
        key = getattr(tz, "key", None)
        hint = f"pass its name, tz={key!r}" if isinstance(key, str) else (
            "pass an IANA name such as 'UTC' or 'Europe/Lisbon'")
        raise ConfigurationError(
            f"time zone {tz!r} is not a time zone name (a string); {hint}")
    if tz.strip().lower() == "localtime":
        # /usr/share/zoneinfo/localtime is a link to the machine's own /etc/localtime:
        # instances (and the status page) on machines set to other zones would each
        # find other fire times.
        raise ConfigurationError(
            f"time zone {tz!r} is each machine's own zone, so instances set to different "
            "zones would disagree on the fire times; use an IANA name such as 'UTC' or "
            "'Europe/Lisbon'")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        pass
    # Names are case-sensitive (files on most systems): 'europe/berlin' or ' UTC' is
    # unknown, and the error names the zone meant.
    meant = sorted(name for name in available_timezones()
                   if name.lower() == tz.strip().lower() and name != "localtime")
    hint = "use an IANA name such as 'UTC' or 'Europe/Lisbon'"
    if meant:
        hint = f"write {meant[0]!r}" + (
            "" if meant[0] == tz.strip() else " (names are case-sensitive)")
    raise ConfigurationError(f"time zone {tz!r} is unknown; {hint}")


class CronSchedule(Schedule):
    """Slots at the fire times of a cron expression, evaluated in time zone ``tz``.

    Daylight saving time: a fire time that a spring-forward skips runs once, at the first
    instant after the gap. A fire time in the hour a fall-back repeats runs once, in the
    first pass, when the expression's minute and hour fields are both fixed (neither
    starts with ``*``: ``30 1 * * *``, ``0 1-3 * * *``), as in Vixie cron and cronie; when
    either starts with ``*`` (``*/30 * * * *``, ``0 * * * *``, ``*/10 1 * * *``) the job
    runs by the clock, in both passes. ``R`` (random) and ``H`` (hashed) values, the
    ``@daily``-style aliases, six fields whose seconds (the last) are ``*`` and whose
    other fields are not all ``*`` (Spring's ``0 0 2 * * *``, seconds first, would run
    every second of a minute; ``*/1`` as the seconds says so), an expression no date
    matches (``0 0 30 2 *``), and a ``tz`` that is no IANA name (a ``ZoneInfo`` object:
    pass its name) or is ``"localtime"`` (each machine's own zone) are refused with
    :class:`~lease_core.errors.ConfigurationError`.
    """

    def __init__(self, expression: str, tz: str = "UTC") -> None:
        stripped = _check_expression(expression)
        self.tz = _zone(tz)
        self.expression = stripped
        minute, hour = stripped.split()[:2]
        #: Fixed times of day run once across a repeated hour (see the class docstring).
        self.once_across_fall_back = not minute.startswith("*") and not hour.startswith("*")
        try:
            it = croniter(self.expression, datetime.now(self.tz))
            first = it.get_next(datetime)
            second = it.get_next(datetime)
        except CroniterBadDateError:
            raise ConfigurationError(
                f"cron expression {expression!r} never fires: no date matches its day, "
                "month and weekday fields (e.g. '0 0 30 2 *', February 30); check them"
            ) from None
        except (CroniterBadCronError, ValueError, KeyError) as exc:
            raise ConfigurationError(
                f"cron expression {expression!r} is invalid" + (_bad_field(stripped) or (
                    f" ({exc}); use five fields 'minute hour day month weekday', "
                    "e.g. '0 3 * * *'"))
            ) from None
        self._period = max(1000, int((second - first).total_seconds() * 1000))

    @property
    def period_ms(self) -> int:
        """The gap between the next two fire times."""
        return self._period

    def _offset_ms(self, ms: int) -> int:
        offset = ms_to_datetime(ms).astimezone(self.tz).utcoffset()
        assert offset is not None
        return offset // _MS

    def _offsets_near(self, ms: int) -> tuple[int, int]:
        """The least and the greatest UTC offset of ``tz`` within 3 hours of ``ms``."""
        offsets = [self._offset_ms(ms + d) for d in (-_NEAR_MS, 0, _NEAR_MS)]
        return min(offsets), max(offsets)

    def _instants(self, wall: datetime) -> list[int]:
        """The slots of the naive local time ``wall``: its instant; both passes of a
        repeated one (only the first for a fixed time of day); the first instant after
        the gap for one a spring-forward skips."""
        first = _epoch_ms(wall.replace(tzinfo=self.tz, fold=0))
        second = _epoch_ms(wall.replace(tzinfo=self.tz, fold=1))
        if first == second:
            return [first]
        if first < second:  # repeated: fold=0 is the first pass
            return [first] if self.once_across_fall_back else [first, second]
        # skipped: fold=1 reads it with the offset after the change, so falls before it
        offset, lo, hi = self._offset_ms(second), second, first
        while hi - lo > 1:  # the instant the offset changes, in (second, first]
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._offset_ms(mid) == offset else (lo, mid)
        return [hi]

    # croniter runs on naive local times, where a day has no gap and no repeated hour (it
    # is inconsistent across some changes of offset, in both directions); the slots are
    # then their instants. Local times and instants are in the same order but near a
    # change of offset, so the search goes on for that change's size after a first find.

    def next_after(self, ms: int) -> int:
        """Return the first fire time strictly after ``ms``."""
        low, high = self._offsets_near(ms)
        it = croniter(self.expression, _naive(ms + low))
        best: int | None = None
        limit: datetime | None = None
        while True:
            wall: datetime = it.get_next(datetime)
            if best is not None and limit is not None and wall >= limit:
                return best
            later = [t for t in self._instants(wall) if t > ms]
            if not later:
                continue
            if best is None:
                near_low, near_high = self._offsets_near(min(later))
                shift = max(high - low, near_high - near_low)
                if shift == 0:
                    return min(later)
                limit = wall + shift * _MS
            best = min(later) if best is None else min(best, *later)

    def previous_at_or_before(self, ms: int) -> int | None:
        """Return the last fire time at or before ``ms``."""
        low, high = self._offsets_near(ms)
        it = croniter(self.expression, _naive(ms + high + 1))
        best: int | None = None
        limit: datetime | None = None
        while True:
            try:
                wall: datetime = it.get_prev(datetime)
            except CroniterBadDateError:
                return best
            if best is not None and limit is not None and wall <= limit:
                return best
            earlier = [t for t in self._instants(wall) if t <= ms]
            if not earlier:
                continue
            if best is None:
                near_low, near_high = self._offsets_near(max(earlier))
                shift = max(high - low, near_high - near_low)
                if shift == 0:
                    return max(earlier)
                limit = wall - shift * _MS
            best = max(earlier) if best is None else max(best, *earlier)

    def spec(self) -> dict[str, str | int]:
        """``{"cron": ..., "tz": ...}``."""
        return {"cron": self.expression, "tz": self.tz.key}

    def describe(self) -> str:
        """``cron 0 2 * * *``, with ``(tz)`` when not UTC."""
        return f"cron {self.expression}" + ("" if self.tz.key == "UTC" else f" ({self.tz.key})")

    def __repr__(self) -> str:
        return f"CronSchedule({self.expression!r}, tz={self.tz.key!r})"


_MS = timedelta(milliseconds=1)
_NEAR_MS = 3 * 3_600_000  # the largest change of offset looked for, 3 hours
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _epoch_ms(moment: datetime) -> int:
    return (moment - _EPOCH) // _MS


def _naive(ms: int) -> datetime:
    """``ms`` after the epoch as a naive datetime (a local time, once an offset is added)."""
    return datetime(1970, 1, 1) + ms * _MS


def schedule_from_spec(spec: object) -> Schedule:
    """The schedule a :meth:`Schedule.spec` describes.

    Raises :class:`~lease_core.errors.ConfigurationError` for anything else.
    """
    if isinstance(spec, dict):
        offset = spec.get("offset_ms", 0)
        if (isinstance(spec.get("every_ms"), int) and isinstance(offset, int)
                and not isinstance(offset, bool)):
            return IntervalSchedule(spec["every_ms"] / 1000, offset / 1000)
        if isinstance(spec.get("cron"), str):
            return CronSchedule(spec["cron"], str(spec.get("tz", "UTC")))
    raise ConfigurationError(f"{spec!r} is not a schedule's spec (see Schedule.spec)")
