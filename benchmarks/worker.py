"""Scheduler processes the benchmarks start: ``python -m benchmarks.worker MODE URL ...``.

Modes (each prints JSON lines on stdout, ends on SIGTERM with a graceful stop, or is
SIGKILLed by the parent):

``load URL JOBS NAME``
    A scheduler with JOBS jobs (every 10, 20, 30 or 60 s, offsets spread over the
    interval, handlers of 2-4 s), heartbeat 1 s, lease 5 s. Prints its held and watched
    runs every second, and on Redis its round trips: all of them, and those made inside
    the backend's ``heartbeat``, ``check`` and ``members`` calls (the upkeep).
``rss URL LEASES``
    A scheduler whose LEASES jobs all fire within a few seconds and never finish; prints
    its RSS and held runs every second.
``scale URL JOBS NAME PREFIX INTERVAL HANDLER HEARTBEAT``
    A scheduler with JOBS jobs every INTERVAL seconds, their offsets spread evenly over
    the interval, handlers of HANDLER seconds, heartbeat HEARTBEAT seconds (lease three
    heartbeats). Prints held and watched runs, its RSS and CPU seconds and how many
    times a call of the backend's ``heartbeat``, ``check``, ``claim`` and ``claim_many``
    returned, and the claims sent (``claims_sent``), every second.
    With INTERVAL 3600 the jobs hardly fire: the process's memory per declared job.
``fleet URL NAME PREFIX JOBS INTERVAL LEASE HEARTBEAT``
    A fleet member: JOBS jobs ``k0`` ... every INTERVAL seconds (offsets spread over the
    interval), handlers of 20 ms, the lease and heartbeat given. Prints the fleet size it
    knows every half second.
``failover URL NAME FIRE_AT_MS LEASE HEARTBEAT``
    One job ``fo`` firing at FIRE_AT_MS (store time); the handler runs until cancelled.
    On SIGTERM it prints the store time at which ``stop()`` was called.
"""

from __future__ import annotations

import contextvars
import json
import os
import signal
import sys
import time
from typing import Any

import anyio

from lease_core import RunContext, Scheduler, backend_from_url
from lease_core.abc import Backend

HOUR_MS = 3_600_000

#: Set while a backend call whose round trips are upkeep (``heartbeat``, ``check``,
#: ``members``) runs:
#: :class:`CountingRedis` counts them apart too (a context variable, so a claim running
#: at the same time in another task is not counted as upkeep).
_upkeep: contextvars.ContextVar[bool] = contextvars.ContextVar("upkeep", default=False)


class CountingRedis:
    """An asyncio redis-py client that counts round trips (pipelines and single commands),
    and apart those made for upkeep (see :data:`_upkeep`)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.connection_pool = client.connection_pool
        self.round_trips = 0
        self.upkeep_round_trips = 0
        self.commands = 0

    def _count(self, commands: int) -> None:
        self.round_trips += 1
        self.commands += commands
        if _upkeep.get():
            self.upkeep_round_trips += 1

    def pipeline(self, transaction: bool = True) -> Any:
        """A pipeline whose ``execute`` counts one round trip."""
        pipe = self._client.pipeline(transaction=transaction)
        run = pipe.execute

        async def execute(raise_on_error: bool = True) -> Any:
            self._count(len(pipe.command_stack))
            return await run(raise_on_error=raise_on_error)

        pipe.execute = execute
        return pipe

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        """One command, one round trip."""
        self._count(1)
        return await self._client.execute_command(*args, **options)

    def register_script(self, script: str) -> Any:
        """A script object whose calls go through :meth:`evalsha` (so are counted)."""
        from redis.commands.core import AsyncScript

        return AsyncScript(self, script)  # type: ignore[arg-type]

    async def evalsha(self, *args: Any) -> Any:
        """One script call, one round trip."""
        self._count(1)
        return await self._client.evalsha(*args)

    async def aclose(self) -> None:
        """Close the wrapped client."""
        await self._client.aclose()

    def __getattr__(self, name: str) -> Any:
        # anything else (script_load, ...) goes to the client, uncounted
        return getattr(self._client, name)


def make_backend(url: str, prefix: str, **pg_options: Any) -> tuple[Backend, CountingRedis | None]:
    """A backend for ``url``; Redis gets a round-trip counting client."""
    if url.startswith("redis"):
        import redis.asyncio

        from backends.redis import RedisBackend

        client = CountingRedis(redis.asyncio.Redis.from_url(url))
        return RedisBackend(client, prefix=prefix), client
    return backend_from_url(url, table=prefix, **pg_options), None


def rss_bytes() -> int:
    """Resident set size of this process, from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def emit(**values: Any) -> None:
    """Print one JSON status line."""
    print(json.dumps(values), flush=True)


