"""Slots: epoch-aligned intervals and cron fire times in a time zone."""

from __future__ import annotations

import json
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lease_core.errors import ConfigurationError
from lease_core.schedules import CronSchedule, IntervalSchedule, Schedule, schedule_from_spec


def ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def test_interval_slots_are_epoch_aligned() -> None:
    s = IntervalSchedule("1h")
    t = ms(datetime(2026, 3, 1, 10, 17, tzinfo=ZoneInfo("UTC")))
    assert s.next_after(t) == ms(datetime(2026, 3, 1, 11, tzinfo=ZoneInfo("UTC")))
    assert s.previous_at_or_before(t) == ms(datetime(2026, 3, 1, 10, tzinfo=ZoneInfo("UTC")))
    with_offset = IntervalSchedule("1h", "5m")
    assert with_offset.next_after(t) == ms(datetime(2026, 3, 1, 11, 5, tzinfo=ZoneInfo("UTC")))


@given(st.integers(1, 10**6), st.integers(0, 2 * 10**12))
def test_every_instance_computes_the_same_slots(interval_s: int, t: int) -> None:
    s = IntervalSchedule(interval_s)
    nxt = s.next_after(t)
    assert nxt > t and nxt - t <= interval_s * 1000 and nxt % (interval_s * 1000) == 0
    assert s.previous_at_or_before(nxt) == nxt
    assert s.previous_at_or_before(nxt - 1) == nxt - interval_s * 1000


def test_slots_between_returns_the_newest_bounded() -> None:
    s = IntervalSchedule("1s")
    assert s.slots_between(0, 10_000, 3) == [8000, 9000, 10_000]
    assert s.slots_between(9000, 10_000, 100) == [10_000]
    assert s.slots_between(10_000, 10_000, 100) == []


def test_cron_uses_the_time_zone_and_dst() -> None:
    lisbon = ZoneInfo("Europe/Lisbon")
    s = CronSchedule("30 2 * * *", tz="Europe/Lisbon")
    before = ms(datetime(2026, 7, 1, 12, tzinfo=lisbon))
    assert s.next_after(before) == ms(datetime(2026, 7, 2, 2, 30, tzinfo=lisbon))
    # Summer time in Lisbon is UTC+1.
    assert datetime.fromtimestamp(s.next_after(before) / 1000, ZoneInfo("UTC")).hour == 1
    winter = ms(datetime(2026, 1, 10, 12, tzinfo=lisbon))
    assert datetime.fromtimestamp(s.next_after(winter) / 1000, ZoneInfo("UTC")).hour == 2


def test_cron_previous_and_next_agree() -> None:
    s = CronSchedule("*/15 * * * *")
    t = ms(datetime(2026, 5, 5, 10, 7, tzinfo=ZoneInfo("UTC")))
    nxt = s.next_after(t)
    assert nxt == ms(datetime(2026, 5, 5, 10, 15, tzinfo=ZoneInfo("UTC")))
    assert s.previous_at_or_before(nxt) == nxt
    assert s.previous_at_or_before(nxt - 1) == ms(datetime(2026, 5, 5, 10, tzinfo=ZoneInfo("UTC")))
    assert s.period_ms == 15 * 60_000


@pytest.mark.parametrize("schedule", [
    IntervalSchedule("1m"), IntervalSchedule("1h", offset="30s"), IntervalSchedule("1500ms"),
    CronSchedule("0 2 * * *", tz="Europe/Lisbon"), CronSchedule("*/5 * * * *"),
], ids=repr)
def test_a_spec_reads_back_as_the_same_slots(schedule: Schedule) -> None:
    spec = json.loads(json.dumps(schedule.spec()))  # as the store keeps it
    again = schedule_from_spec(spec)
    t = 1_764_460_800_123
    assert again.next_after(t) == schedule.next_after(t)
    assert again.previous_at_or_before(t) == schedule.previous_at_or_before(t)
    assert again.describe() == schedule.describe()


def test_descriptions_are_short() -> None:
    assert IntervalSchedule("1m").describe() == "every 1m"
    assert IntervalSchedule("1h", offset="90s").describe() == "every 1h +90s"
    assert IntervalSchedule("1500ms").describe() == "every 1500ms"
    assert CronSchedule("0 2 * * *", tz="Europe/Lisbon").describe() == \
        "cron 0 2 * * * (Europe/Lisbon)"
    assert CronSchedule("0 2 * * *").describe() == "cron 0 2 * * *"


@pytest.mark.parametrize("spec", [None, {}, {"every_ms": "1m"}, {"cron": 5}, "every 1m",
                                  # a corrupted record: was a TypeError, which failed the
                                  # status overview of every job
                                  {"every_ms": 60_000, "offset_ms": "x"},
                                  {"every_ms": 60_000, "offset_ms": None},
                                  {"every_ms": 60_000, "offset_ms": True}])
def test_a_bad_spec_is_refused_naming_it(spec: object) -> None:
    with pytest.raises(ConfigurationError, match="spec"):
        schedule_from_spec(spec)
