"""The sync API's objects sharing one process: a backend shared by a SyncScheduler and
SyncLeases, one SyncLease and several threads, a fork, the interpreter's exit.

Every SyncScheduler and SyncLease of a process runs on one background event loop, so one
backend object serves them all (an async client, a pool and an adapter's lock belong to
the loop they were first used on: with a loop each, a blocking connection's lock lost
wake-ups and hung both, and a Redis client raised "attached to a different loop").
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import (
    LeaseLost,
    MemoryBackend,
    RunContext,
    SchedulerState,
    SyncLease,
    SyncScheduler,
)
from lease_core.abc import Backend
from lease_core.testing import claim_now_sync, open_event_streams, subscriber_count
from tests.helpers import quiet_offset_now
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix

ROOT = Path(__file__).resolve().parent.parent
FAST = {"lease": "3s", "heartbeat": "0.1s"}


def _pg8000_connection(dsn: str) -> Any:
    import pg8000.native

    p = urlsplit(dsn)
    return pg8000.native.Connection(user=p.username or "postgres", password=p.password,
                                    host=p.hostname or "127.0.0.1", port=p.port or 5432,
                                    database=p.path[1:])


def _lease_cycles(backend: Backend, seconds: float) -> int:
    """Acquire and release SyncLeases on ``backend`` for ``seconds``, each in a thread of
    its own that must end within 5 s; return how many cycles were made."""
    cycles, until = 0, time.monotonic() + seconds
    while time.monotonic() < until:
        lease = SyncLease(backend, f"n{cycles % 3}", ttl="2s")
        failed: list[BaseException] = []

        def cycle(lease: SyncLease = lease, failed: list[BaseException] = failed) -> None:
            try:
                if lease.acquire(timeout=0.2):
                    lease.release()
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=cycle, daemon=True)
        thread.start()
        thread.join(5)
        assert not thread.is_alive(), f"a SyncLease hung after {cycles} cycles"
        assert not failed, failed
        cycles += 1
    return cycles


@pytest.mark.parametrize("kind", ["pg8000-connection", "redis-url"])
def test_one_backend_serves_a_sync_scheduler_and_sync_leases(
        kind: str, pg16_server: PgServer, valkey8_server: Any) -> None:
    table, prefix = unique_table(), f"x{uuid.uuid4().hex[:10]}"
    backend: Backend
    connection = None
    if kind == "pg8000-connection":
        connection = _pg8000_connection(pg16_server.dsn)
        backend = PostgresBackend(connection, table=table)
    else:
        backend = RedisBackend(valkey8_server.url, prefix=prefix)
    ran: list[int] = []
    s = SyncScheduler(backend, instance_id="shared", **FAST)
    for i in range(3):
        s.every(f"j{i}", "1s", lambda ctx: ran.append(ctx.slot))
    try:
        # A lease first, then the scheduler, then leases while it runs.
        assert _lease_cycles(backend, 0.3) > 0
        with s:
            assert _lease_cycles(backend, 3) > 10
            deadline = time.monotonic() + 10
            while len(ran) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(ran) >= 3, ran
            assert s.health().store_reachable
    finally:
        if connection is not None:
            connection.close()
            anyio.run(drop_tables, pg16_server.admin_dsn, table)
        else:
            delete_prefix(valkey8_server.url, prefix)


def test_one_sync_lease_has_one_with_body_at_a_time() -> None:
    """A second ``with`` of the same SyncLease, from another thread, raises: it used to
    find the lease "held already" and run its body beside the first."""
    lease = SyncLease(MemoryBackend(), "job", ttl="10s")
    inside, leave = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        with lease:
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    try:
        with lease:
            errors.append(AssertionError("a second body ran"))
    except RuntimeError as exc:
        errors.append(exc)
    leave.set()
    thread.join(10)
    (error,) = errors
    assert isinstance(error, RuntimeError) and "already entered by `with`" in str(error)
    with lease:  # free again
        assert lease.held


def test_a_second_thread_s_acquire_of_one_sync_lease_says_to_give_each_thread_one() -> None:
    """Refused while another thread's acquire() of the same SyncLease runs: the error
    spoke of async tasks and of Lease only."""
    backend = MemoryBackend()
    holder, lease = SyncLease(backend, "n", ttl="10s"), SyncLease(backend, "n", ttl="10s")
    assert holder.acquire(timeout=0)
    refusals: list[str] = []

    def wait_for_it() -> None:
        try:
            lease.acquire(timeout=10)
        except RuntimeError as exc:  # the main thread's acquire() ran first
            refusals.append(str(exc))

    waiting = threading.Thread(target=wait_for_it)
    waiting.start()
    try:
        deadline = time.monotonic() + 10
        while not refusals:
            try:
                assert not lease.acquire(timeout=0)
            except RuntimeError as exc:
                refusals.append(str(exc))
            assert time.monotonic() < deadline, "no acquire() was refused"
            time.sleep(0.005)
    finally:
        holder.release()
        waiting.join(10)
        lease.release()
    assert "each thread a SyncLease" in refusals[0], refusals


def test_a_refused_release_does_not_end_the_with_body_in_another_thread() -> None:
    """release() from an async handler (on the background loop, which it would block)
    raises RuntimeError; it set :attr:`SyncLease.lost` first, and the ``with`` body of
    another thread then ended with LeaseLost 'released while the body ran', the lease
    held all along."""
    lease = SyncLease(MemoryBackend(), "job", ttl="10s")
    inside, leave = threading.Event(), threading.Event()
    seen: list[object] = []

    def body() -> None:
        try:
            with lease:
                inside.set()
                leave.wait(10)
                seen.append(lease.lost.is_set())
        except LeaseLost as exc:
            seen.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    assert inside.wait(10)
    refused: list[str] = []
    s = SyncScheduler(MemoryBackend(), **FAST)

    @s.every("release", "1h", offset=quiet_offset_now())
    async def release(ctx: RunContext) -> None:
        try:
            lease.release()
        except RuntimeError as exc:
            refused.append(str(exc))

    try:
        with s:
            slot = s.jobs["release"].schedule.previous_at_or_before(int(time.time() * 1000))
            assert slot is not None
            claim_now_sync(s, "release", slot)
            deadline = time.monotonic() + 10
            while not refused:
                assert time.monotonic() < deadline, "the handler did not run"
                time.sleep(0.02)
        assert "would block the event loop" in refused[0], refused
        assert lease.held and not lease.lost.is_set()
    finally:
        leave.set()
        thread.join(10)
    assert seen == [False], seen
    assert not lease.held


def _run(script: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=90, cwd=ROOT, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_forked_child_leaving_the_with_body_does_not_release_the_parent_s_lease(
        valkey8_server: Any) -> None:
    """The child's ``with`` ends (``sys.exit()`` unwinds it): the hold is the parent's,
    which keeps it; the child sees it not held, and its own use of it is refused."""
    prefix = f"x{uuid.uuid4().hex[:10]}"
    script = """
