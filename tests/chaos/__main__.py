"""``python -m tests.chaos``: the full chaos run (``make chaos``); writes RESULTS.md."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from .run import FAULTS, ChaosConfig, Report, results_markdown, run_chaos
from .stores import KINDS, Unavailable

RESULTS = Path(__file__).with_name("RESULTS.md")


def main(argv: list[str] | None = None) -> int:
    """Run every store in turn; print the figures; return 1 when an invariant broke."""
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--slots", type=int, default=10_000,
                        help="slots to cover across all stores (sets --seconds)")
    parser.add_argument("--stores", default=",".join(KINDS),
                        help=f"comma-separated store kinds ({', '.join(KINDS)}), each "
                             "optionally with its own faults: pgbouncer:kill+stop")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of faults per store (default: from --slots)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated fault kinds ({', '.join(FAULTS)})")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--interval-ms", type=int, default=600)
    parser.add_argument("--steps", type=int, default=4, help="checkpointed steps per handler")
    parser.add_argument("--step-s", type=float, default=0.1, help="seconds per step")
    parser.add_argument("--spread", action="store_true",
                        help="spread the jobs' slots over the interval instead of all together")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--verbose", action="store_true",
                        help="workers log the library's INFO records to their .stderr file")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where workers write their records and logs (default: a new "
                             "temporary directory, printed)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="where to write the results (markdown); '-' for nowhere")
    parser.add_argument("--save", type=Path, default=None,
                        help="also write each store's figures to this JSON file")
    parser.add_argument("--include", type=Path, action="append", default=[],
                        help="figures saved by an earlier run (--save) to put in the results")
    args = parser.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    faults = tuple(f for f in args.faults.split(",") if f)
    # A SIGTERM ends the run through the finally blocks: workers and servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reports: list[Report] = []
    started = time.monotonic()
    for n, spec in enumerate(stores):
        kind, _, own = spec.partition(":")
        config = ChaosConfig(store=kind, workers=args.workers, jobs=args.jobs,
                             interval_ms=args.interval_ms, steps=args.steps,
                             step_s=args.step_s, spread=args.spread, seed=args.seed + n,
                             faults=tuple(own.split("+")) if own else faults,
                             verbose=args.verbose)
        if args.seconds is not None:
            config.seconds = args.seconds
        else:
            per_store = args.slots / len(stores)
            # Slots are also claimed while the fleet settles after the faults.
            settle = config.settle_leases * config.lease
            config.seconds = max(5.0, per_store / config.slots_per_second - settle)
        try:
            workdir = None if args.workdir is None else args.workdir / kind
            report = run_chaos(config, workdir,
                               progress=lambda m: print(m, file=sys.stderr, flush=True))
        except Unavailable as exc:
            print(f"{kind}: skipped, {exc} is not available", file=sys.stderr)
            continue
        report.store = spec
        reports.append(report)
        print(json.dumps(report.summary()), flush=True)
        for what, items in report.violations.items():
            print(f"{kind}: VIOLATION {what}: {len(items)}: {items[:10]}", file=sys.stderr)
    elapsed = time.monotonic() - started
    total = sum(r.slots for r in reports)
    print(f"{total} slots in {elapsed:.0f}s", file=sys.stderr)
    summaries = [r.summary() for r in reports]
    command = "python -m tests.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    commands = [command.strip()]
    if args.save is not None:
        args.save.write_text(json.dumps({"command": command.strip(), "summaries": summaries}))
    for path in reversed(args.include):
        saved = json.loads(path.read_text())
        summaries = saved["summaries"] + summaries
        commands.insert(0, saved["command"])
    if str(args.out) != "-":
        text = results_markdown(summaries, "`, then `".join(commands))
        wall = sum(float(s["wall_seconds"]) for s in summaries)
        text += f"\nWall time: {wall:.0f} s for the {len(summaries)} stores.\n"
        args.out.write_text(text + _notes_of(args.out))
    return 1 if any(r.violations for r in reports) else 0


def _notes_of(path: Path) -> str:
    """The sections written by hand below the figures of ``path`` (kept on a new run)."""
    try:
        old = path.read_text()
    except FileNotFoundError:
        return ""
    at = old.find("\n## ")
    while old.startswith("\n## Violations", at):
        # Written with the figures (not by hand): the next run writes its own.
        at = old.find("\n## ", at + 1)
    return "" if at < 0 else old[at:]


if __name__ == "__main__":
    sys.exit(main())
