"""Where a run's client CPU goes at spread slots: counts per run, and a cProfile.

One scheduler on the memory backend (or PostgreSQL with ``--pg URL``), ``N`` no-op
jobs ``every="1s"`` with their slots spread over each second (as ``benchmarks/cpu.py``),
on asyncio. Over a window after a warm-up it counts, per run whose handler started:

- task spawns (``asyncio.Task`` objects made);
- cancel scopes entered (anyio's ``CancelScope.__enter__``);
- event-loop turns (``BaseEventLoop._run_once``);
- CPU microseconds (``time.process_time``).

``--floor`` measures, the same way, an empty loop that only wakes at the same pace
(one ``anyio.sleep`` per slot in one task): the cost of a timer wake-up on this machine,
below which no scheduler can go. ``--cprofile`` prints the top functions by own time.

Run: ``python -m benchmarks.profile_cpu [--n 250] [--seconds 3] [--cprofile] [--floor]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import time
from typing import Any

import anyio
from anyio._backends import _asyncio as anyio_asyncio

from lease_core import Scheduler

__all__ = ["main"]


class Counts:
    """Counters patched into asyncio and anyio for the measured window."""

    def __init__(self) -> None:
        self.tasks = 0
        self.scopes = 0
        self.turns = 0
        self.on = False

    def install(self) -> None:
        """Patch the counters in (for this process)."""
        counts = self
        loop_cls: Any = asyncio.BaseEventLoop
        run_once = loop_cls._run_once

        def _run_once(loop: Any) -> None:
            if counts.on:
                counts.turns += 1
            run_once(loop)

        loop_cls._run_once = _run_once
        # asyncio.Task is a C type: tasks are counted through the loop's task factory.
        def factory(loop: Any, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            if counts.on:
                counts.tasks += 1
            return asyncio.Task(coro, loop=loop, **kwargs)

        self.factory = factory
        scope_cls: Any = anyio_asyncio.CancelScope
        enter = scope_cls.__enter__

        def _enter(scope: Any) -> Any:
            if counts.on:
                counts.scopes += 1
            return enter(scope)

        scope_cls.__enter__ = _enter


async def _scheduler(backend: Any, n: int, warmup: float, seconds: float, counts: Counts,
                     prof: cProfile.Profile | None) -> dict[str, float]:
    asyncio.get_running_loop().set_task_factory(counts.factory)
    scheduler = Scheduler(backend, instance_id="cpu-profile")
    started = [0]

    async def handler(ctx: Any) -> None:
        started[0] += 1

    for i in range(n):
        scheduler.every(f"p{i}", "1s", handler, offset=(i * 1000 // n) / 1000)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await anyio.sleep(warmup)
        result = await _measure(seconds, lambda: started[0], counts, prof)
        await scheduler.stop(grace=5)
    return result


async def _floor(n: int, warmup: float, seconds: float, counts: Counts,
                 prof: cProfile.Profile | None) -> dict[str, float]:
    asyncio.get_running_loop().set_task_factory(counts.factory)
    woken = [0]
    end = time.monotonic() + warmup + seconds + 0.5

    async def waker() -> None:
        step = 1 / n
        nxt = time.monotonic()
        while nxt < end:
            nxt += step
            await anyio.sleep(max(0.0, nxt - time.monotonic()))
            woken[0] += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(waker)
        await anyio.sleep(warmup)
        return await _measure(seconds, lambda: woken[0], counts, prof)


async def _measure(seconds: float, count: Any, counts: Counts,
                   prof: cProfile.Profile | None) -> dict[str, float]:
    runs, cpu = count(), time.process_time()
    counts.on = True
    if prof is not None:
        prof.enable()
    await anyio.sleep(seconds)
    if prof is not None:
        prof.disable()
    counts.on = False
    cpu, runs = time.process_time() - cpu, count() - runs
    per = max(1, runs)
    return {"runs": runs, "runs_per_cpu_s": runs / cpu if cpu else 0.0,
            "cpu_us_per_run": cpu / per * 1e6, "tasks": counts.tasks / per,
            "cancel_scopes": counts.scopes / per, "loop_turns": counts.turns / per}


def main() -> None:
    """Print the counts per run (and the profile)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=250, help="runs per second offered")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--pg", help="a PostgreSQL URL (default: the memory backend)")
    parser.add_argument("--floor", action="store_true", help="an empty loop's wake-ups")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    counts = Counts()
    counts.install()
    prof = cProfile.Profile(time.thread_time) if args.cprofile else None
    if args.floor:
        result = anyio.run(_floor, args.n, args.warmup, args.seconds, counts, prof)
    else:
        if args.pg:
            from backends.postgres import PostgresBackend
            backend: Any = PostgresBackend(args.pg, table="cpu_profile")
        else:
            from backends.memory import MemoryBackend
            backend = MemoryBackend()
        result = anyio.run(_scheduler, backend, args.n, args.warmup, args.seconds,
                           counts, prof)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in result.items()))
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