import os, sys
from lease_core import RedisBackend, SyncLease
url, prefix = os.environ["URL"], os.environ["PREFIX"]
lease = SyncLease(RedisBackend(url, prefix=prefix), "forked", ttl="10s")
other = SyncLease(RedisBackend(url, prefix=prefix), "forked", ttl="10s")
with lease:
    pid = os.fork()
    if pid == 0:
        assert not lease.held
        lease.release()  # nothing: the parent's hold
        try:
            lease.acquire(timeout=0)
            os._exit(3)
        except RuntimeError as exc:
            assert "fork" in str(exc), exc
        sys.exit(0)  # unwinds the with
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert lease.held and not lease.lost.is_set()
    assert other.acquire(timeout=0) is False
assert other.acquire(timeout=0) is True
other.release()
print("ok")
"""
    try:
        out = _run(script, {"URL": valkey8_server.url, "PREFIX": prefix})
        assert out.strip() == "ok"
    finally:
        delete_prefix(valkey8_server.url, prefix)


@pytest.mark.parametrize("in_process", [True, False])
def test_a_forked_child_uses_its_copy_of_a_memory_store_subclass_of_its_own_scheme(
    in_process: bool,
) -> None:
    """A MemoryBackend subclass with schemes of its own (registered under another name)
    has no connections either: a forked child's copy is its own store, usable through
    SyncLease and Lease while the parent holds through it. The fork refusals told it
    apart by the scheme 'memory', and refused it ('this process is a fork ...'). What
    decides is the class's public ``in_process`` (a third-party store of the same kind
    sets it): a subclass that sets it False is refused in the child (exit 3)."""
    script = """
import os
import anyio
from lease_core import Lease, MemoryBackend, SyncLease

