"""scheduler.health(): whether the store answers, and what the instance holds."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from backends.embedded.postgres import EmbeddedPostgres
from lease_core import (
    BackendUnavailable,
    Health,
    MemoryBackend,
    PostgresBackend,
    RunContext,
    Scheduler,
    SchedulerState,
)
from lease_core._structures import CheckResult, HeartbeatResult, Lease
from lease_core.testing import claim_now
from tests.helpers import quiet_offset_now, wait_for

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


class Unplugged(MemoryBackend):
    """A memory backend whose calls fail while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _fail(self) -> None:
        if self.down:
            raise BackendUnavailable("store unreachable (test)")

    async def now_ms(self) -> int:
        self._fail()
        return await super().now_ms()

    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        self._fail()
        return await super().check(runs)

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        self._fail()
        return await super().heartbeat(leases)


async def test_health_follows_the_store_and_counts_held_and_watched_runs() -> None:
    backend = Unplugged()
    a = Scheduler(backend, instance_id="a", **FAST)
    b = Scheduler(backend, instance_id="b", **FAST)
    for s in (a, b):
        s.every("long", "1h", catch_up="none", offset=quiet_offset_now())(_forever)
    stopped = a.health()
    assert stopped == Health(SchedulerState.STOPPED, False, None, 0, 0) and not stopped.ready
    await a.start()
    await b.start()
    try:
        health = a.health()
        assert health.ready and health.store_reachable and health.since_store_answer is not None
        slot = a.jobs["long"].schedule.previous_at_or_before(a.store_now_ms())
        assert slot is not None
        await claim_now(a, "long", slot)
        await claim_now(b, "long", slot)
        assert (a.health().runs_held, a.health().runs_watched) == (1, 0)
        assert (b.health().runs_held, b.health().runs_watched) == (0, 1)
        backend.down = True
        await wait_for(lambda: not b.health().store_reachable, timeout=5, what="unreachable")
        assert b.health().state is SchedulerState.RUNNING and not b.health().ready
        assert b.health().since_store_answer > b.lease  # type: ignore[operator]
        backend.down = False
        await wait_for(lambda: b.health().ready, timeout=5, what="reachable again")
    finally:
        await a.stop(grace=0)
        await b.stop(grace=0)
    assert a.health().state is SchedulerState.STOPPED and not a.health().store_reachable


async def _forever(ctx: RunContext) -> None:
    await anyio.sleep_forever()


@pytest.mark.asyncio_only
async def test_health_of_an_idle_scheduler_when_postgresql_stops_and_returns() -> None:
    server = EmbeddedPostgres()
    await anyio.to_thread.run_sync(server.start)
    try:
        s = Scheduler(PostgresBackend(server.dsn, table="health_runs"), instance_id="a",
                      lease="1.5s", heartbeat="0.25s")
        s.every("idle", "1h", _forever, catch_up="none", offset=quiet_offset_now())
        await s.start()
        try:
            await wait_for(lambda: s.health().ready, what="ready")
            await anyio.to_thread.run_sync(lambda: server.stop(remove=False))
            await wait_for(lambda: not s.health().store_reachable, timeout=10,
                           what="unreachable")
            assert not s.health().ready
            await anyio.to_thread.run_sync(server.start)  # the same data, port
            await wait_for(lambda: s.health().ready, timeout=30, what="ready again")
        finally:
            await s.stop(grace=0)
    finally:
        await anyio.to_thread.run_sync(server.stop)
