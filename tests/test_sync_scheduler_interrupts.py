"""SyncScheduler: a signal (Ctrl-C, SIGTERM's handler) while start() waits."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import anyio
import pytest

from lease_core import MemoryBackend, SchedulerState, SyncAdmin, SyncScheduler
from lease_core.testing import backend_users

FAST = {"lease": "30s", "heartbeat": "0.2s"}


class SlowStart(MemoryBackend):
    """A store that takes a while to open (a slow network, a DNS lookup)."""

    async def start(self, *, create: bool = True) -> None:
        await anyio.sleep(0.6)
        await super().start(create=create)


class Interrupted(BaseException):
    pass


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_an_interrupted_start_leaves_nothing_running() -> None:
    s = SyncScheduler(SlowStart(), instance_id="a", **FAST)
    ran = threading.Event()
    s.every("tick", "1s", lambda ctx: ran.set())

    def interrupt(*_: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            s.start()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert s.state is SchedulerState.STOPPED
    # Nothing may go on starting and running behind the caller's back.
    time.sleep(2.5)
    try:
        assert not ran.is_set(), "the interrupted scheduler runs jobs, unstoppable"
        assert s.scheduler.state is SchedulerState.STOPPED
    finally:
        if s.scheduler.state is not SchedulerState.STOPPED:
            from lease_core._lease_loop import _Loop
            _Loop.get().call(s.scheduler.abort)


def test_a_stop_requested_by_a_signal_handler_while_starting_is_not_lost() -> None:
    s = SyncScheduler(SlowStart(), instance_id="b", **FAST)
    s.every("tick", "1s", lambda ctx: None)
    previous = signal.signal(signal.SIGALRM, lambda *_: s.stop())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        s.start()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    try:
        assert not s.started, "SIGTERM's stop() during start() was dropped"
    finally:
        s.stop()


def test_an_interrupted_stop_still_hands_over_at_exit() -> None:
    """A second Ctrl-C (or a signal handler's exception) during stop()'s grace: the
    scheduler goes on stopping, and the interpreter's exit waits for its hand-over
    instead of cancelling it (the run would lapse, taken over a lease later)."""
    script = """
        import signal, threading, time, atexit, anyio
        from lease_core import MemoryBackend, SyncScheduler
        from lease_core.testing import claim_now_sync

        b = MemoryBackend()

        def report():  # registered first: runs after every other exit hook
            print("outcome", [h.outcome for h in anyio.run(b.history, "j")])

        atexit.register(report)
        a = SyncScheduler(b, instance_id="a", lease="30s", heartbeat="0.2s")
        held = threading.Event()

        def h(ctx):
            held.set()
            while not ctx.stopping.is_set():
                time.sleep(0.02)
            time.sleep(1.5)  # finishing its item
            ctx.raise_if_stopping()

        a.every("j", "1h", h, offset="0s")
        a.start()
        slot = a.jobs["j"].schedule.previous_at_or_before(int(time.time() * 1000))
        claim_now_sync(a, "j", slot)
        assert held.wait(10)

        def second(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, second)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            a.stop(grace="10s")
        except KeyboardInterrupt:
            print("state", a.state.name, flush=True)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "state STOPPING" in out.stdout, out.stdout
    assert "outcome [<Outcome.HANDED_OVER: 'handed_over'>]" in out.stdout, out.stdout


class SlowOperate(MemoryBackend):
    """A store that takes a while to make an operation."""

    async def operate(self, operation: Any) -> Any:
        await anyio.sleep(0.6)
        return await super().operate(operation)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_an_interrupted_operation_raises_at_once_and_is_still_made() -> None:
    """A SyncAdmin call interrupted while it waits (Ctrl-C) raises that at once; the
    operation goes on on the background loop and is made (as the docs say: the caller
    cannot take its interrupt as "not made"), and the backend's start is let go of."""
    backend = SlowOperate()
    s = SyncScheduler(backend, instance_id="a", **FAST)
    s.every("tick", "1h", lambda ctx: None)
    with s:
        pass  # the job is in the store
    ops = SyncAdmin(backend, by="ops")

    def interrupt(*_: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        began = time.monotonic()
        with pytest.raises(Interrupted):
            ops.pause("tick")
        assert time.monotonic() - began < 0.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    deadline = time.monotonic() + 10
    while ops.paused() != {"tick": "ops"}:
        assert time.monotonic() < deadline, "the interrupted pause was not made"
        time.sleep(0.05)
    assert backend_users(backend) == 0


def test_a_second_stop_with_a_shorter_grace_shortens_the_one_under_way() -> None:
    """``stop(60)`` under way in one thread, ``stop(0)`` in another: the second waited on
    the first's lock for the whole minute (the first grace was kept) while a handler
    ignoring the soft signal ran on. Both return once the handler is cancelled."""
    s = SyncScheduler(MemoryBackend(), instance_id="g", **FAST)
    started = threading.Event()

    async def stubborn(ctx: Any) -> None:
        started.set()
        await anyio.sleep_forever()  # ignores ctx.stopping; only its cancellation ends it

    s.every("stubborn", "1s", stubborn)
    s.start()
    first = threading.Thread(target=s.stop, args=(60,))
    try:
        assert started.wait(10), "the handler never started"
        first.start()
        deadline = time.monotonic() + 10
        while s.scheduler.state is not SchedulerState.STOPPING:
            assert time.monotonic() < deadline, "the first stop never began"
            time.sleep(0.01)
        second = threading.Thread(target=s.stop, args=(0,))
        second.start()
        for stop in (second, first):
            stop.join(10)  # not the first stop's 60 s
            assert not stop.is_alive(), "a stop still waits for the first grace"
        assert s.state is SchedulerState.STOPPED
    finally:
        s.stop(0)
        first.join(60)