class Store(MemoryBackend):
    schemes = ("store",)
    in_process = IN_PROCESS

backend = Store()
parent = SyncLease(backend, "parent", ttl="10s")
assert parent.acquire(timeout=0)
lost = Lease(backend, "async-parent", ttl="10s")
assert anyio.run(lost.acquire, 0)  # its loop ended: the backend is still counted open
pid = os.fork()
if pid == 0:
    try:
        mine = SyncLease(backend, "child", ttl="10s")
        got = mine.acquire(timeout=0)
        mine.release()
        got = got and anyio.run(Lease(backend, "child-async", ttl="10s").acquire, 0)
    except RuntimeError:
        os._exit(3)
    os._exit(0 if got else 4)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == EXIT, status
assert parent.held
parent.release()
print("ok")
"""
    script = script.replace("IN_PROCESS", str(in_process)).replace("EXIT", "0" if in_process
                                                                   else "3")
    assert _run(script).strip() == "ok"


def test_a_forked_child_reading_through_the_parent_s_open_backend_is_refused(
        valkey8_server: Any) -> None:
    """A SyncLease whose backend the parent holds open (another SyncLease holds through
    it), asked ``current_holder()`` in a forked child: refused, naming the fork, and a
    SyncLease with a backend of the child's own reads. It read through the parent's
    client: RuntimeError in the child, and the parent's next read on that client timed
    out (the child had used its socket)."""
    prefix = f"x{uuid.uuid4().hex[:10]}"
    script = """
import os
from lease_core import RedisBackend, SyncLease
url, prefix = os.environ["URL"], os.environ["PREFIX"]
backend = RedisBackend(url, prefix=prefix)
holder = SyncLease(backend, "shared", ttl="10s", holder="parent")
watcher = SyncLease(backend, "shared", ttl="10s")
holder.acquire()
assert watcher.current_holder().holder == "parent"
pid = os.fork()
if pid == 0:
    try:
        watcher.current_holder()
        os._exit(3)
    except RuntimeError as exc:
        if "fork" not in str(exc):
            os._exit(4)
    own = SyncLease(RedisBackend(url, prefix=prefix), "shared", ttl="10s")
    seen = own.current_holder()
    os._exit(0 if seen is not None and seen.holder == "parent" else 5)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
seen = watcher.current_holder()  # the parent's client is intact
assert seen is not None and seen.holder == "parent", seen
assert holder.held and not holder.lost.is_set()
holder.release()
print("ok")
"""
    try:
        out = _run(script, {"URL": valkey8_server.url, "PREFIX": prefix})
        assert out.strip() == "ok"
    finally:
        delete_prefix(valkey8_server.url, prefix)


def test_a_handler_s_sync_lease_is_held_until_the_stop_at_exit_ends_its_body() -> None:
    """The scheduler's stop at exit runs before the SyncLeases' loop ends, even when
    SyncLease was first imported after the scheduler started (inside the handler)."""
    script = """
import sys, threading, time
from lease_core import MemoryBackend, SyncScheduler
from lease_core.testing import claim_now_sync
s = SyncScheduler(MemoryBackend(), instance_id="a", lease="30s", heartbeat="0.2s")
resource = MemoryBackend()
inside = threading.Event()

def handler(ctx):
    from lease_core._sync_lease import SyncLease  # its module imported only now
    with SyncLease(resource, "resource", ttl="30s") as lease:
        inside.set()
        while not ctx.stopping.is_set():
            time.sleep(0.01)
        print("stopping, held", lease.held, flush=True)
        time.sleep(0.2)
        print("ending, held", lease.held, flush=True)

