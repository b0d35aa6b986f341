"""Lease and SyncLease (lease_core/lease.py) on every scenario store and both event loops.

The store fixture gives memory, PostgreSQL (direct, and through PgBouncer in transaction
mode) and Redis; the named-lease calls themselves are checked by the conformance suite
(lease_core/testing/lease_checks.py). Every wait has a deadline; the store's clock
decides every expiry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
import sniffio

from adapters.base import CANCEL_GRACE_S
from backends.embedded.redis import EmbeddedRedis
from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import ConfigurationError, Lease, LeaseLost, MemoryBackend, SyncLease
from lease_core.abc import Backend
from lease_core.errors import BackendUnavailable
from lease_core.testing import Store, backend_users, wait_for
from tests.chaos.proxy import Proxy, proxy_in_front, with_port
from tests.helpers import Suspend
from tests.stores.memory import MemoryStore
from tests.stores.postgres import PgServer, PostgresStore, drop_tables, unique_table
from tests.stores.redis import RedisStore, delete_prefix

pytestmark = pytest.mark.anyio

TTL = 0.6  # s: short leases, waited out with deadlines


def _loop() -> str | None:
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None  # sync code (SyncLease runs it on its own asyncio loop)


def url_backend(store: Store, port: int | None = None) -> Backend:
    """A new backend on ``store`` made from its URL (bound to no event loop), through
    127.0.0.1:``port`` when given (a proxy). Memory: the store's one shared object."""
    if isinstance(store, PostgresStore):
        dsn = store.server.dsn
        if port is not None:
            dsn = with_port(dsn, port)
        if _loop() == "trio":  # psycopg's async pool needs asyncio
            dsn = "postgresql+pg8000://" + dsn.split("://", 1)[1]
        return PostgresBackend(dsn, table=store.table)
    if isinstance(store, RedisStore):
        url = store.url if port is None else with_port(store.url, port)
        return RedisBackend(url, prefix=store.prefix)
    assert isinstance(store, MemoryStore) and port is None
    return store.backend()


@asynccontextmanager
async def proxy_to(store: Store) -> AsyncIterator[Proxy]:
    """A pausable TCP proxy in front of the store's server (PostgreSQL, PgBouncer, Redis)."""
    url = store.server.dsn if isinstance(store, PostgresStore) else getattr(store, "url", "")
    port = urlsplit(url).port
    assert port is not None, url
    proxy = Proxy(port)
    await anyio.to_thread.run_sync(proxy.start)
    try:
        yield proxy
    finally:
        proxy.resume()
        await anyio.to_thread.run_sync(proxy.close)


async def test_one_holder_at_a_time_and_the_token_grows(store: Store) -> None:
    a = Lease(store.backend(), "job-x", ttl="10s")
    b = Lease(store.backend(), "job-x", ttl="10s")
    async with a:
        assert a.held and a.token is not None and not a.lost.is_set()
        assert await b.acquire(timeout=0) is False
        assert await b.acquire(timeout=0.2) is False
        assert not b.held
    assert not a.held
    assert await b.acquire(timeout=0) is True
    try:
        assert b.token is not None and b.token > a.token
    finally:
        await b.release()
    tokens = [b.token]
    for lease in (a, b, a):  # every new holder, and the same object again, grows it
        async with lease:
            tokens.append(lease.token)
    assert tokens == sorted(set(tokens)) and len(tokens) == 4


async def test_blocking_acquire_gets_it_when_the_holder_releases(store: Store) -> None:
    holder = Lease(store.backend(), "handoff", ttl="10s", poll="50ms")
    waiter = Lease(store.backend(), "handoff", ttl="10s", poll="50ms")
    calls = 0
    real = waiter.backend.acquire_lease

    async def counted(*args: object) -> object:
        nonlocal calls
        calls += 1
        return await real(*args)  # type: ignore[arg-type]

    await holder.acquire()
    got = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def wait_for_it() -> None:
            waiter.backend.acquire_lease = counted  # type: ignore[method-assign]
            async with waiter:
                got.set()
                await anyio.sleep_forever()

        tg.start_soon(wait_for_it)
        await wait_for(lambda: calls >= 2, timeout=5, what="the waiter to try twice")
        assert not got.is_set()
        await holder.release()
        with anyio.fail_after(5):
            await got.wait()
        assert waiter.token is not None and holder.token is not None
        assert waiter.token > holder.token
        tg.cancel_scope.cancel()
    assert not waiter.held


@pytest.mark.server_timing
async def test_blocking_acquire_gets_it_when_the_holder_ttl_passes(store: Store) -> None:
    backend = store.backend()
    await backend.start()
    try:  # a holder that took the name and died: it never renews
        dead = await backend.acquire_lease("orphan", "dead holder", int(TTL * 1000))
        assert dead.held
        lease = Lease(store.backend(), "orphan", ttl="10s", poll="50ms")
        assert await lease.acquire(timeout=0) is False
        assert await lease.acquire(timeout=10) is True
        try:
            assert lease.token is not None and lease.token > dead.token
            assert await backend.now_ms() >= dead.expires_ms  # by the store's clock
        finally:
            await lease.release()
    finally:
        await backend.close()


async def test_timeout_zero_tries_once(store: Store) -> None:
    a = Lease(store.backend(), "once", ttl="10s")
    b = Lease(store.backend(), "once", ttl="10s")
    calls: list[str] = []
    real = b.backend.acquire_lease

    async def counted(name: str, holder: str, ttl_ms: int) -> object:
        calls.append(holder)
        return await real(name, holder, ttl_ms)

    async with a:
        b.backend.acquire_lease = counted  # type: ignore[method-assign]
        try:
            assert await b.acquire(timeout=0) is False
        finally:
            del b.backend.acquire_lease
    assert calls == [b.holder]


@pytest.mark.server_timing
async def test_renewal_keeps_it_past_the_ttl(store: Store) -> None:
    a = Lease(store.backend(), "kept", ttl=TTL)
    b = Lease(store.backend(), "kept", ttl=TTL)
    probe = store.backend()
    await probe.start()
    try:
        async with a:
            start = await probe.now_ms()

            async def past_three_ttls() -> bool:
                return await probe.now_ms() > start + 3 * TTL * 1000

            await wait_for(past_three_ttls, timeout=10, what="three ttls on the store clock")
            assert a.held and not a.lost.is_set()
            assert await b.acquire(timeout=0) is False
    finally:
        await probe.close()


@pytest.mark.server_timing
async def test_a_process_clock_far_off_changes_nothing(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 365 * 86400.0)  # a year ahead
    a = Lease(store.backend(), "skewed", ttl=TTL)
    b = Lease(store.backend(), "skewed", ttl=TTL, poll="50ms")
    probe = store.backend()
    await probe.start()
    try:
        async with a:
            first = a.token
            start = await probe.now_ms()

            async def past_two_ttls() -> bool:  # only renewals keep it that long
                return await probe.now_ms() > start + 2 * TTL * 1000

            await wait_for(past_two_ttls, timeout=10, what="two ttls on the store clock")
            assert a.held and await b.acquire(timeout=0) is False
    finally:
        await probe.close()
    assert await b.acquire(timeout=5) is True
    try:
        assert b.token is not None and first is not None and b.token > first
    finally:
        await b.release()


