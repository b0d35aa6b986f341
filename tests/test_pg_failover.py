"""A real asynchronous failover on PostgreSQL (issue 21): a primary and its streaming
replica (``backends.embedded.pg_replica``), on PostgreSQL 16 (pgserver) and 15 (the
system's), the replica cut off so that the last commits are never replicated, the primary
killed and the replica promoted.

The store then detects the promotion at its first claim (the timeline changed), records
the epoch, quarantines every claim until the longest lease has passed, reports every
lease held before as lost at its next heartbeat, and numbers the attempts after it in
the new epoch: ``fence_of(epoch, attempt)`` grows although the attempt number repeats.
Named-lease tokens after it are above every token before. A scheduler going through
PgBouncer carries on once PgBouncer is pointed at the promoted replica.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg_pool import ConnectionPool

from backends.embedded import EmbeddedServerError
from backends.embedded.pg_replica import EmbeddedReplica
from backends.embedded.postgres import EmbeddedPostgres
from lease_core import PostgresBackend, RunContext, Scheduler, fence_of
from lease_core.abc import ClaimRequest, ClaimResult, ClaimStatus, Lease, Outcome
from lease_core.errors import AnarchonError, BackendUnavailable
from lease_core.testing import claim_now, wait_for
from tests.helpers import Instance, quiet_offset, store_now_ms
from tests.stores import missing_service
from tests.stores.postgres import (
    PGBOUNCER,
    SYSTEM_BINDIR,
    PgBouncer,
    PgServer,
    drop_tables,
    unique_table,
)

pytestmark = pytest.mark.anyio

LEASE_MS = 2_000
SHORT_MS = 300
NAMED_MS = 3_000


class Pair:
    """A primary and its streaming replica, both stopped and removed at the end."""

    def __init__(self, bindir: Path | None) -> None:
        self.primary = EmbeddedPostgres(bindir)
        self.replica = EmbeddedReplica(self.primary)

    def url(self, user: str = "postgres", password: str | None = None) -> str:
        """A multi-host URL listing the primary, then the replica (psycopg picks the writer)."""
        p, r = self.primary, self.replica
        return (f"postgresql://{user}:{password or p.password}@{p.host}:{p.port},"
                f"{r.host}:{r.port}/postgres?target_session_attrs=read-write&connect_timeout=2")

    def fail_over(self) -> None:
        """Kill the primary and promote the replica (which is then on timeline 2)."""
        self.primary.kill()
        self.replica.promote()


@pytest.fixture(params=["16", "15"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A primary with a streaming replica: PostgreSQL 16 (pgserver) or the system's 15."""
    bindir = None if request.param == "16" else SYSTEM_BINDIR
    if bindir is not None and not (bindir / "postgres").exists():
        missing_service(f"a system PostgreSQL in {bindir} (apt-get install postgresql)")
    try:
        pair = Pair(bindir)
    except (EmbeddedServerError, ImportError):
        missing_service("PostgreSQL 16 (pip install pgserver)")
        raise  # pragma: no cover - missing_service raises
    try:
        pair.primary.start()
        pair.replica.start()
        yield pair
    finally:
        pair.replica.stop()
        pair.primary.stop()


def request(slot: int, instance: str, token: str, lease_ms: int = LEASE_MS) -> ClaimRequest:
    """A claim of job "j" at ``slot`` (runs of j may overlap)."""
    return ClaimRequest("j", slot, instance, token, lease_ms, overlap_skip=False)


async def until(what: str, call: object, check: object, timeout: float = 20) -> object:
    """Call ``call()`` until ``check(result)`` holds; fail naming ``what`` at the deadline.

    A failed call (the pool reconnecting after the failover) counts as not yet.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = await call()  # type: ignore[operator]
            if check(last):  # type: ignore[operator]
                return last
        except AnarchonError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; last answer {last!r}")
        await anyio.sleep(0.05)


def meta_failover(dsn: str, table: str) -> str:
    """The store's 'failover' row: '<timeline> <epoch> <quiet>'."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT value FROM {table}_meta WHERE key = 'failover'").fetchone()
    assert row is not None
    return str(row[0])


