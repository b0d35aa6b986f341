"""Schedules at their edges: random and hashed cron values, aliases, daylight saving time
(checked against a minute-by-minute model), and intervals too long or too fine."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lease_core import ConfigurationError, MemoryBackend
from lease_core._overview import read_overview
from lease_core.schedules import CronSchedule, IntervalSchedule, schedule_from_spec

MAX_INTERVAL_MS = 365_250 * 86_400_000  # 1000 years, the longest interval

# ----------------------------------------------------------------- R, H and aliases


@pytest.mark.parametrize(("expression", "field", "kind"), [
    ("R 2 * * *", "minute", "random"), ("0 R * * *", "hour", "random"),
    ("0 0 r * *", "day", "random"), ("R(0-30) 2 * * *", "minute", "random"),
    ("H 2 * * *", "minute", "hashed"), ("H(0-5) 2 * * *", "minute", "hashed"),
    ("0 H/2 * * *", "hour", "hashed"), ("0 0 * * * R", "second", "random"),
])
def test_random_and_hashed_values_are_refused_saying_what_to_write(
        expression: str, field: str, kind: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        CronSchedule(expression)
    message = str(info.value)
    assert repr(expression) in message and f"{field} field" in message
    assert f"{kind} value" in message and "fixed value" in message and "*/15" in message


@pytest.mark.parametrize("expression", ["0 0 * MAR THU", "0 0 * * FRI-SAT", "0 0 * APR,DEC *"])
def test_month_and_weekday_names_are_no_random_values(expression: str) -> None:
    CronSchedule(expression)


@pytest.mark.parametrize(("alias", "fields"), [
    ("@daily", "0 0 * * *"), ("@hourly", "0 * * * *"), ("@weekly", "0 0 * * 0"),
    ("@monthly", "0 0 1 * *"), ("@yearly", "0 0 1 1 *"), (" @Midnight ", "0 0 * * *"),
])
def test_an_alias_is_refused_with_its_five_fields(alias: str, fields: str) -> None:
    with pytest.raises(ConfigurationError, match="aliases are not supported") as info:
        CronSchedule(alias)
    assert repr(alias) in str(info.value) and repr(fields) in str(info.value)
    CronSchedule(fields)


@pytest.mark.parametrize(("quartz", "fields"), [
    ("0 0/5 * * * ?", "0/5 * * * *"), ("0 0 12 * * ?", "0 12 * * *"),
    ("0 15 10 ? * MON-FRI", "15 10 * * MON-FRI"), ("30 0 12 ? * *", "0 12 * * * 30"),
    ("0 0 12 * * ? 2027", "0 12 * * *"), ("0 0 */5 * * * *", "0 */5 * * *"),
])
def test_a_quartz_expression_is_refused_with_the_fields_it_means(quartz: str,
                                                                  fields: str) -> None:
    """Quartz's and Spring's form (seconds first, '?' in a day field, a year seventh) was
    refused as "is invalid ([...] is not acceptable. Question mark can only used in
    day_of_month or day_of_week); use five fields ...", croniter's words for a field it
    read as another, or as "invalid" for seven fields: the message says which form it is,
    and what to write."""
    with pytest.raises(ConfigurationError, match="is in Quartz's or Spring's form") as info:
        CronSchedule(quartz)
    assert str(info.value).startswith(f"cron expression {quartz!r} ")
    assert str(info.value).endswith(f"(or six, with seconds last): write {fields!r}")
    CronSchedule(fields)


def test_a_quartz_weekday_number_is_said_to_count_from_one() -> None:
    """Quartz's weekdays are 1 (Sunday) to 7: copied as they are, '2-6' (Monday to
    Friday) would run Tuesday to Saturday."""
    with pytest.raises(ConfigurationError, match=r"write '0 12 \* \* 2-6' with the weekday's "
                       r"numbers \('2-6'\) one lower, or as names \(MON-FRI\): Quartz "):
        CronSchedule("0 0 12 ? * 2-6")


# ----------------------------------------------------------------- daylight saving time

ZONES = ("Europe/Lisbon", "America/New_York", "Australia/Lord_Howe")
Match = Callable[[int, int], bool]
#: expression, its wall-time test (hour, minute), whether it is a fixed time of day
EXPRESSIONS: list[tuple[str, Match, bool]] = [
    ("30 1 * * *", lambda h, m: h == 1 and m == 30, True),
    ("45 1 * * *", lambda h, m: h == 1 and m == 45, True),
    ("0 2 * * *", lambda h, m: h == 2 and m == 0, True),
    ("15 2 * * *", lambda h, m: h == 2 and m == 15, True),
    ("0,40 1-3 * * *", lambda h, m: 1 <= h <= 3 and m in (0, 40), True),
    ("*/30 * * * *", lambda h, m: m % 30 == 0, False),
    ("0 * * * *", lambda h, m: m == 0, False),
    ("*/20 1 * * *", lambda h, m: h == 1 and m % 20 == 0, False),
]
DAILY = {"30 1 * * *", "45 1 * * *", "0 2 * * *", "15 2 * * *"}


def _transitions(tz: ZoneInfo) -> list[datetime]:
    """The instants of 2024 at which ``tz`` changes its offset."""
    out, t = [], datetime(2024, 1, 1, tzinfo=UTC)
    offset = t.astimezone(tz).utcoffset()
    while t.year == 2024:
        t += timedelta(minutes=30)
        if t.astimezone(tz).utcoffset() != offset:
            out.append(t)
            offset = t.astimezone(tz).utcoffset()
    return out


def _model(match: Match, fixed: bool, tz: ZoneInfo, start: datetime, end: datetime,
           ) -> list[int]:
    """The slots minute by minute: a matching wall time, but for a fixed time of day not
    its second pass in a repeated hour; a matching wall time a gap skips runs at the gap's
    end."""
    slots, t = [], start
    before = (t - timedelta(minutes=1)).astimezone(tz).replace(tzinfo=None)
    while t < end:
        local = t.astimezone(tz)
        wall = local.replace(tzinfo=None)
        skipped = wall - before - timedelta(minutes=1)  # wall minutes a gap jumped over
        jumped = (before + timedelta(minutes=k)
                  for k in range(1, int(skipped.total_seconds() // 60) + 1))
        gap = any(match(w.hour, w.minute) for w in jumped)
        repeated = local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset()
        if gap or (match(local.hour, local.minute) and not (fixed and repeated)):
            slots.append(int(t.timestamp() * 1000))
        before, t = wall, t + timedelta(minutes=1)
    return slots


@pytest.mark.parametrize("zone", ZONES)
def test_next_and_previous_agree_with_the_model_across_both_transitions(zone: str) -> None:
    tz = ZoneInfo(zone)
    transitions = _transitions(tz)
    assert len(transitions) == 2
    for at in transitions:
        start, end = at - timedelta(days=2), at + timedelta(days=2)
        lo, hi = int(start.timestamp() * 1000), int(end.timestamp() * 1000)
        for expression, match, fixed in EXPRESSIONS:
            s = CronSchedule(expression, tz=zone)
            expected = _model(match, fixed, tz, start, end)
            where = f"{expression!r} in {zone} around {at.isoformat()}"
            forward, t = [], lo - 1
            while (t := s.next_after(t)) < hi:
                forward.append(t)
            backward, p = [], s.previous_at_or_before(hi - 1)
            while p is not None and p >= lo:
                backward.append(p)
                p = s.previous_at_or_before(p - 1)
            assert forward == expected, where
            assert backward[::-1] == expected, where
            for a, b in pairwise(expected):
                # the engine's invariant: the next slot is a slot, and none lies between
                assert s.previous_at_or_before(s.next_after(a)) == b, where
                assert s.previous_at_or_before(b - 1) == a, where
                assert s.next_after((a + b) // 2) == b, where
                assert s.previous_at_or_before((a + b) // 2) == a, where
            if expression in DAILY:
                days = Counter(datetime.fromtimestamp(x / 1000, tz).date() for x in expected)
                local = at.astimezone(tz).date()
                for day in (local - timedelta(days=1), local, local + timedelta(days=1)):
                    assert days[day] == 1, (where, day)


@pytest.mark.parametrize(("expression", "fixed"), [(e, f) for e, _, f in EXPRESSIONS])
def test_a_fixed_time_of_day_is_neither_minute_nor_hour_starting_with_a_star(
        expression: str, fixed: bool) -> None:
    assert CronSchedule(expression).once_across_fall_back is fixed


def test_a_fixed_time_in_the_repeated_hour_runs_once_and_a_clock_job_twice() -> None:
    ny = ZoneInfo("America/New_York")
    t = int(datetime(2024, 11, 3, tzinfo=ny).timestamp() * 1000)
    nightly = CronSchedule("30 1 * * *", tz="America/New_York")
    first = nightly.next_after(t)
    assert first == int(datetime(2024, 11, 3, 5, 30, tzinfo=UTC).timestamp() * 1000)
    assert datetime.fromtimestamp(nightly.next_after(first) / 1000, ny).date() == \
        date(2024, 11, 4)
    half_hourly = CronSchedule("*/30 * * * *", tz="America/New_York")
    assert half_hourly.slots_between(first - 1, first + 3_600_000, 10) == \
        [first, first + 1_800_000, first + 3_600_000]  # 01:30 EDT, 01:00 EST, 01:30 EST


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize(("tz", "hint"), [
    (ZoneInfo("Europe/Lisbon"), "tz='Europe/Lisbon'"), (UTC, "IANA name"), (None, "IANA name"),
])
def test_a_time_zone_object_is_refused_saying_to_pass_its_name(tz: object, hint: str) -> None:
    with pytest.raises(ConfigurationError, match="not a time zone name") as info:
        CronSchedule("0 2 * * *", tz=tz)  # type: ignore[arg-type]
    assert repr(tz) in str(info.value) and hint in str(info.value)
    assert "unknown" not in str(info.value)


def test_the_machine_s_own_zone_is_refused() -> None:
    # 'localtime' links to each machine's /etc/localtime: instances would disagree.
    with pytest.raises(ConfigurationError, match="each machine's own zone") as info:
        CronSchedule("0 2 * * *", tz="localtime")
    assert "'localtime'" in str(info.value) and "'Europe/Lisbon'" in str(info.value)


@pytest.mark.parametrize(("tz", "meant"), [
    ("europe/berlin", "'Europe/Berlin' (names are case-sensitive)"),
    ("utc", "'UTC' (names are case-sensitive)"), ("US/EASTERN", "'US/Eastern'"),
    (" Europe/Lisbon", "write 'Europe/Lisbon'"),
])
def test_a_zone_name_in_other_case_or_with_spaces_is_refused_naming_the_zone_meant(
        tz: str, meant: str) -> None:
    """'europe/berlin' was called unknown, and the error gave 'UTC' and 'Europe/Lisbon'
    as examples (on a file system that ignores case, such as macOS's, it may even load,
    so a developer's machine took what the fleet's refused). The error now names the
    zone meant."""
    with pytest.raises(ConfigurationError, match="unknown") as info:
        CronSchedule("0 2 * * *", tz=tz)
    assert f"{tz!r} is unknown; write " in str(info.value) and meant in str(info.value)
    if meant.startswith("write"):
        assert "case-sensitive" not in str(info.value)


@pytest.mark.parametrize("expression", ["0 0 30 2 *", "0 0 31 4,6 *", "0 12 30,31 2 *"])
def test_an_expression_that_never_fires_is_refused_as_such(expression: str) -> None:
    with pytest.raises(ConfigurationError, match="never fires") as info:
        CronSchedule(expression)
    assert repr(expression) in str(info.value) and "five fields" not in str(info.value)


@pytest.mark.parametrize(("expression", "value", "field", "takes"), [
    ("0 25 * * *", "25", "hour", "0-23"), ("60 2 * * *", "60", "minute", "0-59"),
    ("0 0 0 * *", "0", "day", "1-31"), ("0 0 1 13 *", "13", "month", "1-12 or JAN-DEC"),
    ("0 0 * * 8", "8", "weekday", "0-7"), ("0 0 * * MON-FRY", "MON-FRY", "weekday", "SUN-SAT"),
    ("*/0 * * * *", "*/0", "minute", "0-59"), ("0 0 * * * 61", "61", "second", "0-59"),
])
def test_a_bad_value_is_refused_naming_its_field_and_what_it_takes(
        expression: str, value: str, field: str, takes: str) -> None:
    """The error named the whole expression with croniter's "is not acceptable, out of
    range" and said to use five fields, which it had: now it names the value refused,
    its field, and the values that field takes."""
    with pytest.raises(ConfigurationError) as info:
        CronSchedule(expression)
    message = str(info.value)
    assert f"{expression!r} is invalid: {value!r} in the {field} field" in message, message
    assert takes in message and "five fields" not in message, message


@pytest.mark.parametrize(("expression", "meant"), [
    ("0 30 9 * * MON-FRI", "'30 9 * * MON-FRI'"), ("0 0 12 * * MON", "'0 12 * * MON'"),
    ("15 30 9 * * 1-5", "'30 9 * * 1-5 15' (Quartz numbers the weekdays from 1"),
])
def test_a_bad_six_field_expression_that_reads_with_the_seconds_first_says_so(
        expression: str, meant: str) -> None:
    """Spring's '0 30 9 * * MON-FRI' (seconds first, no '?') was refused with croniter's
    "out of range": the hour field, read with the seconds last, is 30. The error names
    that field and the five fields meant with the seconds first."""
    with pytest.raises(ConfigurationError) as info:
        CronSchedule(expression)
    message = str(info.value)
    assert "Six fields put the seconds last" in message and f"write {meant}" in message, message


@pytest.mark.parametrize(("expression", "meant"), [
    ("0 0 2 * * *", "'0 2 * * *'"), ("0 */5 * * * *", "'*/5 * * * *'"),
    ("*/10 * * * * *", "'* * * * * */10'"),
])
def test_six_fields_with_every_second_last_are_refused_naming_the_readings(
        expression: str, meant: str) -> None:
    """Spring's '0 0 2 * * *' (02:00 daily, seconds first, no '?') was accepted and read
    with the seconds last: every second of 00:00 on each month's 2nd, sixty runs. It is
    refused, naming the seconds-first reading and the five fields; every second of the
    minutes matched is written out with '*/1', and '* * * * * *' means every second."""
    with pytest.raises(ConfigurationError, match="runs every second of the minutes") as info:
        CronSchedule(expression)
    five = " ".join(expression.split()[:5])
    message = str(info.value)
    assert f"write {meant}" in message and f"five fields {five!r}" in message, message
    for accepted in (five, f"{five} */1", "* * * * * *", meant.strip("'")):
        CronSchedule(accepted)


@pytest.mark.parametrize("expression", ["0 25 * * *", "0 0 * * * 61", "0 0 1 * * 61"])
def test_no_seconds_first_reading_is_offered_where_none_reads(expression: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        CronSchedule(expression)
    assert "seconds first" not in str(info.value)


# ----------------------------------------------------------------- intervals


@pytest.mark.parametrize("interval", ["4000000d", 1e300, timedelta(days=999_999_999),
                                      "365251d"])
def test_an_interval_beyond_the_year_9999_is_refused_naming_it(interval: object) -> None:
    with pytest.raises(ConfigurationError, match="too long") as info:
        IntervalSchedule(interval)  # type: ignore[arg-type]
    assert repr(interval) in str(info.value) and "1000 years" in str(info.value)


def test_the_longest_interval_has_dated_slots() -> None:
    s = IntervalSchedule("365250d", offset="365249d")
    assert s.interval_ms == MAX_INTERVAL_MS
    now = int(datetime(9000, 1, 1, tzinfo=UTC).timestamp() * 1000)
    assert datetime.fromtimestamp(s.next_after(now) / 1000, UTC).year <= 9999


@pytest.mark.parametrize(("interval", "offset"), [
    ("0.1ms", 0), ("1.5ms", 0), (0.0005, 0), (timedelta(microseconds=1), 0),
    ("1h", "0.2ms"), ("1h", "1.5ms"), ("1s", timedelta(microseconds=1500)),
])
def test_a_part_of_a_millisecond_is_refused(interval: object, offset: object) -> None:
    with pytest.raises(ConfigurationError, match="whole number of milliseconds") as info:
        IntervalSchedule(interval, offset)  # type: ignore[arg-type]
    bad = offset if offset else interval
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(("interval", "ms"), [
    ("1ms", 1), ("1500ms", 1500), (0.001, 1), (1.1, 1100), ("1.5s", 1500),
    (timedelta(milliseconds=3), 3), ("2.5m", 150_000), ("1h30m", 5_400_000),
])
def test_whole_milliseconds_are_kept(interval: object, ms: int) -> None:
    assert IntervalSchedule(interval).interval_ms == ms  # type: ignore[arg-type]


@given(st.integers(2, MAX_INTERVAL_MS), st.data())
def test_every_spec_reads_back(interval_ms: int, data: st.DataObject) -> None:
    offset_ms = data.draw(st.integers(0, interval_ms - 1))
    again = schedule_from_spec({"every_ms": interval_ms, "offset_ms": offset_ms})
    assert again.spec() == {"every_ms": interval_ms, "offset_ms": offset_ms}


def test_a_job_whose_next_slot_has_no_date_does_not_fail_the_overview() -> None:
    async def main() -> dict[str, dict[str, object]]:
        backend = MemoryBackend()
        await backend.start()
        far = json.dumps({"every_ms": 4_000_000 * 86_400_000, "offset_ms": 0})  # an old store
        await backend.register_schedules({"far": far,
                                          "near": json.dumps(IntervalSchedule("1m").spec())})
        await backend.register_jobs(["far", "near"])
        overview = await read_overview(backend)
        return {row["name"]: row for row in overview["rows"]}

    rows = anyio.run(main)
    assert rows["far"]["next_slot"] is None and rows["far"]["next_at"] is None
    assert rows["near"]["schedule"] == "every 1m" and rows["near"]["next_at"] is not None
