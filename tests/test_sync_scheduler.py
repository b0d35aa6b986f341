"""SyncScheduler: the blocking front end, on the memory backend, PostgreSQL and Redis.

Plain sync tests (no event loop in the test): the scheduler runs in its own background
thread, as it would in Django, Flask or a script. Every wait polls a state with a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from backends.embedded.postgres import find_free_port
from lease_core import (
    AnarchonError,
    Attempt,
    BackendUnavailable,
    ConfigurationError,
    MemoryBackend,
    OperationRefused,
    Outcome,
    PostgresBackend,
    Reason,
    RedisBackend,
    RunContext,
    SchedulerState,
    SyncAdmin,
    SyncLease,
    SyncScheduler,
)
from lease_core.abc import Backend
from lease_core.testing import claim_now_sync
from tests.helpers import quiet_cron, quiet_offset_now
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix

FAST = {"lease": "30s", "heartbeat": "0.2s"}
"""Long leases: a run taken over before one expires was handed over, not lost."""


def wait_until(predicate: Callable[[], Any], *, timeout: float = 15.0, what: str) -> Any:
    """Poll ``predicate`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class SyncStore:
    """One isolated store; ``backend()`` makes one backend per simulated instance."""

    kind: str
    backend: Callable[[], Backend]
    url: str = ""
    table: str = ""
    cleanups: list[Callable[[], Any]] = field(default_factory=list)


@pytest.fixture(params=["memory", "postgres", "redis"])
def sync_store(request: pytest.FixtureRequest) -> Iterator[SyncStore]:
    """A memory backend, a fresh PostgreSQL table, or a fresh Redis key prefix."""
    if request.param == "memory":
        shared = MemoryBackend()
        yield SyncStore("memory", lambda: shared)
    elif request.param == "postgres":
        server: PgServer = request.getfixturevalue("pg16_server")
        table = unique_table()
        yield SyncStore("postgres", lambda: PostgresBackend(server.dsn, table=table),
                        server.dsn, table)
        anyio.run(drop_tables, server.admin_dsn, table)
    else:
        url: str = request.getfixturevalue("valkey8_server").url
        prefix = f"t{uuid.uuid4().hex[:12]}"
        yield SyncStore("redis", lambda: RedisBackend(url, prefix=prefix), url, prefix)
        delete_prefix(url, prefix)


def runs_of(history: list[Attempt], slot: int) -> list[tuple[int, str, str | None]]:
    """(attempt, reason, outcome) of one slot, oldest first."""
    return sorted((h.attempt, h.reason, h.outcome) for h in history if h.slot == slot)


class Blocker:
    """A sync handler whose first run holds its run until the scheduler stops.

    It reports the slot it holds, then polls ``ctx.stopping`` and ends with
    ``raise_if_stopping()``, so stopping hands the run over. Later runs complete at once.
    """

    def __init__(self) -> None:
        self.held: list[int] = []
        self.calls: list[tuple[int, int, str]] = []

    def __call__(self, ctx: RunContext) -> None:
        self.calls.append((ctx.slot, ctx.attempt, ctx.reason))
        if self.held:
            return
        self.held.append(ctx.slot)
        while not ctx.stopping.is_set():
            time.sleep(0.02)
        ctx.raise_if_stopping()


def test_sync_and_async_jobs_run_and_complete(sync_store: SyncStore) -> None:
    s = SyncScheduler(sync_store.backend(), instance_id="a", **FAST)
    ran: list[tuple[str, int, str]] = []

    @s.every("sync-job", "1s")
    def sync_job(ctx: RunContext) -> None:
        ran.append(("sync", ctx.slot, threading.current_thread().name))

    async def async_job(ctx: RunContext) -> None:
        await anyio.sleep(0.001)
        ran.append(("async", ctx.slot, threading.current_thread().name))

    s.every("async-job", "1s", async_job)
    # A daily job that does not fire during the test (the stores run on this machine's clock).
    s.cron("nightly", quiet_cron(int(time.time() * 1000)), lambda ctx: None)
    assert set(s.jobs) == {"sync-job", "async-job", "nightly"}
    s.start()
    try:
        assert s.started
        with pytest.raises(ConfigurationError, match="after start"):
            s.every("late", "1s", lambda ctx: None)
        wait_until(lambda: {kind for kind, _, _ in ran} == {"sync", "async"}, what="both jobs")
        history = wait_until(
            lambda: [h for h in s.history() if h.outcome == Outcome.COMPLETED],
            what="completed attempts in the store",
        )
    finally:
        s.stop()
    assert not s.started
    assert {h.job for h in history} <= {"sync-job", "async-job"}
    assert all(name != threading.current_thread().name for _, _, name in ran)
    # After stop(), history is read on a short-lived event loop.
    after = s.history("sync-job")
    assert after and all(h.job == "sync-job" for h in after)
    assert {h.slot for h in after} >= {slot for kind, slot, _ in ran if kind == "sync"}


def test_operations_from_sync_code_on_the_backend_a_running_scheduler_holds(
        sync_store: SyncStore) -> None:
    """``sync_scheduler.admin`` and ``SyncAdmin(backend)`` make the operations from the
    caller's thread on the background loop, so they may share the backend object the
    running scheduler holds (an ``Admin`` run by ``anyio.run`` there may not)."""
    s = SyncScheduler(sync_store.backend(), instance_id="a", **FAST)
    ran: list[tuple[int, str]] = []

    @s.every("report", "1h", offset=quiet_offset_now())
    def report(ctx: RunContext) -> None:
        ran.append((ctx.slot, ctx.reason))
        if len(ran) == 1:  # the first waits for its cancel, the second fails
            while not ctx.stopping.is_set():
                time.sleep(0.02)
            ctx.raise_if_stopping()
        elif len(ran) == 2:
            raise RuntimeError("boom")

    ops = SyncAdmin(s.backend, by="ops")
    assert (s.admin.by, ops.by) == ("a", "ops")
    with s:
        with pytest.raises(OperationRefused, match="'nightly'") as refused:
            ops.trigger("nightly")  # the store has never seen it
        assert refused.value.kind == "unknown_job"
        first = s.admin.trigger("report")
        wait_until(lambda: ran, what="the triggered run")
        ops.cancel("report", first, grace=0)
        wait_until(lambda: not s.running, what="the cancelled run to end")
        with pytest.raises(OperationRefused, match="cancelled") as refused:
            ops.retry("report", first)
        assert refused.value.kind == "conflict"
        ops.pause("report")
        assert s.admin.paused() == {"report": "ops"}
        with pytest.raises(OperationRefused, match="paused"):
            s.admin.pause("report")
        s.admin.resume("report")
        assert ops.paused() == {}
        second = ops.trigger("report")
        wait_until(lambda: len(ran) == 2 and not s.running, what="the failed run")
        s.admin.retry("report", second)
        wait_until(lambda: len(ran) == 3 and not s.running, what="the retried run")
    assert ran == [(first, Reason.MANUAL), (second, Reason.MANUAL), (second, Reason.RETRY)]
    history = s.history("report")
    assert runs_of(history, first) == [(1, Reason.MANUAL, Outcome.CANCELLED)]
    assert runs_of(history, second) == [(1, Reason.MANUAL, Outcome.FAILED),
                                        (2, Reason.RETRY, Outcome.COMPLETED)]
    assert s.admin.paused() == {}  # after stop() too


def test_with_block_hands_over_on_exit(sync_store: SyncStore) -> None:
    blocker = Blocker()
    a = SyncScheduler(sync_store.backend(), instance_id="a", **FAST)
    a.every("hold", "1s", blocker)
    with a:
        wait_until(lambda: blocker.held, what="a run held")
    slot = blocker.held[0]
    assert not a.started
    assert runs_of(a.history("hold"), slot) == [(1, Reason.SCHEDULED, Outcome.HANDED_OVER)]


def test_stop_hands_over_a_held_run_and_a_backup_takes_it(sync_store: SyncStore) -> None:
    blocker = Blocker()
    a = SyncScheduler(sync_store.backend(), instance_id="a", **FAST)
    a.every("hold", "1s", blocker)
    a.start()
    wait_until(lambda: blocker.held, what="a run held")
    slot = blocker.held[0]
    assert a.running == [("hold", slot)]
    stopped_at = time.monotonic()
    a.stop(grace="2s")
    assert time.monotonic() - stopped_at < 10
    a.stop()  # idempotent
    assert runs_of(a.history("hold"), slot) == [(1, Reason.SCHEDULED, Outcome.HANDED_OVER)]

    b = SyncScheduler(sync_store.backend(), instance_id="b", **FAST)
    b.every("hold", "1s", blocker)
    with b:
        wait_until(lambda: runs_of(b.history("hold"), slot)[-1][2] == Outcome.COMPLETED,
                   what="the backup completing the handed-over run")
    assert runs_of(b.history("hold"), slot) == [
        (1, Reason.SCHEDULED, Outcome.HANDED_OVER),
        (2, Reason.HAND_OVER, Outcome.COMPLETED),
    ]
    assert (slot, 2, Reason.HAND_OVER) in blocker.calls


def test_state_and_health_follow_the_lifecycle(sync_store: SyncStore) -> None:
    blocker = Blocker()
    a = SyncScheduler(sync_store.backend(), instance_id="a", **FAST)
    a.every("hold", "1s", blocker)
    assert a.state is SchedulerState.STOPPED
    before = a.health()
    assert before.state is SchedulerState.STOPPED and not before.ready
    assert before.runs_held == 0
    a.start()
    try:
        assert a.state is SchedulerState.RUNNING
        wait_until(lambda: blocker.held, what="a run held")
        seen: list[Any] = []

        def probe() -> None:  # from another thread, as a web server's probe would
            seen.append(a.health())

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join(timeout=15)
        (health,) = seen
        assert health.state is SchedulerState.RUNNING and health.ready
        assert health.store_reachable and health.runs_held == 1
        assert health.since_store_answer is not None and health.since_store_answer >= 0
    finally:
        a.stop(grace="2s")
    assert a.state is SchedulerState.STOPPED
    assert a.health().state is SchedulerState.STOPPED


def test_lifecycle_misuse() -> None:
    s = SyncScheduler(MemoryBackend(), **FAST)
    s.stop()  # before start: a no-op
    assert not s.started
    with pytest.raises(ConfigurationError, match="grace"):
        s.stop(grace="soon")
    with pytest.raises(ConfigurationError, match="exit_grace"):
        SyncScheduler(MemoryBackend(), exit_grace=-1)
    with pytest.raises(ConfigurationError, match="lease"):
        SyncScheduler(MemoryBackend(), lease="1s", heartbeat="1s")
    # A mistyped option names SyncScheduler (not Scheduler.__init__) and the one meant.
    with pytest.raises(TypeError, match=r"^SyncScheduler\(\) got an unexpected option "
                                        r"'leese'; did you mean 'lease'\?$"):
        SyncScheduler(MemoryBackend(), leese="30s")
    with pytest.raises(TypeError, match="'colour'; it takes call_timeout, clock, exit_grace"):
        SyncScheduler(MemoryBackend(), colour="red")
    s.start()
    try:
        with pytest.raises(AnarchonError, match="already started"):
            s.start()
        assert s.started
    finally:
        s.stop()
    s.start()  # a stopped scheduler may start again
    s.stop()
    assert not s.started


def test_start_after_a_handler_s_stop_says_to_call_stop_first() -> None:
    """A handler's stop() only requests it; the scheduler then reads STOPPED, not
    started, and start() said it "is already started"."""
    s = SyncScheduler(MemoryBackend(), instance_id="a", **FAST)
    s.every("quit", "1h", lambda ctx: s.stop(), offset=quiet_offset_now())
    s.start()
    try:
        slot = s.jobs["quit"].schedule.previous_at_or_before(int(time.time() * 1000))
        assert slot is not None
        claim_now_sync(s, "quit", slot)
        wait_until(lambda: s.state is SchedulerState.STOPPED, what="the handler's stop")
        assert not s.started
        with pytest.raises(AnarchonError) as refused:
            s.start()
        assert "is stopped: a handler called stop()" in str(refused.value)
        assert "call stop() first" in str(refused.value)
    finally:
        s.stop()
    s.start()  # the stop() from outside ended it: it starts again
    assert s.started
    s.stop()
    assert runs_of(s.history("quit"), slot) == [(1, Reason.SCHEDULED, Outcome.COMPLETED)]


def test_blocking_calls_from_an_async_handler_raise() -> None:
    s = SyncScheduler(MemoryBackend(), **FAST)
    other = SyncScheduler(MemoryBackend(), **FAST)
    errors: list[str] = []

    @s.every("tick", "1s")
    async def tick(ctx: RunContext) -> None:
        if errors:
            return
        for call in (s.history, s.stop, s.admin.paused, other.start):
            try:
                call()
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    with s:
        wait_until(lambda: len(errors) >= 4, what="the handler's calls")
        assert s.started
    assert all(error.startswith("AnarchonError: ") for error in errors), errors
    assert "history() would block" in errors[0] and "stop() would block" in errors[1]
    assert "SyncAdmin.paused() would block" in errors[2], errors[2]
    # start() blocked on the loop it waits for: anyio's bare RuntimeError said neither
    # what was wrong nor what to do
    assert "SyncScheduler.start() would block" in errors[3], errors[3]
    assert "from sync code" in errors[3], errors[3]
    assert other.state is SchedulerState.STOPPED


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def test_start_error_surfaces_in_the_caller_and_leaves_nothing_running(
    pg16_server: PgServer,
) -> None:
    # The process's background loop (every SyncScheduler's and SyncLease's) stays for
    # the process; nothing else may be left.
    warm = SyncLease(MemoryBackend(), "warm")
    assert warm.acquire(timeout=0)
    warm.release()
    before = _threads()
    bad_schema = SyncScheduler(
        PostgresBackend(pg16_server.dsn, table="no_such_schema.runs"), **FAST
    )
    bad_schema.every("x", "1s", lambda ctx: None)
    with pytest.raises(ConfigurationError, match="no_such_schema"):
        bad_schema.start()
    assert not bad_schema.started
    bad_schema.stop()  # nothing to stop

    unreachable = SyncScheduler(
        RedisBackend(f"redis://127.0.0.1:{find_free_port()}/0"), **FAST
    )
    with pytest.raises(BackendUnavailable):
        unreachable.start()
    with pytest.raises(BackendUnavailable):  # not "already started"
        unreachable.start()
    assert not unreachable.started
    wait_until(lambda: _threads() <= before, timeout=5, what="no thread left behind")


def _run_script(script: str, env: dict[str, str], timeout: float = 60) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_interpreter_exit_hands_over(pg16_server: PgServer) -> None:
    table = unique_table()
    script = """
        import os, threading, time
        from lease_core import PostgresBackend, SyncScheduler

        s = SyncScheduler(PostgresBackend(os.environ["DSN"], table=os.environ["TABLE"]),
                          instance_id="exiting", lease="30s", heartbeat="0.2s")
        holding = threading.Event()

        @s.every("hold", "1s")
        def hold(ctx):
            print("slot", ctx.slot, flush=True)
            holding.set()
            while not ctx.stopping.is_set():
                time.sleep(0.02)
            ctx.raise_if_stopping()

        s.start()
        assert holding.wait(30)
        # No stop(): the interpreter exits normally, and the atexit hook hands over.
    """
    try:
        out = _run_script(script, {"DSN": pg16_server.dsn, "TABLE": table})
        slot = int(out.split()[1])
        check = SyncScheduler(PostgresBackend(pg16_server.dsn, table=table))
        assert runs_of(check.history("hold"), slot) == [
            (1, Reason.SCHEDULED, Outcome.HANDED_OVER)
        ]
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_use_in_a_forked_child_raises_instead_of_hanging() -> None:
    script = """
        import os, sys
        from lease_core import AnarchonError, MemoryBackend, SyncAdmin, SyncScheduler

        s = SyncScheduler(MemoryBackend(), lease="30s", heartbeat="0.2s")
        s.every("tick", "1s", lambda ctx: None)
        ops = SyncAdmin(s.backend)  # never used here: its backend is open all the same
        s.start()
        off = s.subscribe(lambda event: None)  # its unsubscribe hung in the child
        pid = os.fork()
        if pid == 0:
            assert not s.started
            for admin in (ops, SyncAdmin(s.backend)):
                try:
                    admin.paused()
                except AnarchonError as exc:
                    assert "fork" in str(exc) and "in the child" in str(exc), exc
                else:
                    sys.exit("a SyncAdmin on the parent's open backend did not raise")
            for call in (s.history, s.stop, s.start, lambda: s.running, s.admin.paused, off):
                try:
                    call()
                except AnarchonError as exc:
                    assert "fork" in str(exc) and "post_fork" in str(exc), exc
                else:
                    sys.exit(f"{call} did not raise in the forked child")
            sys.exit(0)  # a normal exit: the atexit hook must not hang here
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert s.started  # the parent's scheduler is untouched
        s.history()
        s.stop()
        print("ok")
    """
    assert _run_script(script, {}, timeout=60).strip() == "ok"


def test_a_handler_reading_the_history_while_its_scheduler_stops_is_not_held_up() -> None:
    """stop() holds its lock for the whole grace; a handler calling history() meanwhile
    waited for it (and so the stop waited for the handler, and handed its run over at
    the end of the grace). The history is read at once and the run completes."""
    backend = MemoryBackend()
    s = SyncScheduler(backend, instance_id="a", **FAST)
    waited: list[float] = []
    started = threading.Event()

    def reads(ctx: RunContext) -> None:
        started.set()
        wait_until(lambda: s.state is SchedulerState.STOPPING, what="the stop under way")
        began = time.monotonic()
        s.history("reads")
        waited.append(time.monotonic() - began)

    s.every("reads", "1h", reads, offset=quiet_offset_now())
    s.start()
    try:
        slot = s.jobs["reads"].schedule.previous_at_or_before(int(time.time() * 1000))
        assert slot is not None
        claim_now_sync(s, "reads", slot)
        wait_until(started.is_set, what="the handler started")
    finally:
        s.stop(grace="20s")
    assert len(waited) == 1 and waited[0] < 5, waited
    assert runs_of(s.history("reads"), slot) == [(1, Reason.SCHEDULED, Outcome.COMPLETED)]


def test_events_dropped_is_read_as_on_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operating guide counts a slow subscriber's overflow in
    ``scheduler.events_dropped``; a SyncScheduler had no such attribute."""
    import lease_core.engine.base

    monkeypatch.setattr(lease_core.engine.base, "EVENT_BUFFER", 1)
    monkeypatch.setattr(lease_core.engine.base, "EVENTS_PER_JOB", 0)  # 1 event in all
    release = threading.Event()
    s = SyncScheduler(MemoryBackend(), instance_id="a", **FAST)
    s.every("j", "1h", lambda ctx: None, catch_up="none", offset=quiet_offset_now())
    s.subscribe(lambda event: release.wait(30))  # stuck on the first event
    assert s.events_dropped == 0
    with s:
        slot = s.jobs["j"].schedule.previous_at_or_before(int(time.time() * 1000))
        assert slot is not None
        for at in (slot, slot + 3_600_000, slot + 7_200_000):
            claim_now_sync(s, "j", at)
        wait_until(lambda: s.events_dropped > 0, what="an event dropped")
        release.set()
    assert s.events_dropped > 0