async def test_lost_when_the_store_stops_answering_cancels_the_body(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """Renewals that never answer (the store's calls hang): lost after one ttl."""
    lease = Lease(store.backend(), "cut", ttl=TTL)
    cancelled = anyio.Event()
    cut = anyio.Event()
    real = lease.backend.renew_lease

    async def hanging(name: str, token: int, ttl_ms: int) -> int | None:
        if cut.is_set():
            await anyio.sleep_forever()
        return await real(name, token, ttl_ms)

    lease.backend.renew_lease = hanging  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="anarchon")
    try:
        with anyio.fail_after(10), pytest.raises(LeaseLost, match="'cut'"):
            async with lease:
                cut.set()
                try:
                    await anyio.sleep_forever()
                finally:
                    cancelled.set()
    finally:
        del lease.backend.renew_lease
    assert cancelled.is_set() and lease.lost.is_set() and not lease.held
    assert any("was lost" in r.getMessage() for r in caplog.records)
    # it was not released (it may be someone else's by now), and expires on its own
    other = Lease(store.backend(), "cut", ttl="10s")
    assert await other.acquire(timeout=10) is True
    try:
        assert other.token is not None and lease.token is not None
        assert other.token > lease.token
    finally:
        await other.release()


async def test_lost_when_a_renewal_is_refused(store: Store) -> None:
    lease = Lease(store.backend(), "refused", ttl=TTL)

    async def refused(name: str, token: int, ttl_ms: int) -> int | None:
        return None

    await lease.acquire()
    try:
        lease.backend.renew_lease = refused  # type: ignore[method-assign]
        with anyio.fail_after(5):
            await lease.lost.wait()
        assert not lease.held
        assert lease.lost_error is not None and "no longer lists" in str(lease.lost_error)
    finally:
        del lease.backend.renew_lease
        await lease.release()


async def test_lost_through_a_network_partition(store: Store) -> None:
    """A real partition: a proxy that stops forwarding without closing. The body is
    cancelled once the ttl since the last renewal has run out, while the renewal still
    waits for the store: not once the driver gives the call up (``CANCEL_GRACE_S`` after
    that, or its own timeout), seconds after another holder could take the name."""
    if isinstance(store, MemoryStore):
        pytest.skip("the memory store has no network")
    async with proxy_to(store) as proxy:
        lease = Lease(url_backend(store, proxy.port), "partition", ttl=TTL)
        cancelled = anyio.Event()
        paused = ended = 0.0
        with anyio.fail_after(20), pytest.raises(LeaseLost):
            async with lease:
                proxy.pause()
                paused = time.monotonic()
                try:
                    await anyio.sleep_forever()
                finally:
                    ended = time.monotonic()
                    cancelled.set()
                    proxy.resume()
        assert cancelled.is_set() and lease.lost.is_set()
        # a bound of correctness, far from any timing noise: about TTL, against >= 5 s
        assert ended - paused < TTL + CANCEL_GRACE_S / 2
    other = Lease(url_backend(store), "partition", ttl="10s")
    assert await other.acquire(timeout=10) is True
    try:
        assert other.token is not None and lease.token is not None
        assert other.token > lease.token
    finally:
        await other.release()


def test_a_lost_sync_lease_s_with_ends_through_a_partition(pg16_server: PgServer) -> None:
    """The end of ``with SyncLease`` whose lease a partition lost gives its release up
    after min(ttl, 5 s), as ``async with`` does, and raises LeaseLost: through a
    PostgreSQL that stopped answering, it waited as long as the partition lasted
    (minutes), the thread blocked at the end of its body."""
    table = unique_table()
    try:
        with proxy_in_front(pg16_server.dsn) as proxy:
            ended = _with_sync_lease_through_a_partition(
                proxy, PostgresBackend(with_port(pg16_server.dsn, proxy.port), table=table))
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)
    assert isinstance(ended, LeaseLost), ended


def _with_sync_lease_through_a_partition(proxy: Proxy, backend: Backend) -> BaseException:
    """Pause ``proxy`` in the body of ``with SyncLease``; return how the ``with`` ended."""
    lease = SyncLease(backend, "partition", ttl="2s")
    ended: list[BaseException] = []

    def body() -> None:
        try:
            with lease:
                proxy.pause()
                assert lease.lost.wait(20)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(45)  # the ttl, then about 12 s (as async with: see the leases guide)
    assert not thread.is_alive(), "with SyncLease had not ended 45 s into the partition"
    return ended[0]


async def test_sync_lease_excludes_an_async_one_and_reports_a_loss(store: Store) -> None:
    # Sync code has no event loop: its objects are made in the worker thread.
    other = Lease(url_backend(store), "sync", ttl="10s")
    made: list[SyncLease] = []

    def hold_then_check() -> int | None:
        sync = SyncLease(url_backend(store), "sync", ttl="10s")
        made.append(sync)
        with sync as held:
            assert held.held and not held.lost.is_set()
            inside = anyio.from_thread.run(other.acquire, 0)
            assert inside is False
            return held.token

    token = await anyio.to_thread.run_sync(hold_then_check)
    assert token is not None and not made[0].held
    assert await other.acquire(timeout=0) is True
    try:
        assert other.token is not None and other.token > token
    finally:
        await other.release()

    seen: list[bool] = []

    def lose() -> None:
        refusing = url_backend(store)
        lost = SyncLease(refusing, "sync-lost", ttl=TTL)
        made.append(lost)
        with pytest.raises(LeaseLost, match="'sync-lost'"), lost:
            refusing.renew_lease = _refuse  # type: ignore[method-assign]
            seen.append(lost.lost.wait(5))

    await anyio.to_thread.run_sync(lose)
    assert seen == [True] and not made[1].held


async def _refuse(name: str, token: int, ttl_ms: int) -> int | None:
    return None


async def test_a_lease_starts_and_closes_only_its_own_hold_of_the_backend(
        store: Store) -> None:
    backend = store.backend()
    assert backend_users(backend) == 0
    async with Lease(backend, "owned", ttl="10s"):
        assert backend_users(backend) == 1
    assert backend_users(backend) == 0
    await backend.start()  # the owner's own start: a lease leaves it open
    try:
        async with Lease(backend, "owned", ttl="10s"), Lease(backend, "other", ttl="10s"):
            assert backend_users(backend) == 3
        assert backend_users(backend) == 1
        again = Lease(backend, "owned")
        assert await again.acquire(timeout=0) is True
        assert backend_users(backend) == 2
        await again.release()
        assert backend_users(backend) == 1
    finally:
        await backend.close()


