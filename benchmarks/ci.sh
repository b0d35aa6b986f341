#!/bin/sh
# Quick benchmark, then compare its ratios with the committed baseline.
# Only ratios are compared (library against the raw driver in the same run), each the
# median of a few short interleaved rounds; a ratio fails when it dropped more than
# BENCH_THRESHOLD (default 0.2). The sections behind a failing comparison are measured
# again, up to twice, and a ratio fails only when every one of its measurements
# regressed, because the machine may be busy with other work.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THRESHOLD=${BENCH_THRESHOLD:-0.2}
OUT=benchmarks/out/ci.json
SECTIONS=benchmarks/out/ci-regressed.txt

rm -f "$SECTIONS"  # (a list an earlier run left must not choose what is measured again)
"$PY" -m benchmarks.run --quick --out "$OUT"
runs="$OUT"
for again in 1 2; do
    status=0
    "$PY" benchmarks/compare.py benchmarks/baseline-quick.json $runs \
        --threshold "$THRESHOLD" --sections-file "$SECTIONS" || status=$?
    if [ "$status" -eq 0 ]; then
        exit 0
    fi
    if [ "$status" -ne 1 ]; then  # unusable input (2): measuring again cannot help
        exit "$status"
    fi
    only=$(cat "$SECTIONS")
    echo "ci.sh: ratios regressed; measuring ${only:-every section} again ($again of 2)" \
        "to rule out a busy machine" >&2
    again_out="benchmarks/out/ci-again-$again.json"
    if [ -n "$only" ]; then
        "$PY" -m benchmarks.run --quick --only "$only" --out "$again_out"
    else
        "$PY" -m benchmarks.run --quick --out "$again_out"
    fi
    runs="$runs $again_out"
done
# A ratio fails only when it regressed in every measurement.
exec "$PY" benchmarks/compare.py benchmarks/baseline-quick.json $runs --threshold "$THRESHOLD"