def backend_for(url: str, anyio_backend: str, table: str) -> tuple[PostgresBackend, Any]:
    """A backend on ``url``: from the URL on asyncio, through a psycopg sync pool (which
    runs in worker threads) on trio. Returns it with the pool to close, if any."""
    if anyio_backend == "asyncio":
        return PostgresBackend(url, table=table), None
    pool: ConnectionPool[Any] = ConnectionPool(url, min_size=1, max_size=4, open=False)
    pool.open(wait=True, timeout=20)
    return PostgresBackend(pool, table=table), pool


async def test_a_promotion_is_detected_quarantined_and_fenced(pair: Pair,
                                                              anyio_backend: str) -> None:
    table = "failover_runs"
    # The app's role has only its table privileges (the detection needs no more).
    creator, creator_pool = backend_for(pair.primary.dsn, anyio_backend, table)
    await creator.start()  # a superuser's start() creates the store
    await creator.close()
    if creator_pool is not None:
        creator_pool.close()
    pair.primary.psql_superuser(
        "CREATE ROLE app LOGIN PASSWORD 'app-pw'; GRANT SELECT, INSERT, UPDATE, DELETE ON "
        + ", ".join(table + s for s in ("", "_attempts", "_jobs", "_meta")) + " TO app")
    # The holder, before and after the failover, through the multi-host URL.
    a, pool = backend_for(pair.url("app", "app-pw"), anyio_backend, table)
    await a.start()
    try:
        fences: list[int] = []
        tokens: list[int] = []

        def won(result: ClaimResult) -> ClaimResult:
            assert result.status is ClaimStatus.WON, result
            fences.append(fence_of(result.epoch, result.attempt))
            return result

        # Replicated: slot 1 run and finished, slot 2 held, slot 3 claimed; a named lease.
        won(await a.claim(request(1, "a", "a1")))
        assert await a.finish(Lease("j", 1, "a1", LEASE_MS), Outcome.COMPLETED)
        held = Lease("j", 2, "a2", LEASE_MS)
        won(await a.claim(request(2, "a", "a2")))
        won(await a.claim(request(3, "a", "a3", SHORT_MS)))
        first = await a.acquire_lease("n", "h1", SHORT_MS)
        assert first.held
        tokens.append(first.token)
        kept = await a.acquire_lease("m", "h1", NAMED_MS)  # still live at the failover
        assert kept.held
        assert meta_failover(pair.primary.dsn, table).startswith("00000001 0 ")
        pair.replica.wait_replayed()

        # Not replicated: slot 3 taken over (attempt 2) and finished, the lease taken again.
        pair.replica.detach()
        assert (await a.heartbeat([held])).renewed == frozenset({"a2"})
        again = await until("slot 3's takeover", lambda: a.claim(request(3, "b", "b3")),
                            lambda r: r.status is ClaimStatus.WON)
        assert won(again).attempt == 2  # type: ignore[arg-type]
        assert await a.finish(Lease("j", 3, "b3", LEASE_MS), Outcome.COMPLETED)
        second = await until("the lease taken again",
                             lambda: a.acquire_lease("n", "h2", LEASE_MS), lambda r: r.held)
        tokens.append(second.token)  # type: ignore[attr-defined]
        assert tokens == [1, 2]
        before = max(fences)
        assert before == 2

        pair.fail_over()
        assert pair.replica.timeline() == 2

        # The first claim on the promoted server detects it: quarantine, the epoch set.
        quarantined = await until("the first claim on the promoted server",
                                  lambda: a.claim(request(4, "c", "c4")),
                                  lambda r: True)
        assert isinstance(quarantined, ClaimResult)
        assert quarantined.status is ClaimStatus.RUNNING and quarantined.run_status is None
        assert quarantined.attempt == 0 and quarantined.epoch > 0
        timeline, epoch, quiet = meta_failover(pair.replica.dsn, table).split()
        assert (timeline, int(epoch)) == ("00000002", quarantined.epoch)
        assert int(epoch) <= quarantined.now_ms < int(quiet) == quarantined.expires_ms
        assert int(quiet) >= int(epoch) + LEASE_MS

        # The holder of slot 2 learns at its next heartbeat that its lease is gone, and
        # the holder of the named lease at its next renewal.
        beat = await a.heartbeat([held])
        assert beat.renewed == frozenset() and beat.held == frozenset()
        assert await a.renew_lease("m", kept.token, NAMED_MS) is None
        assert int(quiet) >= kept.expires_ms  # the quarantine outlasts every live lease

        # No attempt starts during the quarantine, on any run, nor a named lease.
        for slot in (2, 3, 4):
            answer = await a.claim(request(slot, "c", f"q{slot}"))
            assert answer.status is ClaimStatus.RUNNING and answer.run_status is None
            assert answer.epoch == int(epoch)
        # A backup's check: a run missing during the quarantine was lost, not deleted.
        seen = await a.check([("j", 3), ("j", 4)])
        assert set(seen.runs) == {("j", 3)} and seen.lost == frozenset({("j", 4)})
        busy = await a.acquire_lease("n", "h3", LEASE_MS)
        assert not busy.held and busy.expires_ms >= int(quiet)

        # After it: slot 3's lost takeover is made again as attempt 2, in the new epoch.
        retaken = await until("slot 3 claimed after the quarantine",
                              lambda: a.claim(request(3, "c", "c3")),
                              lambda r: r.status is ClaimStatus.WON, timeout=30)
        assert isinstance(retaken, ClaimResult)
        assert retaken.attempt == 2 and retaken.epoch == int(epoch)
        assert retaken.now_ms >= int(quiet)
        assert fence_of(retaken.epoch, retaken.attempt) > before
        assert (await a.check([("j", 9)])).lost == frozenset()  # the quarantine is over
        took_over = won(await a.claim(request(2, "c", "c2")))
        assert took_over.attempt == 2 and fence_of(took_over.epoch, 2) > before
        history = await a.history("j", limit=10)
        assert {(h.slot, h.attempt) for h in history} >= {(1, 1), (2, 1), (2, 2), (3, 1),
                                                          (3, 2)}
        assert all(h.claimed_at.timestamp() * 1000 >= int(quiet) - 1
                   for h in history if h.instance_id == "c")

        # Named lease: the token after the failover is above every token before.
        third = await until("the lease after the quarantine",
                            lambda: a.acquire_lease("n", "h3", LEASE_MS), lambda r: r.held)
        assert third.token >= int(epoch) << 20  # type: ignore[attr-defined]
        assert third.token > max(tokens)  # type: ignore[attr-defined]
    finally:
        await a.close()
        if pool is not None:
            pool.close()


