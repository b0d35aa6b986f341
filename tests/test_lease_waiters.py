"""A release wakes the blocking acquires of the same process waiting for the name on the
same backend and thread, so one takes it at once, not at its next ``poll``; on every
scenario store (memory, PostgreSQL direct and through PgBouncer, Redis) and both event
loops, and through ``SyncLease`` (whose leases share one background loop).

Each waiter polls every 60 s: without the wake-up, none would take the name within the
10 s these tests allow.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from lease_core import Lease, MemoryBackend, SyncLease
from lease_core.abc import Backend
from lease_core.testing import Store, wait_for

pytestmark = pytest.mark.anyio


def count_tries(backend: Backend) -> list[int]:
    """Count the backend's answered acquire calls (one item per answer): a waiter whose
    first try was answered is in its pause by the time the count shows it (nothing
    between the answer and the pause gives way to another task)."""
    answered: list[int] = []
    real = backend.acquire_lease

    async def acquire_lease(*args: Any) -> Any:
        answer = await real(*args)
        answered.append(1)
        return answer

    backend.acquire_lease = acquire_lease  # type: ignore[method-assign]
    return answered


async def test_a_release_wakes_the_waiters_of_this_process_at_once(store: Store) -> None:
    backend = store.backend()
    tries = count_tries(backend)
    holder = Lease(backend, "report-lock", ttl="60s")
    waiters = [Lease(backend, "report-lock", ttl="60s", poll="60s") for _ in range(2)]
    assert await holder.acquire(timeout=0)
    won: list[Lease] = []

    async def wait(lease: Lease) -> None:
        assert await lease.acquire()
        won.append(lease)
        await lease.release()  # and wakes the other, at once too

    async with anyio.create_task_group() as tg:
        for lease in waiters:
            tg.start_soon(wait, lease)
        await wait_for(lambda: len(tries) >= 3, what="both waiters refused once")
        await holder.release()
        with anyio.fail_after(10):
            await wait_for(lambda: len(won) == 2, timeout=10, what="both waiters served")
    assert holder.token is not None and all(
        lease.token is not None and lease.token > holder.token for lease in waiters)
    assert len(tries) <= 6  # one more try each: woken, not polling


async def test_a_release_sent_again_after_a_cancellation_wakes_the_waiters(
        store: Store) -> None:
    """A release cancelled before the store answered is sent again, shielded; that one
    frees the name too, and wakes this process's waiters (they waited for their poll)."""
    backend = store.backend()
    tries = count_tries(backend)
    real = backend.release_lease
    calls: list[int] = []

    async def release_lease(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            await anyio.sleep_forever()  # the first one is cancelled before it is sent
        return await real(*args)

    backend.release_lease = release_lease  # type: ignore[method-assign]
    holder = Lease(backend, "report-lock", ttl="60s")
    waiter = Lease(backend, "report-lock", ttl="60s", poll="60s")
    assert await holder.acquire(timeout=0)
    won: list[Lease] = []

    async def wait() -> None:
        assert await waiter.acquire()
        won.append(waiter)
        await waiter.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await wait_for(lambda: len(tries) >= 2, what="the waiter refused once")
        with anyio.move_on_after(0.2):
            await holder.release()
        with anyio.fail_after(10):
            await wait_for(lambda: won == [waiter], timeout=10, what="the waiter served")
    assert len(calls) == 3  # the cancelled one, the one sent again, the waiter's


async def test_a_waiter_elsewhere_keeps_its_poll(store: Store) -> None:
    """A waiter on another backend object (as in another process) is not woken: it takes
    the name at its next try, within its ``poll``."""
    backend = store.backend()
    holder = Lease(backend, "report-lock", ttl="60s")
    assert await holder.acquire(timeout=0)
    elsewhere = Lease(store.backend(), "report-lock", ttl="60s", poll="0.2s")
    if elsewhere.backend is backend:
        pytest.skip("this store hands out one backend object")
    tries = count_tries(elsewhere.backend)
    async with anyio.create_task_group() as tg:
        tg.start_soon(elsewhere.acquire)
        await wait_for(lambda: tries, what="the waiter refused once")
        await holder.release()
        await wait_for(lambda: elsewhere.held, what="the waiter's next try")
    assert len(tries) >= 2  # its first try, refused, and the one after its pause
    await elsewhere.release()


@pytest.mark.asyncio_only
async def test_a_sync_lease_release_wakes_a_sync_waiter_at_once() -> None:
    backend = MemoryBackend()
    tries = count_tries(backend)
    holder = SyncLease(backend, "report-lock", ttl="60s")
    waiter = SyncLease(backend, "report-lock", ttl="60s", poll="60s")
    assert holder.acquire(timeout=0)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30)))
    thread.start()
    try:
        await wait_for(lambda: len(tries) >= 2, what="the waiter refused once")
        holder.release()
        await wait_for(lambda: got, timeout=10, what="the waiter woken")
        assert got == [True] and waiter.held
    finally:
        thread.join(35)
        waiter.release()


