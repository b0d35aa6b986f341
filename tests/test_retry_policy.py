"""The Retry policy on its own: its checks, its backoff, and retry= at declaration time."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lease_core import ConfigurationError, MemoryBackend, Retry, Scheduler
from lease_core.abc import Backend
from lease_core.retry import supports_retries, to_retry


def test_backoff_grows_by_the_factor_up_to_the_cap() -> None:
    policy = Retry(retries=6, backoff="1s", factor=3, max_backoff="30s", jitter=0)
    assert policy.delays_ms() == (1000, 3000, 9000, 27000, 30000, 30000)
    assert Retry(retries=2, backoff=timedelta(milliseconds=250), jitter=0).delays_ms() == (
        250, 500)


def test_jitter_spreads_each_wait_within_its_bounds() -> None:
    policy = Retry(retries=1, backoff="10s", jitter=0.2)
    waits = {policy.delay_ms(1) for _ in range(200)}
    assert all(8000 <= w <= 12000 for w in waits)
    assert len(waits) > 1  # spread, not one value


@pytest.mark.parametrize("number", [0, -1, 1.5, True, "1"])
def test_a_retry_number_below_one_is_refused(number: object) -> None:
    with pytest.raises(ConfigurationError, match=r"delay_ms\(.*\): a retry's number is 1"):
        Retry().delay_ms(number)  # type: ignore[arg-type]


def test_no_retry_types_and_timeouts() -> None:
    policy = Retry(no_retry=(KeyError,))
    assert not policy.retries_error(KeyError("x"))
    assert policy.retries_error(ValueError("x"))
    assert policy.retries_error(None)  # a timeout
    assert Retry(no_retry=KeyError).no_retry == (KeyError,)


def test_retry_option_forms() -> None:
    assert to_retry(None) is None
    assert to_retry(0) is None
    assert to_retry(3) == Retry(retries=3)
    policy = Retry(retries=1)
    assert to_retry(policy) is policy


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"retries": -1}, "retries=-1"),
    ({"retries": True}, "retries=True"),
    ({"retries": 1001}, "retries=1001 must be a whole number from 0 to 1000"),
    ({"backoff": "soon"}, "backoff='soon'"),
    ({"max_backoff": -1}, "max_backoff=-1"),
    ({"max_backoff": "99999999h"}, "max_backoff='99999999h' is longer than 30 days"),
    ({"backoff": "31d"}, "backoff='31d'"),
    ({"factor": 0.5}, "factor=0.5"),
    ({"jitter": 2}, "jitter=2"),
    ({"no_retry": ("KeyError",)}, "no_retry="),
])
def test_bad_policies_name_the_value(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Retry(**kwargs)  # type: ignore[arg-type]
    assert named in str(caught.value)


def test_bad_retry_options_are_refused_at_declaration() -> None:
    s = Scheduler(MemoryBackend())
    with pytest.raises(ConfigurationError, match=r"retry=-2"):
        s.every("a", "1h", lambda ctx: None, retry=-2)
    with pytest.raises(ConfigurationError, match=r"retry='3'"):
        s.cron("b", "0 * * * *", lambda ctx: None, retry="3")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^retry=5000 must be a number of retries "
                       r"from 0 to 1000$"):
        s.every("big", "1h", lambda ctx: None, retry=5000)
    with pytest.raises(ConfigurationError, match=r"retry=1.5"):
        s.workflow("w", every="1h", retry=1.5)  # type: ignore[arg-type]
    wf = s.workflow("w2", every="1h", retry=2)
    with pytest.raises(ConfigurationError, match=r"retry=\[\]"):
        wf.step("one", lambda ctx: None, retry=[])  # type: ignore[arg-type]
    s.every("c", "1h", lambda ctx: None, retry=Retry(retries=2, backoff=0))
    assert s.jobs["c"].retry == Retry(retries=2, backoff=0)


class NoRetries(MemoryBackend):
    """A backend without retries: the contract's default retry_later()."""

    retry_later = Backend.retry_later


@pytest.mark.anyio
async def test_a_backend_without_retry_later_refuses_retry_at_start() -> None:
    backend = NoRetries()
    assert not supports_retries(backend) and supports_retries(MemoryBackend())
    s = Scheduler(backend)
    s.every("plain", "1h", lambda ctx: None)
    s.every("flaky", "1h", lambda ctx: None, retry=2)
    with pytest.raises(ConfigurationError, match=r"job 'flaky' has retry=.*NoRetries"):
        await s.start()
    assert str(s.state) == "stopped"


def test_a_long_policy_is_capped_not_overflowed() -> None:
    """``factor ** (n - 1)`` passes any float long before the last of 1,000 retries: the
    cap applies (it raised OverflowError at the failure, which ended the scheduler)."""
    for factor in (2, 2.0, 10):
        policy = Retry(retries=1000, backoff="10ms", factor=factor, max_backoff="50ms",
                       jitter=0)
        delays = policy.delays_ms()
        assert len(delays) == 1000 and delays[0] == 10 and set(delays[10:]) == {50}


def test_a_backoff_longer_than_its_cap_is_refused_naming_both() -> None:
    """Every wait, the first too, was cut to ``max_backoff``: ``Retry(backoff="1h")`` waited
    5 minutes (the default cap), the backoff given never applied."""
    with pytest.raises(ConfigurationError) as caught:
        Retry(retries=1, backoff="1h")
    assert "backoff='1h' is longer than max_backoff='5m' (the default)" in str(caught.value)
    with pytest.raises(ConfigurationError, match=r"backoff='10s' is longer than max_backoff=5"):
        Retry(backoff="10s", max_backoff=5)
    assert Retry(retries=1, backoff="1h", max_backoff="1h", jitter=0).delays_ms() == (
        3_600_000,)
    assert Retry(backoff="5m").delays_ms()[0] <= 300_000  # a backoff at the cap is fine
