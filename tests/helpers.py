"""Helpers for tests: waiting for a state with a deadline, instances run in tasks,
schedules that cannot fire while a test runs, a memory store that can be unplugged, and
a machine suspend stood in for."""

from __future__ import annotations

import textwrap
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup, TaskStatus

from lease_core import Attempt, BackendUnavailable, MemoryBackend, Scheduler
from lease_core._lease_clock import clock_id
from lease_core._structures import (
    CheckResult,
    ClaimRequest,
    ClaimResult,
    HeartbeatResult,
    Lease,
)
from lease_core.abc import Backend
from lease_core.testing import wait_for

HOUR_MS = 3_600_000


class Suspend:
    """A machine suspend stood in for: ``slept`` seconds added to ``time.clock_gettime``
    (which :func:`~lease_core._lease_clock.lease_clock` reads: ``CLOCK_BOOTTIME`` on Linux,
    ``CLOCK_MONOTONIC`` on macOS) and to :meth:`store_clock`, a memory store's clock; the
    event loop's clock (``time.monotonic``) does not count them, as it does not count a
    real suspend. Skips the test where the lease clock is ``time.monotonic`` (Windows)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        if clock_id() is None:
            pytest.skip("the lease clock is time.monotonic here, as the event loop's")
        self.slept = 0.0
        """Seconds the machine has been suspended so far (set it to suspend)."""
        real = time.clock_gettime
        monkeypatch.setattr(time, "clock_gettime", lambda clock: real(clock) + self.slept)

    def store_clock(self) -> float:
        """The store's clock (epoch seconds), which ran on through the suspend."""
        return time.time() + self.slept

#: The calls a running scheduler makes to its store (a memory backend's ``claim`` is a
#: ``claim_many`` of one). An unplugged store fails them all: it answers nothing, not the
#: checks nor the clock either (a slot whose claim failed after the store answered is
#: claimed whatever comes after it).
STORE_CALLS = frozenset({"now_ms", "check", "claim_many", "heartbeat", "members"})
#: The writes among them: a store that answers reads and refuses writes fails these.
WRITE_CALLS = frozenset({"claim_many", "heartbeat", "members"})


def install_toy_backend(site: Path, source: str, schemes: Mapping[str, str]) -> None:
    """Install a third-party backend into the folder ``site`` (to put on ``sys.path``).

    ``source`` becomes the module ``toy_backend``; a distribution ``toy-backend 1.0`` declares
    each scheme of ``schemes`` in the entry-point group ``anarchon.backends``, loading the
    class of ``toy_backend`` it maps to.
    """
    (site / "toy_backend.py").write_text(textwrap.dedent(source))
    dist = site / "toy_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[anarchon.backends]\n"
        + "".join(f"{scheme} = toy_backend:{name}\n" for scheme, name in schemes.items())
    )


@asynccontextmanager
async def started(backend: Backend) -> AsyncIterator[Backend]:
    """``backend`` held open for the block, whether its scheduler runs or was stopped (a
    backend made from a URL answers only while started)."""
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


async def wait_history(
    scheduler: Scheduler,
    predicate: Callable[[list[Attempt]], Any],
    *,
    job: str | None = None,
    timeout: float = 10.0,
    what: str = "history",
) -> list[Attempt]:
    """Wait until the store's history satisfies ``predicate``; return it."""
    found: list[Attempt] = []

    async def check() -> bool:
        nonlocal found
        async with started(scheduler.backend):
            found = await scheduler.backend.history(job, 1000)
        return bool(predicate(found))

    await wait_for(check, timeout=timeout, what=what)
    return found


async def store_now_ms(backend: Backend) -> int:
    """Read the store's clock through ``backend``, which is started and closed here.

    Pass a backend object of its own (``store.backend()``): the one a scheduler will
    use is started by the scheduler.
    """
    await backend.start()
    try:
        return await backend.now_ms()
    finally:
        await backend.close()


