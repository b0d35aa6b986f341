"""scheduler.health(): whether the store answers, and what the instance holds."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import anyio
import psycopg
import pytest
import redis

from backends.embedded.postgres import EmbeddedPostgres
from backends.embedded.redis import EmbeddedRedis, find_server
from lease_core import (
    Health,
    PostgresBackend,
    RedisBackend,
    RunContext,
    RunStatus,
    Scheduler,
    SchedulerState,
    StoreBack,
    StoreUnreachable,
)
from lease_core._structures import (
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
)
from lease_core.abc import Backend
from lease_core.events import Event
from lease_core.testing import claim_now
from tests.helpers import STORE_CALLS, WRITE_CALLS, Unplugged, quiet_offset_now, wait_for

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


async def test_health_follows_the_store_and_counts_held_and_watched_runs() -> None:
    backend = Unplugged(fails=STORE_CALLS - {"claim_many"})  # claims answer
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


async def _quick(ctx: RunContext) -> None:
    pass


async def _forever(ctx: RunContext) -> None:
    await anyio.sleep_forever()


@pytest.mark.asyncio_only
@pytest.mark.parametrize("outage_s", [0, 40], ids=["brief", "long"])
async def test_health_when_postgresql_stops_and_returns(outage_s: float) -> None:
    """An idle scheduler is unready while PostgreSQL is down, and ready again once it is
    back. After a long outage too, soon: the pool made from a DSN reconnected with
    psycopg_pool's exponential backoff (1s, 2s, 4s, 8s, ... up to its 5-minute reconnect
    timeout), so after 40 seconds the next attempt came up to 30 seconds after the server
    was back, and the instance stayed unready (and claimed nothing) that long. Its
    reconnection attempts are at most RECONNECT_MAX_DELAY_S apart."""
    import time

    from adapters._psycopg_pools import RECONNECT_MAX_DELAY_S

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
            down = time.monotonic()
            await wait_for(lambda: not s.health().store_reachable, timeout=10,
                           what="unreachable")
            assert not s.health().ready
            # A long outage: the backoff has grown to 32s and more by its end.
            await anyio.sleep(max(0.0, down + outage_s - time.monotonic()))
            await anyio.to_thread.run_sync(server.start)  # the same data, port
            back = time.monotonic()
            await wait_for(lambda: s.health().ready, timeout=30, what="ready again")
            took = time.monotonic() - back
            if outage_s:
                assert took < RECONNECT_MAX_DELAY_S + 2, f"ready {took:.1f}s after the restart"
        finally:
            await s.stop(grace=0)
    finally:
        await anyio.to_thread.run_sync(server.stop)


class _Events:
    def __init__(self) -> None:
        self.events: list[Event] = []

    async def __call__(self, event: Event) -> None:
        self.events.append(event)

    def count(self, kind: type[Event]) -> int:
        return sum(isinstance(e, kind) for e in self.events)


async def _refused_writes_end_readiness(backend: Backend,
                                        refusing: Callable[[bool], None]) -> None:
    """An idle scheduler on ``backend``: while ``refusing(True)`` holds, the store answers
    reads and refuses writes; health() must say not ready, with one StoreUnreachable and no
    StoreBack, then ready again with one StoreBack once writes are accepted."""
    s = Scheduler(backend, instance_id="a", **FAST)
    s.every("idle", "1h", _forever, catch_up="none", offset=quiet_offset_now())
    seen = _Events()
    s.subscribe(seen)
    await s.start()
    try:
        await wait_for(lambda: s.health().ready, what="ready")
        await anyio.to_thread.run_sync(refusing, True)
        await wait_for(lambda: not s.health().store_reachable, timeout=10,
                       what="not ready while writes are refused")
        # Many ticks later (each reads the store's clock, which it answers): still
        # unreachable, reported once, never reported back.
        await wait_for(lambda: (s.health().since_store_answer or 0) > 2 * s.lease,
                       timeout=10, what="two leases without an accepted write")
        assert not s.health().ready
        assert (seen.count(StoreUnreachable), seen.count(StoreBack)) == (1, 0)
        await anyio.to_thread.run_sync(refusing, False)
        await wait_for(lambda: s.health().ready, timeout=10, what="ready again")
        await wait_for(lambda: seen.count(StoreBack) == 1, what="StoreBack")
        assert seen.count(StoreUnreachable) == 1
    finally:
        await s.stop(grace=0)


def read_only() -> Unplugged:
    """A memory backend that answers reads and refuses writes while ``down`` is set."""
    return Unplugged(fails=WRITE_CALLS, message="the store refuses writes (test)")


async def test_a_store_that_answers_reads_but_refuses_writes_is_not_ready() -> None:
    backend = read_only()

    def refusing(on: bool) -> None:
        backend.down = on

    await _refused_writes_end_readiness(backend, refusing)


@contextmanager
def _read_only_store(kind: str) -> Iterator[tuple[Backend, Callable[[bool], None]]]:
    """A server of its own, with a backend on it and a switch that makes it refuse writes:
    PostgreSQL's ``default_transaction_read_only`` (as a standby or a full disk refuses
    them), Redis's ``min-replicas-to-write`` (as a primary that lost its replicas)."""
    if kind == "postgres":
        server = EmbeddedPostgres()
        server.start()
        try:
            def pg_refusing(on: bool) -> None:
                with psycopg.connect(server.dsn, autocommit=True) as conn:
                    conn.execute("ALTER SYSTEM SET default_transaction_read_only = "
                                 + ("on" if on else "off"))
                    conn.execute("SELECT pg_reload_conf()")

            yield PostgresBackend(server.dsn, table="readonly_runs"), pg_refusing
        finally:
            server.stop()
        return
    binary = find_server("redis")
    assert binary is not None, "no redis server installed"
    with EmbeddedRedis(binary, appendonly=False) as made:
        def redis_refusing(on: bool) -> None:
            with redis.Redis(port=made.port) as client:
                client.config_set("min-replicas-to-write", 1 if on else 0)

        yield RedisBackend(made.url, prefix="readonly"), redis_refusing