async def _until_sigterm(scheduler: Scheduler, report: Any) -> None:
    async with anyio.create_task_group() as tg:

        async def reporter() -> None:
            while True:
                report()
                await anyio.sleep(1)

        tg.start_soon(reporter)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        emit(event="stopping", store_ms=scheduler.store_now_ms())
        tg.cancel_scope.cancel()
    await scheduler.stop(grace=0)
    emit(event="stopped")


def _as_upkeep(method: Any) -> Any:
    """``method``, its round trips counted as upkeep."""
    async def call(*args: Any, **kwargs: Any) -> Any:
        token = _upkeep.set(True)
        try:
            return await method(*args, **kwargs)
        finally:
            _upkeep.reset(token)
    return call


async def load(url: str, jobs: int, name: str, prefix: str) -> None:
    """Steady-state fleet member (see module docs)."""
    backend, counter = make_backend(url, prefix)
    for op in ("heartbeat", "check", "members"):
        setattr(backend, op, _as_upkeep(getattr(backend, op)))
    scheduler = Scheduler(backend, instance_id=name, lease="5s", heartbeat="1s")

    async def handler(ctx: RunContext) -> None:
        await anyio.sleep(2 + int(ctx.job[1:]) % 3)

    intervals = (10, 20, 30, 60)
    for i in range(jobs):
        interval = intervals[i % 4]
        offset_ms = (i * 7919) % (interval * 1000)
        scheduler.every(f"j{i}", f"{interval}s", handler, offset=f"{offset_ms}ms",
                        catch_up="none")
    async with scheduler:
        emit(event="started")

        def report() -> None:
            emit(event="status", held=len(scheduler.running), watch=len(scheduler.watching),
                 round_trips=counter.round_trips if counter else None,
                 upkeep_round_trips=counter.upkeep_round_trips if counter else None,
                 commands=counter.commands if counter else None, t=time.monotonic())

        await _until_sigterm(scheduler, report)


async def rss(url: str, leases: int, prefix: str) -> None:
    """Hold ``leases`` runs at once (see module docs)."""
    backend, _ = make_backend(url, prefix, max_size=4)
    scheduler = Scheduler(backend, instance_id="rss", lease="60s", heartbeat="5s")

    async def handler(ctx: RunContext) -> None:
        await anyio.sleep(3600)

    first = int(time.time() * 1000) + 4000
    for i in range(leases):
        fire = first + (i * 4000) // max(leases, 1)
        scheduler.every(f"r{i}", "1h", handler, offset=f"{fire % HOUR_MS}ms", catch_up="none")
    emit(event="declared", rss=rss_bytes())
    async with scheduler:
        emit(event="started", rss=rss_bytes())

        def report() -> None:
            emit(event="status", held=len(scheduler.running), rss=rss_bytes())

        await _until_sigterm(scheduler, report)


async def failover(url: str, name: str, fire_at_ms: int, lease: str, heartbeat: str,
                   prefix: str) -> None:
    """One job, one slot (see module docs)."""
    backend, _ = make_backend(url, prefix)
    scheduler = Scheduler(backend, instance_id=name, lease=lease, heartbeat=heartbeat)

    async def handler(ctx: RunContext) -> None:
        emit(event="won", attempt=ctx.attempt, reason=str(ctx.reason))
        await anyio.sleep(3600)

    scheduler.every("fo", "1h", handler, offset=f"{fire_at_ms % HOUR_MS}ms", catch_up="none")
    async with scheduler:
        emit(event="started")
        await _until_sigterm(scheduler, lambda: None)


