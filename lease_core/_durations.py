"""Parsing of durations given as strings, ``timedelta`` or numbers of seconds."""

from __future__ import annotations

import math
import re
from datetime import timedelta

from .errors import ConfigurationError

__all__ = ["Duration", "parse_duration", "parse_typed_duration", "to_ms"]

Duration = str | timedelta | int | float

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_SECONDS = re.compile(r"\s*[0-9]+(\.[0-9]+)?\s*")
#: A capital M as a unit: months in many tools, minutes here once lowered ('6M' deleted
#: history older than six minutes); refused, never read (MS, milliseconds, is not one).
_CAPITAL_M = re.compile(r"[0-9.]\s*M(?![sS])")
#: Unit words people write, and the unit they mean ('5 min' is '5m').
_WORDS = {
    "msec": "ms", "msecs": "ms", "millisecond": "ms", "milliseconds": "ms",
    "sec": "s", "secs": "s", "second": "s", "seconds": "s",
    "min": "m", "mins": "m", "minute": "m", "minutes": "m",
    "hr": "h", "hrs": "h", "hour": "h", "hours": "h", "day": "d", "days": "d",
}
_LOOSE_PART = re.compile(r"(\d+(?:\.\d+)?)([a-z]*)")
_ACCEPTED = (
    "a string such as '500ms', '30s', '5m', '1h30m' or '2d', a timedelta, or a number of seconds"
)


def parse_duration(value: object, *, what: str = "duration", allow_zero: bool = False) -> float:
    """Return ``value`` as a number of seconds, or raise :class:`ConfigurationError`.

    ``what`` names the option in the error message.
    """
    seconds: float
    if isinstance(value, bool):
        raise ConfigurationError(f"{what}={value!r} is not a duration; use {_ACCEPTED}")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        if _CAPITAL_M.search(value):
            raise ConfigurationError(f"{what}={value!r} {_capital_m()}")
        text = value.strip().lower().replace(" ", "")
        pos = 0
        total = 0.0
        for match in _PART.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNITS_MS[match.group(2)] / 1000
            pos = match.end()
        if not text or pos != len(text):
            raise ConfigurationError(f"{what}={value!r} {_not_a_duration(value, allow_zero)}")
        seconds = total
    else:
        raise ConfigurationError(
            f"{what}={value!r} has type {type(value).__name__}; use {_ACCEPTED}"
        )
    if math.isnan(seconds) or math.isinf(seconds):
        raise ConfigurationError(f"{what}={value!r} must be a finite duration")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigurationError(f"{what}={value!r} must be "
                                 + ("0 or more" if allow_zero else "greater than zero"))
    return seconds


def _not_a_duration(value: str, allow_zero: bool = False) -> str:
    """Why the string ``value`` is no duration, and what to write instead: the duration
    it most likely means when that is clear (a bare number, a unit word, a minus sign)."""
    text = value.strip().lower().replace(" ", "")
    accepted = f"use {_ACCEPTED} (units: {', '.join(_UNITS_MS)})"
    if _SECONDS.fullmatch(value):
        return (f"has no unit: write '{value.strip()}s' for seconds, or pass the number "
                f"{value.strip()}; {accepted}")
    if text.startswith("-") and (_meant(text[1:]) or _SECONDS.fullmatch(text[1:])):
        at_least = "0 or more" if allow_zero else "greater than zero"
        return f"is negative; a duration must be {at_least} here: {accepted}"
    meant = _meant(text)
    if meant is not None:
        return f"is not a duration: write {meant!r}; {accepted}"
    return f"is not a duration; {accepted}"


def _meant(text: str) -> str | None:
    """``text`` (lowered, no blanks) with its unit words as units ('5min' -> '5m'), when
    every part is a number and a unit or a unit word; else None."""
    parts, pos = [], 0
    for match in _LOOSE_PART.finditer(text):
        unit = match.group(2)
        unit = unit if unit in _UNITS_MS else _WORDS.get(unit, "")
        if match.start() != pos or not unit:
            return None
        parts.append(match.group(1) + unit)
        pos = match.end()
    return "".join(parts) if parts and pos == len(text) else None


def parse_typed_duration(text: str, *, what: str, allow_zero: bool = False) -> float:
    """A duration typed by a person (a command-line option): as :func:`parse_duration`,
    a bare number meaning seconds, and an error worded for what can be typed (no
    timedelta). ``what`` names the option (``--older-than``)."""
    if _CAPITAL_M.search(text):
        raise ConfigurationError(f"{what} {text.strip()!r} {_capital_m()}")
    if _SECONDS.fullmatch(text):
        if float(text) == 0 and not allow_zero:
            raise ConfigurationError(f"{what} {text.strip()!r} must be greater than zero")
        return parse_duration(float(text), what=what, allow_zero=allow_zero)
    try:
        return parse_duration(text, what=what, allow_zero=allow_zero)
    except ConfigurationError:
        pass
    try:  # "0s" is a duration, zero: say so rather than "not a duration"
        zero = parse_duration(text, allow_zero=True) == 0
    except ConfigurationError:
        zero = False
    if zero:
        raise ConfigurationError(f"{what} {text.strip()!r} must be greater than zero")
    bare = text.strip().lower().replace(" ", "")
    if bare.startswith("-") and (_meant(bare[1:]) or _SECONDS.fullmatch(bare[1:])):
        raise ConfigurationError(
            f"{what} {text.strip()!r} is negative; give a duration "
            f"{'of 0 or more' if allow_zero else 'greater than zero'}, such as 30s or 7d")
    meant = _meant(bare)
    if meant is not None:
        raise ConfigurationError(f"{what} {text!r} is not a duration; write {meant!r}")
    raise ConfigurationError(
        f"{what} {text!r} is not a duration; give a number of seconds or a duration "
        "such as 500ms, 30s, 5m, 1h30m or 2d"
    )


def _capital_m() -> str:
    return ("has a capital M, which is months in many tools and would be minutes here: write "
            "'m' for minutes, or months in days (180d for six months)")


def to_ms(seconds: float) -> int:
    """Round a number of seconds to whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))