@pytest.fixture
def pgbouncer_binary() -> str:
    """The pgbouncer binary (the test is skipped, or fails under CI, without one)."""
    if not os.path.exists(PGBOUNCER):
        missing_service("pgbouncer")
    return PGBOUNCER


@pytest.mark.asyncio_only
@pytest.mark.usefixtures("pgbouncer_binary")
async def test_a_scheduler_through_pgbouncer_goes_on_after_its_target_is_switched(
        pair: Pair) -> None:
    table = "bouncer_runs"
    bouncer = PgBouncer(pair.primary, pool_size=4).start()
    try:
        backend = PostgresBackend(bouncer.dsn, table=table)
        s = Scheduler(backend, instance_id="a", lease="1.5s", heartbeat="0.25s")
        ticks: list[tuple[int, int]] = []  # (slot, fence) of every tick attempt
        long_fences: list[int] = []
        cancelled = anyio.Event()

        @s.every("tick", "1s", overlap="allow")
        async def tick(ctx: RunContext) -> None:
            ticks.append((ctx.slot, ctx.fence))

        # The next slot is half an hour away: the test claims the current one itself.
        offset = quiet_offset(await store_now_ms(PostgresBackend(bouncer.dsn, table=table)))

        @s.every("long", "1h", offset=offset)
        async def long(ctx: RunContext) -> None:
            long_fences.append(ctx.fence)
            try:
                await anyio.sleep_forever()
            finally:
                cancelled.set()

        async with anyio.create_task_group() as tg:
            instance = await Instance(s).start(tg)
            slot = s.jobs["long"].schedule.previous_at_or_before(s.store_now_ms())
            assert slot is not None
            await claim_now(s, "long", slot)
            await wait_for(lambda: long_fences and len(ticks) >= 2, timeout=10,
                           what="the long run and two ticks")
            pair.replica.wait_replayed()
            pair.replica.detach()  # from here on nothing reaches the replica
            lost = len(ticks)
            await wait_for(lambda: len(ticks) > lost, timeout=10, what="an unreplicated tick")
            before = max([fence for _, fence in ticks] + long_fences)
            assert before == 1  # no loss detected yet: the fence is the attempt number

            pair.fail_over()
            bouncer.retarget(pair.replica)  # the same URL now reaches the new primary

            await wait_for(lambda: any(f > before for _, f in ticks), timeout=30,
                           what="a tick claimed on the new primary")
            await wait_for(cancelled.is_set, timeout=10, what="the long run's loss")
            await wait_for(lambda: len(long_fences) >= 2, timeout=30,
                           what="the long run taken over after the quarantine")
            await instance.stop()

        timeline, epoch, quiet = meta_failover(pair.replica.dsn, table).split()
        assert timeline == "00000002" and int(epoch) > 0
        after = [fence for _, fence in ticks if fence > before] + long_fences[1:]
        assert after and all(fence >= int(epoch) << 20 for fence in after)
        assert long_fences[1] == fence_of(int(epoch), 2)
        # No attempt started during the quarantine.
        with psycopg.connect(pair.replica.dsn, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM {table}_attempts WHERE claimed_ms >= "
                               f"{int(epoch)} AND claimed_ms < {int(quiet)}").fetchone()
        assert row == (0,)
    finally:
        bouncer.close()


