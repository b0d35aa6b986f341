"""Placeholders: how a statement's ``%s`` or ``%(name)s`` parameters reach each driver.

The backend's statements use ``%s`` with a sequence of parameters, or ``%(name)s`` with
a mapping where a value is used more than once (one statement uses one style). The rule
is the same whatever the driver, and whether parameters are given or not: ``%%`` is a
literal percent sign, a ``%`` that starts neither a placeholder nor ``%%`` is refused, and
the number of ``%s`` placeholders must match the number of parameters (a mismatch raises
:class:`~lease_core.errors.ConfigurationError` here; psycopg raises its
``ProgrammingError``). psycopg takes both styles as they are (always with parameters, an
empty tuple for none, so that it processes ``%%`` too). For the others:

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

#: ``%s``, ``%(name)s``, ``%%``, or a ``%`` that starts none of them (refused).
_PLACEHOLDER = re.compile(r"%s|%\(([A-Za-z_][A-Za-z0-9_]*)\)s|%%|%")
#: Per statement text with ``%s`` placeholders: its ``$n`` text and its placeholder count.
_numbered: dict[str, tuple[str, int]] = {}
#: Per statement text with named placeholders: its ``$n`` text and the names in order.
_named_numbered: dict[str, tuple[str, tuple[str, ...]]] = {}
#: Per statement text with named placeholders: its ``%s`` text and a name per place.
_named_positional: dict[str, tuple[str, tuple[str, ...]]] = {}


def _style_error(sql: str, named: bool) -> ConfigurationError:
    given = "a mapping" if named else "a sequence"
    other = "%s" if named else "%(name)s"
    return ConfigurationError(
        f"statement {sql[:60]!r} has {other} placeholders but its parameters are {given}; "
        "use %(name)s placeholders with a mapping or %s ones with a sequence"
    )


def _stray_percent(sql: str) -> ConfigurationError:
    return ConfigurationError(
        f"statement {sql[:60]!r} has a % that starts no placeholder (%s or %(name)s); "
        "write %% for a literal percent sign"
    )


def _count_error(sql: str, placeholders: int, params: int) -> ConfigurationError:
    return ConfigurationError(
        f"statement {sql[:60]!r} has {placeholders} placeholder(s) but {params} "
        "parameter(s); pass one parameter per %s"
    )


def _number(sql: str) -> tuple[str, int]:
    """``sql`` with ``$1, $2, …`` for its ``%s`` placeholders, and how many there are."""
    cached = _numbered.get(sql)
    if cached is None:
        count = 0

        def sub(match: re.Match[str]) -> str:
            nonlocal count
            token = match.group()
            if match.group(1) is not None:
                raise _style_error(sql, False)
            if token == "%%":
                return "%"
            if token == "%":
                raise _stray_percent(sql)
            count += 1
            return f"${count}"

        text = _PLACEHOLDER.sub(sub, sql)
        cached = _numbered[sql] = (text, count)
    return cached


def numbered_placeholders(sql: str) -> str:
    """Rewrite ``%s`` placeholders as ``$1, $2, …`` (and ``%%`` as ``%``).

    For drivers that number their parameters, such as pg8000's core API or asyncpg. A
    ``%`` that starts no placeholder raises :class:`ConfigurationError`.
    """
    return _number(sql)[0]


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
            if match.group() == "%":
                raise _stray_percent(sql)
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

    ``%s`` placeholders with a sequence: as :func:`numbered_placeholders`, one value per
    placeholder (another count raises :class:`ConfigurationError`). ``%(name)s``
    placeholders with a mapping: one number per name, wherever it is used, so each value is
    passed once.
    """
    if isinstance(params, Mapping):
        text, names = _split_named(sql, numbering=True)
        return text, _values(sql, names, params)
    text, count = _number(sql)
    values = tuple(params)
    if len(values) != count:
        raise _count_error(sql, count, len(values))
    return text, values


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
    A negative number is written in parentheses (``(-5)``), so that it cannot follow a
    minus sign of the statement as a comment (``10-%s`` gives ``10-(-5)``, not ``10--5``).
    """
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        # A negative number in parentheses: after a minus sign, ``--5`` would start a comment.
        return f"({value})" if value < 0 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"'{value}'"
        text = repr(value)
        return f"({text})" if text.startswith("-") else text
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

    ``%s`` takes the sequence's values in order, one per placeholder (another count raises
    :class:`ConfigurationError`); ``%(name)s`` the mapping's value of that name, wherever
    it is used.
    """
    if isinstance(params, Mapping):
        def named(match: re.Match[str]) -> str:
            name = match.group(1)
            if match.group() == "%%":
                return "%"
            if match.group() == "%":
                raise _stray_percent(sql)
            if name is None:
                raise _style_error(sql, True)
            if name not in params:
                raise ConfigurationError(f"statement {sql[:60]!r} needs the parameter {name}")
            return sql_literal(params[name])

        return _PLACEHOLDER.sub(named, sql)
    values = tuple(params)
    count = 0

    def sub(match: re.Match[str]) -> str:
        nonlocal count
        token = match.group()
        if match.group(1) is not None:
            raise _style_error(sql, False)
        if token == "%%":
            return "%"
        if token == "%":
            raise _stray_percent(sql)
        count += 1
        return sql_literal(values[count - 1]) if count <= len(values) else ""

    text = _PLACEHOLDER.sub(sub, sql)
    if count != len(values):
        raise _count_error(sql, count, len(values))
    return text
