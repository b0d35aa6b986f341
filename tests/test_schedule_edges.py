"""Schedules at their edges: intervals too long for a date, or finer than a millisecond,
and an overview over a schedule recorded with no dated next slot."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lease_core import ConfigurationError, MemoryBackend
from lease_core._overview import read_overview
from lease_core.schedules import IntervalSchedule, schedule_from_spec

MAX_INTERVAL_MS = 365_250 * 86_400_000  # 1000 years, the longest interval


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
        far = json.dumps({"every_ms": 4_000_000 * 86_400_000, "offset_ms": 0})  # an old store
        await backend.register_schedules({"far": far,
                                          "near": json.dumps(IntervalSchedule("1m").spec())})
        await backend.register_jobs(["far", "near"])
        overview = await read_overview(backend)
        return {row["name"]: row for row in overview["rows"]}

    rows = anyio.run(main)
    assert rows["far"]["next_slot"] is None and rows["far"]["next_at"] is None
    assert rows["near"]["schedule"] == "every 1m" and rows["near"]["next_at"] is not None
