"""anarchon's benchmarks: library against the raw driver, in the same run (see README.md).

Run them with ``make bench`` (everything) or ``make bench-quick`` (a short subset), or
``python -m benchmarks.run --help``. They are never part of the default test run.
"""