@pytest.mark.asyncio_only
@pytest.mark.parametrize("first_loop", ["closed", "stopped"])
async def test_a_waiter_left_on_another_loop_of_the_thread_is_not_woken(
        first_loop: str) -> None:
    """An acquire left pending on an event loop that ended (closed, or stopped as
    ``run_until_complete`` leaves it) is not woken by a release on a later loop of the
    same thread: its cancel scope is the other loop's. The release raised 'Event loop is
    closed' (closed), or anyio delivered the cancellation at every turn of the later
    loop, for ever (stopped: a busy loop)."""
    import asyncio
    import time

    def scenario() -> tuple[float, str | None]:
        backend = MemoryBackend()
        holder = Lease(backend, "report-lock", ttl="60s")
        waiter = Lease(backend, "report-lock", ttl="60s", poll="60s")
        loop = asyncio.new_event_loop()
        left: list[asyncio.Future[bool]] = []

        async def first() -> None:
            assert await holder.acquire(timeout=0)
            left.append(asyncio.ensure_future(waiter.acquire()))  # pending with its loop
            await asyncio.sleep(0.1)

        loop.run_until_complete(first())
        if first_loop == "closed":
            loop.close()

        async def second() -> tuple[float, str | None]:
            error = None
            try:
                await holder.release()
            except RuntimeError as exc:
                error = str(exc)
            cpu = time.thread_time()
            await asyncio.sleep(0.5)
            return time.thread_time() - cpu, error

        try:
            return asyncio.run(second())
        finally:
            loop.close()

    busy, error = await anyio.to_thread.run_sync(scenario)
    assert error is None
    assert busy < 0.25  # idle, not re-delivering a cancellation at every turn


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork")
async def test_an_acquire_in_a_forked_child_does_not_wait_for_the_parents_lock() -> None:
    """A fork while another thread of the parent registers a waiter (a SyncLease's
    acquire on the background loop): the child's copy of the registry's lock stays held,
    and every acquire of the child waited for it for ever."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, threading, anyio
        from lease_core import Lease, MemoryBackend
        from lease_core import _lease_waiters
        held, forked = threading.Event(), threading.Event()
        def registering():  # another thread, inside the registry's lock as it forks
            with _lease_waiters._lock:
                held.set()
                forked.wait()
        threading.Thread(target=registering, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            async def child():
                assert await Lease(MemoryBackend(), "n").acquire(timeout=0)
            anyio.run(child)
            os._exit(0)
        forked.set()
        for _ in range(100):  # 10 s
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                raise SystemExit(os.waitstatus_to_exitcode(status))
            threading.Event().wait(0.1)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise SystemExit("the child's acquire waited for the lock its parent held")
    """)
    done = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-c", script], timeout=30, capture_output=True))
    assert done.returncode == 0, done.stderr.decode()
