"""Where a demo keeps its tables and keys: a namespace of its own, claimed, then removed.

Every demo run works under one namespace, a name such as ``anarchon_demo_3f9c2a1b``
(random, unless ``--namespace`` names one):

- on PostgreSQL, in the connection's current schema, every table, index and function the
  run creates is named ``<ns>`` or ``<ns>_*``: the store's runs table is ``<ns>`` (so
  ``anarchon status --namespace <ns>`` reads it) with ``<ns>_attempts``, ``<ns>_jobs``,
  ``<ns>_meta`` and its claim functions, the demo's own tables are ``<ns>_<name>``, and
  the table ``<ns>_demo`` marks the namespace as a demo's;
- on Redis, the namespace is the store's key prefix: ``{<ns>}:*`` and ``{<ns>/<job>}:*``;
  the key ``{<ns>}:demo`` marks it.

A demo *claims* its namespace before it creates anything: when any table, view, index,
sequence, type or function (PostgreSQL) or any key (Redis) already has a name of the
namespace, it raises :class:`NamespaceInUse` and has changed nothing. Otherwise it
creates the marker (and, on PostgreSQL, its own tables) in one transaction, which
fails, and so changes nothing, if another session took one of the names meanwhile.

:meth:`Namespace.remove` deletes a namespace only while its marker is there, only while
no scheduler runs on it (a kept demo still running: its fleet's live members), only while
the store under it holds no job but the demos' own (:data:`DEMO_JOBS`: a scheduler of
yours pointed at it would otherwise lose its history), and only what a demo creates: on
PostgreSQL the names a demo's store and tables have (:func:`demo_names`), each as the
kind a demo makes it (another object that merely starts with ``<ns>_``, such as a store
of yours named ``<ns>_runs`` or a table of yours named like a function of the demo's
store, ``<ns>_claim``, is left and reported), dropped in one transaction without
``CASCADE`` (an object of someone else's that depends on them makes it fail and change
nothing); on Redis its keys of the shapes a store and its marker have (a key of yours
that merely shares the namespace's hash tag, such as ``{<ns>}:queue``, is left and
reported), the marker last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from backends.postgres.statements import quote_ident, store_names
from lease_core._redact import MASK, redact
from lease_core._registry import backend_from_url, split_url_options
from lease_core.errors import AnarchonError, BackendUnavailable, ConfigurationError

__all__ = ["DEMO_JOBS", "DEMO_TABLES", "PREFIX", "Namespace", "NamespaceInUse",
           "NotADemoNamespace", "claimed", "demo_names", "namespace_for", "new_name",
           "validate_name"]

#: The start of every namespace a demo picks itself.
PREFIX = "anarchon_demo_"
#: Lower-case letters, digits and underscores, so the name needs no quoting in SQL, in a
#: Redis key pattern or on a shell's command line, and leaves room for the store's
#: suffixes within PostgreSQL's 63 bytes.
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,39}")
#: The marker's suffix: the table ``<ns>_demo``, the key ``{<ns>}:demo``.
MARKER = "demo"
#: The store options a URL may carry that would name the store's tables or keys.
_NAME_OPTIONS = ("table", "prefix", "namespace")
#: The tables of its own a demo may create, ``<ns>_<name>`` (the bank-close demo's).
DEMO_TABLES = ("accounts", "opening", "snapshot", "interest", "statements")
#: The demos that make tables of their own, and those tables (the fleet demo makes none).
_OWN_TABLES = {"bank-close": DEMO_TABLES}
#: The jobs and workflows the demos declare (a workflow's steps are ``<workflow>/<step>``):
#: a store holding any other is not only a demo's, and :meth:`Namespace.remove` refuses it.
DEMO_JOBS = frozenset({"report", "export", "bank-close"})


def _demo_job(job: str) -> bool:
    return job in DEMO_JOBS or job.split("/", 1)[0] in DEMO_JOBS


def demo_names(name: str) -> frozenset[str]:
    """Every name a demo may create in its namespace ``name`` on PostgreSQL: its store's
    (runs table ``name``), its own tables and the marker; :meth:`PostgresNamespace.remove`
    drops only these, each as the kind a demo makes it."""
    return frozenset((*store_names(name), f"{name}_{MARKER}",
                      *(f"{name}_{table}" for table in DEMO_TABLES)))


class NamespaceInUse(ConfigurationError):
    """The namespace a demo would use already holds something; nothing was changed."""


class NotADemoNamespace(ConfigurationError):
    """``remove`` was asked for a namespace without a demo's marker; nothing was removed."""


