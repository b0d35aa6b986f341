"""Named parameters: a statement that uses a value more than once names it (``%(job)s``)
and the value is passed once; each driver gets the placeholders it takes, and a user's own
adapter still gets ``%s`` placeholders with a list.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from adapters._placeholders import numbered, positional
from adapters.custom import CustomAdapter
from adapters.pg8000 import inline_parameters
from adapters.sql import numbered_placeholders
from backends.postgres import QUERIES, Statements
from lease_core import ConfigurationError

pytestmark = pytest.mark.anyio

NAMED = "SELECT %(job)s::text, %(n)s::bigint WHERE %(job)s::text IS NOT NULL AND '%%' = '%%'"
#: ``%(name)s`` placeholders.
NAME = re.compile(r"%\(([A-Za-z_][A-Za-z0-9_]*)\)s")


def test_numbered_gives_each_named_value_one_number() -> None:
    assert numbered(NAMED, {"job": "j", "n": 3, "unused": 0}) == (
        "SELECT $1::text, $2::bigint WHERE $1::text IS NOT NULL AND '%' = '%'", ("j", 3))
    assert numbered("SELECT %s, %s, '%%'", ("a", 1)) == ("SELECT $1, $2, '%'", ("a", 1))
    assert numbered_placeholders("SELECT %s, %s") == "SELECT $1, $2"


def test_positional_repeats_a_named_value_at_each_of_its_places() -> None:
    assert positional(NAMED, {"job": "j", "n": 3}) == (
        "SELECT %s::text, %s::bigint WHERE %s::text IS NOT NULL AND '%%' = '%%'",
        ("j", 3, "j"))
    assert positional("SELECT %s", ["a"]) == ("SELECT %s", ("a",))


def test_inline_parameters_writes_a_named_value_at_each_of_its_places() -> None:
    assert inline_parameters(NAMED, {"job": "o'k", "n": None}) == (
        "SELECT E'o''k'::text, NULL::bigint WHERE E'o''k'::text IS NOT NULL AND '%' = '%'")


def test_a_style_mismatch_or_a_missing_name_is_refused() -> None:
    for call in (lambda: numbered(NAMED, ("j", 3)), lambda: positional("SELECT %s", {"a": 1}),
                 lambda: inline_parameters("SELECT %s", {"a": 1}),
                 lambda: inline_parameters(NAMED, ("j", 3))):
        with pytest.raises(ConfigurationError, match="placeholders"):
            call()
    for call in (lambda: numbered(NAMED, {"job": "j"}),
                 lambda: positional(NAMED, {"n": 1}),
                 lambda: inline_parameters(NAMED, {"job": "j"})):
        with pytest.raises(ConfigurationError, match="needs the parameter"):
            call()


class _UserAdapter:
    """A user's adapter, as adapters.custom documents the protocol."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    async def all(self, sql: str, params: Any) -> list[tuple[Any, ...]]:
        self.seen.append((sql, params))
        return [(1,)]

    async def transaction(self, fn: Any) -> Any:
        return await fn(self)


async def test_a_user_adapter_gets_percent_s_placeholders_and_a_list() -> None:
    user = _UserAdapter()
    adapter = CustomAdapter(user)
    assert await adapter.all(NAMED, {"job": "j", "n": 3}) == [(1,)]
    assert await adapter.all("SELECT %s", ("a",)) == [(1,)]
    assert await adapter.run_transaction(lambda tx: tx.all(NAMED, {"job": "t", "n": 4})) == [
        (1,)]
    assert user.seen == [
        ("SELECT %s::text, %s::bigint WHERE %s::text IS NOT NULL AND '%%' = '%%'",
         ["j", 3, "j"]),
        ("SELECT %s", ["a"]),
        ("SELECT %s::text, %s::bigint WHERE %s::text IS NOT NULL AND '%%' = '%%'",
         ["t", 4, "t"]),
    ]


def test_each_statement_uses_one_style_and_the_named_ones_name_repeated_values() -> None:
    statements = Statements(None, "runs")
    named = {}
    for name in QUERIES:
        text = getattr(statements, name)
        names = NAME.findall(text)
        if names:
            assert "%s" not in text, name
            named[name] = names
    # Every named statement passes some value more than once (the reason it names them).
    assert all(len(set(names)) < len(names) for names in named.values()), named
    assert {"trim_job", "trim_jobs", "list_runs"} <= set(named)
    # the trimmed mark, the N-th newest, the runs read as they are now, and the steps of
    # its workflow (held together, the other steps' runs read as they are now too)
    assert named["trim_job"].count("job") == 12
