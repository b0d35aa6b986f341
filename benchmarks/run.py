"""Run the benchmarks: ``python -m benchmarks.run [--quick] [--only ...] [--out FILE]``.

Starts its own PostgreSQL and Redis on 127.0.0.1, runs each section with bounded loops,
stops the servers, and writes ``benchmarks/out/<name>.json``, ``<name>.md`` and the plots.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from . import report
from ._util import environment, pg_servers

SECTIONS = ("throughput", "heartbeat", "load", "rss", "failover", "peers", "cluster", "scale",
            "burst", "burst_fleet", "lease", "fleet", "fleet_kill", "cpu")
OUT = Path(__file__).resolve().parent / "out"


def log(text: str) -> None:
    """Progress on stderr."""
    print(text, file=sys.stderr, flush=True)


async def _run(servers: Any, args: argparse.Namespace, results: dict[str, Any]) -> None:
    quick = args.quick
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    if "throughput" in only:
        from .throughput import run_throughput

        log("claim throughput")
        results["throughput"] = await run_throughput(
            servers, quick=quick, seconds=args.seconds, repeat=args.repeat, log=log)
    if "heartbeat" in only:
        from .heartbeat import run_heartbeat

        log("heartbeat cost")
        results["heartbeat"] = await run_heartbeat(
            servers, quick=quick, budget=0.5 if quick else 1.5, log=log)
    if "load" in only:
        from .load import run_load

        log("store load")
        results["load"] = await run_load(servers, quick=quick, log=log)
    if "rss" in only:
        from .load import run_rss

        log("memory")
        results["rss"] = await run_rss(servers, leases=1000 if quick else 10_000, log=log)
    if "failover" in only:
        from .failover import run_failover

        log("failover and hand-over")
        results["failover"] = await run_failover(
            servers, trials=2 if quick else 4, stores=("pg",) if quick else ("pg", "redis"),
            log=log)
    if "peers" in only:
        from .peers import run_peers

        log("peers")
        results["peers"] = await run_peers(
            servers, seconds=0.15 if quick else 0.3, rounds=9 if quick else 15, log=log)
    if "cluster" in only:
        from .cluster import run_cluster

        log("redis cluster (3 nodes)")
        results["cluster"] = await run_cluster(quick=quick, log=log)
    if "scale" in only and not quick:
        from .scale import run_scale

        log("scale: fleets of scheduler processes, per-operation costs, the scale model")
        results["scale"] = await run_scale(servers, log=log)
    if "burst" in only:
        from .burst import run_burst

        log("burst: jobs due at one instant, 3 schedulers")
        results["burst"] = await run_burst(
            servers, sizes=(100,) if quick else (100, 1000),
            stores=("redis",) if quick else ("redis", "pg"), rounds=3 if quick else 5,
            log=log)
    if "burst_fleet" in only and not quick:
        from .burst_fleet import run_burst_fleet

        log("burst: jobs due at one instant, 3 instances in 3 processes")
        results["burst_fleet"] = await run_burst_fleet(servers, rounds=5, log=log)
    if "lease" in only:
        from .lease import run_lease

        log("lease: acquire + release against redis-py Lock and ShedLock")
        results["lease"] = await run_lease(
            servers, seconds=0.15 if quick else 0.3, rounds=9 if quick else 15, log=log)
    if "fleet" in only:
        from .fleet import run_fleet

        log("fleet: claims per run as the fleet grows, beside every instance claiming")
        results["fleet"] = await run_fleet(
            servers, sizes=(10,) if quick else (3, 10, 30),
            stores=("pg", "redis"),
            slots=2 if quick else 4, log=log)
    if "fleet_kill" in only:
        from .fleet_kill import run_fleet_kill

        log("fleet kill: one of 5 scheduler processes killed")
        results["fleet_kill"] = await run_fleet_kill(
            servers, trials=1 if quick else 2, stores=("pg",) if quick else ("pg", "redis"),
            log=log)
    if "cpu" in only:
        from .cpu import run_cpu

        log("cpu: client CPU per run, one scheduler, slots spread over each second")
        results["cpu"] = await run_cpu(servers, quick=quick, log=log)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, write the outputs; 0 when every target was met."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short subset (about 3 minutes)")
    parser.add_argument("--only", help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/out/"
                        "full.json or quick.json)")
    parser.add_argument("--seconds", type=float, help="seconds per throughput round and side")
    parser.add_argument("--repeat", type=int, help="rounds per throughput cell (library and "
                        "raw alternate; the median of the per-round ratios is reported)")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (0.15 if args.quick else 0.25)
    args.repeat = args.repeat or (8 if args.quick else 12)
    out = args.out or OUT / ("quick.json" if args.quick else "full.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {"mode": "quick" if args.quick else "full",
                               "settings": {"seconds": args.seconds, "repeat": args.repeat,
                                            "only": args.only}}
    with pg_servers() as servers:
        results["environment"] = environment(servers)
        anyio.run(_run, servers, args, results)
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["ratios"] = report.ratios(results)
    results["targets"] = report.targets(results)
    out.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    images = report.plots(results, out.parent, out.stem)
    report.write_markdown(results, out.with_suffix(".md"), images)
    log(f"wrote {out}, {out.with_suffix('.md')} and {len(images)} plots "
        f"in {results['elapsed_s']} s")
    missed = [name for name, t in results["targets"].items() if not t["met"]]
    if missed:
        log(f"targets missed: {', '.join(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