def new_name() -> str:
    """A namespace no one uses yet, in all likelihood: ``anarchon_demo_`` and 8 hex digits."""
    return PREFIX + secrets.token_hex(4)


def validate_name(name: str) -> str:
    """Return ``name``, or raise :class:`ConfigurationError` if it cannot be a namespace."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"namespace {name!r} is not valid: use 1 to 40 lower-case letters, digits and "
            "underscores, starting with a letter or underscore"
        )
    return name


def _store_url(url: str) -> str:
    """``url`` without a store name in its query, which the demo would not use."""
    plain, names = split_url_options(url, _NAME_OPTIONS)
    if names:
        given = ", ".join(f"{key}={value}" for key, value in names.items())
        raise ConfigurationError(
            f"the demo names its own tables and keys, so --url must not name them ({given}); "
            "drop it from the URL, or give --namespace NAME for a namespace of your choice"
        )
    return plain


class Namespace(ABC):
    """One demo run's namespace on one store."""

    kind: str
    """``postgres`` or ``redis``."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = validate_name(name)

    @property
    def backend_options(self) -> dict[str, str]:
        """The keywords that put a backend's tables or keys in this namespace."""
        return {"namespace": self.name}

    @abstractmethod
    def where(self) -> str:
        """Where the namespace's names are, for people: ``tables ... in schema public``."""

    @abstractmethod
    def claim(self, demo: str, statements: list[str] | None = None) -> None:
        """Refuse a namespace in use; else create the marker (and ``statements``) at once."""

    @abstractmethod
    def remove(self, *, own: bool = False) -> str:
        """Delete what the namespace holds; return what was removed, for people.

        Raises :class:`NotADemoNamespace` when the namespace holds names but no marker,
        :class:`NamespaceInUse` while schedulers run on it, unless ``own``: the demo
        that claimed it removes it after stopping its workers (a killed one's membership
        lasts a lease longer).
        """

    @abstractmethod
    def look_commands(self, url: str) -> list[str]:
        """Commands that show what the namespace holds (``url`` as it may be shown)."""

    def _marker_value(self, demo: str) -> str:
        return json.dumps({"demo": demo, "namespace": self.name,
                           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def namespace_for(url: str, name: str | None = None) -> Namespace:
    """The namespace ``name`` (a new one by default) on the store at ``url``."""
    name = validate_name(name) if name is not None else new_name()
    url = _store_url(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else "postgresql"
    if scheme.split("+")[0] in ("postgresql", "postgres"):
        return PostgresNamespace(url, name)
    if scheme in ("redis", "rediss", "unix"):
        # The store's own checks of the URL (a bad port or query parameter), which
        # redis-py's from_url reported as a TypeError or a ValueError.
        backend_from_url(url)
        return RedisNamespace(url, name)
    if scheme in ("redis+cluster", "rediss+cluster", "redis+sentinel"):
        what = "through Sentinel" if scheme == "redis+sentinel" else "on a Redis Cluster"
        raise ConfigurationError(
            f"the demo runs on one Redis server, not {what} ({redact(url)!r}): "
            "give --url redis://host:port of a server of its own, or leave out --url for "
            "an embedded one")
    hint = ("; for the in-process memory store, run `anarchon demo --backend memory` "
            "(no --url)" if scheme == "memory" else "")
    raise ConfigurationError(
        f"the demo runs on PostgreSQL or Redis, not on {redact(url)!r}{hint}")


# --------------------------------------------------------------------------- PostgreSQL

#: The names of the namespace in the current schema, of every kind that could collide with
#: what the demo creates, and in the later schemas of the search_path (shown with their
#: schema): the store finds its tables where the search_path does, so a store of yours
#: in a later schema named like the namespace would be the demo's. A row only when there
#: is a current schema.
_PG_TAKEN = """
SELECT n.nspname::text, ARRAY(
    SELECT kind || ' ' || CASE WHEN s.current THEN name ELSE s.nspname || '.' || name END
    FROM (
        SELECT CASE c.relkind WHEN 'r' THEN 'table' WHEN 'p' THEN 'table'
                    WHEN 'i' THEN 'index' WHEN 'I' THEN 'index' WHEN 'S' THEN 'sequence'
                    WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view'
                    WHEN 'f' THEN 'foreign table' ELSE 'relation' END AS kind,
               c.relname::text AS name, c.relnamespace AS space
        FROM pg_catalog.pg_class c
        UNION ALL
        SELECT 'function', p.proname::text, p.pronamespace FROM pg_catalog.pg_proc p
        UNION ALL
        SELECT 'type', t.typname::text, t.typnamespace FROM pg_catalog.pg_type t
        WHERE t.typrelid = 0
    ) AS o
    JOIN (SELECT s.oid, s.nspname, s.oid = n.oid AS current FROM pg_catalog.pg_namespace s
          WHERE s.nspname = ANY(current_schemas(false))) AS s ON s.oid = o.space
    WHERE name = %(ns)s OR left(name, %(length)s) = %(under)s
    ORDER BY NOT s.current, kind <> 'table', name, kind)
FROM pg_catalog.pg_namespace n WHERE n.nspname = current_schema()
"""

#: The tables and sequences (``regclass``) and functions (``regprocedure``) of the
#: namespace in the current schema, with whether a demo makes that name as that kind
#: (``remove`` drops only those: a table of yours named like the demo store's function
#: or index, such as ``<ns>_claim`` or ``<ns>_open``, is not the demo's).
_PG_OWNED = """
SELECT kind, object,
       name = ANY(CASE WHEN kind = 'function' THEN %(functions)s::text[]
                       ELSE %(tables)s::text[] END) FROM (
    SELECT CASE c.relkind WHEN 'S' THEN 'sequence' ELSE 'table' END AS kind,
           c.oid::regclass::text AS object, c.relname::text AS name
    FROM pg_catalog.pg_class c
    WHERE c.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace
                            WHERE nspname = current_schema())
      AND c.relkind IN ('r', 'p', 'S')
      AND (c.relname = %(ns)s OR left(c.relname, %(length)s) = %(under)s)
    UNION ALL
    SELECT 'function', p.oid::regprocedure::text, p.proname::text
    FROM pg_catalog.pg_proc p
    WHERE p.pronamespace = (SELECT oid FROM pg_catalog.pg_namespace
                            WHERE nspname = current_schema())
      AND (p.proname = %(ns)s OR left(p.proname, %(length)s) = %(under)s)
) AS o
ORDER BY 1, 2
"""

#: The instances whose membership of the namespace's fleet has not ended (on the server's
#: clock): a scheduler renews it every half lease and ends it when it stops, so one is
#: running there now (or died less than a lease ago).
_PG_LIVE_MEMBERS = """
SELECT substr(key, 8) FROM {meta}
WHERE left(key, 7) = 'member:'
  AND CASE WHEN value ~ '^[0-9]+$' AND length(value) < 19 THEN value::bigint ELSE 0 END
      > floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint
ORDER BY 1
"""

#: How long removal waits for a lock on the namespace's tables (a worker still running).
_PG_LOCK_TIMEOUT = "10s"
#: Seconds a connection of the demo's (to claim or remove a namespace) waits for the
#: server's login, unless the URL's ``connect_timeout`` or ``$PGCONNECT_TIMEOUT`` says:
#: libpq's own default is to wait for ever (the backend's first login waits as long).
CONNECT_TIMEOUT = 10


class PostgresNamespace(Namespace):
    """The namespace as names in the current schema of a PostgreSQL database."""

    kind = "postgres"

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, name)
        self.schema: str | None = None

    def table(self, what: str) -> str:
        """The quoted name of the demo's table ``what``: ``"<ns>_<what>"``."""
        return quote_ident(f"{self.name}_{what}")

    @property
    def marker(self) -> str:
        """The marker table's name."""
        return f"{self.name}_{MARKER}"

    def _params(self, demo: str | None = None) -> dict[str, Any]:
        """The names of the namespace's queries; the tables of the demo ``demo`` made."""
        tables = {*store_names(self.name, "table"), self.marker,
                  *(f"{self.name}_{table}" for table in _OWN_TABLES.get(demo or "", ()))}
        return {"ns": self.name, "length": len(self.name) + 1, "under": self.name + "_",
                "tables": sorted(tables), "functions": sorted(store_names(self.name,
                                                                          "function"))}

    def _connect(self) -> Any:
        try:
            import psycopg
        except ImportError:
            raise ConfigurationError("the demo on PostgreSQL needs psycopg: "
                                     "pip install 'anarchon[postgres]'") from None
        from backends.postgres import driver_dsn

        dsn = driver_dsn(self.url)
        timeout: dict[str, Any] = (
            {} if "connect_timeout" in psycopg.conninfo.conninfo_to_dict(dsn)
            or os.environ.get("PGCONNECT_TIMEOUT") else {"connect_timeout": CONNECT_TIMEOUT})
        try:
            return psycopg.connect(dsn, **timeout)
        except psycopg.OperationalError as exc:
            raise BackendUnavailable(
                f"could not connect to {redact(self.url)!r}: "
                f"{redact(str(exc).strip().splitlines()[0] if str(exc).strip() else '')}"
            ) from None

    def where(self) -> str:
        schema = f"schema {self.schema}" if self.schema else "the current schema"
        return f"tables {self.name} and {self.name}_* in {schema}"

    def claim(self, demo: str, statements: list[str] | None = None) -> None:
        import psycopg
        from psycopg import sql

        try:
            with self._connect() as conn:  # one transaction, committed on leaving
                row = conn.execute(_PG_TAKEN, self._params()).fetchone()
                if row is None:
                    raise ConfigurationError(
                        "the demo creates its tables in the current schema, and the "
                        "connection's search_path names no schema that exists")
                self.schema, taken = row[0], list(row[1])
                if taken:
                    raise self._in_use(taken)
                conn.execute(f'CREATE TABLE "{self.marker}" (namespace text PRIMARY KEY, '
                             "demo text NOT NULL, created_at timestamptz NOT NULL)")
                conn.execute(f'INSERT INTO "{self.marker}" VALUES (%s, %s, now())',
                             (self.name, demo))
                conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(
                    sql.Identifier(self.marker), sql.Literal(self._comment(demo))))
                for statement in statements or []:
                    conn.execute(statement)
        except psycopg.errors.DuplicateObject as exc:  # pragma: no cover - a race
            raise self._in_use([str(exc).splitlines()[0]]) from None
        except psycopg.errors.DuplicateTable as exc:  # pragma: no cover - a race
            raise self._in_use([str(exc).splitlines()[0]]) from None
        except psycopg.Error as exc:
            raise AnarchonError(
                f"could not create the demo's tables under namespace {self.name}: "
                f"{str(exc).strip().splitlines()[0]}") from None

    def _comment(self, demo: str) -> str:
        """The marker table's comment, which :meth:`remove` checks."""
        return (f"anarchon demo {demo}: marks namespace {self.name}; "
                f"'anarchon demo --url URL --remove {self.name}' drops it")

    def _marker_demo(self, conn: Any) -> str | None:
        """The demo whose marker the table ``<ns>_demo`` is (its comment, and its row),
        or None when it is none."""
        row = conn.execute(
            "SELECT pg_catalog.obj_description(c.oid, 'pg_class') FROM pg_catalog.pg_class c "
            "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relname = %s AND c.relkind = 'r'",
            (self.marker,)).fetchone()
        if row is None or not isinstance(row[0], str):
            return None
        demo = row[0].removeprefix("anarchon demo ").split(":", 1)[0]
        if row[0] != self._comment(demo):
            return None
        found = conn.execute(f'SELECT demo FROM "{self.marker}" WHERE namespace = %s',
                             (self.name,)).fetchone()
        return demo if found is not None and found[0] == demo else None

    def _in_use(self, taken: list[str]) -> NamespaceInUse:
        shown = ", ".join(taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
        return NamespaceInUse(
            f"namespace {self.name} is in use: the search_path (schema {self.schema} first) "
            f"already holds {shown}; the demo creates only names of its own, so it changed "
            "nothing (give another --namespace, or leave it out for a new one)")

    def remove(self, *, own: bool = False) -> str:
        import psycopg

        with self._connect() as conn:
            conn.execute(f"SET LOCAL lock_timeout = '{_PG_LOCK_TIMEOUT}'")
            demo = self._marker_demo(conn)
            found = conn.execute(_PG_OWNED, self._params(demo)).fetchall()
            if demo is None:
                if found:
                    raise NotADemoNamespace(
                        f"namespace {self.name} has no demo marker (table {self.marker}), so "
                        f"what it holds ({_shown([name for _, name, _ in found])}) was not "
                        "made by anarchon demo: nothing was removed")
                return f"nothing to remove under namespace {self.name}"
            owned = [(kind, name) for kind, name, ours in found if ours]
            others = [name for _, name, ours in found if not ours]
            meta_table = f"{self.name}_meta"
            if any(name == meta_table for kind, name in owned if kind == "table"):
                live = [member for (member,) in conn.execute(
                    _PG_LIVE_MEMBERS.format(meta=quote_ident(meta_table))).fetchall()]
                if live and not own:
                    raise _running(self.name, live)
            jobs_table = f"{self.name}_jobs"
            if any(name == jobs_table for kind, name in owned if kind == "table"):
                foreign = [job for (job,) in conn.execute(
                    f"SELECT job FROM {quote_ident(jobs_table)} WHERE job <> ALL(%(jobs)s) "
                    "AND split_part(job, '/', 1) <> ALL(%(jobs)s) ORDER BY job",
                    {"jobs": sorted(DEMO_JOBS)}).fetchall()]
                if foreign:
                    raise _foreign_jobs(self.name, foreign)
            names = {kind: [name for k, name in owned if k == kind]
                     for kind in ("table", "sequence", "function")}
            try:
                # The tables in one statement (foreign keys between them), then sequences
                # and functions, in one transaction; no CASCADE: an object of someone
                # else's that depends on one of them stops it all.
                for kind in ("table", "sequence", "function"):
                    if names[kind]:
                        conn.execute(f"DROP {kind.upper()} IF EXISTS " + ", ".join(names[kind]))
                conn.commit()
            except psycopg.Error as exc:
                conn.rollback()
                raise AnarchonError(
                    f"could not remove namespace {self.name} (nothing was removed): "
                    f"{str(exc).strip().splitlines()[0]}") from None
        counts = [f"{len(names[kind])} {kind}s" for kind in ("table", "sequence", "function")
                  if names[kind]]
        left = (f"; left {_shown(others)}, which no demo makes (not removed)" if others
                else "")
        return f"removed namespace {self.name}: {' and '.join(counts)}{left}"

    def look_commands(self, url: str) -> list[str]:
        quoted = _shell(url)
        # psql refused a driver in the scheme (postgresql+pg8000://) and anarchon's own
        # parameters (?min_size=2): it is given neither.
        plain = _shell(re.sub(r"^postgres(?:ql)?\+\w+://", "postgresql://", split_url_options(
            url, ("min_size", "max_size", "timeout"))[0]))
        return [f"anarchon status --url {quoted} --namespace {self.name}",
                f"anarchon history --url {quoted} --namespace {self.name}",
                f"psql {plain} -c '\\dt {self.name}*'"]


def _shown(names: list[str]) -> str:
    """The first five of ``names``, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _running(name: str, members: list[str]) -> NamespaceInUse:
    return NamespaceInUse(
        f"namespace {name} is in use: schedulers are running on it now ("
        f"{_shown(members)}), such as the demo kept there, still running; stop them (Ctrl-C "
        "in the demo's terminal) or, if they were killed, wait for their membership to "
        "end (a lease after they died), then remove it: nothing was removed")


def _foreign_jobs(name: str, jobs: list[str]) -> NotADemoNamespace:
    return NotADemoNamespace(
        f"namespace {name} holds the history of jobs no demo declares ({_shown(jobs)}): a "
        "scheduler of yours uses it, so nothing was removed (point that scheduler at a "
        "store of its own first)")


def _shell(text: str) -> str:
    import shlex

    return shlex.quote(text)


# --------------------------------------------------------------------------- Redis


#: The keys a demo's store and its marker have under namespace ``{ns}`` (a regular
#: expression, filled with the name escaped): the store's own ``{ns}:<name>``, each
#: job's ``{ns/<job>}:<name>`` (the job percent-encoded: no brace or slash), its runs'
#: ``{ns/<job>}:run:<slot>`` and operations' ``{ns/<job>}:op:<hex>``, and each named
#: lease's ``{ns/lease/<name>}`` (see backends.redis).
_REDIS_KEYS = (r"\{{{ns}\}}:(?:meta|jobs|members|maintenance|" + MARKER + r")"
               r"|\{{{ns}/lease/[^{{}}/]*\}}"
               r"|\{{{ns}/[^{{}}/]+\}}:(?:job|open|hist|att|done|orphan|hold|run:-?[0-9]+"
               r"|op:[0-9a-f]+)")


class RedisNamespace(Namespace):
    """The namespace as a key prefix on a Redis server: ``{<ns>}:*`` and ``{<ns>/*``."""

    kind = "redis"

    @property
    def marker(self) -> str:
        """The marker key."""
        return "{" + self.name + "}:" + MARKER

    @property
    def pattern(self) -> str:
        """The key pattern of the namespace: ``{<ns>}…`` and ``{<ns>/…``."""
        # The name holds only [a-z0-9_], none of them special in a key pattern.
        return "{" + self.name + "[}/]*"

    def _client(self) -> Any:
        import redis

        plain, _ = split_url_options(self.url, ("wait_replicas", "wait_timeout"))
        client = redis.Redis.from_url(plain)
        try:
            client.ping()
        except redis.RedisError as exc:
            client.close()
            raise BackendUnavailable(
                f"could not connect to {redact(self.url)!r}: {redact(str(exc))}") from None
        return client

    def _keys(self, client: Any, limit: int | None = None) -> list[bytes]:
        keys: list[bytes] = []
        for key in client.scan_iter(match=self.pattern, count=1000):
            keys.append(key)
            if limit is not None and len(keys) >= limit:
                break
        return keys

    def _ours(self, key: bytes) -> bool:
        """Whether ``key`` has a shape the store or a demo writes (:data:`_REDIS_KEYS`): a
        key of yours that merely shares the namespace's hash tag is not the demo's."""
        return re.fullmatch(_REDIS_KEYS.format(ns=re.escape(self.name)).encode(),
                            key) is not None

    def where(self) -> str:
        return f"keys {{{self.name}}}:* and {{{self.name}/<job>}}:*"

    def claim(self, demo: str, statements: list[str] | None = None) -> None:
        if statements:
            raise ConfigurationError("the demo's own tables need PostgreSQL")
        client = self._client()
        try:
            taken = self._keys(client, limit=6)
            if taken or not client.set(self.marker, self._marker_value(demo), nx=True):
                taken = taken or [self.marker.encode()]
                shown = ", ".join(k.decode(errors="replace") for k in taken[:5])
                more = " and more" if len(taken) > 5 else ""
                raise NamespaceInUse(
                    f"namespace {self.name} is in use on this server, which already holds "
                    f"{shown}{more}; the demo creates only keys of its own, so it changed "
                    "nothing (give another --namespace, or leave it out for a new one)")
        finally:
            client.close()

    def _is_marker(self, client: Any) -> bool:
        """Whether the key ``{<ns>}:demo`` is a demo's marker: a string of its JSON."""
        import redis

        try:
            value = json.loads(client.get(self.marker) or b"null")
        except (ValueError, UnicodeDecodeError, redis.ResponseError):  # WRONGTYPE: not a string
            return False
        return (isinstance(value, dict) and value.get("namespace") == self.name
                and isinstance(value.get("demo"), str))

    def remove(self, *, own: bool = False) -> str:
        client = self._client()
        try:
            if not self._is_marker(client):
                found = self._keys(client, limit=6)
                if found:
                    shown = ", ".join(k.decode(errors="replace") for k in found[:5]) + (
                        " and more" if len(found) > 5 else "")
                    raise NotADemoNamespace(
                        f"namespace {self.name} has no demo marker (key {self.marker}), so "
                        f"its keys ({shown}) were not made by anarchon demo: nothing was "
                        "removed")
                return f"nothing to remove under namespace {self.name}"
            jobs = "{" + self.name + "}:jobs"
            if client.type(jobs) not in (b"set", b"none"):
                raise NotADemoNamespace(f"namespace {self.name}'s key {jobs} is not a demo "
                                        "store's set of jobs: nothing was removed")
            seconds, micros = client.time()
            live = client.zrangebyscore("{" + self.name + "}:members",
                                        f"({seconds * 1000 + micros // 1000}", "+inf")
            if live and not own:
                raise _running(self.name, sorted(m.decode(errors="replace") for m in live))
            foreign = sorted(job for job in (j.decode(errors="replace")
                                             for j in client.smembers(jobs))
                             if not _demo_job(job))
            if foreign:
                raise _foreign_jobs(self.name, foreign)
            removed = 0
            while True:  # the marker last, so an interrupted removal can be run again
                found = self._keys(client)
                keys = [k for k in found if k != self.marker.encode() and self._ours(k)]
                if not keys:
                    break
                for i in range(0, len(keys), 500):
                    removed += int(client.delete(*keys[i:i + 500]))
            others = [k.decode(errors="replace") for k in found
                      if k != self.marker.encode() and not self._ours(k)]
            removed += int(client.delete(self.marker))
        finally:
            client.close()
        left = (f"; left {len(others)} keys which no demo makes (not removed): "
                f"{_shown(sorted(others))}" if others else "")
        return f"removed namespace {self.name}: {removed} keys{left}"

    def look_commands(self, url: str) -> list[str]:
        quoted = _shell(url)
        return [f"anarchon status --url {quoted} --namespace {self.name}",
                f"anarchon history --url {quoted} --namespace {self.name}",
                f"redis-cli -u {quoted} --scan --pattern {_shell(self.pattern)}"]


# --------------------------------------------------------------------------- a demo's run


@contextlib.contextmanager
def claimed(ns: Namespace, demo: str, out: Any, *, keep: bool = False, shown_url: str,
            statements: list[str] | None = None) -> Iterator[Namespace]:
    """Claim ``ns`` for the demo ``demo``, print it, and remove it on leaving.

    Removal happens however the block ends (an error, Ctrl-C), unless ``keep``: then it
    prints how to look at the namespace and how to remove it. ``shown_url`` is the store's
    URL as it may be printed (password masked).
    """
    ns.claim(demo, statements)
    end = "kept at the end (--keep)" if keep else "removed at the end (--keep keeps it)"
    print(f"Namespace: {ns.name} ({ns.where()}); {end}", file=out, flush=True)
    remove = f"anarchon demo --url {_shell(shown_url)} --remove {ns.name}"
    password = (f" ({MASK} stands for the password, not printed)" if MASK in shown_url
                else "")
    try:
        yield ns
    except BaseException:
        if not keep:
            _remove_quietly(ns, out, remove, password)
        else:  # the demo failed or was stopped: what it made is kept, as asked
            print(f"\nKept namespace {ns.name}; to remove it{password}:\n  {remove}",
                  file=out, flush=True)
        raise
    if keep:
        print(f"\nKept namespace {ns.name} ({ns.where()}).\nTo look at it{password}:",
              file=out)
        for command in ns.look_commands(shown_url):
            print(f"  {command}", file=out)
        print(f"To remove it:\n  {remove}", file=out, flush=True)
        return
    try:
        print("\n" + _capital(ns.remove(own=True)), file=out, flush=True)
    except BaseException:
        print(f"\nNamespace {ns.name} was not removed; to remove it{password}:\n  {remove}",
              file=out, flush=True)
        raise


def _remove_quietly(ns: Namespace, out: Any, remove: str, password: str) -> None:
    """Remove ``ns`` after an error: say what happened, never hide the error itself."""
    try:
        print("\n" + _capital(ns.remove(own=True)), file=out, flush=True)
    except BaseException as exc:
        reason = " ".join(redact(str(exc)).split()) or type(exc).__name__
        print(f"\nNamespace {ns.name} was not removed ({reason}); to remove it{password}:\n"
              f"  {remove}", file=out, flush=True)


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]