@pytest.mark.asyncio_only
async def test_a_second_failover_raises_the_epoch_again(pair: Pair) -> None:
    table = "twice_runs"
    backend = PostgresBackend(pair.url(), table=table)
    await backend.start()
    second: EmbeddedReplica | None = None
    try:
        assert (await backend.claim(request(1, "a", "a1", SHORT_MS))).epoch == 0
        pair.replica.wait_replayed()
        pair.fail_over()
        first = await until("the first epoch", lambda: backend.claim(request(1, "b", "b1")),
                            lambda r: r.status is ClaimStatus.WON, timeout=30)
        assert isinstance(first, ClaimResult) and first.epoch > 0 and first.attempt == 2
        # A replica of the promoted server, then a second failover to it.
        second = EmbeddedReplica(pair.replica)
        second.start()
        second.wait_replayed()
        pair.replica.kill()
        second.promote()
        assert second.timeline() == 3
        moved = PostgresBackend(second.dsn, table=table)
        await moved.start()
        try:
            again = await until("the second epoch", lambda: moved.claim(request(1, "c", "c1")),
                                lambda r: r.status is ClaimStatus.WON, timeout=30)
        finally:
            await moved.close()
        assert isinstance(again, ClaimResult) and again.epoch > first.epoch
        assert again.attempt == 3
        assert fence_of(again.epoch, 3) > fence_of(first.epoch, 2) > 1
        assert meta_failover(second.dsn, table).startswith(f"00000003 {again.epoch} ")
    finally:
        await backend.close()
        if second is not None:
            second.stop()


@pytest.mark.asyncio_only
async def test_a_claim_or_a_named_lease_on_a_standby_says_it_takes_no_writes(
        pair: Pair) -> None:
    """A backend pointed at a hot standby (PgBouncer still at the old primary rejoined as a
    standby, a single-host URL): a claim past the fast path and a named lease's acquire
    fail with BackendUnavailable saying the server takes no writes, on both drivers, not
    with a driver's error nor as an unreachable server."""
    table = "standby_runs"
    creator = PostgresBackend(pair.primary.dsn, table=table)
    await creator.start()
    try:
        assert (await creator.claim(request(1, "a", "a1"))).status is ClaimStatus.WON
        pair.replica.wait_replayed()
    finally:
        await creator.close()
    for driver in ("postgresql", "postgresql+pg8000"):
        standby = PostgresBackend(pair.replica.dsn.replace("postgresql", driver, 1),
                                  table=table)
        await standby.start()  # reads only: a standby allows it
        try:
            with pytest.raises(BackendUnavailable, match="takes no writes") as claimed:
                await standby.claim(request(2, "b", "b2"))
            with pytest.raises(BackendUnavailable, match="takes no writes") as acquired:
                await standby.acquire_lease("n", "h", LEASE_MS)
            for info in (claimed, acquired):
                assert "target_session_attrs" in str(info.value), driver
            # A backup's check, a plain read, works there (a missing run is not lost).
            seen = await standby.check([("j", 1), ("j", 2)])
            assert set(seen.runs) == {("j", 1)} and seen.lost == frozenset(), driver
        finally:
            await standby.close()