s.every("h", "1h", handler)
s.start()
slot = s.jobs["h"].schedule.previous_at_or_before(int(time.time() * 1000))
claim_now_sync(s, "h", slot)
assert inside.wait(10)
"""
    out = _run(script)
    assert out.split("\n")[:2] == ["stopping, held True", "ending, held True"], out


def test_history_before_start_works_inside_a_running_event_loop() -> None:
    """A sync call made from async code (a test, a notebook): it used to run a loop of
    its own, which anyio refuses inside a running one."""
    s = SyncScheduler(MemoryBackend(), instance_id="a")

    @s.every("tick", "1h")
    def tick(ctx: RunContext) -> None:
        pass

    async def main() -> tuple[int, int]:
        return len(s.history()), len(s.recovery_log(("tick", 0)))

    assert anyio.run(main) == (0, 0)


@pytest.mark.parametrize("exit_with", ["sync SystemExit", "sync KeyboardInterrupt",
                                       "async SystemExit"])
def test_a_handler_that_exits_fails_its_run_and_ends_nothing_else(exit_with: str) -> None:
    """``sys.exit()`` in a handler used to end the event loop it reached: now shared,
    that would have ended every SyncScheduler and SyncLease of the process. The run
    fails; the other scheduler, the SyncLeases and the exiting one go on."""
    kind, error = exit_with.split()
    raised: type[BaseException] = SystemExit if error == "SystemExit" else KeyboardInterrupt
    a = SyncScheduler(MemoryBackend(), instance_id="a", **FAST)
    b = SyncScheduler(MemoryBackend(), instance_id="b", **FAST)
    ticks: list[int] = []

    if kind == "sync":
        @a.every("boom", "1s")
        def boom(ctx: RunContext) -> None:
            raise raised(3)
    else:
        @a.every("boom", "1s")
        async def boom_async(ctx: RunContext) -> None:
            raise raised(3)

    b.every("tick", "1s", lambda ctx: ticks.append(ctx.slot))
    with b, a:
        deadline = time.monotonic() + 10
        failed: list[Any] = []
        while time.monotonic() < deadline and not (failed and len(ticks) >= 3):
            failed = [h for h in a.history("boom") if h.outcome == "failed"]
            time.sleep(0.1)
        assert failed and f"the handler raised {error}(3)" in (failed[0].error or ""), failed
        assert len(ticks) >= 3, ticks
        assert a.started and b.started
        lease = SyncLease(MemoryBackend(), "after", ttl="2s")
        assert lease.acquire(timeout=0)
        lease.release()


def test_subscribing_from_another_thread_while_it_starts_feeds_the_subscriber() -> None:
    # A web framework's startup hook starts the scheduler while another thread (an
    # extension's setup, a request) subscribes: the subscription made while start() is
    # in progress raised NoEventLoopError (the subscriber was opened off the loop's thread).
    for _ in range(10):
        s = SyncScheduler(MemoryBackend(), **FAST)
        s.every("idle", "1h", lambda ctx: None)
        done, errors = threading.Event(), []

        def subscribe_meanwhile(s: SyncScheduler = s, done: threading.Event = done,
                                errors: list[BaseException] = errors) -> None:
            while not done.is_set():
                if s.state is SchedulerState.STARTING:
                    try:
                        s.subscribe(lambda event: None)
                    except Exception as exc:
                        errors.append(exc)
                        return

        other = threading.Thread(target=subscribe_meanwhile)
        other.start()
        try:
            s.start()
        finally:
            done.set()
            other.join()
        try:
            assert errors == []
            assert open_event_streams(s.scheduler) == subscriber_count(s.scheduler)
        finally:
            s.stop()


def test_an_unsubscribe_made_before_start_is_made_on_the_loop_while_it_runs() -> None:
    """The unsubscribe function of a subscription made before start() closed the
    subscriber's stream from the caller's thread while the scheduler ran, beside the
    loop feeding it: asyncio's debug mode raised RuntimeError ('Non-thread-safe
    operation') half-way, and the scheduler's stop then waited for that subscriber
    forever; without debug mode, its delivery task woke only at the loop's next wake-up,
    and the subscriber list changed while the loop read it."""
    script = """
import os, time
from lease_core import MemoryBackend, SyncScheduler
from lease_core.testing import open_event_streams

def wait_for(streams):
    deadline = time.monotonic() + 10
    while open_event_streams(s.scheduler) != streams:
        assert time.monotonic() < deadline, open_event_streams(s.scheduler)
        time.sleep(0.02)

s = SyncScheduler(MemoryBackend(), lease="30s", heartbeat="0.2s")
s.every("idle", "1h", lambda ctx: None)
offs = [s.subscribe(lambda event: None)]  # before start
with s:
    offs.append(s.subscribe(lambda event: None))  # while it runs
    wait_for(2)
    try:
        for off in offs:
            off()
    except RuntimeError as exc:  # the stop would then wait for the subscriber forever
        print("off() raised:", exc, flush=True)
        os._exit(1)
    wait_for(0)
    offs[0]()  # twice: nothing more
print("ok")
"""
    assert _run(script, {"PYTHONASYNCIODEBUG": "1"}).strip() == "ok"
