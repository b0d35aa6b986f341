"""Bad input gets a clear ConfigurationError naming the value, at declaration time."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lease_core import Admin, AnarchonError, ConfigurationError, Lease, MemoryBackend, Scheduler
from lease_core._durations import parse_duration, parse_typed_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30), ("5m", 300), ("1h30m", 5400), ("2d", 172800),
     ("1.5s", 1.5), (" 1H ", 3600), (timedelta(minutes=2), 120), (7, 7.0), (0.25, 0.25)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["10x", "5 minutes", "", "m", "1h30", "-5s", "s5", "1e3s"])
def test_bad_duration_names_the_value_and_the_units(bad: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_duration(bad, what="interval")
    assert repr(bad) in str(info.value)
    assert "'30s'" in str(info.value) or "greater than zero" in str(info.value)


@pytest.mark.parametrize(("bad", "says"), [
    ("5", "has no unit: write '5s' for seconds, or pass the number 5;"),
    (" 1.5 ", "has no unit: write '1.5s' for seconds, or pass the number 1.5;"),
    ("5 min", "is not a duration: write '5m';"),
    ("30 seconds", "is not a duration: write '30s';"),
    ("1 hour 30 mins", "is not a duration: write '1h30m';"),
    ("-5s", "is negative; a duration must be greater than zero"),
    ("-10", "is negative; a duration must be greater than zero"),
])
def test_a_near_miss_duration_says_what_to_write(bad: str, says: str) -> None:
    """``every("j", "5 min")`` or ``"5"`` (meaning seconds) said only "is not a duration;
    use ... or a number of seconds", and ``"-5s"`` "is not a duration" though the docs
    call it a negative one: the message names what was most likely meant."""
    with pytest.raises(ConfigurationError, match=f"^interval={re.escape(repr(bad))} "
                       f"{re.escape(says)}"):
        parse_duration(bad, what="interval")
    with pytest.raises(ConfigurationError, match=r"'30s'.*\(units: ms, s, m, h, d\)$"):
        parse_duration(bad, what="interval")
    if "write" in says and "no unit" not in says:  # typed on a command line alike
        with pytest.raises(ConfigurationError) as typed:
            parse_typed_duration(bad, what="--older-than")
        assert str(typed.value) == (f"--older-than {bad!r} is not a duration; write "
                                    f"{says.split(chr(39))[1]!r}")
    elif "no unit" in says:  # a bare number typed on a command line is seconds
        assert parse_typed_duration(bad, what="--older-than") == float(bad)


def test_a_negative_duration_where_zero_is_allowed_says_0_or_more() -> None:
    """A negative string where zero is allowed (a stop's grace, an acquire's timeout)
    said "a duration must be greater than zero", though 0 is accepted there (and the
    number -5 said "must be 0 or more")."""
    with pytest.raises(ConfigurationError,
                       match=r"^grace='-5s' is negative; a duration must be 0 or more here: use "):
        parse_duration("-5s", what="grace", allow_zero=True)
    with pytest.raises(ConfigurationError, match=r"^grace=-5 must be 0 or more$"):
        parse_duration(-5, what="grace", allow_zero=True)


@pytest.mark.parametrize("bad", [0, -1, "0s", timedelta(0), timedelta(seconds=-3),
                                 float("nan"), True, None, [1]])
def test_zero_negative_and_wrong_types_are_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="interval"):
        parse_duration(bad, what="interval")


@given(st.lists(st.tuples(st.integers(1, 999), st.sampled_from(["ms", "s", "m", "h", "d"])),
                min_size=1, max_size=4))
def test_duration_strings_add_up(parts: list[tuple[int, str]]) -> None:
    unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    text = "".join(f"{n}{u}" for n, u in parts)
    assert parse_duration(text) == pytest.approx(sum(n * unit[u] for n, u in parts))


def sched(**kw: object) -> Scheduler:
    return Scheduler(MemoryBackend(), **kw)  # type: ignore[arg-type]


def noop(ctx: object) -> None:
    pass


def test_errors_are_anarchon_errors_and_value_errors() -> None:
    assert issubclass(ConfigurationError, AnarchonError)
    assert issubclass(ConfigurationError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"lease": "10s", "heartbeat": "5s"}, "lease='10s' is shorter than 3 heartbeats"),
        # below a millisecond, the numbers the check compares (whole ms), not 0.0003s
        ({"lease": "1ms", "heartbeat": "0.1ms", "timer_slack": 0},
         "lease='1ms' is shorter than 3 heartbeats (0.001s each); use a lease of at least "
         "0.003s"),
        ({"lease": "-30s"}, "'-30s'"),
        ({"heartbeat": "0s"}, "heartbeat='0s'"),
        ({"history_size": 0}, "history_size=0"),
        ({"history_ttl": "forever"}, "history_ttl='forever'"),
        ({"instance_id": ""}, "instance_id=''"),
        # No store keeps a NUL or a lone surrogate (os.fsdecode of bytes not UTF-8).
        ({"instance_id": "web\x001"}, "instance_id='web\\x001' holds a NUL"),
        ({"instance_id": "web-\udcff"}, "instance_id='web-\\udcff' is not valid Unicode"),
        ({"timer_slack": "-1ms"}, "timer_slack='-1ms'"),
        ({"timer_slack": "soon"}, "timer_slack='soon'"),
        ({"timer_slack": "5s", "heartbeat": "5s"}, "timer_slack='5s' must be shorter"),
    ],
)
def test_bad_scheduler_options(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        sched(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize("make", [Scheduler, Admin, lambda b: Lease(b, "leader")],
                         ids=["Scheduler", "Admin", "Lease"])
def test_backend_must_be_a_backend(make: object) -> None:
    """A URL string (password masked), None or a number is refused at construction by
    each of the three, with what to pass instead (Admin took them, and failed at its
    first call with an AttributeError)."""
    with pytest.raises(ConfigurationError, match="is a string, not an anarchon backend; "
                       r"pass backend_from_url\(url\)") as info:
        make("postgresql://app:s3cret@db/app")  # type: ignore[operator]
    assert "s3cret" not in str(info.value) and "app:***@db" in str(info.value)
    for bad in (None, 42):
        with pytest.raises(ConfigurationError, match=f"backend={bad} is not an anarchon "
                           r"backend; pass MemoryBackend\(\)"):
            make(bad)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda s: s.every("j", "10x", noop), "interval='10x'"),
        (lambda s: s.every("j", "0s", noop), "interval='0s'"),
        (lambda s: s.every("j", "1m", noop, overlap="queue"), "overlap='queue'"),
        (lambda s: s.every("j", "1m", noop, catch_up="some"), "catch_up='some'"),
        (lambda s: s.every("j", "1m", noop, max_attempts=0), "max_attempts=0"),
        (lambda s: s.every("j", "1m", noop, timeout="-1s"), "timeout='-1s'"),
        (lambda s: s.every("j", "1m", noop, lease="6s"), "lease='6s' is shorter"),
        (lambda s: s.every("j", "1m", noop, offset="2m"), "offset='2m'"),
        (lambda s: s.every("", "1m", noop), "job name ''"),
        (lambda s: s.every("has space", "1m", noop), "job name 'has space'"),
        (lambda s: s.every("quote'd", "1m", noop), "job name"),
        (lambda s: s.every("x" * 201, "1m", noop), "job name"),
        # A trailing newline: "$" matches before it (a log line or key split by the name).
        (lambda s: s.every("j\n", "1m", noop), "job name 'j\\n'"),
        (lambda s: s.workflow("w\n", every="1m"), "workflow name 'w\\n'"),
        (lambda s: s.every("j", "1m", 42), "not callable"),
        (lambda s: s.cron("j", "61 * * * *", noop), "'61 * * * *'"),
        (lambda s: s.cron("j", "every day", noop), "'every day'"),
        (lambda s: s.cron("j", "* * *", noop), "'* * *'"),
        (lambda s: s.cron("j", "0 3 * * *", noop, tz="Mars/Olympus"), "'Mars/Olympus'"),
    ],
)
def test_bad_job_declarations(call: object, needle: str) -> None:
    s = sched()
    with pytest.raises(ConfigurationError) as info:
        call(s)  # type: ignore[operator]
    assert needle in str(info.value)
    assert not s.jobs


def test_a_handler_s_coroutine_instead_of_the_handler_says_to_pass_the_function() -> None:
    """every("j", "1m", job(ctx)) said only "is not callable" (and Python warned that the
    coroutine was never awaited): the message names the function to pass."""

    async def export(ctx: object) -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"of job 'j' is not callable; pass the "
                       r"function itself \(.*export\), not the coroutine a call of it made"):
        sched().every("j", "1m", export(None))  # type: ignore[arg-type]


def test_duplicate_job_name() -> None:
    s = sched()
    s.every("dup", "1m", noop)
    with pytest.raises(ConfigurationError, match="'dup' is already declared"):
        s.cron("dup", "* * * * *", noop)


def test_decorator_and_plain_forms() -> None:
    s = sched()

    @s.every("deco", "1m", timeout="30s", overlap="allow", max_attempts=3, lease="1m")
    async def deco(ctx: object) -> None:
        pass

    s.cron("plain", "0 3 * * *", noop, tz="Europe/Athens")
    assert deco.__name__ == "deco"
    job = s.jobs["deco"]
    assert (job.timeout, job.overlap, job.max_attempts, job.lease_ms, job.is_async) == (
        30.0, "allow", 3, 60_000, True
    )
    assert not s.jobs["plain"].is_async


def test_instance_ids_are_unique_per_scheduler() -> None:
    assert sched().instance_id != sched().instance_id
    assert sched(instance_id="web-1").instance_id == "web-1"


@pytest.mark.parametrize("name", ["by", "lease"])
def test_names_no_store_can_keep_are_refused_by_admin_and_lease(name: str) -> None:
    with pytest.raises(ConfigurationError, match="not valid Unicode"):
        if name == "by":
            Admin(MemoryBackend(), by="ops-\udcff")
        else:
            Lease(MemoryBackend(), "leader-\udcff")


@pytest.mark.parametrize("name", ["by", "lease", "holder", "instance_id"])
def test_names_too_long_for_a_store_s_index_are_refused_at_construction(name: str) -> None:
    """A lease name or instance id beyond 2704 bytes failed on PostgreSQL (its btree
    index's limit) as "cannot reach PostgreSQL", retried as an outage; 1000 bytes is the most."""
    make = {"by": lambda text: Admin(MemoryBackend(), by=text),
            "lease": lambda text: Lease(MemoryBackend(), text),
            "holder": lambda text: Lease(MemoryBackend(), "leader", holder=text),
            "instance_id": lambda text: sched(instance_id=text)}[name]
    make("é" * 500)  # 1000 bytes
    with pytest.raises(ConfigurationError, match=r"'ééé.*\.\.\. is 1002 bytes long .*1000$"):
        make("é" * 501)


def test_a_backend_refuses_an_unusable_connection_or_clock_at_construction() -> None:
    """RedisBackend(123) and MemoryBackend(clock="x") were taken, and failed at start()
    or at the first read of the clock; PostgresBackend(123) already raised at once."""
    from backends.redis import RedisBackend

    for bad in (123, object()):
        with pytest.raises(ConfigurationError, match="is not a Redis URL, client or pool; "
                           "pass 'redis://host:port/db'"):
            RedisBackend(bad)
    with pytest.raises(ConfigurationError, match="clock='x' is not callable"):
        MemoryBackend(clock="x")  # type: ignore[arg-type]
    assert MemoryBackend(clock=lambda: 1_000.0)


def test_a_handler_that_cannot_take_the_context_is_refused_at_declaration() -> None:
    """``def job(): ...`` (no ``ctx``) was declared, and then failed every run with a
    TypeError; a handler that takes the context (also through ``*args``, a default, a
    callable object or a bound method) is accepted."""

    def no_args() -> None:
        pass

    async def two_args(ctx: object, other: object) -> None:
        pass

    def keyword_only(*, ctx: object) -> None:
        pass

    class Job:
        def __call__(self, ctx: object) -> None:
            pass

        def method(self, ctx: object) -> None:
            pass

    s = sched()
    for i, bad in enumerate((no_args, two_args, keyword_only, lambda: None)):
        with pytest.raises(ConfigurationError, match=rf"handler .* of job 'bad{i}' cannot be "
                           r"called with one argument, the run's context .*'def handler\(ctx\)'"):
            s.every(f"bad{i}", "1h", bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="cannot be called with one argument"):
            s.cron(f"badc{i}", "0 3 * * *")(bad)  # type: ignore[type-var]
    flow = s.workflow("flow", every="1h")
    with pytest.raises(ConfigurationError, match="of step 'flow/a' cannot be called"):
        flow.step("a", no_args)  # type: ignore[arg-type]
    assert not s.jobs

    def star(*args: object) -> None:
        pass

    def default(ctx: object, extra: int = 1) -> None:
        pass

    for i, good in enumerate((noop, star, default, Job(), Job().method, print)):
        s.every(f"good{i}", "1h", good)  # type: ignore[arg-type]
    flow.step("a", noop)
    assert len(s.jobs) == 7


def test_a_generator_handler_is_refused_at_declaration() -> None:
    """``async def job(ctx): ... yield ...`` (or a plain function with ``yield``) was taken:
    calling it only made a generator, so none of its body ran, and every run was recorded
    ``completed``. It is refused at declaration, naming the handler and the ``yield``."""

    async def agen(ctx: object) -> Any:
        yield 1

    def gen(ctx: object) -> Any:
        yield 1

    class Gen:
        async def __call__(self, ctx: object) -> Any:
            yield 1

    s = sched()
    for i, (bad, kind) in enumerate(((agen, "an async generator"), (gen, "a generator"),
                                     (Gen(), "an async generator"))):
        with pytest.raises(ConfigurationError, match=rf"handler .* of job 'gen{i}' is {kind} "
                           r"function \(its body has 'yield'\): calling it would run none of"):
            s.every(f"gen{i}", "1h", bad)
        with pytest.raises(ConfigurationError, match="without 'yield'"):
            s.cron(f"genc{i}", "0 3 * * *")(bad)
    flow = s.workflow("flow", every="1h")
    with pytest.raises(ConfigurationError, match=r"handler .* of step 'flow/a' is a generator"):
        flow.step("a", gen)
    assert not s.jobs


@pytest.mark.parametrize("zero", ["0", "0s", "0ms", " 0m0s ", "0.0h"])
def test_a_typed_zero_duration_is_said_to_be_zero_not_to_be_no_duration(zero: str) -> None:
    """``anarchon prune --older-than 0s`` said "'0s' is not a duration" (only a bare "0"
    was said to be zero); a zero with a unit is a duration, and too short."""
    with pytest.raises(ConfigurationError,
                       match=rf"^--older-than '{zero.strip()}' must be greater than zero$"):
        parse_typed_duration(zero, what="--older-than")
    assert parse_typed_duration(zero, what="grace", allow_zero=True) == 0
    with pytest.raises(ConfigurationError, match="'0x' is not a duration; give a number"):
        parse_typed_duration("0x", what="--older-than")


@pytest.mark.parametrize("negative", ["-5s", "-30d", " - 5m", "-1h30m"])
def test_a_typed_negative_duration_is_said_to_be_negative(negative: str) -> None:
    """``anarchon prune --older-than -5s`` said only "is not a duration"."""
    with pytest.raises(ConfigurationError, match=rf"^--older-than '{negative.strip()}' is "
                       "negative; give a duration greater than zero"):
        parse_typed_duration(negative, what="--older-than")
    with pytest.raises(ConfigurationError, match="is negative; give a duration of 0 or more"):
        parse_typed_duration(negative, what="--grace", allow_zero=True)


@pytest.mark.parametrize("clock", [5, "monotonic"])
def test_a_scheduler_clock_that_is_not_callable_is_refused_at_construction(clock: object) -> None:
    """``Scheduler(backend, clock=5)`` was taken, and start() failed with a traceback
    ("'int' object is not callable"), where MemoryBackend(clock=...) names the value."""
    with pytest.raises(ConfigurationError, match=f"clock={clock!r} is not callable; pass a "
                       "function returning the local monotonic time"):
        sched(clock=clock)


def test_an_event_subscriber_that_cannot_take_the_event_is_refused() -> None:
    """``scheduler.subscribe(lambda: ...)`` was taken, and failed at every event (each
    failure logged as the subscriber's); it is refused at ``subscribe()``."""
    s = sched()

    async def two(event: object, other: object) -> None:
        pass

    for bad in (lambda: None, two):
        with pytest.raises(ConfigurationError, match=r"the callback cannot be called with one "
                           r"argument, the event .*'def on_event\(event\)'"):
            s.subscribe(bad)  # type: ignore[arg-type]
    for good in (noop, print, lambda *events: None):
        s.subscribe(good)()  # subscribed, then unsubscribed


def test_an_event_subscriber_with_yield_is_refused() -> None:
    """``async def on_event(event): ... yield ...`` was subscribed, and at every event only
    made a generator: none of its body ran, and nothing said so."""
    s = sched()

    async def agen(event: object) -> Any:
        yield event

    def gen(event: object) -> Any:
        yield event

    for bad in (agen, gen):
        with pytest.raises(ConfigurationError, match=r"the callback is a generator function "
                           r"\(its body has 'yield'\), so none of its body would run"):
            s.subscribe(bad)