async def fleet(url: str, name: str, prefix: str, jobs: int, interval: float, lease: str,
                heartbeat: str) -> None:
    """A member of the fleet-kill benchmark (see module docs)."""
    backend, _ = make_backend(url, prefix)
    scheduler = Scheduler(backend, instance_id=name, lease=lease, heartbeat=heartbeat,
                          history_size=50)

    async def handler(ctx: RunContext) -> None:
        await anyio.sleep(0.02)

    period_ms = int(interval * 1000)
    for i in range(jobs):
        scheduler.every(f"k{i}", f"{interval:g}s", handler,
                        offset=f"{(i * period_ms) // max(jobs, 1)}ms", catch_up="none")
    async with scheduler:
        emit(event="started")
        async with anyio.create_task_group() as tg:
            async def reporter() -> None:
                while True:
                    emit(event="status", fleet_size=scheduler.health().fleet_size,
                         store_ms=scheduler.store_now_ms())
                    await anyio.sleep(0.5)

            tg.start_soon(reporter)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()
        await scheduler.stop(grace=0)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, from /proc."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def scale(url: str, jobs: int, name: str, prefix: str, interval: float,
                handler_s: float, heartbeat: float) -> None:
    """A fleet member of the scale benchmark (see module docs)."""
    backend, counter = make_backend(url, prefix)
    calls = {"heartbeat": 0, "check": 0, "claim": 0, "claim_many": 0, "claims_sent": 0}

    within_claim: contextvars.ContextVar[bool] = contextvars.ContextVar("within_claim",
                                                                        default=False)

    def counted(op: str, method: Any) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            # a backend's claim may be its claim_many of one: count the claim once
            token = None
            if op in ("claim", "claim_many") and not within_claim.get():
                calls["claims_sent"] += len(args[0]) if op == "claim_many" else 1
                token = within_claim.set(True)
            try:
                result = await method(*args, **kwargs)
            finally:
                if token is not None:
                    within_claim.reset(token)
            calls[op] += 1
            return result
        return call

    # count the scheduler's calls of the backend that returned (one per tick or claim),
    # and the claims sent (a batch counting each of its claims)
    for op in ("heartbeat", "check", "claim", "claim_many"):
        setattr(backend, op, counted(op, getattr(backend, op)))
    scheduler = Scheduler(backend, instance_id=name, lease=f"{3 * heartbeat}s",
                          heartbeat=f"{heartbeat}s")

    async def handler(ctx: RunContext) -> None:
        await anyio.sleep(handler_s)

    period_ms = int(interval * 1000)
    for i in range(jobs):
        scheduler.every(f"s{i}", f"{interval:g}s", handler,
                        offset=f"{(i * period_ms) // max(jobs, 1)}ms", catch_up="none")
    emit(event="declared", rss=rss_bytes(), cpu=cpu_seconds())
    async with scheduler:
        emit(event="started", rss=rss_bytes(), cpu=cpu_seconds())

        def report() -> None:
            emit(event="status", held=len(scheduler.running), watch=len(scheduler.watching),
                 rss=rss_bytes(), cpu=cpu_seconds(), t=time.monotonic(),
                 round_trips=counter.round_trips if counter else None, **calls)

        await _until_sigterm(scheduler, report)
    emit(event="final", rss=rss_bytes(), cpu=cpu_seconds(),
         round_trips=counter.round_trips if counter else None, **calls)


def main(argv: list[str]) -> None:
    """Dispatch on the mode."""
    mode, url, *rest = argv
    if mode == "load":
        anyio.run(load, url, int(rest[0]), rest[1], rest[2])
    elif mode == "rss":
        anyio.run(rss, url, int(rest[0]), rest[1])
    elif mode == "scale":
        anyio.run(scale, url, int(rest[0]), rest[1], rest[2], float(rest[3]), float(rest[4]),
                  float(rest[5]))
    elif mode == "fleet":
        anyio.run(fleet, url, rest[0], rest[1], int(rest[2]), float(rest[3]), rest[4], rest[5])
    elif mode == "failover":
        anyio.run(failover, url, rest[0], int(rest[1]), rest[2], rest[3], rest[4])
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
