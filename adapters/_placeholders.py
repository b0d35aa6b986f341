"""Placeholders: how a statement's ``%s`` or ``%(name)s`` parameters reach each driver.

The backend's statements use ``%s`` with a sequence of parameters, or ``%(name)s`` with
a mapping where a value is used more than once (``%%`` is a literal percent sign; one
statement uses one style). psycopg takes both as they are. For the others:

- :func:`numbered` gives ``$1, $2, …`` placeholders and the values in their order, each
  named value once (pg8000's extended protocol, asyncpg);
- :func:`positional` gives ``%s`` placeholders and a tuple, a named value repeated at
  each of its places (what a user's own adapter receives, as before named parameters);
- :func:`inline_parameters` writes the values into the text as literals (pg8000's simple
  protocol, one message through PgBouncer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lease_core.errors import ConfigurationError

__all__ = ["inline_parameters", "numbered", "numbered_placeholders", "positional",
           "sql_literal"]

#: ``%s``, ``%(name)s`` or ``%%``.
_PLACEHOLDER = re.compile(r"%s|%\(([A-Za-z_][A-Za-z0-9_]*)\)s|%%")
_numbered: dict[str, str] = {}
#: Per statement text with named placeholders: its ``$n`` text and the names in order.
_named_numbered: dict[str, tuple[str, tuple[str, ...]]] = {}
#: Per statement text with named placeholders: its ``%s`` text and a name per place.
_named_positional: dict[str, tuple[str, tuple[str, ...]]] = {}
_END = object()


def _style_error(sql: str, named: bool) -> ConfigurationError:
    given = "a mapping" if named else "a sequence"
    other = "%s" if named else "%(name)s"
    return ConfigurationError(
        f"statement {sql[:60]!r} has {other} placeholders but its parameters are {given}; "
        "use %(name)s placeholders with a mapping or %s ones with a sequence"
    )


def numbered_placeholders(sql: str) -> str:
    """Rewrite ``%s`` placeholders as ``$1, $2, …`` (and ``%%`` as ``%``).

    For drivers that number their parameters, such as pg8000's core API or asyncpg.
    """
    cached = _numbered.get(sql)
    if cached is None:
        counter = iter(range(1, 1 << 16))

        def sub(match: re.Match[str]) -> str:
            if match.group(1) is not None:
                raise _style_error(sql, False)
            return "%" if match.group() == "%%" else f"${next(counter)}"

        cached = _numbered[sql] = _PLACEHOLDER.sub(sub, sql)
    return cached


def _split_named(sql: str, numbering: bool) -> tuple[str, tuple[str, ...]]:
    """``sql`` with ``$n`` (numbering: one per name) or ``%s`` (one per place) placeholders,
    and the names they stand for, in order."""
    cache = _named_numbered if numbering else _named_positional
    cached = cache.get(sql)
    if cached is None:
        names: list[str] = []

        def sub(match: re.Match[str]) -> str:
            name = match.group(1)
            if match.group() == "%%":
                return "%" if numbering else "%%"
            if name is None:
                raise _style_error(sql, True)
            if not numbering:
                names.append(name)
                return "%s"
            if name not in names:
                names.append(name)
            return f"${names.index(name) + 1}"

        cached = cache[sql] = (_PLACEHOLDER.sub(sub, sql), tuple(names))
    return cached


def _values(sql: str, names: tuple[str, ...], params: Mapping[str, Any]) -> tuple[Any, ...]:
    missing = [name for name in dict.fromkeys(names) if name not in params]
    if missing:
        raise ConfigurationError(
            f"statement {sql[:60]!r} needs the parameter(s) {', '.join(missing)}")
    return tuple(params[name] for name in names)


def numbered(sql: str, params: Sequence[Any] | Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """``sql`` with ``$1, $2, …`` placeholders and its values in their order.

    ``%s`` placeholders with a sequence: as :func:`numbered_placeholders`. ``%(name)s``
    placeholders with a mapping: one number per name, wherever it is used, so each value is
    passed once.
    """
    if isinstance(params, Mapping):
        text, names = _split_named(sql, numbering=True)
        return text, _values(sql, names, params)
    return numbered_placeholders(sql), tuple(params)


def positional(sql: str,
               params: Sequence[Any] | Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """``sql`` with ``%s`` placeholders only and its values, one per placeholder.

    A sequence is returned as it is; ``%(name)s`` placeholders with a mapping become ``%s``,
    the value repeated at each place its name is used (``%%`` stays ``%%``).
    """
    if isinstance(params, Mapping):
        text, names = _split_named(sql, numbering=False)
        return text, _values(sql, names, params)
    return sql, tuple(params)


def sql_literal(value: Any) -> str:
    """``value`` as a PostgreSQL literal; ``TypeError`` for a type with no literal here.

    Strings use the escape form (``E'...'``), so the result is the same whatever
    ``standard_conforming_strings`` says; a NUL character cannot be stored and is refused.
    """
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"'{value}'"
    if isinstance(value, str):
        if "\x00" in value:
            raise ConfigurationError("a text value holds a NUL character, which PostgreSQL "
                                     "cannot store; remove it")
        return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"
    if isinstance(value, list | tuple):
        return "ARRAY[" + ",".join(sql_literal(v) for v in value) + "]"
    raise TypeError(f"no SQL literal for {type(value).__name__}")


def inline_parameters(sql: str, params: Sequence[Any] | Mapping[str, Any]) -> str:
    """Replace the placeholders of ``sql`` by literals (``%%`` becomes ``%``).

    ``%s`` takes the sequence's values in order; ``%(name)s`` the mapping's value of that
    name, wherever it is used.
    """
    if isinstance(params, Mapping):
        def named(match: re.Match[str]) -> str:
            name = match.group(1)
            if match.group() == "%%":
                return "%"
            if name is None:
                raise _style_error(sql, True)
            if name not in params:
                raise ConfigurationError(f"statement {sql[:60]!r} needs the parameter {name}")
            return sql_literal(params[name])

        return _PLACEHOLDER.sub(named, sql)
    values = iter(params)

    def sub(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            raise _style_error(sql, False)
        return "%" if match.group() == "%%" else sql_literal(next(values))

    text = _PLACEHOLDER.sub(sub, sql)
    if next(values, _END) is not _END:
        raise ConfigurationError(f"more parameters than placeholders in {sql[:60]!r}")
    return text
