"""The store restarting mid-lease, seen through the scheduler (PostgreSQL).

While the server is down heartbeats fail: the handler must be cancelled before its lease
could expire in the store. When the server returns, the run is taken over (attempt 2) and
completes once; nothing is lost and nothing runs twice at the same time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest

from backends.embedded.postgres import EmbeddedPostgres
from lease_core import Outcome, PostgresBackend, Reason, RunContext, Scheduler
from lease_core.abc import HeartbeatResult, Lease
from lease_core.testing import claim_now
from tests.helpers import Instance, quiet_offset, store_now_ms, wait_for, wait_history

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]


@pytest.mark.parametrize("scheme", ["postgresql://", "postgresql+pg8000://"])
async def test_handler_stops_before_its_lease_and_resumes_after_restart(scheme: str) -> None:
    server = EmbeddedPostgres()
    await anyio.to_thread.run_sync(server.start)
    try:
        url = server.dsn.replace("postgresql://", scheme, 1)
        backend = PostgresBackend(url, table="restart_runs")
        s = Scheduler(backend, instance_id="a", lease="1.5s", heartbeat="0.25s")
        renewals: list[float] = []  # when each renewal that held the lease was sent
        heartbeat = backend.heartbeat

        async def counted_heartbeat(leases: Sequence[Lease]) -> HeartbeatResult:
            sent = time.monotonic()
            result = await heartbeat(leases)
            if result.held:
                renewals.append(sent)
            return result

        backend.heartbeat = counted_heartbeat  # type: ignore[method-assign]
        # The next slot is half an hour away: the test claims the current one itself.
        offset = quiet_offset(await store_now_ms(PostgresBackend(url, table="restart_runs")))
        live: list[int] = []
        overlaps: list[int] = []
        attempts: list[tuple[int, float, float | None]] = []
        release = anyio.Event()

        @s.every("long", "1h", offset=offset)
        async def long(ctx: RunContext) -> None:
            if live:
                overlaps.append(ctx.attempt)
            live.append(ctx.attempt)
            attempts.append((ctx.attempt, time.monotonic(), None))
            try:
                if ctx.attempt >= 2:
                    await release.wait()
                else:
                    await anyio.sleep_forever()
            finally:
                live.remove(ctx.attempt)
                attempts[-1] = (ctx.attempt, attempts[-1][1], time.monotonic())

        async with anyio.create_task_group() as tg:
            instance = await Instance(s).start(tg)
            slot = s.jobs["long"].schedule.previous_at_or_before(s.store_now_ms())
            assert slot is not None
            await claim_now(s, "long", slot)
            await wait_for(lambda: attempts, what="attempt 1")
            # Let one heartbeat renew the lease, then take the server away.
            await wait_for(lambda: renewals, what="a renewal of attempt 1")
            await anyio.to_thread.run_sync(lambda: server.stop(remove=False))
            stopped_at = time.monotonic()
            await wait_for(lambda: attempts[0][2] is not None, timeout=5,
                           what="attempt 1 cancelled")
            # The store's lease ends no earlier than 1.5s after the last renewal was sent
            # (a renewal may still have landed while the server was stopping).
            ran_on = attempts[0][2] - renewals[-1]  # type: ignore[operator]
            assert ran_on < 1.5, f"handler ran {ran_on:.2f}s past its last renewal"
            # Restart only once the lease has expired by the store's clock (the same
            # machine's): it was renewed last before the server stopped.
            await wait_for(lambda: time.monotonic() > stopped_at + 1.5, what="lease expiry")
            await anyio.to_thread.run_sync(server.start)  # the same data, port
            await wait_for(lambda: len(attempts) == 2, timeout=20, what="takeover after restart")
            release.set()
            history = await wait_history(s, lambda h: h and h[0].outcome == "completed",
                                         job="long", timeout=20)
            await instance.stop()
        assert overlaps == []
        assert [(h.attempt, h.reason, h.outcome) for h in history] == [
            (2, Reason.TAKEOVER, Outcome.COMPLETED),
            (1, Reason.SCHEDULED, Outcome.LOST),
        ]
    finally:
        await anyio.to_thread.run_sync(server.stop)