async def test_bad_input_is_refused_naming_the_value() -> None:
    backend = MemoryBackend()
    for name in ["", None, 3]:
        with pytest.raises(ConfigurationError, match=f"name={name!r}"):
            Lease(backend, name)  # type: ignore[arg-type]
    for ttl in ["0s", -1, 0, "soon", True]:
        with pytest.raises(ValueError, match=f"ttl={ttl!r}"):
            Lease(backend, "x", ttl=ttl)
    with pytest.raises(ValueError, match="poll=0"):
        Lease(backend, "x", poll=0)
    with pytest.raises(ValueError, match="holder=''"):
        Lease(backend, "x", holder="")
    with pytest.raises(ValueError, match="backend=None"):
        Lease(None, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout=-1 must be 0 or more"):
        await Lease(backend, "x").acquire(timeout=-1)
    # PostgreSQL stores no NUL; the stores' expiry arithmetic holds no ttl of ages.
    with pytest.raises(ValueError, match="NUL"):
        Lease(backend, "a\x00b")
    with pytest.raises(ValueError, match=r"holder='h\\x00'.*NUL"):
        Lease(backend, "x", holder="h\x00")
    with pytest.raises(ValueError, match="longer than 365 days"):
        Lease(backend, "x", ttl=1e17)
    with pytest.raises(ValueError, match=r"^ttl='400d' is longer than 365 days"):
        Lease(backend, "x", ttl="400d")  # named as given, not by its milliseconds
    # a hold lapsing before its renewal could come back: held, then lost at once
    for ttl in ["1ms", 0.099, "99ms"]:
        with pytest.raises(ValueError, match=rf"^ttl={ttl!r} is shorter than 100 ms"):
            Lease(backend, "x", ttl=ttl)
        with pytest.raises(ValueError, match=rf"^ttl={ttl!r} is shorter than 100 ms"):
            SyncLease(backend, "x", ttl=ttl)
    assert Lease(backend, "x", ttl="100ms").ttl == 0.1
    assert backend_users(backend) == 0


async def test_leases_taken_and_released_at_a_high_rate_are_not_all_kept() -> None:
    """A released hold waits in the renewal queue until its renewal would have been due;
    the queue drops them as it grows, so 5,000 leases taken and released within one ttl
    leave far fewer than 5,000 holds alive (each queued hold keeps its Lease too)."""
    import gc

    def queued() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o).__name__ == "_Hold")

    backend = MemoryBackend()
    before = queued()
    for i in range(5000):
        lease = Lease(backend, f"burst-{i % 10}", ttl="60s")
        assert await lease.acquire(timeout=0)
        await lease.release()
    assert queued() - before <= 2100
    held = Lease(backend, "still-held", ttl="1.5s")
    async with held:  # a live hold is still renewed after the compactions
        first = held.token
        holder = await held.current_holder()
        assert holder is not None
        taken = time.monotonic() + holder.expires_in

        async def renewed() -> bool:  # the store's expiry moved past the first one's
            now = await held.current_holder()
            return now is not None and time.monotonic() + now.expires_in > taken + 0.25

        await wait_for(renewed, timeout=10, what="a renewal of the live hold")
        assert held.held and not held.lost.is_set() and held.token == first


async def test_a_release_cancelled_on_its_way_still_frees_the_name(store: Store) -> None:
    """A release is not shielded on its usual path. Cancelled while its call waits for the
    store, or before the call could be sent (trio raises at the first await), it still
    frees the name at once, not after its ttl (a call interrupted is sent again,
    shielded), and closes the lease's start of the backend."""
    if isinstance(store, MemoryStore):
        pytest.skip("the memory store has no network")
    async with proxy_to(store) as proxy:
        backend = url_backend(store, proxy.port)
        lease = Lease(backend, "cancelled-release", ttl="60s")
        assert await lease.acquire(timeout=10) is True
        proxy.pause()  # the release's call waits for an answer that does not come
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lease.release)
                await wait_for(lambda: not lease.held, what="the release to start")
                await anyio.sleep(0.05)  # let its call reach the paused proxy
                tg.cancel_scope.cancel()
                proxy.resume()
        assert backend_users(backend) == 0
    other = Lease(url_backend(store), "cancelled-release", ttl="10s")
    assert await other.acquire(timeout=0) is True
    with anyio.CancelScope() as scope:  # cancelled before its call could be sent
        scope.cancel()
        await other.release()
    assert backend_users(other.backend) == 0
    third = Lease(url_backend(store), "cancelled-release", ttl="10s")
    assert await third.acquire(timeout=0) is True
    await third.release()


async def test_an_acquire_cancelled_on_its_way_leaves_the_name_free(store: Store) -> None:
    """An acquire cancelled while its call waits for the store: the store may still give
    it the name (the call arrives, or a PostgreSQL statement runs to its end), which
    nothing would renew nor release. It is asked again and released, shielded, so the
    name is free at once, not after its 60 s ttl. (Cancelled after its call ended, it
    returns the hold; its caller releases it.)"""
    if isinstance(store, MemoryStore):
        pytest.skip("the memory store has no network")
    async with proxy_to(store) as proxy:
        backend = url_backend(store, proxy.port)
        await backend.start()  # connected before the pause
        try:
            lease = Lease(backend, "cancelled-acquire", ttl="60s")
            proxy.pause()
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lease.acquire, 0)
                    await anyio.sleep(0.05)  # let its call reach the paused proxy
                    tg.cancel_scope.cancel()
                    proxy.resume()
            # A call made in a thread (a sync driver) is not interrupted: it may have
            # ended, and then the acquire returned the hold, for its caller to release.
            if lease.held:
                await lease.release()
            assert not lease.held and backend_users(backend) == 1
        finally:
            await backend.close()
    other = Lease(url_backend(store), "cancelled-acquire", ttl="10s")
    assert await other.acquire(timeout=0) is True
    await other.release()


@pytest.mark.server_timing
async def test_a_stalled_holder_knows_it_lost_the_lease_before_its_keeper_runs(
        store: Store) -> None:
    """A process stalled past the ttl (a long GC, a blocking call, SIGSTOP): the store
    may have given the name to another holder, so the lease is not held any more, even
    before its renewal task wakes to find out."""
    lease = Lease(store.backend(), "stalled", ttl=TTL)
    assert await lease.acquire(timeout=0) is True
    try:
        time.sleep(TTL + 0.2)  # noqa: ASYNC251 - the stall itself: the event loop blocked
        assert not lease.held and lease.lost.is_set()
        assert lease.lost_error is not None and "within the ttl" in str(lease.lost_error)
        assert await lease.acquire(timeout=0) is True  # taken again, with a new token
    finally:
        await lease.release()


async def test_a_body_that_stalled_past_the_ttl_ends_with_lease_lost() -> None:
    """The body blocked the event loop past the ttl (its keeper never ran): the store may
    have given the name to another holder meanwhile, so ``async with`` raises LeaseLost
    at its end, and ``lost`` is set."""
    backend = MemoryBackend()
    lease = Lease(backend, "stall-in-body", ttl=0.2)
    with pytest.raises(LeaseLost, match="within the ttl"):
        async with lease:
            time.sleep(0.5)  # noqa: ASYNC251 - the stall itself: the event loop blocked
    assert lease.lost.is_set() and backend_users(backend) == 0


#: ``clock_gettime`` and the clock ids each platform's :mod:`time` has (their values are
#: the platform's own: macOS's CLOCK_MONOTONIC is 6).
_CLOCKS = {"linux": {"clock_gettime": True, "CLOCK_MONOTONIC": 1, "CLOCK_BOOTTIME": 7},
           "darwin": {"clock_gettime": True, "CLOCK_MONOTONIC": 6, "CLOCK_UPTIME_RAW": 8},
           "darwin-10.11": {"CLOCK_MONOTONIC": 6},  # built for 10.12, run on an older one
           "win32": {},
           "freebsd14": {"clock_gettime": True, "CLOCK_MONOTONIC": 4}}


@pytest.mark.parametrize(("platform", "expected"), [
    ("linux", 7), ("darwin", 6), ("darwin-10.11", None), ("win32", None), ("freebsd14", None)])
