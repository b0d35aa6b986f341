#!/bin/sh
# Quick benchmark, then compare its ratios with the committed baseline.
# Only ratios are compared (library against the raw driver in the same run), each the
# best of 3 short repetitions; a ratio fails when it dropped more than BENCH_THRESHOLD
# (default 0.2). A failing comparison is re-measured once, and a ratio fails only when
# both measurements regressed, because the machine may be busy with other work.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THRESHOLD=${BENCH_THRESHOLD:-0.2}
OUT=benchmarks/out/ci.json

"$PY" -m benchmarks.run --quick --out "$OUT"
if "$PY" benchmarks/compare.py benchmarks/baseline-quick.json "$OUT" --threshold "$THRESHOLD"; then
    exit 0
fi
echo "ci.sh: ratios regressed; measuring once more to rule out a busy machine" >&2
"$PY" -m benchmarks.run --quick --out benchmarks/out/ci-again.json
# A ratio fails only when it regressed in both measurements.
exec "$PY" benchmarks/compare.py benchmarks/baseline-quick.json "$OUT" \
    benchmarks/out/ci-again.json --threshold "$THRESHOLD"
