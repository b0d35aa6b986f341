"""What the scheduler logs: failures with their traceback, timeouts, slots as ISO-8601 UTC."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

import lease_core
from lease_core import MemoryBackend, Outcome, Retry, RunContext, Scheduler
from lease_core._structures import ClaimRequest, ClaimResult, format_slot
from lease_core.engine import outages
from lease_core.testing import claim_now
from tests.helpers import Unplugged, quiet_offset_now, wait_for, wait_history


def test_with_no_logging_configured_a_failed_handler_prints_on_stderr() -> None:
    """The library's logger had a NullHandler, so with no logging configured a failing
    handler said nothing at all; Python's last-resort handler prints warnings and errors
    on stderr now, as for any module that logs; the INFO records stay silent."""
    code = textwrap.dedent("""
        import anyio
        from lease_core import MemoryBackend, Scheduler
        from lease_core.testing import claim_now

        def export(ctx):
            raise RuntimeError("the export broke (test)")

        async def main():
            s = Scheduler(MemoryBackend(), instance_id="a")
            s.every("export", "1h", export, offset="0s")
            async with s:
                slot = s.jobs["export"].schedule.previous_at_or_before(s.store_now_ms())
                await claim_now(s, "export", slot)
                with anyio.fail_after(10):
                    while not [a for a in await s.history("export") if a.outcome]:
                        await anyio.sleep(0.02)

        anyio.run(main)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "the export broke (test)" in done.stderr, done.stderr
    assert "Traceback" in done.stderr, done.stderr
    assert "started with" not in done.stderr, done.stderr  # INFO: not shown
    assert lease_core.Scheduler
    assert not logging.getLogger("anarchon").handlers


def test_slots_format_as_iso_8601_utc() -> None:
    assert format_slot(0) == "1970-01-01T00:00:00Z"
    assert format_slot(1_700_000_000_250) == "2023-11-14T22:13:20.250Z"


class Boom(Exception):
    pass


def _explode(n: int) -> None:
    raise Boom(f"broken after {n}")


@pytest.mark.anyio
async def test_a_failing_handler_is_logged_with_its_traceback_and_iso_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")

    @s.every("broken", "1h", catch_up="none", offset=quiet_offset_now())
    async def broken(ctx: RunContext) -> None:
        ctx.log.info("about to fail")
        _explode(3)

    caplog.set_level("INFO", logger="anarchon")
    async with s:
        job = s.jobs["broken"]
        slot = job.schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, job, slot)
        await wait_history(s, lambda h: h and h[0].outcome == Outcome.FAILED, job="broken")
        await wait_for(lambda: [r for r in caplog.records if "failed" in r.getMessage()],
                       what="the failure's log line")
    failure = next(r for r in caplog.records if "failed" in r.getMessage())
    assert failure.levelno == logging.WARNING
    assert failure.exc_info is not None and isinstance(failure.exc_info[1], Boom)
    message = failure.getMessage()
    assert f"slot {format_slot(slot)} ({slot})" in message and "Boom: broken after 3" in message
    assert "_explode" in caplog.text and "Traceback" in caplog.text
    handler_line = next(r for r in caplog.records if "about to fail" in r.getMessage())
    assert handler_line.getMessage().startswith(f"[broken slot {format_slot(slot)} attempt 1]")
    assert handler_line.slot == slot  # type: ignore[attr-defined]
    won = next(r for r in caplog.records if "won attempt" in r.getMessage())
    assert format_slot(slot) in won.getMessage()


@pytest.mark.anyio
async def test_a_timed_out_handler_is_logged_with_its_iso_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every other end of an attempt but completed was logged (failed, lost, cancelled,
    escalated); a timeout left no line at all, only the history's ``timed_out``."""
    s = Scheduler(MemoryBackend(), instance_id="a", lease="1.2s", heartbeat="0.2s")

    @s.every("slow", "1h", catch_up="none", offset=quiet_offset_now(), timeout="0.3s")
    async def slow(ctx: RunContext) -> None:
        await anyio.sleep_forever()

    caplog.set_level("INFO", logger="anarchon")
    async with s:
        slot = s.jobs["slow"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "slow", slot)
        await wait_history(s, lambda h: h and h[0].outcome == Outcome.TIMED_OUT, job="slow")
        await wait_for(lambda: [r for r in caplog.records if "timed out" in r.getMessage()],
                       what="the timeout's log line")
    line = next(r for r in caplog.records if "timed out" in r.getMessage())
    assert line.levelno == logging.WARNING
    message = line.getMessage()
    assert message.startswith(f"slow slot {format_slot(slot)} ({slot}) attempt 1 timed out")
    assert "0.3s" in message