def test_the_lease_clock_is_one_that_counts_a_suspend_on_each_platform(
        monkeypatch: pytest.MonkeyPatch, platform: str, expected: int | None) -> None:
    """Linux: CLOCK_BOOTTIME; macOS: CLOCK_MONOTONIC, which counts a suspend there (not
    CLOCK_UPTIME_RAW, which does not); where ``clock_gettime`` is missing (Windows, whose
    monotonic counter counts a suspend; a macOS too old for it) or no clock counts a
    suspend, ``time.monotonic()``: the module imports and the lease clock runs on every
    platform."""
    from lease_core import _lease_clock

    clocks = SimpleNamespace(**_CLOCKS[platform])
    chosen = _lease_clock.clock_id(clocks, platform.split("-")[0])
    assert chosen == expected
    monkeypatch.setattr(_lease_clock, "_ID", chosen)
    monkeypatch.setattr(time, "monotonic", lambda: -1.0)
    monkeypatch.setattr(time, "clock_gettime", lambda clock: float(clock))
    assert _lease_clock.lease_clock() == (-1.0 if expected is None else expected)


_RECORDING_LOOPS = textwrap.dedent("""
    import asyncio, sys
    made = []
    class Recording(asyncio.SelectorEventLoop):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)
    asyncio.SelectorEventLoop = Recording
    from lease_core import MemoryBackend, SyncLease
    from lease_core.cli import main
    sys.platform = "win32"
    assert main(["status", "--url", "memory://"]) == 0
    assert len(made) == 1, made
    with SyncLease(MemoryBackend(), "x", ttl="5s"):
        assert len(made) == 2, made
""")


