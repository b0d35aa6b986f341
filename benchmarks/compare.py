#!/usr/bin/env python3
"""Compare the ratios of benchmark runs: ``compare.py OLD.json NEW.json [NEW2.json ...]``.

Only ratios are compared (library/raw, raw/library speed, reduction against the model),
never absolute times, so a busier machine does not fail the comparison. Every ratio is
oriented so that higher is better; a ratio regressed when ``new < old * (1 - threshold)``.
Exits 1 when any ratio regressed, 2 on unusable input, else 0. A ratio of NEW that is
not a finite number (NaN, infinity) counts as regressed: ``new < old`` is false for NaN,
so it would pass whatever it hides. A ratio of OLD that is not finite and positive is
unusable input, as is a threshold outside [0, 1): either would gate nothing.

A ratio of OLD that no NEW file has fails too (a benchmark that stopped producing it, or
a contender that could not run, must not pass the gate by its absence); a ratio only in
NEW is listed as new.

Given several NEW files (repeated measurements of the same code), each ratio takes its
best value among them: a ratio counts as regressed only when every measurement regressed,
which keeps a noisy, shared machine from failing the comparison by chance.
``--sections-file F`` writes the benchmark sections (``benchmarks.run --only``) that
measure the regressed ratios to ``F``, comma-separated, so that only those are measured
again.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

#: The ``benchmarks.run`` section that measures the ratios under each key prefix.
SECTION_OF_PREFIX = {"claim": "throughput", "heartbeat": "heartbeat", "load": "load",
                     "peers": "peers", "batch": "peers", "cluster": "cluster",
                     "burst": "burst", "lease": "lease", "fleet": "fleet",
                     "fleet_kill": "fleet_kill", "cpu": "cpu"}


def sections_of(keys: list[str]) -> list[str]:
    """The sections to run again to measure ``keys`` anew, in a stable order."""
    found = {SECTION_OF_PREFIX.get(key.split(".", 1)[0]) for key in keys}
    if None in found:  # a ratio of an unknown section: measure everything again
        return []
    return sorted(s for s in found if s)


def load_ratios(path: Path) -> dict[str, float]:
    """The ``ratios`` table of a results JSON."""
    data: dict[str, Any] = json.loads(path.read_text())
    ratios = data.get("ratios")
    if not isinstance(ratios, dict):
        raise ValueError(f"{path} has no 'ratios' table; is it a benchmarks/run.py output?")
    return {str(k): float(v) for k, v in ratios.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    """Print the table; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path, nargs="+")
    parser.add_argument("--threshold", type=float, default=0.2,
                        help="allowed relative drop of a ratio (default 0.2 = 20%%)")
    parser.add_argument("--sections-file", type=Path,
                        help="write the sections measuring the regressed ratios here "
                             "(empty: every section)")
    args = parser.parse_args(argv)
    if not 0 <= args.threshold < 1:
        print(f"compare: --threshold {args.threshold} is outside [0, 1): no ratio could "
              "regress", file=sys.stderr)
        return 2
    try:
        old = load_ratios(args.old)
        ungated = sorted(k for k, v in old.items() if not (math.isfinite(v) and v > 0))
        if ungated:
            raise ValueError(f"{args.old}: ratios that are not finite and positive gate "
                             f"nothing: {', '.join(ungated)}")
        new: dict[str, float] = {}
        for path in args.new:
            for key, value in load_ratios(path).items():
                # the best measurement; a finite one over NaN (max() keeps its first
                # argument when a comparison with NaN is false)
                best = new.get(key, value)
                new[key] = value if math.isnan(best) or value > best else best
    except (OSError, ValueError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    width = max((len(k) for k in old.keys() | new.keys()), default=10)
    print(f"{'ratio (higher is better)':<{width}}  {'old':>8}  {'new':>8}  {'change':>8}")
    regressed = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if b is None:
            print(f"{key:<{width}}  {a:>8.3f}  {'-':>8}  {'':>8}  MISSING")
            regressed.append(key)
            continue
        if a is None:
            print(f"{key:<{width}}  {'-':>8}  {b:>8.3f}  {'new':>8}")
            continue
        change = (b - a) / a
        flag = ""
        if not math.isfinite(b):
            print(f"{key:<{width}}  {a:>8.3f}  {b!s:>8}  {'':>8}  INVALID")
            regressed.append(key)
            continue
        if b < a * (1 - args.threshold):
            flag = "  REGRESSED"
            regressed.append(key)
        print(f"{key:<{width}}  {a:>8.3f}  {b:>8.3f}  {change:>+7.0%}{flag}")
    common = old.keys() & new.keys()
    if not common:
        print("compare: the two runs share no ratio", file=sys.stderr)
        return 2
    if regressed:
        print(f"\n{len(regressed)} of {len(old)} ratios regressed by more than "
              f"{args.threshold:.0%} or are missing or not a number: {', '.join(regressed)}")
        if args.sections_file:
            args.sections_file.write_text(",".join(sections_of(regressed)) + "\n")
        return 1
    print(f"\nno ratio regressed by more than {args.threshold:.0%} ({len(common)} compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
