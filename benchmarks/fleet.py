"""Claims per run as the fleet grows: ``python -m benchmarks.fleet [--instances 3,10,30]``.

N schedulers share one in-process store; J jobs are due every second. After every member
knows the whole fleet, the claims each instance sends (counted at the backend, a batch
counting each of its claims) are divided by the runs, over a few slots; the busiest
instance's share of the runs is reported against its fair share. Before membership, every
instance claimed every slot: N claims per run.

Writes ``benchmarks/out/fleet.json``. The count does not depend on the store: every backend
ranks members the same way; the in-process store keeps 30 instances cheap to run here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

from lease_core import MemoryBackend, RunContext, Scheduler

OUT = Path(__file__).resolve().parent / "out"


class _Counting:
    def __init__(self, inner: Any, counts: Counter[str], name: str) -> None:
        self.inner, self.counts, self.name = inner, counts, name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr not in ("claim", "claim_many"):
            return value

        async def counted(arg: Any) -> Any:
            self.counts[self.name] += len(arg) if attr == "claim_many" else 1
            return await value(arg)

        return counted


async def _until(ready: Any, seconds: float = 30) -> None:
    with anyio.fail_after(seconds):
        while True:
            if ready():
                return
            await anyio.sleep(0.02)


async def measure(instances: int, jobs: int, slots: int = 4) -> dict[str, Any]:
    """Claims per run and the busiest instance's share, for ``instances`` schedulers."""
    backend = MemoryBackend()
    counts: Counter[str] = Counter()
    ran: Counter[tuple[str, int]] = Counter()
    by: Counter[str] = Counter()
    schedulers = []
    for i in range(instances):
        name = f"instance-{i:02d}"
        s = Scheduler(backend, instance_id=name, lease="3s", heartbeat="0.5s")
        s.backend = _Counting(s.backend, counts, name)  # type: ignore[assignment]
        for j in range(jobs):
            async def tick(ctx: RunContext, name: str = name) -> None:
                ran[(ctx.job, ctx.slot)] += 1
                by[name] += 1
            s.every(f"job-{j}", "1s", tick)
        schedulers.append(s)
    for s in schedulers:
        await s.start()
    try:
        await _until(lambda: all(s.health().fleet_size == instances for s in schedulers))
        clock = schedulers[0].store_now_ms
        first = (clock() // 1000 + 1) * 1000
        await _until(lambda: clock() >= first)
        counts.clear()
        by.clear()
        end = first + slots * 1000
        await _until(lambda: clock() >= end + 500)
        claims = sum(counts.values())
        runs = sum(1 for job, slot in ran if first <= slot < end)
    finally:
        for s in schedulers:
            await s.stop(grace=0)
    fair = runs / instances
    return {
        "instances": instances, "jobs": jobs, "slots": slots, "runs": runs,
        "claims": claims, "claims_per_run": round(claims / max(runs, 1), 3),
        "busiest_share_vs_fair": round(max(by.values(), default=0) / max(fair, 1e-9), 2),
        "ran_twice": sum(1 for n in ran.values() if n > 1),
    }


async def _main(sizes: list[int], jobs: int) -> list[dict[str, Any]]:
    results = []
    for n in sizes:
        row = await measure(n, jobs)
        print(f"{n:3d} instances: {row['claims_per_run']:.2f} claims per run "
              f"({row['claims']} claims, {row['runs']} runs), busiest "
              f"{row['busiest_share_vs_fair']:.2f}x its fair share, "
              f"{row['ran_twice']} runs twice", file=sys.stderr, flush=True)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    """Measure each fleet size and write ``benchmarks/out/fleet.json``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__)
    parser.add_argument("--instances", default="3,10,30")
    parser.add_argument("--jobs", type=int, default=300, help="jobs due every second")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.instances.split(",")]
    results = anyio.run(_main, sizes, args.jobs)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fleet.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
