"""The store code version is written once: ``backends.postgres.CODE_VERSION``.

The SQL files name this release's claim functions ``{claim}`` and ``{batch}``, never by
their version; the Python code composes ``<table>_claim_v<N>`` from ``CODE_VERSION`` in
one place. So the version the statements call, the functions ``start()`` creates and
grants, the names older releases call and the code version recorded in the store
cannot disagree, and bumping the version is a change of ``CODE_VERSION`` (and the new
function's file).
"""

from __future__ import annotations

import re
from importlib import resources

import backends.postgres as postgres
from backends.postgres import BATCH_SUFFIX, CLAIM_SUFFIX, CODE_VERSION, FINISH_SUFFIX, Statements
from backends.redis import SCRIPTS, STORE_FORMAT

SQL = resources.files("backends") / "postgres_sql"
#: A versioned name in SQL text: a placeholder such as {claim_v2} or a file name.
VERSIONED = re.compile(r"(?:claim|batch|end)_v(\d+)\b")


def _sql_texts() -> dict[str, str]:
    return {f.name: f.read_text("utf-8") for f in SQL.iterdir() if f.name.endswith(".sql")}


def _code(text: str) -> str:
    """The SQL without its comment lines (prose may name the file's own version)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


def test_the_sql_files_never_name_the_current_version() -> None:
    for name, text in _sql_texts().items():
        versions = {int(v) for v in VERSIONED.findall(_code(text))}
        # Only the names of older releases, which the upgrade redefines as calls of {claim}.
        assert all(v < CODE_VERSION for v in versions), (name, versions)
    # queries.sql names the current version nowhere, not even in a comment or a name.
    queries = _sql_texts()["queries.sql"]
    assert not re.search(rf"v{CODE_VERSION}\b", queries)


def test_the_statements_call_and_create_the_functions_of_code_version() -> None:
    suffixes = (CLAIM_SUFFIX, BATCH_SUFFIX)
    assert suffixes == (f"_claim_v{CODE_VERSION}", f"_batch_v{CODE_VERSION}")
    loaded = (postgres.CLAIM_FUNCTION, postgres.BATCH_FUNCTION)
    assert loaded == ((SQL / f"claim_v{CODE_VERSION}.sql").read_text("utf-8"),
                      (SQL / f"batch_v{CODE_VERSION}.sql").read_text("utf-8"))
    s = Statements("app", "runs")
    claim, batch = f'"app"."runs{CLAIM_SUFFIX}"', f'"app"."runs{BATCH_SUFFIX}"'
    assert f"FROM {claim}(" in s.claim and f"FROM {batch}(" in s.claim_many
    assert f"CREATE OR REPLACE FUNCTION {claim}(" in s.create_claim_function
    assert f"CREATE OR REPLACE FUNCTION {batch}(" in s.create_batch_function
    assert f"FROM {claim}(" in s.create_batch_function
    assert f"ON FUNCTION {claim}(" in s.grant_claim and f"ON FUNCTION {batch}(" in s.grant_batch
    # The names older releases call are calls of this release's functions.
    for old in (s.create_claim_v1, s.create_claim_v2):
        assert f"FROM {claim}(" in old
    assert f"FROM {batch}(" in s.create_batch_v2 and f"FROM {batch}(" in s.create_batch_v3
    assert f"FROM {claim}(" in s.create_claim_v3
    # The finish function (store code v4 on) is named and loaded the same way.
    assert f"_end_v{CODE_VERSION}" == FINISH_SUFFIX
    assert (SQL / f"finish_v{CODE_VERSION}.sql").read_text("utf-8") == postgres.FINISH_FUNCTION
    finish = f'"app"."runs{FINISH_SUFFIX}"'
    assert f"SELECT {finish}(" in s.finish
    assert f"CREATE OR REPLACE FUNCTION {finish}(" in s.create_finish_function
    assert f"ON FUNCTION {finish}(" in s.grant_finish
    # Every versioned name in a filled statement is this release's or an older one's.
    filled = [value for value in vars(s).values() if isinstance(value, str)]
    filled += list(s.ddl)
    versions = {int(v) for text in filled for v in VERSIONED.findall(_code(text))}
    assert max(versions) == CODE_VERSION


def test_the_redis_scripts_take_the_store_format_from_python() -> None:
    # The Redis store's one version, STORE_FORMAT, is an argument of open_store.lua: no
    # script writes a format of its own.
    assert isinstance(STORE_FORMAT, int)
    assert "'format', ARGV[1]" in SCRIPTS["open_store"].source
    for script in SCRIPTS.values():
        assert not re.search(r"'format',\s*['\"]?\d", script.source), script.name