@pytest.mark.asyncio_only
@pytest.mark.parametrize("kind", ["postgres", "redis"])
async def test_a_real_store_that_refuses_writes_is_not_ready(kind: str) -> None:
    with _read_only_store(kind) as (backend, refusing):
        await _refused_writes_end_readiness(backend, refusing)


class HeldElsewhere(Unplugged):
    """While ``down``: refuses writes, and answers every claim as a run another
    instance holds, writing nothing, as Redis short of ``min-replicas-to-write`` answers
    a claim that finds the run held or finished (or a heartbeat renewing no lease)."""

    def __init__(self) -> None:
        super().__init__(fails=WRITE_CALLS, message="the store refuses writes (test)")
        self.answered = 0

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        if not self.down:
            return await super().claim_many(requests)
        now = await self.now_ms()
        self.answered += len(requests)
        return [ClaimResult(ClaimStatus.RUNNING, r.job, r.slot, now, attempt=1,
                            expires_ms=now + r.lease_ms, run_status=RunStatus.RUNNING,
                            instance_id="elsewhere") for r in requests]


async def test_a_claim_answered_without_a_write_does_not_end_a_write_outage() -> None:
    backend = HeldElsewhere()
    s = Scheduler(backend, instance_id="a", **FAST)
    s.every("often", "0.3s", _quick, catch_up="none")
    seen = _Events()
    s.subscribe(seen)
    await s.start()
    try:
        await wait_for(lambda: s.health().ready, what="ready")
        backend.down = True
        await wait_for(lambda: not s.health().store_reachable, timeout=10,
                       what="not reachable while writes are refused")
        answered = backend.answered
        await wait_for(lambda: backend.answered >= answered + 3, timeout=10,
                       what="claims answered during the outage")
        # Answered claims that wrote nothing: the outage goes on, never reported over.
        assert not s.health().store_reachable
        assert (seen.count(StoreUnreachable), seen.count(StoreBack)) == (1, 0)
        backend.down = False
        await wait_for(lambda: seen.count(StoreBack) == 1, timeout=10, what="StoreBack")
    finally:
        await s.stop(grace=0)