@pytest.mark.asyncio_only
async def test_a_failover_that_lost_the_stores_first_claims_is_detected(pair: Pair) -> None:
    """The store's timeline is recorded when the store is made, not by its first claim: a
    failover that lost every claim since (the replica cut off right after the store was
    made or upgraded) is detected, so attempt 1 of a run is not fenced 1 twice, nor a
    named lease's token 1 handed out twice."""
    table = "first_runs"
    backend = PostgresBackend(pair.url(), table=table)
    await backend.start()
    try:
        pair.replica.wait_replayed()
        pair.replica.detach()
        lost = await backend.claim(request(1, "a", "a1"))
        assert (lost.status, lost.attempt, lost.epoch) == (ClaimStatus.WON, 1, 0)
        assert (await backend.acquire_lease("n", "h1", LEASE_MS)).token == 1
        pair.fail_over()
        # The named lease's token 1 is not handed out again: nobody takes it for now.
        taken = await until("the first acquire on the promoted server",
                            lambda: backend.acquire_lease("n", "h2", LEASE_MS),
                            lambda r: True)
        assert not taken.held, taken  # type: ignore[attr-defined]
        again = await backend.claim(request(1, "b", "b1"))
        # Detected: quarantined for the lost holder's lease, then fenced in a new epoch.
        assert again.status is ClaimStatus.RUNNING and again.run_status is None, again
        assert again.epoch > 0 and again.expires_ms >= again.epoch + LEASE_MS
    finally:
        await backend.close()


@pytest.mark.asyncio_only
async def test_a_check_before_any_claim_on_the_promoted_server_reports_a_lost_run(
        pair: Pair) -> None:
    """A backup's check that reaches the promoted server before any claim there reports a
    watched run the failover lost as lost (the scheduler claims it again, and that claim
    detects the promotion), not as deleted: backups then stopped watching it, and the
    slot whose holder learnt at its heartbeat that its lease was gone never ran."""
    table = "check_runs"
    backend = PostgresBackend(pair.url(), table=table)
    await backend.start()
    try:
        assert (await backend.claim(request(1, "a", "a1"))).status is ClaimStatus.WON
        pair.replica.wait_replayed()
        pair.replica.detach()
        assert (await backend.claim(request(2, "a", "a2"))).status is ClaimStatus.WON
        before = await backend.check([("j", 1), ("j", 2), ("j", 3)])
        assert set(before.runs) == {("j", 1), ("j", 2)} and before.lost == frozenset()
        pair.fail_over()
        seen = await until("a check on the promoted server",
                           lambda: backend.check([("j", 1), ("j", 2)]), lambda r: True)
        assert set(seen.runs) == {("j", 1)}, seen  # type: ignore[attr-defined]
        assert seen.lost == frozenset({("j", 2)}), seen  # type: ignore[attr-defined]
        # The claim it leads to detects the promotion: quarantined, in a new epoch.
        again = await backend.claim(request(2, "b", "b2"))
        assert again.status is ClaimStatus.RUNNING and again.run_status is None, again
        assert again.epoch > 0
        assert (await backend.check([("j", 2)])).lost == frozenset({("j", 2)})
    finally:
        await backend.close()


@pytest.mark.asyncio_only
async def test_the_quarantine_warning_says_what_happened_and_until_when(
        pg16_server: PgServer, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler's warning at a quarantine names a possible failover and gives its end
    as a time (it said "the store lost its data" with a bare number of milliseconds)."""
    table = unique_table()
    scheduler = Scheduler(PostgresBackend(pg16_server.dsn, table=table), lease="1s",
                          heartbeat="0.2s")

    @scheduler.every("tick", "0.5s")
    async def tick(ctx: RunContext) -> None:
        return None

    try:
        async with anyio.create_task_group() as tg:
            instance = await Instance(scheduler).start(tg)
            try:
                # The store last wrote on another timeline: as after a promotion.
                with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
                    conn.execute(f"UPDATE {table}_meta SET value = 'FFFFFFFF 0 0' "
                                 "WHERE key = 'failover'")
                warned = await wait_for(
                    lambda: [r.getMessage() for r in caplog.records
                             if "acknowledged may be lost" in r.getMessage()],
                    what="the quarantine's warning")
            finally:
                await instance.stop()
    finally:
        await drop_tables(pg16_server.admin_dsn, table)
    assert "a failover to a replica" in warned[0], warned
    assert re.search(r"no new attempt before \d{4}-\d\d-\d\dT[\d:.]+Z", warned[0]), warned