def test_on_windows_the_loops_the_library_starts_are_selector_loops() -> None:
    """Windows' default asyncio loop, the ``ProactorEventLoop``, is one psycopg's async
    connections refuse ("Psycopg cannot use the 'ProactorEventLoop'"): every command of
    ``anarchon`` on PostgreSQL through psycopg (``postgresql://``) failed there as "cannot
    reach PostgreSQL", and so did the sync API (SyncScheduler, SyncLease), whose loop the
    library starts. Both start a selector loop on Windows (simulated: ``sys.platform``,
    a recording loop class)."""
    out = subprocess.run([sys.executable, "-c", _RECORDING_LOOPS], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


async def test_a_lease_is_lost_soon_after_the_machine_resumes_from_a_suspend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine was suspended for longer than the ttl (a laptop's lid closed, a VM
    paused): the store's clock ran on and gave the name away, but the process's
    ``time.monotonic()`` and its event loop's timers did not count the suspend. The
    lease counts it (``CLOCK_BOOTTIME``): it is not ``held`` at once, and its body is
    cancelled within seconds, not when its next renewal (20 s away) falls due. The
    suspend is stood in for by shifting ``time.clock_gettime`` and the store's clock."""
    suspend = Suspend(monkeypatch)
    backend = MemoryBackend(clock=suspend.store_clock)
    lease = Lease(backend, "suspended", ttl="60s")
    with pytest.raises(LeaseLost, match="within the ttl"):
        async with lease:
            suspend.slept = 120.0  # resumed: two ttls passed on the store's clock
            other = Lease(backend, "suspended", ttl="60s")
            assert await other.acquire(timeout=0) is True  # the store gave it away
            assert not lease.held
            await other.release()
    lease = Lease(backend, "suspended-keeper", ttl="60s")
    with pytest.raises(LeaseLost, match="was lost"):
        async with lease:
            suspend.slept = 240.0
            with anyio.fail_after(10):  # the body is cancelled by the renewal task
                await anyio.sleep_forever()
    assert backend_users(backend) == 0


async def test_an_acquire_answered_after_the_ttl_is_not_a_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The process froze between the store's answer to an acquire and reading it, for
    longer than the ttl (a suspend, SIGSTOP, a long GC), and the store gave the name to
    another holder meanwhile. ``acquire`` returned True (with ``held`` False) and
    ``async with`` ran its body, up to its first await, beside the other holder. The
    late hold is not taken: ``acquire(timeout=0)`` is False, and a blocking one waits
    for the other holder. The freeze is stood in for by shifting the clocks."""
    suspend = Suspend(monkeypatch)
    late = [2]  # the next acquires of holders other than "other" answered late

    class Late(MemoryBackend):
        async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> Any:
            answer = await super().acquire_lease(name, holder, ttl_ms)
            if holder != "other" and late[0]:
                late[0] -= 1
                suspend.slept += 120.0  # two ttls, after the store answered
                assert (await super().acquire_lease(name, "other", 60_000)).held
            return answer

    backend = Late(clock=suspend.store_clock)
    lease = Lease(backend, "late", ttl="60s")
    assert await lease.acquire(timeout=0) is False
    assert not lease.held
    body: list[int | None] = []
    async with anyio.create_task_group() as tg:
        async def enter() -> None:
            async with Lease(backend, "late-body", ttl="60s", poll=0.05) as held:
                body.append(held.token)

        tg.start_soon(enter)
        await wait_for(lambda: not late[0], timeout=5, what="the late answer")
        await anyio.sleep(0.2)  # a few polls, all refused: "other" holds the name
        assert body == []
        await backend.release_lease("late-body", 2)
        await wait_for(lambda: body, timeout=5, what="the body, once the name is free")
    assert body[0] is not None and body[0] > 2
    assert backend_users(backend) == 0


async def test_a_renewal_answered_late_counts_the_hold_from_when_it_was_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The process froze between the store's answer to a renewal and reading it (a
    suspend, SIGSTOP, a long GC): the renewed hold ends a ttl after the renewal was sent,
    as the store's does, not a ttl after the answer was read. Counted from the read, the
    lease said ``held`` for as long as the freeze past the store's expiry, with the name
    free for another holder. The freeze is stood in for by shifting the clocks; later
    renewals never answer."""
    suspend = Suspend(monkeypatch)
    renewals: list[int | None] = []

    class Late(MemoryBackend):
        async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
            if renewals:
                await anyio.sleep_forever()  # the next renewal is never answered
            expires = await super().renew_lease(name, token, ttl_ms)
            suspend.slept += 42.0  # frozen for 0.7 ttl, after the store answered
            # (read by the lease before anything else runs: it awaits nothing until then)
            renewals.append(expires)
            return expires

    backend = Late(clock=suspend.store_clock)
    lease = Lease(backend, "late-renewal", ttl="60s")
    assert await lease.acquire(timeout=0)
    suspend.slept += 20.0  # a third of the ttl: the renewal is due
    await wait_for(lambda: renewals, timeout=10, what="the late renewal read")
    assert renewals[0] is not None
    assert lease.held  # 42 s after the renewal was sent: live in the store too
    suspend.slept += 24.0  # 66 s after it was sent: expired in the store
    assert (await backend.acquire_lease("late-renewal", "other", 60_000)).held
    assert not lease.held and lease.lost.is_set()
    await lease.release()
    assert backend_users(backend) == 0


async def test_a_renewal_the_store_never_answers_loses_the_lease_at_its_ttl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal sent to a store that then answers nothing, through a driver call that a
    cancellation does not interrupt mid-statement: the hold is lost when its ttl since
    the last renewal sent has passed, on the lease's clock, and the body is cancelled,
    without waiting for the call to give up. The passing time is stood in for by
    shifting the clocks (a suspend), which the event loop's timers do not count."""
    suspend = Suspend(monkeypatch)
    answer = anyio.Event()
    sent: list[int] = []

    class Hung(MemoryBackend):
        async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
            sent.append(token)
            with anyio.CancelScope(shield=True):  # a driver call not interrupted
                await answer.wait()
            return None

    backend = Hung(clock=suspend.store_clock)
    lease = Lease(backend, "hung-renewal", ttl="60s")
    try:
        with pytest.raises(LeaseLost, match="has not answered yet"):
            async with lease:
                suspend.slept += 20.0  # a third of the ttl: the renewal is due
                await wait_for(lambda: sent, timeout=10, what="the renewal sent")
                suspend.slept += 45.0  # past the ttl since the acquire, still unanswered
                with anyio.fail_after(10):  # cancelled at the hold's deadline
                    await anyio.sleep_forever()
        assert lease.lost.is_set() and not lease.held
    finally:
        answer.set()
    await wait_for(lambda: backend_users(backend) == 0, timeout=10, what="the lease closed")


def test_a_sync_body_that_outlasted_the_ttl_ends_with_lease_lost() -> None:
    """As above for SyncLease, whose renewal runs on a loop of its own: here that loop is
    blocked for 1.5 s (another SyncLease's store call that blocks it) while the body
    runs 0.6 s with a 0.2 s ttl; the body's end finds the hold's deadline passed."""
    import threading

    class Blocking(MemoryBackend):
        async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> Any:
            time.sleep(1.5)  # noqa: ASYNC251 - the stall itself: the loop blocked
            return await super().acquire_lease(name, holder, ttl_ms)

    lease = SyncLease(MemoryBackend(), "stall-in-sync-body", ttl=0.2)
    blocker = SyncLease(Blocking(), "blocker", ttl="10s")
    with pytest.raises(LeaseLost, match="within the ttl"), lease:
        thread = threading.Thread(target=blocker.acquire, args=(0,))
        thread.start()
        time.sleep(0.6)
    thread.join()
    blocker.release()


async def test_the_local_deadline_comes_before_the_store_s_expiry() -> None:
    """The store's expiry is its now in whole ms (rounded down) + the ttl: a holder
    stalled (no await: its keeper cannot renew) until the store's expiry has passed must
    not count itself live, while the store gives the name to another holder."""
    backend = MemoryBackend()
    both = 0
    for trial in range(10):
        name = f"deadline-{trial}"
        a, b = Lease(backend, name, ttl=0.3), Lease(backend, name, ttl="10s")
        assert await a.acquire(timeout=0) is True
        expires = (await backend.acquire_lease(name, "probe", 1000)).expires_ms
        while time.time() * 1000 < expires:  # the stall itself (the store's clock)
            pass
        if await b.acquire(timeout=0) and a.held:
            both += 1
        await b.release()
        await a.release()
    assert both == 0


async def test_a_loss_whose_release_fails_still_raises_lease_lost() -> None:
    """The store stopped answering: renewals fail, the lease is lost and the body
    cancelled; the release fails too, and async with raises LeaseLost (the release's
    error as its cause), as the leader example expects."""
    backend = MemoryBackend()

    async def down(*args: Any) -> Any:
        raise BackendUnavailable("the store does not answer")

    lease = Lease(backend, "down", ttl=0.3)
    with anyio.fail_after(5):
        with pytest.raises(LeaseLost) as lost:
            async with lease:
                backend.renew_lease = down  # type: ignore[method-assign]
                backend.release_lease = down  # type: ignore[method-assign]
                await anyio.sleep_forever()
    assert isinstance(lost.value.__cause__, BackendUnavailable)
    assert backend_users(backend) == 0


async def test_a_release_by_another_task_during_the_body_cancels_it() -> None:
    """Another task releases the lease while the body runs: the body is cancelled and
    async with raises LeaseLost (it ran without the lease from then on)."""
    backend = MemoryBackend()
    lease = Lease(backend, "released-meanwhile", ttl="10s")
    other = Lease(backend, "released-meanwhile", ttl="10s")
    reached = False
    with anyio.fail_after(5):
        with pytest.raises(LeaseLost, match="released while the body"):
            async with lease, anyio.create_task_group() as tg:
                tg.start_soon(lease.release)
                await anyio.sleep_forever()
                reached = True
    assert not reached and lease.lost.is_set()
    assert await other.acquire(timeout=0) is True
    await other.release()
    with pytest.raises(RuntimeError, match="already entered"):
        async with lease, lease:
            pass


@pytest.mark.server_timing
async def test_an_acquire_while_a_lost_async_with_still_runs_is_refused(
        store: Store) -> None:
    """A hold lost while the body of ``async with`` runs (here a stall past the ttl):
    another task's ``acquire()`` of the same Lease, before that ``async with`` ended, is
    refused. It took a new hold, which the ``async with``'s end then released, and that
    end raised no LeaseLost for the body it had cancelled."""
    lease = Lease(store.backend(), "lost-in-body", ttl=TTL)
    entered = anyio.Event()
    ended: list[str] = []

    async def body() -> None:
        try:
            async with lease:
                entered.set()
                await anyio.sleep_forever()
        except LeaseLost:
            ended.append("LeaseLost")
        else:
            ended.append("no error")

    refused: RuntimeError | None = None
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(body)
            await entered.wait()
            time.sleep(TTL + 0.2)  # noqa: ASYNC251 - the stall itself: the loop blocked
            assert not lease.held  # lost: the body is cancelled, its `async with` not over
            try:
                await lease.acquire(timeout=0)
            except RuntimeError as exc:
                refused = exc
    assert ended == ["LeaseLost"] and not lease.held
    assert refused is not None and "lost `async with` body runs" in str(refused)
    assert await lease.acquire(timeout=0) is True  # after the end: taken anew
    await lease.release()


def test_a_release_by_another_thread_during_a_sync_body_raises_at_its_end() -> None:
    import threading

    backend = MemoryBackend()
    lease = SyncLease(backend, "sync-released-meanwhile", ttl="10s")
    with pytest.raises(LeaseLost, match="released while the body"), lease:
        thread = threading.Thread(target=lease.release)
        thread.start()
        thread.join()
        assert lease.lost.is_set()


def test_a_forked_child_neither_hangs_nor_releases_the_parent_s_lease(tmp_path: Path) -> None:
    """A child forked after the parent used a SyncLease: it exits normally (the parent's
    loop thread is not in it), uses a SyncLease of its own, and never releases the
    parent's hold."""
    script = tmp_path / "fork.py"
    script.write_text("""
import os, sys
from lease_core import MemoryBackend, SyncLease
backend = MemoryBackend()
parent = SyncLease(backend, "parent", ttl="10s")
assert parent.acquire(timeout=0)
warm = SyncLease(backend, "warm", ttl="10s")
assert warm.acquire(timeout=0)
warm.release()
pid = os.fork()
if pid == 0:
    mine = SyncLease(backend, "child", ttl="10s")  # the child's copy of the store
    assert mine.acquire(timeout=0)
    mine.release()
    sys.exit(0)  # the interpreter's exit: atexit, then the collection of the loop objects
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert parent.held
parent.release()
print("ok")
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.stdout, done.stderr)


def _run_fork_script(script: Path, server: EmbeddedRedis) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (which forks) with the server's URL and a fresh key prefix, deleted
    after it; it must exit cleanly."""
    prefix = f"fork_{uuid.uuid4().hex[:10]}"
    try:
        done = subprocess.run([sys.executable, str(script), server.url, prefix],
                              capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parent.parent)
    finally:
        delete_prefix(server.url, prefix)
    assert done.returncode == 0, done.stderr
    return done


def test_an_async_lease_in_a_forked_child_refuses_the_parent_s_open_backend(
        redis62_server: EmbeddedRedis, tmp_path: Path) -> None:
    """A forked child that calls a Lease through a backend its parent holds open (its
    connections are the parent's) gets a RuntimeError naming the fork; it went through
    the parent's client ("attached to a different loop"), breaking the parent's
    connection. The parent's hold is untouched."""
    script = tmp_path / "forked.py"
    script.write_text("""
import os, sys
import anyio
from backends.redis import RedisBackend
from lease_core import Lease
backend = RedisBackend(sys.argv[1], prefix=sys.argv[2])
held = Lease(backend, "parent", ttl="60s")

async def parent():
    assert await held.acquire(timeout=0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, b"ready")
        os._exit(0)
    os.waitpid(pid, 0)
    return os.read(read, 5)

async def child():
    try:
        await Lease(backend, "other", ttl="60s").current_holder()
    except RuntimeError as exc:
        return str(exc)
    return "no error"

assert anyio.run(parent) == b"ready"
read, write = os.pipe()
pid = os.fork()  # the backend is still open (the hold, lost with its loop, counted)
if pid == 0:
    os.write(write, anyio.run(child).encode()[:300])
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 300).decode())
""")
    done = _run_fork_script(script, redis62_server)
    assert "is a fork of the one that opened it" in done.stdout, done.stdout


def test_leases_made_before_a_fork_are_not_shared_by_the_children(
        redis62_server: EmbeddedRedis, tmp_path: Path) -> None:
    """A Lease or SyncLease made before a fork (at import, in an app server that forks
    its workers from a preloaded parent) is copied into every child with its holder id.
    The store gives a live hold back to its holder, so every child held the name at once,
    with one token. Each child's copy takes an id of its own: one child holds it. And a
    child forked while the parent holds a Lease does not see it as held."""
    # The processes share the store: Redis stands for all (a subprocess, on no loop here).
    script = tmp_path / "preload.py"
    script.write_text("""
import os, sys
import anyio
from backends.redis import RedisBackend
from lease_core import Lease, SyncLease
url, prefix = sys.argv[1], sys.argv[2]
lease = Lease(RedisBackend(url, prefix=prefix), "preloaded", ttl="60s")
sync = SyncLease(RedisBackend(url, prefix=prefix), "preloaded-sync", ttl="60s")
taken = []
for _ in range(3):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker: takes both, and exits holding what it got (no release)
        got = anyio.run(lease.acquire, 0)
        os.write(write, f"{int(got)}{int(sync.acquire(timeout=0))}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    taken.append(os.read(read, 2).decode())

async def parent():
    held = Lease(RedisBackend(url, prefix=prefix), "parent", ttl="60s")
    assert await held.acquire(timeout=0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, b"1" if held.held else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    seen = os.read(read, 1).decode()
    assert held.held
    await held.release()
    return seen

print(" ".join(taken), anyio.run(lease.acquire, 0), anyio.run(parent))
""")
    done = _run_fork_script(script, redis62_server)
    # one worker took each name; the parent's copy is another holder again; the child
    # forked while the parent held a lease did not see it as held
    assert done.stdout.split() == ["11", "00", "00", "False", "0"], done.stdout


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_lease_held_when_its_event_loop_ends_is_lost(loop: str) -> None:
    """Nothing renews a lease once its loop ended: it reports itself lost, not held."""
    async def leave_held() -> Lease:
        lease = Lease(MemoryBackend(), "loop-ends", ttl="10s")
        assert await lease.acquire(timeout=0) is True
        return lease

    lease = anyio.run(leave_held, backend=loop)
    assert not lease.held
    assert lease.lost_error is not None and "renewal task ended" in str(lease.lost_error)

    async def leave_renewing() -> Lease:  # its renewal in flight (a store that hangs)
        backend = MemoryBackend()
        renewing = anyio.Event()

        async def hang(name: str, token: int, ttl_ms: int) -> int | None:
            renewing.set()
            await anyio.sleep_forever()
            return None

        backend.renew_lease = hang  # type: ignore[method-assign]
        lease = Lease(backend, "loop-ends", ttl="3s")
        assert await lease.acquire(timeout=0) is True
        with anyio.fail_after(5):
            await renewing.wait()
        return lease

    lease = anyio.run(leave_renewing, backend=loop)
    assert lease.lost_error is not None and "renewal task ended" in str(lease.lost_error)


def test_an_interrupted_sync_acquire_leaves_nothing_behind() -> None:
    """Ctrl-C (here a signal's exception) in a blocking SyncLease.acquire(): the acquire
    on the background loop is cancelled and its start of the backend closed, so it can
    take no hold later that nobody would release."""
    import os
    import signal
    import threading

    backend = MemoryBackend()
    holder = SyncLease(backend, "interrupted", ttl="10s")
    waiter = SyncLease(backend, "interrupted", ttl="10s", poll="50ms")

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGUSR1, not SIGALRM: pytest-timeout's guard uses that one.
    previous = signal.signal(signal.SIGUSR1, interrupt)
    assert holder.acquire(timeout=0) is True
    later = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        later.start()
        with pytest.raises(KeyboardInterrupt):
            waiter.acquire()  # blocks: the holder keeps the name
    finally:
        later.cancel()
        signal.signal(signal.SIGUSR1, previous)
        holder.release()
    assert not waiter.held and backend_users(backend) == 0
    other = SyncLease(backend, "interrupted", ttl="10s")
    assert other.acquire(timeout=0) is True
    other.release()


def test_an_interrupt_as_a_sync_acquire_wins_releases_the_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C landing just as the background acquire returned True: the hold it won is
    released, not renewed on the background loop with nobody to release it."""
    import concurrent.futures

    from lease_core import _sync_lease as lease_module

    portal = lease_module._Loop.get()
    real_start = portal.start_task_soon

    def start_task_soon(fn: Any, *args: Any, **kw: Any) -> Any:
        future = real_start(fn, *args, **kw)
        if getattr(fn, "__name__", "") == "acquire":
            def result(timeout: float | None = None) -> Any:
                concurrent.futures.wait([future])  # the acquire ended on the loop...
                raise KeyboardInterrupt  # ... as the signal's handler ran
            future.result = result
        return future

    backend = MemoryBackend()
    lease = SyncLease(backend, "interrupted-as-won", ttl="10s")
    monkeypatch.setattr(portal, "start_task_soon", start_task_soon)
    with pytest.raises(KeyboardInterrupt):
        lease.acquire()
    monkeypatch.setattr(portal, "start_task_soon", real_start)
    assert not lease.held and backend_users(backend) == 0
    other = SyncLease(backend, "interrupted-as-won", ttl="10s")
    assert other.acquire(timeout=0) is True
    other.release()


async def test_a_release_during_another_tasks_acquire_makes_it_give_up(store: Store) -> None:
    """A task waits in acquire() (the name is held) while another releases the same
    Lease, at shutdown say: the acquire gives up, holding nothing, before release()
    returns, so it cannot take the name later with nobody left to release it. A second
    acquire() of the same object at the same time is refused by name."""
    holder = Lease(store.backend(), "given-up", ttl="10s")
    waiter = Lease(url_backend(store), "given-up", ttl="10s", poll="50ms")
    assert await holder.acquire(timeout=0) is True
    results: list[bool] = []

    async def wait_for_it() -> None:
        results.append(await waiter.acquire())

    shared = int(waiter.backend is holder.backend)  # memory: one backend for all
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_it)
            await wait_for(lambda: backend_users(waiter.backend) == 1 + shared,
                           what="the waiter's acquire under way")
            with pytest.raises(RuntimeError, match="already running in another task"):
                await waiter.acquire(timeout=0)
            with anyio.fail_after(10):
                await waiter.release()
            assert results == [False] and not waiter.held
            assert backend_users(waiter.backend) == shared
    finally:
        await holder.release()
    other = Lease(store.backend(), "given-up", ttl="10s")
    assert await other.acquire(timeout=0) is True
    await other.release()


async def test_a_lease_released_twice_at_once_lets_go_of_the_backend_once(
        store: Store) -> None:
    """Two tasks releasing one lease together (an explicit release beside the end of
    ``async with``) take one user off a shared backend, not two, so its owner's start
    still holds it open."""
    backend = store.backend()
    await backend.start()  # the owner's
    try:
        other = Lease(backend, "released-twice-other", ttl="10s")
        lease = Lease(backend, "released-twice", ttl="10s")
        assert await other.acquire(timeout=0) and await lease.acquire(timeout=0)
        assert backend_users(backend) == 3
        async with anyio.create_task_group() as tg:
            tg.start_soon(lease.release)
            tg.start_soon(lease.release)
        assert backend_users(backend) == 2
        await other.release()
        assert backend_users(backend) == 1
    finally:
        await backend.close()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_leases_taken_and_released_one_by_one_wake_the_keeper_rarely() -> None:
    """The renewal keeper drops released holds ahead of the first live one when it wakes,
    rather than waking for each when its renewal would have been due: 50 leases taken and
    released 2 ms apart (their renewals due 1 s later, within 0.1-1 s of each other as the
    machine is busy) wake it a few times, not 50 (counted with trio's instruments: the
    steps of the keeper's task)."""
    import trio

    class Steps(trio.abc.Instrument):
        count = 0

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            if task.name == "anarchon-lease-keeper":
                Steps.count += 1

    trio.lowlevel.add_instrument(Steps())
    backend = MemoryBackend()
    last = None
    for _ in range(50):
        lease = Lease(backend, "one-by-one", ttl=3)
        assert await lease.acquire(timeout=0)
        await lease.release()
        last = time.monotonic()
        await anyio.sleep(0.002)
    assert last is not None
    await anyio.sleep(max(0.0, last + 3 / 3 + 0.1 - time.monotonic()))  # all now due
    assert Steps.count <= 8, Steps.count


def _example(name: str) -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "docs" / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.server_timing
async def test_the_leader_election_example_hands_the_lead_over(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    example = _example("leader_election")
    leading: list[int] = []
    step_down = anyio.Event()

    async def lead(lease: Lease) -> None:
        assert lease.token is not None
        leading.append(lease.token)
        if len(leading) == 1:
            await step_down.wait()  # the first leader leads until told to stop

    monkeypatch.setattr(example, "lead", lead)
    served: list[list[int]] = []

    async def elector() -> None:
        served.append(await example.elect(store.backend(), "example-leader", ttl="10s",
                                          terms=1))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(elector)
            tg.start_soon(elector)
            await wait_for(lambda: leading, what="a leader")
            probe = Lease(store.backend(), "example-leader")
            assert await probe.acquire(timeout=0) is False  # it is held
            assert len(leading) == 1  # and the other elector waits
            step_down.set()
    assert len(leading) == 2 and leading[1] > leading[0]
    assert sorted(served) == sorted([[leading[0]], [leading[1]]])


async def test_the_leader_election_example_stands_by_through_a_store_outage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby whose store stops answering for a while (a Redis restart) keeps waiting
    and leads once the store is back: the loop "for the life of the process" must not
    end at the first store error (it raised BackendUnavailable out of elect())."""
    from backends.embedded.redis import find_server
    from tests.stores import missing_service

    binary = find_server("system")
    if binary is None:
        missing_service("a system redis-server")
    example = _example("leader_election")
    leading: list[int] = []

    async def lead(lease: Lease) -> None:
        assert lease.token is not None
        leading.append(lease.token)

    monkeypatch.setattr(example, "lead", lead)
    failures = 0
    server = EmbeddedRedis(binary)
    await anyio.to_thread.run_sync(server.start)
    try:
        standby = RedisBackend(server.url, prefix="outage")
        real = standby.acquire_lease

        async def counted(*args: Any) -> Any:
            nonlocal failures
            try:
                return await real(*args)
            except BackendUnavailable:
                failures += 1
                raise

        monkeypatch.setattr(standby, "acquire_lease", counted)
        holder = Lease(RedisBackend(server.url, prefix="outage"), "leader", ttl="10s")
        assert await holder.acquire(timeout=0)
        served: list[list[int]] = []

        async def elector() -> None:
            served.append(await example.elect(standby, "leader", ttl="10s", terms=1))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(elector)
                await anyio.to_thread.run_sync(server.stop)  # the store goes away
                await wait_for(lambda: failures >= 2, what="the standby to find it down")
                await anyio.to_thread.run_sync(server.start)  # (without its data)
                await wait_for(lambda: served, timeout=20, what="the standby to lead")
        assert leading and served == [leading]
        with contextlib.suppress(LeaseLost, BackendUnavailable):
            await holder.release()
    finally:
        await anyio.to_thread.run_sync(server.close)


# (the first loop ends with the backend's connections open, as the scenario has it: their
# sockets are reported unclosed when collected)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("server", ["valkey8_server", "pg16_server"])
def test_a_lease_left_held_when_its_loop_ended_is_acquired_on_the_next_loop(
        server: str, request: pytest.FixtureRequest) -> None:
    """One Lease (and its backend, made from a URL) used by one ``asyncio.run`` after
    another, as a CLI or a test suite does: left held when its loop ended, it is lost,
    and the next loop's acquire takes the name again (it raised RuntimeError("Event loop
    is closed") from the lost hold's release through the closed loop's client)."""
    import asyncio
    import gc

    table = unique_table()
    found = request.getfixturevalue(server)
    if isinstance(found, EmbeddedRedis):
        backend: Backend = RedisBackend(found.url, prefix=table)
    else:
        backend = PostgresBackend(found.dsn, table=table)
    lease = Lease(backend, "cli", ttl="10s")
    tokens: list[int | None] = []

    async def take(lease: Lease, release: bool) -> None:
        assert await lease.acquire(timeout=5)
        tokens.append(lease.token)
        if release:
            await lease.release()

    try:
        asyncio.run(take(lease, release=False))  # held when the loop ends: lost
        gc.collect()  # (the closed loop's sockets reported here, not in a later test)
        assert not lease.held and lease.lost_error is not None
        asyncio.run(take(lease, release=True))  # the same holder takes it back
        assert len(tokens) == 2 and None not in tokens
        assert backend_users(backend) == 0
        asyncio.run(take(lease, release=False))  # left held again; then released on a
        gc.collect()  # new loop: a courtesy that fails through the old loop's client,
        asyncio.run(lease.release())  # logged, not raised (it raised RuntimeError)
        assert backend_users(backend) == 0 and not lease.held
        asyncio.run(take(lease, release=True))
        assert len(tokens) == 4 and tokens == sorted(set(tokens))
        assert backend_users(backend) == 0
    finally:
        if not isinstance(found, EmbeddedRedis):
            asyncio.run(drop_tables(found.admin_dsn, table))
        # The first loop's client (its sockets, closed on a closed loop, are left
        # unclosed): collected here, so it is not reported in a later test.
        del lease, backend
        gc.collect()


def _exit_holding(backend: str, ttl: str) -> None:
    """Run a process that takes SyncLease 'x' on ``backend`` (its Python expression) and
    exits holding it; check that it held it and exited cleanly."""
    code = ("from lease_core import MemoryBackend, RedisBackend, SyncLease\n"
            f"lease = SyncLease({backend}, 'x', ttl={ttl!r})\n"
            "assert lease.acquire(0)\n"
            "print('held', lease.held)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "held True"


def test_a_process_exits_while_a_sync_lease_is_held() -> None:
    """The SyncLease loop is stopped at interpreter exit, whatever it still runs."""
    _exit_holding("MemoryBackend()", "10s")


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_through_pgbouncer_on_trio(pgbouncer_server: PgServer) -> None:
    """The store matrix has PgBouncer on asyncio only: trio here, through pg8000."""
    table = unique_table()
    dsn = "postgresql+pg8000://" + pgbouncer_server.dsn.split("://", 1)[1]
    probe = PostgresBackend(dsn, table=table)
    await probe.start()
    try:
        a = Lease(PostgresBackend(dsn, table=table), "bouncer", ttl=TTL)
        b = Lease(PostgresBackend(dsn, table=table), "bouncer", ttl=TTL, poll="50ms")
        async with a:
            start = await probe.now_ms()

            async def past_two_ttls() -> bool:  # only renewals keep it that long
                return await probe.now_ms() > start + 2 * TTL * 1000

            await wait_for(past_two_ttls, timeout=10, what="two ttls on the store clock")
            assert a.held and await b.acquire(timeout=0) is False
        assert await b.acquire(timeout=5) is True
        try:
            assert b.token is not None and a.token is not None and b.token > a.token
        finally:
            await b.release()
    finally:
        await probe.close()
        await drop_tables(pgbouncer_server.admin_dsn, table)


async def test_async_with_given_up_by_a_release_raises_and_skips_the_body() -> None:
    """A task waiting in ``async with`` (the name is held) whose Lease another task
    releases: the wait gives up, and the body never runs without the lease."""
    backend = MemoryBackend()
    holder = Lease(backend, "given-up-with", ttl="10s")
    waiter = Lease(backend, "given-up-with", ttl="10s", poll="50ms")
    assert await holder.acquire(timeout=0)
    ran: list[bool] = []
    raised: list[BaseException] = []

    async def enter() -> None:
        try:
            async with waiter:
                ran.append(waiter.held)
        except LeaseLost as exc:
            raised.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(enter)
            await wait_for(lambda: backend_users(backend) == 2,
                           what="the waiter's acquire under way")
            with anyio.fail_after(10):
                await waiter.release()
    finally:
        await holder.release()
    assert ran == [] and len(raised) == 1
    assert "released while this holder waited" in str(raised[0])


def test_sync_with_survives_a_refused_second_acquire_and_gives_up_on_release() -> None:
    """Thread A waits in ``with lease:``; thread B's acquire() of the same object is
    refused by name and leaves A waiting (it used to release, and A's body ran without
    the lease); B's release() then makes A's ``with`` raise, its body never run."""
    import threading

    backend = MemoryBackend()
    holder = SyncLease(backend, "sync-given-up", ttl="10s")
    waiter = SyncLease(backend, "sync-given-up", ttl="10s", poll="50ms")
    assert holder.acquire(timeout=0)
    outcome: list[object] = []

    def enter() -> None:
        try:
            with waiter:
                outcome.append(("ran", waiter.held))
        except LeaseLost as exc:
            outcome.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while backend_users(backend) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend_users(backend) == 2, "the waiter's acquire under way"
        with pytest.raises(RuntimeError, match="already running"):
            waiter.acquire(timeout=0)
        assert thread.is_alive()  # still waiting (its body never ran: checked below)
        waiter.release()
        thread.join(10)
    finally:
        holder.release()
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLost), outcome


class _LostAcquireReply(MemoryBackend):
    """A store whose next ``acquire_lease`` is made, then its reply lost."""

    lose = 0

    async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> Any:
        answer = await super().acquire_lease(name, holder, ttl_ms)
        if self.lose:
            self.lose -= 1
            raise ConnectionError("reply lost")
        return answer


async def test_an_acquire_whose_reply_was_lost_leaves_the_name_free() -> None:
    """The store gave the name, the reply failed: the acquire raises, and the hold it
    cannot know of is asked again and released, so the name is free at once, not after
    its ttl."""
    backend = _LostAcquireReply()
    backend.lose = 1
    lease = Lease(backend, "lost-reply", ttl="60s")
    with pytest.raises(ConnectionError, match="reply lost"):
        await lease.acquire(timeout=0)
    assert not lease.held
    other = Lease(backend, "lost-reply", ttl="10s")
    assert await other.acquire(timeout=0) is True
    await other.release()


def test_a_sync_lease_held_at_a_clean_exit_is_released(valkey8_server: Any) -> None:
    """A process that exits holding a SyncLease frees the name then: another holder
    takes it at once, not after its 30 s ttl."""
    import uuid

    url, prefix = valkey8_server.url, f"x{uuid.uuid4().hex[:10]}"
    _exit_holding(f"RedisBackend({url!r}, prefix={prefix!r})", "30s")
    other = SyncLease(RedisBackend(url, prefix=prefix), "x", ttl="10s")
    try:
        assert other.acquire(timeout=0) is True
    finally:
        other.release()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_the_leader_election_example_steps_down_quietly_on_ctrl_c(stop: signal.Signals) -> None:
    """Ctrl-C is how its text says to stop it, SIGTERM how a container runtime does: it
    ends with exit 0, saying it stepped down, and no traceback (a KeyboardInterrupt
    traceback before; SIGTERM killed it holding the lease, for others to wait its ttl)."""
    path = Path(__file__).resolve().parent.parent / "docs" / "examples" / "leader_election.py"
    process = subprocess.Popen([sys.executable, "-u", str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        first = process.stdout.readline()
        assert first.startswith("leading with token "), first
        process.send_signal(stop)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err and out.strip() == "stepped down", (out, err)


def test_a_sync_acquire_on_a_thread_during_the_exit_release_waits_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At interpreter exit the background loop releases the SyncLeases still held; a
    daemon thread's acquire may end just then and record its lease. The record waits for
    the exit's look at the leases (before, it changed the set during that look, which
    raised "Set changed size during iteration" and released none of them)."""
    import threading
    import weakref

    from lease_core import _lease_loop

    loop = _lease_loop._Loop

    class Tracked:
        held = False

    late_thread: list[threading.Thread] = []
    late = Tracked()

    class Looked(weakref.WeakSet[Any]):
        def __iter__(self) -> Any:
            for n, item in enumerate(super().__iter__()):
                if n == 0:  # the exit looks at the leases: a thread's acquire records one
                    thread = threading.Thread(target=loop.track, args=(late,), daemon=True)
                    late_thread.append(thread)
                    thread.start()
                    thread.join(0.3)  # (with the lock it waits for the exit's look)
                yield item

    kept = [Tracked(), Tracked()]
    monkeypatch.setattr(loop, "leases", Looked(kept))
    loop.get()  # the background loop runs
    loop.close()  # what the exit runs: raised before
    late_thread[0].join(5)
    assert late in loop.leases and all(item in loop.leases for item in kept)