@pytest.mark.anyio
async def test_an_outage_logs_a_few_lines_not_one_per_failed_call(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20 jobs due every 100 ms on a store out of reach: every failed claim logged a
    warning, and so did every slot of every job missed meanwhile (with 100 jobs due every
    second, about 6,000 lines for an outage of 30 s). An outage logs its start, a
    reminder every OUTAGE_REMINDER seconds, its end (with the calls failed and the slots
    missed), and the slots missed after it in one line; an unexpected error, once with
    its traceback; outages that follow each other (a store refusing one kind of call),
    their reminders."""
    monkeypatch.setattr(outages, "OUTAGE_REMINDER", 0.3)
    caplog.set_level("INFO", logger="anarchon")
    backend = Unplugged()
    s = Scheduler(backend, instance_id="a", lease="1.2s", heartbeat="0.2s")
    for n in range(20):
        s.every(f"j{n}", "100ms", lambda ctx: None)

    def said(text: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if text in r.getMessage()]

    async with s:
        await wait_for(lambda: said("won attempt"), what="a run")
        backend.down = True
        began = time.monotonic()
        await wait_for(lambda: len(backend.failed_claims) >= 100 and said("still unreachable"),
                       what="failed claims and a reminder")
        backend.down = False
        await wait_for(lambda: said("answers again"), what="the outage's end")
        lasted = time.monotonic() - began
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        [start] = said("cannot reach the store")
        assert "claim of" in start.getMessage() and "store unreachable (test)" in start.getMessage()
        reminders = said("still unreachable")
        assert 1 <= len(reminders) <= lasted / 0.3 + 1
        [end] = said("answers again")
        assert end.levelno == logging.WARNING and "calls failed" in end.getMessage()
        assert int(end.getMessage().split(" (")[1].split()[0]) >= 100  # the whole outage's
        assert len(warnings) <= len(reminders) + 4, [r.getMessage() for r in warnings]
        caplog.clear()
        failed = len(backend.failed_claims)
        backend.down = ZeroDivisionError
        await wait_for(lambda: len(backend.failed_claims) >= failed + 40, what="failed claims")
        backend.down = False
        await wait_for(lambda: said("answers again"), what="the outage's end")
        [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert error.exc_info is not None and error.exc_info[0] is ZeroDivisionError
        assert "failed unexpectedly" in error.getMessage()
        # Membership renewals refused, claims accepted: an outage at every tick, each
        # ended by the next claim. Each logged its start and its end.
        caplog.clear()
        # A reminder's time longer than a tick even on a loaded machine: a tick later
        # than it starts an outage of its own (its start and end logged).
        monkeypatch.setattr(outages, "OUTAGE_REMINDER", 1.5)
        backend.fails = frozenset({"members"})
        backend.down = True
        await wait_for(lambda: said("outages over the last"), what="a reminder")
        backend.down = False
    [reminder] = said("outages over the last")
    assert int(reminder.getMessage().split(" failed in ")[1].split()[0]) >= 2
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 3


def test_a_bug_in_an_outage_keeps_its_traceback_after_many_store_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outage logs each of the store's errors once, up to OUTAGE_ERRORS kinds; a bug
    met after that many (claims' timeouts of jobs with different leases differ in their
    text) was only counted, its traceback never logged."""
    caplog.set_level("WARNING", logger="anarchon")
    log = outages.OutageLog("a")
    for n in range(outages.OUTAGE_ERRORS):
        log.failed("claim", lease_core.BackendUnavailable(f"no answer within {n}s"), n,
                   starting=n == 0)
    try:
        raise ZeroDivisionError("a bug (test)")
    except ZeroDivisionError as exc:
        log.failed("check", exc, 10, starting=False)
    [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.exc_info is not None and error.exc_info[0] is ZeroDivisionError


@pytest.mark.anyio
async def test_a_scheduler_started_without_jobs_warns_that_it_runs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Jobs declared on another ``Scheduler`` object (or in a module the process never
    imported) left the one started with none: it started and ran nothing, logging only
    "started with 0 jobs" at INFO, unseen at the usual WARNING level."""
    caplog.set_level("INFO", logger="anarchon")
    empty = Scheduler(MemoryBackend(), instance_id="empty", lease="1.2s", heartbeat="0.2s")
    async with empty:
        pass
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.getMessage() == (
        "instance empty started with no jobs, so it runs nothing: declare them with "
        "every(), cron() or workflow() on this scheduler before start()")
    caplog.clear()
    one = Scheduler(MemoryBackend(), instance_id="one", lease="1.2s", heartbeat="0.2s")
    one.every("j", "1h", lambda ctx: None, offset=quiet_offset_now())
    async with one:
        pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "instance one started with 1 job" in [r.getMessage() for r in caplog.records]


@pytest.mark.anyio
@pytest.mark.parametrize("ids", [("worker", "worker"), ("worker-1", "worker-2")])
async def test_an_instance_id_shared_by_two_running_schedulers_is_warned_about(
    caplog: pytest.LogCaptureFixture, ids: tuple[str, str],
) -> None:
    """``Scheduler(backend, instance_id="worker")`` on every replica: their memberships
    are one, so when the holder of a run only it knew of (a triggered run) dies, the other
    never takes it over (its membership never lapses), and nothing said why. A claim that
    finds its slot held under its own id by another attempt warns, once."""
    caplog.set_level("WARNING", logger="anarchon")
    backend = MemoryBackend()
    release = anyio.Event()

    async def hold(ctx: RunContext) -> None:
        await release.wait()

    def replica(instance_id: str) -> Scheduler:
        s = Scheduler(backend, instance_id=instance_id, lease="1.2s", heartbeat="0.2s")
        s.every("j", "1h", hold, offset=quiet_offset_now())
        return s

    a, b = replica(ids[0]), replica(ids[1])
    async with a, b:
        slot = a.jobs["j"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "j", slot)
        await wait_for(lambda: a.running, what="a's run")
        await claim_now(b, "j", slot)  # held by a, under the id b has too (or not)
        await claim_now(b, "j", slot)
        release.set()
    shared = [r.getMessage() for r in caplog.records if "by another process" in r.getMessage()]
    if ids[0] != ids[1]:
        assert shared == []
        return
    assert shared == [
        f"j slot {format_slot(slot)} is held under this instance's id 'worker' by another "
        "process (this instance's previous one, its lease not yet lapsed, or another "
        "instance with the same id): give every instance its own instance_id (the default "
        "is unique); "
        "instances that share one do not take over each other's runs that only one of "
        "them knew of (a triggered run, a retry) when it dies"]


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_scheduler_whose_event_loop_ends_under_it_says_so(
    caplog: pytest.LogCaptureFixture, loop: str,
) -> None:
    """``anyio.run(scheduler.start)`` in a script returns at once, its loop ending under
    the scheduler, which ended as a crashed instance: nothing ran, and nothing said why.
    A scheduler stopped, or aborted, as asked says nothing of the kind."""
    caplog.set_level("WARNING", logger="anarchon")

    def scheduler() -> Scheduler:
        s = Scheduler(MemoryBackend(), instance_id="script", lease="1.2s", heartbeat="0.2s")
        s.every("j", "1h", lambda ctx: None, offset=quiet_offset_now())
        return s

    s = scheduler()
    anyio.run(s.start, backend=loop)
    assert s.state == "stopped"
    assert [r.getMessage() for r in caplog.records] == [
        "scheduler script was cancelled from outside (its event loop ending, or its task "
        "group cancelled) without stop(): as a crashed instance, nothing handed over; keep "
        "the loop running while it should run (`async with "
        "scheduler:` around the application's work; anyio.run(scheduler.start) returns at "
        "once, ending it), or use SyncScheduler"]
    caplog.clear()

    async def stopped(s: Scheduler) -> None:
        await s.start()
        await s.stop()

    async def aborted(s: Scheduler) -> None:
        await s.start()
        await s.abort()

    for asked in (stopped, aborted):
        anyio.run(asked, scheduler(), backend=loop)
    assert caplog.records == []


class _LostReply(MemoryBackend):
    """A store whose first claim is written, and its answer never arrives."""

    lose = True

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        answers = await super().claim_many(requests)
        if self.lose:
            self.lose = False
            await anyio.sleep_forever()  # until the claim's own time limit gives up on it
        return answers


@pytest.mark.anyio
async def test_a_claim_answered_late_is_not_taken_for_a_shared_instance_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A claim whose answer did not come in time may have won: claimed again, the slot is
    found held under this instance's own id, by its own earlier attempt (taken over once
    its lease lapses). That is no other process sharing the id, and warned as one."""
    caplog.set_level("WARNING", logger="anarchon")
    ran: list[int] = []

    async def handler(ctx: RunContext) -> None:
        ran.append(ctx.attempt)

    s = Scheduler(_LostReply(), instance_id="solo", lease="1.2s", heartbeat="0.2s")
    s.every("j", "1h", handler, offset=quiet_offset_now())
    async with s:
        slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "j", slot)
        await wait_for(lambda: ran, what="the takeover of the unanswered claim's run")
    assert ran == [2]
    assert not [r for r in caplog.records if "by another process" in r.getMessage()]


class _SteppedBack(MemoryBackend):
    """A store whose clock steps back half a second (an NTP step) once a failed attempt
    is set to wait for its retry: the instance's claim of the retry comes early then."""

    def __init__(self) -> None:
        self.skew = 0.0
        super().__init__(clock=lambda: time.time() - self.skew)

    async def retry_later(self, items: Sequence[Any]) -> list[int]:
        answers = await super().retry_later(items)
        self.skew = 0.5
        return answers


@pytest.mark.anyio
async def test_a_retry_claimed_early_is_not_taken_for_a_shared_instance_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A claim of a run waiting for its retry, made before the store's due time ("an
    early claim only stands by"), finds it under the id of the attempt that failed, this
    instance's own: no lease is held, no other process is there, and none was to be
    warned of."""
    caplog.set_level("WARNING", logger="anarchon")
    ran: list[int] = []

    async def flaky(ctx: RunContext) -> None:
        ran.append(ctx.attempt)
        if len(ran) == 1:
            raise ValueError("first attempt fails")

    s = Scheduler(_SteppedBack(), instance_id="solo", lease="1.2s", heartbeat="0.2s")
    s.every("j", "1h", flaky, offset=quiet_offset_now(), retry=Retry(backoff="1s", jitter=0))
    async with s:
        slot = s.jobs["j"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "j", slot)
        await wait_for(lambda: len(ran) == 2, what="the retry")
    assert not [r for r in caplog.records if "by another process" in r.getMessage()]


@pytest.mark.anyio
@pytest.mark.asyncio_only
@pytest.mark.parametrize("server", ["pg16_server", "valkey8_server"])
async def test_an_instance_id_shared_on_a_server_store_is_warned_about(
    caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest, server: str,
) -> None:
    """As on the memory store, on PostgreSQL and Redis: the answer of a claim of a run
    held elsewhere names its holder's id; two schedulers with one instance_id are warned
    of, once."""
    from backends.postgres import PostgresBackend
    from backends.redis import RedisBackend
    from tests.stores.postgres import drop_tables, unique_table
    from tests.stores.redis import delete_prefix

    caplog.set_level("WARNING", logger="anarchon")
    found = request.getfixturevalue(server)
    table, prefix = unique_table(), f"x{unique_table()[-12:]}"

    def backend() -> Any:
        return (PostgresBackend(found.dsn, table=table) if server == "pg16_server"
                else RedisBackend(found.url, prefix=prefix))

    release = anyio.Event()

    async def hold(ctx: RunContext) -> None:
        await release.wait()

    def replica() -> Scheduler:
        s = Scheduler(backend(), instance_id="worker", lease="3s", heartbeat="0.5s")
        s.every("j", "1h", hold, offset=quiet_offset_now())
        return s

    a, b = replica(), replica()
    try:
        async with a, b:
            slot = a.jobs["j"].schedule.previous_at_or_before(a.store_now_ms())
            assert slot is not None
            await claim_now(a, "j", slot)
            await wait_for(lambda: a.running, what="a's run")
            await claim_now(b, "j", slot)
            await claim_now(b, "j", slot)
            release.set()
    finally:
        if server == "pg16_server":
            await drop_tables(found.admin_dsn, table)
        else:
            delete_prefix(found.url, prefix)
    shared = [r.getMessage() for r in caplog.records if "by another process" in r.getMessage()]
    assert len(shared) == 1 and "'worker'" in shared[0], shared


def test_an_outage_long_after_quiet_relapses_logs_its_start(
        caplog: pytest.LogCaptureFixture) -> None:
    """Relapses (outages following a logged one within a reminder's time) log nothing of
    their own; an outage a day later is an outage of its own, with its start line: it
    began "the store keeps failing calls: 2 failed in 2 outages over the last 86395s"."""
    caplog.set_level("WARNING", logger="anarchon")
    log = outages.OutageLog("a")
    down = lease_core.BackendUnavailable("store unreachable (test)")
    log.failed("claim", down, 0.0, starting=True)
    log.ended(1.0, None)
    log.failed("heartbeat", down, 2.0, starting=True)  # a relapse: quiet
    log.ended(2.5, None)
    assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]
    log.failed("claim", down, 86_400.0, starting=True)
    assert len(caplog.records) == 3
    assert "cannot reach the store" in caplog.records[-1].getMessage(), caplog.records[-1]
