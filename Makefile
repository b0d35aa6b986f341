# The two commands: `make demo` and `make test`. Both create and reuse .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-minimums test-pythons docs screenshots lint system-deps bench bench-quick bench-ci chaos clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

## Run the fleet demo, then the bank-close workflow demo, on an embedded PostgreSQL.
demo: $(STAMP)
	env -u ANARCHON_URL $(VENV)/bin/anarchon demo
	env -u ANARCHON_URL $(VENV)/bin/anarchon demo --workflow bank-close

## Run the whole test suite against servers the harness starts itself. Six workers on
## two cores: most tests wait on leases and timers, not on the CPU (measured on this
## machine: the whole run took 12 minutes at six workers, its tests' own times 16% longer
## than at four, which took 15); the few that load the CPU for many seconds
## (tests/conftest.py HEAVY_MODULES) share one worker (--dist loadgroup).
## The 20 slowest tests are listed at the end: the suite must stay under 15 minutes.
test: $(STAMP) system-deps
	$(PY) -m pytest -n 6 --dist loadgroup --durations=20

## A fast part of the suite with every dependency at the lowest version pyproject.toml
## accepts (tests/minimums.txt, kept equal to the declared bounds by tests/test_packaging.py),
## on the lowest Python the project supports, in .venv-minimums (made anew when either file
## changes). Not part of `make test` or CI: run it after raising or adding a dependency.
MIN_PYTHON ?= python3.11
MIN_VENV := .venv-minimums
MIN_STAMP := $(MIN_VENV)/.installed-stamp

$(MIN_STAMP): pyproject.toml tests/minimums.txt
	rm -rf $(MIN_VENV)
	$(MIN_PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MIN_VENV)/bin/python -m pip install --quiet -c tests/minimums.txt -e ".[test]"
	touch $(MIN_STAMP)

## Each file here is one that failed on a dependency below its bound, or exercises one:
## the psycopg pools (reconnection, sizes), cancellation on trio, partitions (psycopg's
## cancel), redis-py's lean path, otel, the testing kit (hypothesis), the HTTP API, page
## and `anarchon serve` (starlette, uvicorn, fastapi, httpx), schedules (croniter).
MINIMUMS_TESTS ?= tests/test_pool_bounds.py tests/test_health.py tests/test_adapter_safety.py \
	tests/test_redis_lean.py tests/test_otel.py tests/test_testing_kit.py tests/test_http.py \
	tests/test_cli_safety.py tests/test_schedules.py "tests/test_lease.py::test_lost_through_a_network_partition"

test-minimums: $(MIN_STAMP) system-deps
	$(MIN_VENV)/bin/python -m pytest -q -n 2 --durations=5 $(MINIMUMS_TESTS)

## The documentation site (docs/mkdocs.yml, pages in docs/pages/) into build/docs; --strict
## fails on a broken link or a missing API page.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -f docs/mkdocs.yml

## The status page's screenshots in docs/pages/images/ (status-*.png), taken afresh by
## its browser test (tests/test_page.py, headless chromium) with ANARCHON_SCREENSHOTS set:
## run it after changing the page, and commit the images.
screenshots: $(STAMP) system-deps
	ANARCHON_SCREENSHOTS=docs/pages/images $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_page.py -k "overview_drill_down or 1000_jobs"

## A representative part of the suite and the demos of `make demo` on Python 3.12 and 3.13
## (pyenv's, or pythonX.Y on PATH), each in a venv of its own under .venv/pythons/.
PYTHONS ?= 3.12 3.13
test-pythons: system-deps
	sh .ci/test-pythons.sh $(PYTHONS)

## ruff and mypy --strict on the library, then the code's shape (.ci/shape.py: module and
## class sizes, import cycles, private touches in tests).
lint: $(STAMP)
	$(VENV)/bin/ruff check lease_core backends adapters tests benchmarks
	$(VENV)/bin/mypy
	$(PY) .ci/shape.py

BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(BENCH_STAMP)

## Every benchmark (about 26 minutes on 2 cores): benchmarks/out/full.{json,md} and PNG plots.
bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.run

## A short subset (under 3 minutes): benchmarks/out/quick.{json,md}.
bench-quick: $(BENCH_STAMP)
	$(PY) -m benchmarks.run --quick

## The quick benchmark compared with benchmarks/baseline-quick.json (run by CI).
bench-ci: $(BENCH_STAMP)
	PY=$(PY) sh benchmarks/ci.sh

## Chaos run (about 11 minutes): >= 10,000 slots across the stores, faults injected
## (store restarts included, behind PgBouncer too; on the replicated stores, PostgreSQL 16
## and 15 with a streaming replica and Redis with Sentinel, lossy failovers), then
## audited; figures in tests/chaos/RESULTS.md.
CHAOS_ARGS ?= --slots 10000 --stores postgres,redis,pgbouncer,pgreplica,pgreplica15,redis-sentinel
chaos: $(STAMP) system-deps
	$(PY) -m tests.chaos $(CHAOS_ARGS)

## System binaries the tests need (PgBouncer), installed with apt-get when missing.
system-deps:
	@sh .ci/system-deps.sh

clean:
	rm -rf $(VENV) $(MIN_VENV) build *.egg-info
