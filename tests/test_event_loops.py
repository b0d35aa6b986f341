"""A backend and its adapter keep nothing bound to one event loop, and leave nothing on one.

A backend object may be used under asyncio, then under trio (or the process's background
loop of the sync front ends, then the application's own), and an adapter made at every
start of a backend (one from a DSN or a URL) must leave nothing behind on a loop that
runs for the life of the process. Real servers: the embedded PostgreSQL 16 and Redis 6.2.
"""

from __future__ import annotations

import gc
import threading
import uuid
from typing import Any

import anyio
import pytest

from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import Lease
from lease_core.abc import Backend
from lease_core.testing import backend_users, close_backend
from tests.stores.postgres import PgServer
from tests.stores.redis import delete_prefix


def _backend(kind: str, request: pytest.FixtureRequest) -> Backend:
    if kind == "postgres-pg8000":
        server: PgServer = request.getfixturevalue("pg16_server")
        url = server.dsn.replace("postgresql://", "postgresql+pg8000://", 1)
        return PostgresBackend(url, table=f"anarchon_loops_{uuid.uuid4().hex[:10]}")
    url = request.getfixturevalue("redis62_server").url
    prefix = f"t{uuid.uuid4().hex[:12]}"
    request.addfinalizer(lambda: delete_prefix(url, prefix))
    return RedisBackend(url, prefix=prefix)


@pytest.mark.parametrize("kind", ["postgres-pg8000", "redis-url"])
def test_a_backend_is_started_under_asyncio_then_trio(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """A backend started and closed under asyncio, then under trio, then asyncio again
    (a lease each time): its start lock was asyncio's for good, and trio's first start
    failed with "no running event loop"."""
    backend = _backend(kind, request)
    tokens: list[int | None] = []

    async def use() -> None:
        with anyio.fail_after(10):
            async with Lease(backend, "loops", ttl="5s") as lease:
                tokens.append(lease.token)

    anyio.run(use, backend="asyncio")
    anyio.run(use, backend="trio")
    anyio.run(use, backend="asyncio")
    assert len(tokens) == 3 and tokens == sorted(tokens)


def _anyio_primitives() -> int:
    """How many anyio limiters and locks are alive (after a collection)."""
    gc.collect()
    kinds = (anyio.CapacityLimiter, anyio.Lock)
    return sum(1 for o in gc.get_objects() if isinstance(o, kinds))


@pytest.mark.anyio
async def test_leases_on_a_dsn_backend_leave_nothing_on_the_event_loop(
    pg16_server: PgServer,
) -> None:
    """Each start of a backend made from a DSN makes a new adapter, whose worker threads
    and slots have a limiter per loop: they went when the adapter went, not when the
    loop ends (two limiters stayed on the loop per lease taken and released, for good on
    the sync front ends' loop, which runs as long as the process)."""
    url = pg16_server.dsn.replace("postgresql://", "postgresql+pg8000://", 1)
    backend = PostgresBackend(url, table=f"anarchon_loops_{uuid.uuid4().hex[:10]}")
    counts = []
    for cycle in range(45):
        async with Lease(backend, "loops", ttl="5s"):
            pass
        if cycle in (4, 44):
            counts.append(_anyio_primitives())
    assert counts[1] - counts[0] < 10, f"anyio limiters and locks alive: {counts}"


def test_a_backend_started_on_two_loops_at_once_opens_once(pg16_server: PgServer) -> None:
    """Two event loops in two threads start one backend at once (the sync front ends'
    loop and the application's): the second waits for the first's open, and is woken
    when it ends (its wait was a future of its own loop, resolved from the other thread,
    which did not wake it: it hung), then shares what the first opened."""
    url = pg16_server.dsn.replace("postgresql://", "postgresql+pg8000://", 1)
    opening, go_on = threading.Event(), threading.Event()
    opened = 0

    class Slow(PostgresBackend):
        async def _open(self) -> None:
            nonlocal opened
            opened += 1
            opening.set()
            await anyio.to_thread.run_sync(go_on.wait, 10)
            await super()._open()

    backend = Slow(url, table=f"anarchon_loops_{uuid.uuid4().hex[:10]}")
    results: list[Any] = []

    async def first() -> None:
        await backend.start()
        results.append(await backend.now_ms())

    thread = threading.Thread(target=anyio.run, args=(first,), daemon=True)
    thread.start()
    try:
        assert opening.wait(10)

        async def second() -> None:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(backend.start)
                    await anyio.sleep(0.2)  # the start waits for the other loop's open
                    go_on.set()
                results.append(await backend.now_ms())

        anyio.run(second)
    finally:
        go_on.set()
        thread.join(10)
    assert not thread.is_alive()
    assert opened == 1 and len(results) == 2

    async def close_all() -> None:
        await close_backend(backend)

    anyio.run(close_all)


def test_a_start_on_one_thread_never_returns_while_another_closes_the_backend() -> None:
    """One thread's :meth:`Backend.start` finds the backend open (another user holds it)
    while the last user closes it on another thread: the start must not count itself in
    a backend that closes meanwhile. Its user count is read and changed under the start
    lock; before, the check and the increment came apart (an unlocked read of the lock),
    so the close ran between them and the start returned on a closed backend."""
    from backends.memory import MemoryBackend

    paused, closed = threading.Event(), threading.Event()
    second_thread: list[threading.Thread] = []

    class Counted(MemoryBackend):
        start = Backend.start  # Backend's counting (MemoryBackend counts on its own)
        close = Backend.close
        is_open = False
        reads = 0

        @property
        def _users(self) -> int:  # type: ignore[override]
            if second_thread and threading.current_thread() is second_thread[0]:
                self.reads += 1
                if self.reads == 2:  # after the start's first look: let the close run
                    paused.set()
                    closed.wait(1)  # (with the fix the close waits for the lock: 1 s)
            return int(self.__dict__.get("_users_", 0))

        @_users.setter
        def _users(self, value: int) -> None:
            self.__dict__["_users_"] = value

        async def _open(self) -> None:
            self.is_open = True

        async def _close(self) -> None:
            self.is_open = False

    backend = Counted()
    seen: list[bool] = []

    async def second() -> None:
        await backend.start()
        seen.append(backend.is_open)
        await backend.close()

    async def first() -> None:
        await backend.start()
        thread = threading.Thread(target=anyio.run, args=(second,), daemon=True)
        second_thread.append(thread)
        thread.start()
        assert await anyio.to_thread.run_sync(paused.wait, 10)
        await backend.close()
        closed.set()
        await anyio.to_thread.run_sync(thread.join, 10)

    anyio.run(first)
    assert seen == [True], "a start returned while the last user closed the backend"
    assert backend_users(backend) == 0 and not backend.is_open