def quiet_offset(now_ms: int, interval_ms: int = HOUR_MS) -> float:
    """An ``offset`` (seconds) that puts ``now_ms`` half an interval from any slot.

    ``every(name, "1h", offset=quiet_offset(now))`` declares a job whose current slot began
    half an hour before ``now`` and whose next slot is half an hour after it: its job
    loop claims nothing while a test runs, whatever the wall-clock time (a plain ``"1h"``
    job fires at the top of every hour, midnight included). Tests that mean a run to
    happen claim the current slot explicitly. ``now_ms`` is the store's clock (see
    :func:`store_now_ms`), which is the clock slots follow.
    """
    return ((now_ms - interval_ms // 2) % interval_ms) / 1000


def quiet_offset_now() -> float:
    """An hourly ``offset`` (seconds) whose slots are at least 15 minutes from now.

    Slots are at :00 when this machine's clock is between :15 and :45 past the hour, at
    :30 otherwise. Unlike :func:`quiet_offset`, the answer only changes at :15 and :45,
    so schedulers of one test that each call it declare the same slots. For stores that
    follow this machine's clock: the servers the suite starts, and a memory backend
    without an injected clock.
    """
    minute = int(time.time()) % 3600 // 60
    return 0.0 if 15 <= minute < 45 else 1800.0


def quiet_cron(now_ms: int) -> str:
    """A daily cron expression (UTC) whose fire times are 11 to 12 hours from ``now_ms``.

    A fixed time such as ``"0 3 * * *"`` fires mid-test when the suite runs across 03:00.
    """
    hour = (now_ms // HOUR_MS + 12) % 24
    return f"0 {hour} * * *"


async def wait_mid_slot(scheduler: Scheduler, interval_ms: int = 1000) -> None:
    """Wait until the store's clock is in the middle of an ``interval_ms`` slot.

    Stopping instances of a job that fires every ``interval_ms`` then races no claim:
    a claim still in flight when an instance stops is handed over unrun, and would show
    up in the history as a run nobody executed.
    """
    low, high = interval_ms * 3 // 10, interval_ms * 6 // 10
    await wait_for(lambda: low <= scheduler.store_now_ms() % interval_ms < high,
                   interval=0.005, what="the middle of a slot")


async def stop_all(instances: list[Instance], grace: float = 0.0) -> None:
    """Stop ``instances`` together (so quickly, and none outlives the others' stop)."""
    async with anyio.create_task_group() as tg:
        for instance in instances:
            tg.start_soon(instance.stop, grace)


class Instance:
    """A scheduler running in its own task, as one process of a fleet would.

    ``crash()`` cancels the task (no hand-over, no finish: like SIGKILL for the store);
    ``stop(grace)`` stops it gracefully.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._scope = anyio.CancelScope()
        self._stop = anyio.Event()
        self._done = anyio.Event()
        self._grace = 0.0

    async def start(self, tg: TaskGroup) -> Instance:
        """Start the scheduler in a new task of ``tg``; return once it has started."""
        await tg.start(self._run)
        return self

    async def _run(self, *, task_status: TaskStatus[None]) -> None:
        try:
            with self._scope:
                async with self.scheduler:
                    task_status.started()
                    await self._stop.wait()
                    await self.scheduler.stop(grace=self._grace)
        finally:
            self._done.set()

    def crash(self) -> None:
        """Cancel the instance's task: nothing is handed over or finished."""
        self._scope.cancel()

    async def stop(self, grace: float = 0.0) -> None:
        """Stop the scheduler gracefully and wait for it."""
        self._grace = grace
        self._stop.set()
        await self._done.wait()

    async def wait_done(self) -> None:
        """Wait until the instance's task ended."""
        await self._done.wait()


def run_job_once(url: str, job: str, **options: str) -> None:
    """One run of ``job`` recorded in the store at ``url`` (``namespace=...`` and so on)."""
    from lease_core import backend_from_url

    async def main_() -> None:
        done = anyio.Event()
        s = Scheduler(backend_from_url(url, **options), lease="3s", heartbeat="0.2s")

        @s.every(job, "0.2s")
        async def handler(ctx: object) -> None:
            done.set()

        with anyio.fail_after(30):
            async with s:
                await done.wait()

    anyio.run(main_)


class FailsOnce:
    """What :func:`fail_once` did: ``failed`` is set once the call failed."""

    def __init__(self) -> None:
        self.failed = False


def fail_once(backend: Any, call: str, *, applied: bool = False,
              when: Callable[[Any], bool] | None = None,
              message: str = "the connection dropped (test)") -> FailsOnce:
    """Make the first ``call`` of ``backend`` (an instance's method replaced) raise
    ``BackendUnavailable(message)``: before the store applied it, as a store out of reach;
    or, with ``applied``, after (its answer lost with the connection), and then only for a
    call whose answer ``when`` accepts. The calls after it go through."""
    inner = getattr(backend, call)
    state = FailsOnce()

    async def failing(*args: Any, **kwargs: Any) -> Any:
        if state.failed:
            return await inner(*args, **kwargs)
        if not applied:
            state.failed = True
            raise BackendUnavailable(message)
        answer = await inner(*args, **kwargs)
        if when is not None and not when(answer):
            return answer
        state.failed = True
        raise BackendUnavailable(message)

    setattr(backend, call, failing)
    return state


class Unplugged(MemoryBackend):
    """A memory backend whose calls named in ``fails`` raise while ``down`` is set, as a
    store out of reach (or one that refuses some of them) does.

    ``down`` is ``False`` while the store answers; ``True`` or ``BackendUnavailable``
    makes the calls raise ``BackendUnavailable(message)``, any other exception class
    makes them raise that (an unexpected error, as a driver's bug). ``fails`` names the
    calls that raise: every call of :data:`STORE_CALLS` unless told otherwise,
    :data:`WRITE_CALLS` for a store that answers reads and refuses writes, or only
    ``claim_many`` (which ``claim`` goes through) for one whose claims do not get
    through. The slots of the claims that raised are kept in ``failed_claims``, in order.
    """

    def __init__(self, fails: Collection[str] = STORE_CALLS,
                 message: str = "store unreachable (test)") -> None:
        super().__init__()
        self.down: bool | type[Exception] = False
        self.fails = frozenset(fails)
        self.message = message
        self.failed_claims: list[int] = []

    def _fail(self, call: str, slots: Iterable[int] = ()) -> None:
        if not self.down or call not in self.fails:
            return
        self.failed_claims += slots
        if isinstance(self.down, bool) or self.down is BackendUnavailable:
            raise BackendUnavailable(self.message)
        raise self.down("driver bug (test)")

    async def now_ms(self) -> int:
        self._fail("now_ms")
        return await super().now_ms()

    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        self._fail("check")
        return await super().check(runs)

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        self._fail("claim_many", [r.slot for r in requests])
        return await super().claim_many(requests)

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        self._fail("heartbeat")
        return await super().heartbeat(leases)

    async def members(self, instance_id: str, ttl_ms: int) -> list[str]:
        self._fail("members")
        return await super().members(instance_id, ttl_ms)
