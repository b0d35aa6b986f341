"""The SQL of the PostgreSQL backend, filled with one store's names: :class:`Statements`.

The statements live in ``backends/postgres_sql/`` (see :mod:`backends.postgres`), are
loaded once, and are filled per store by ``str.format`` with quoted identifiers only.
The store's versions are here: :data:`FORMAT_VERSION` (the tables' layout) and
:data:`CODE_VERSION` (the claim functions), the one place the claim functions' version is
written: :data:`CLAIM_SUFFIX`, :data:`BATCH_SUFFIX` and :data:`FINISH_SUFFIX` compose their
names from it, and the SQL files call them ``{claim}``, ``{batch}`` and ``{finish}``.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterable

from lease_core.errors import ConfigurationError

__all__ = [
    "BATCH_SUFFIX",
    "BODY_MARKS",
    "CLAIM_ARG_COUNT",
    "CLAIM_SUFFIX",
    "CODE_VERSION",
    "FAILOVER_SUFFIX",
    "FINISH_FUNCTION",
    "FINISH_SUFFIX",
    "FORMAT_VERSION",
    "LEASE_SUFFIX",
    "LOCK_NOT_AVAILABLE",
    "NOW",
    "OPEN_SUFFIX",
    "OPERATE_SUFFIX",
    "QUERIES",
    "TRIM_BATCH",
    "Statements",
    "bool_array",
    "int_array",
    "parse_queries",
    "quote_ident",
    "split_table",
    "sqlstate",
    "store_names",
    "text_array",
]

#: The store format this code writes (the tables' layout, which an older release can still
#: use); a store with a newer one is refused.
FORMAT_VERSION = 1
#: The store code version: the claim function ``<table>_claim_v<N>`` of this release and
#: the columns it keeps. ``start()`` upgrades an older store (privileged user) or refuses
#: it with an error naming ``anarchon migrate``.
CODE_VERSION = 4
#: The suffixes of this release's claim functions, ``<table>_claim_v<CODE_VERSION>`` and
#: ``<table>_batch_v<CODE_VERSION>``: the only place their version is written (the SQL
#: files name them ``{claim}`` and ``{batch}``).
CLAIM_SUFFIX = f"_claim_v{CODE_VERSION}"
BATCH_SUFFIX = f"_batch_v{CODE_VERSION}"
#: The suffix of this release's finish function, ``<table>_end_v<CODE_VERSION>`` (store
#: code v4 and later; short, so that it limits the table name no more than the others).
FINISH_SUFFIX = f"_end_v{CODE_VERSION}"
#: The suffix of the open runs' partial index (running, handed over, retrying), which
#: replaced ``<table>_open`` (without retrying runs) in store code v4.
OPEN_SUFFIX = "_opens"
#: The suffix of this release's operations function, ``<table>_op_v<CODE_VERSION>``
#: (``postgres_sql/operate_v<N>.sql``; lease_core/operations.py).
OPERATE_SUFFIX = f"_op_v{CODE_VERSION}"
#: The suffix of the failover detection function, ``<table>_fo_v<CODE_VERSION>``
#: (``postgres_sql/failover_v<N>.sql``; issue 21).
FAILOVER_SUFFIX = f"_fo_v{CODE_VERSION}"
#: The suffix of this release's named-lease function, ``<table>_lease_v<CODE_VERSION>``
#: (``postgres_sql/lease_v<N>.sql``; lease_core/lease.py).
LEASE_SUFFIX = f"_lease_v{CODE_VERSION}"
#: The trim batch older releases pass to the claim function (the current one ignores it).
TRIM_BATCH = 100
#: SQLSTATE of a lock wait that ran out (``lock_timeout``) or a NOWAIT lock refused.
LOCK_NOT_AVAILABLE = "55P03"


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Suffixes of the names derived from ``table``, by kind: tables, indexes, functions.
_KIND_SUFFIXES = {
    "table": ("", "_attempts", "_jobs", "_meta"),
    "index": ("_open", OPEN_SUFFIX, "_a_seq", "_a_claimed", "_a_job", "_a_fin"),
    "function": ("_claim", "_claim_v2", "_batch_v2", "_claim_v3", "_batch_v3", CLAIM_SUFFIX,
                 BATCH_SUFFIX, FINISH_SUFFIX, OPERATE_SUFFIX, FAILOVER_SUFFIX, LEASE_SUFFIX),
}
_SUFFIXES = tuple(suffix for suffixes in _KIND_SUFFIXES.values() for suffix in suffixes)


def store_names(table: str, kind: str | None = None) -> tuple[str, ...]:
    """Every name a store whose runs table is ``table`` may create in its schema (tables,
    indexes and functions, of this release and the earlier ones it upgrades); with
    ``kind`` (``"table"``, ``"index"`` or ``"function"``), those of that kind only."""
    suffixes = _SUFFIXES if kind is None else _KIND_SUFFIXES[kind]
    return tuple(table + suffix for suffix in suffixes)


NOW = "(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)"

#: The parameters of the store code v3 claim function (and of v4's before it took
#: ``p_scheduled``); its name now calls the current function.
CLAIM_ARGS_V3 = ("p_job text, p_slot bigint, p_instance text, p_token text, "
                 "p_lease_ms bigint, p_reason text, p_overlap_skip boolean, "
                 "p_max_attempts bigint")
CLAIM_ARG_TYPES_V3 = "text, bigint, text, text, bigint, text, boolean, bigint"
#: The claim function's parameters, in order (also its signature for GRANT).
CLAIM_ARGS = CLAIM_ARGS_V3 + ", p_scheduled boolean"
CLAIM_ARG_TYPES = CLAIM_ARG_TYPES_V3 + ", boolean"
#: How many parameters the claim function takes (``find_tables`` checks it: a v4 store
#: made by an earlier build of this release has the claim without ``p_scheduled``).
CLAIM_ARG_COUNT = CLAIM_ARG_TYPES.count(",") + 1
#: Function suffix -> a text its body of this build contains: a function of this store
#: code whose body an earlier build of it made (without the text) is made again on start.
BODY_MARKS = {OPERATE_SUFFIX: "operate body 3", CLAIM_SUFFIX: "claimed_at written",
              "_claim": "in the words of 0.1.0"}
#: The parameters of the store code v1 and v2 claim functions (which also took the
#: history to keep and trimmed it); their names now call the current function.
CLAIM_ARGS_V2 = (CLAIM_ARGS_V3 + ", p_history_size bigint, p_history_ttl_ms bigint, "
                 "p_trim_batch bigint")
#: Their argument types (for GRANT).
CLAIM_ARG_TYPES_V2 = CLAIM_ARG_TYPES_V3 + ", bigint, bigint, bigint"

# --- the SQL files ----------------------------------------------------------------------

_SQL_PACKAGE = "postgres_sql"
_HEADER = re.compile(r"^-- name: ([a-z0-9_]+)[ \t]*$", re.MULTILINE)


def _sql_file(name: str) -> str:
    """The text of one file of ``backends/postgres_sql/`` (shipped in the wheel)."""
    return (importlib.resources.files("backends") / _SQL_PACKAGE / name).read_text("utf-8")


def parse_queries(text: str) -> dict[str, str]:
    """Split ``-- name: <name>`` sections into statements, dropping whole-line comments."""
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"statement {name!r} is defined twice")
        kept = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        queries[name] = "\n".join(kept).strip()
    return queries


#: Every statement of ``postgres_sql/queries.sql``, by name, as templates.
QUERIES = parse_queries(_sql_file("queries.sql"))
#: The claim function of this release (``postgres_sql/claim_v<CODE_VERSION>.sql``), as a
#: template.
CLAIM_FUNCTION = _sql_file(f"claim_v{CODE_VERSION}.sql")
#: The batched claim function of this release (``postgres_sql/batch_v<CODE_VERSION>.sql``),
#: as a template.
BATCH_FUNCTION = _sql_file(f"batch_v{CODE_VERSION}.sql")
#: The finish function of this release (``postgres_sql/finish_v<CODE_VERSION>.sql``), as a
#: template.
FINISH_FUNCTION = _sql_file(f"finish_v{CODE_VERSION}.sql")
# Operations: their statements (postgres_sql/operations.sql) and function.
QUERIES.update(parse_queries(_sql_file("operations.sql")))
#: The operations function of this release (``postgres_sql/operate_v<CODE_VERSION>.sql``).
OPERATE_FUNCTION = _sql_file(f"operate_v{CODE_VERSION}.sql")
#: Failover detection (issue 21): the function the claims and named leases call.
FAILOVER_FUNCTION = _sql_file(f"failover_v{CODE_VERSION}.sql")
# Named leases: their calls (postgres_sql/leases.sql) and function.
QUERIES.update(parse_queries(_sql_file("leases.sql")))
#: The named-lease function of this release (``postgres_sql/lease_v<CODE_VERSION>.sql``).
LEASE_FUNCTION = _sql_file(f"lease_v{CODE_VERSION}.sql")
#: The v1 name of the claim function, redefined as a call of the current one.
CLAIM_FUNCTION_V1 = _sql_file("claim_v1.sql")
#: The v2 name of the claim function, redefined as a call of the current one.
CLAIM_FUNCTION_V2 = _sql_file("claim_v2.sql")
#: The v2 name of the batched claim function, redefined as a call of the current one.
BATCH_FUNCTION_V2 = _sql_file("batch_v2.sql")
#: The v3 name of the claim function, redefined as a call of the current one.
CLAIM_FUNCTION_V3 = _sql_file("claim_v3.sql")
#: The v3 name of the batched claim function, redefined as a call of the current one.
BATCH_FUNCTION_V3 = _sql_file("batch_v3.sql")
#: The tables and indexes, in creation order.
DDL = tuple(QUERIES[name] for name in (
    "create_meta", "create_jobs", "create_runs", "create_runs_open", "create_attempts",
    "create_attempts_seq", "create_attempts_claimed", "create_attempts_job"))


def quote_ident(name: str) -> str:
    """Quote one SQL identifier (the only place identifiers are turned into SQL text)."""
    return '"' + name.replace('"', '""') + '"'


# Array parameters are sent as PostgreSQL array literals (text), which every statement
# casts (``%s::text[]``): the drivers' own list adaptation inspects every element and
# builds a dumper per array at each call (psycopg: 250 µs of client CPU for a claim batch
# of 13, against 133 µs sent as literals; 724 against 220 µs for 100).


def text_array(values: Iterable[str | None]) -> str:
    """``values`` as a PostgreSQL ``text[]`` literal: each element quoted (``\\`` and
    ``"`` escaped), None as NULL."""
    return "{" + ",".join(
        "NULL" if v is None else '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
        for v in values) + "}"


def int_array(values: Iterable[int | None]) -> str:
    """``values`` as a PostgreSQL integer array literal (``bigint[]``), None as NULL."""
    return "{" + ",".join("NULL" if v is None else str(int(v)) for v in values) + "}"


def bool_array(values: Iterable[bool | None]) -> str:
    """``values`` as a PostgreSQL ``boolean[]`` literal, None as NULL."""
    return "{" + ",".join("NULL" if v is None else "t" if v else "f" for v in values) + "}"


def split_table(table: object) -> tuple[str | None, str]:
    """``table`` as (schema or None, name), validated (``ConfigurationError`` naming it)."""
    if not isinstance(table, str):
        raise ConfigurationError(f"table must be a string such as 'anarchon_runs', not {table!r}")
    parts = table.split(".")
    if len(parts) > 2 or not all(_IDENT.fullmatch(part) for part in parts):
        raise ConfigurationError(
            f"invalid table name {table!r}: use letters, digits and underscores, optionally "
            "prefixed by a schema ('jobs.cron_runs'); no quotes, spaces or extra dots"
        )
    schema, name = (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    longest = max(_SUFFIXES, key=len)
    if len((name + longest).encode()) > 63 or (schema and len(schema.encode()) > 63):
        raise ConfigurationError(
            f"table name {table!r} is too long: PostgreSQL identifiers hold 63 bytes and "
            f"anarchon derives names such as {name + longest!r}; use at most "
            f"{63 - len(longest)} characters for the table"
        )
    return schema, name


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error (psycopg or pg8000), or of the error that caused it."""
    seen: BaseException | None = exc
    while seen is not None:
        state = getattr(seen, "sqlstate", None)
        if isinstance(state, str):
            return state
        args = getattr(seen, "args", ())
        if args and isinstance(args[0], dict) and isinstance(args[0].get("C"), str):
            return str(args[0]["C"])
        seen = seen.__cause__
    return None


class Statements:
    """The SQL this backend sends, filled with one store's quoted table names.

    Public for tools that run the very same statements through a raw driver (the
    benchmarks compare the library with that); the statements' text is not a stable API.
    Every statement of ``postgres_sql/queries.sql`` is an attribute of the same name.
    """

    def __init__(self, schema: str | None, name: str) -> None:
        prefix = quote_ident(schema) + "." if schema else ""
        names = {
            "runs": prefix + quote_ident(name),
            "attempts": prefix + quote_ident(name + "_attempts"),
            "jobs": prefix + quote_ident(name + "_jobs"),
            "meta": prefix + quote_ident(name + "_meta"),
            "open_idx": quote_ident(name + OPEN_SUFFIX),
            "open_idx_old": quote_ident(name + "_open"),
            "open_idx_old_q": prefix + quote_ident(name + "_open"),
            "seq_idx": quote_ident(name + "_a_seq"),
            "claimed_idx": quote_ident(name + "_a_claimed"),
            "job_idx": quote_ident(name + "_a_job"),
            "fin_idx": quote_ident(name + "_a_fin"),
            "fin_idx_q": prefix + quote_ident(name + "_a_fin"),
            "claim_v1": prefix + quote_ident(name + "_claim"),
            "claim_v2": prefix + quote_ident(name + "_claim_v2"),
            "batch_v2": prefix + quote_ident(name + "_batch_v2"),
            "claim_v3": prefix + quote_ident(name + "_claim_v3"),
            "batch_v3": prefix + quote_ident(name + "_batch_v3"),
            "finish": prefix + quote_ident(name + FINISH_SUFFIX),
            "operate": prefix + quote_ident(name + OPERATE_SUFFIX),
            "failover": prefix + quote_ident(name + FAILOVER_SUFFIX),
            "lease": prefix + quote_ident(name + LEASE_SUFFIX),
            "claim": prefix + quote_ident(name + CLAIM_SUFFIX),
            "batch": prefix + quote_ident(name + BATCH_SUFFIX),
            "claim_args": CLAIM_ARGS,
            "claim_arg_types": CLAIM_ARG_TYPES,
            "claim_args_v3": CLAIM_ARGS_V3,
            "claim_arg_types_v3": CLAIM_ARG_TYPES_V3,
            "claim_args_v2": CLAIM_ARGS_V2,
            "claim_arg_types_v2": CLAIM_ARG_TYPES_V2,
            "now": NOW,
        }

        def fill(template: str) -> str:
            return template.format(**names).strip()

        for key, template in QUERIES.items():
            setattr(self, key, fill(template))
        self.ddl = tuple(fill(statement) for statement in DDL)
        self.create_claim_function = fill(CLAIM_FUNCTION)
        self.create_batch_function = fill(BATCH_FUNCTION)
        self.create_finish_function = fill(FINISH_FUNCTION)
        self.create_operate_function = fill(OPERATE_FUNCTION)
        self.create_failover_function = fill(FAILOVER_FUNCTION)
        self.create_lease_function = fill(LEASE_FUNCTION)
        self.create_claim_v1 = fill(CLAIM_FUNCTION_V1)
        self.create_claim_v2 = fill(CLAIM_FUNCTION_V2)
        self.create_batch_v2 = fill(BATCH_FUNCTION_V2)
        self.create_claim_v3 = fill(CLAIM_FUNCTION_V3)
        self.create_batch_v3 = fill(BATCH_FUNCTION_V3)
        self.runs_table = names["runs"]
        self.attempts_table = names["attempts"]
        #: The indexes older releases made, as drop_runs_open_old and
        #: drop_attempts_finished name them.
        self.open_index_old = names["open_idx_old_q"]
        self.finished_index = names["fin_idx_q"]
        #: The four tables (schema-qualified when the table is), by role.
        self.tables = {role: names[role] for role in ("runs", "attempts", "jobs", "meta")}

    def __getattr__(self, name: str) -> str:
        """Typed access to the statements set from ``queries.sql`` (unknown: AttributeError)."""
        raise AttributeError(f"no statement named {name!r} in postgres_sql/queries.sql")
