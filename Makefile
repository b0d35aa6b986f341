# The two commands: `make demo` and `make test`. Both create and reuse .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint system-deps bench bench-quick clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

## Run the fleet demo on an embedded PostgreSQL (no server to install).
demo: $(STAMP)
	$(VENV)/bin/anarchon demo

## Run the whole test suite against servers the harness starts itself.
test: $(STAMP) system-deps
	$(PY) -m pytest

## ruff and mypy --strict on the library.
lint: $(STAMP)
	$(VENV)/bin/ruff check lease_core backends adapters tests benchmarks
	$(VENV)/bin/mypy

## System binaries the tests need (PgBouncer), installed with apt-get when missing.
system-deps:
	@sh .ci/system-deps.sh

clean:
	rm -rf $(VENV) build *.egg-info
