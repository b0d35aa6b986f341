"""The Redis backend's base: options, connection, key names and one round trip.

:class:`RedisStore` holds what every part of :class:`~backends.redis.RedisBackend` uses:
the validated options, the adapter (:mod:`adapters.redis`), the key of each job's data
(see :mod:`backends.redis` for the layout), and :meth:`RedisStore._run`, which sends
commands in one round trip. The contract's calls are its subclasses' (claims, leases,
records), combined in :class:`~backends.redis.RedisBackend`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Self
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import anyio.to_thread
import sniffio

from adapters._redis_cluster_url import (
    check_cluster_url,
    cluster_adapter,
    is_cluster_url,
    refuse_replica_reads,
)
from adapters.redis import (
    SENTINEL_SCHEME,
    AsyncClientAdapter,
    Command,
    RedisAdapter,
    check_client,
    redis_adapter,
    sentinel_parts,
)
from lease_core._checks import MEMBER_RETENTION_MS
from lease_core._durations import Duration, parse_duration, to_ms
from lease_core._redact import redact
from lease_core._registry import check_url, merge_options, positive_whole, split_url_options
from lease_core.abc import Backend
from lease_core.errors import (
    BackendUnavailable,
    ConfigurationError,
    StoreFormatError,
    StoreNotFound,
)

from .replies import as_text, time_ms
from .scripts import SCRIPTS, STORE_FORMAT

__all__ = ["RedisStore"]

logger = logging.getLogger("anarchon")

_PREFIX = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")
#: Options the backend takes, as keywords or from a URL's query.
_OPTIONS = ("prefix", "namespace", "wait_replicas", "wait_timeout")
#: Query parameters redis-py reads from a URL as strings (besides its typed ones).
_DRIVER_PARAMS = ("username", "password", "sentinel_password", "client_name", "lib_name",
                  "lib_version", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data",
                  "ssl_certfile", "ssl_keyfile", "ssl_password")


def _wait_timeout(value: object) -> float:
    """``wait_timeout`` in seconds: a duration, or (as a URL's query gives it, and as
    PostgreSQL's ``?timeout=`` reads it) text that is a plain number of seconds."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            return parse_duration(number, what="wait_timeout")
    return parse_duration(value, what="wait_timeout")


def _cert_reqs(value: str) -> str:
    """``ssl_cert_reqs`` as redis-py reads it from a URL (it refuses any other only when
    it first connects, an error that looked like an unreachable server)."""
    if value not in ("none", "optional", "required"):
        raise ValueError("one of none, optional and required")
    return value


def _number_reader(what: str, *, whole: bool = False, least: float = 0.0,
                   above: bool = False) -> Callable[[str], float]:
    """A reader of a URL option's number for :func:`check_url`: finite, at least ``least``
    (more than it with ``above``), whole with ``whole``. redis-py's own parsers (``float``,
    ``int``) took nan, negative numbers and 0 alike: a socket's ValueError at start(), or
    a store said to be unreachable."""

    def read(text: str) -> float:
        try:
            number = float(int(text) if whole else float(text))
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < least or (above and number == least):
            raise ValueError(what)
        return number

    return read


def _protocol(text: str) -> int:
    """``protocol``: RESP2 or RESP3 (redis-py refused any other as it first connected, an
    error that read as an unreachable store)."""
    if text not in ("2", "3"):
        raise ValueError("2 or 3")
    return int(text)


def _tls_version(text: str) -> int:
    """``ssl_min_version``: a number of Python's :class:`ssl.TLSVersion`, as redis-py takes
    it (it failed at start() with a bare ValueError)."""
    try:
        return int(ssl.TLSVersion(int(text)))
    except ValueError:
        raise ValueError("a number of Python's ssl.TLSVersion: 771 for TLS 1.2, 772 for "
                         "TLS 1.3") from None


#: The TLS files a ``rediss://`` URL may name, and what each must be.
_TLS_FILES = {"ssl_ca_certs": "file", "ssl_certfile": "file", "ssl_keyfile": "file",
              "ssl_ca_path": "directory"}

#: Readers of redis-py's options whose own parser accepts values it then fails on.
_DRIVER_READERS: dict[str, Callable[[str], float]] = {
    "socket_timeout": _number_reader("a number of seconds, more than 0", above=True),
    "socket_connect_timeout": _number_reader("a number of seconds, more than 0", above=True),
    "timeout": _number_reader("a number of seconds, 0 or more"),
    "health_check_interval": _number_reader("a whole number of seconds, 0 or more",
                                            whole=True),
    "socket_read_size": _number_reader("a whole number, at least 1", whole=True, least=1),
    "protocol": _protocol,
    "ssl_min_version": _tls_version,
}


def _check_url(url: str) -> None:
    """Refuse a bad port, a query parameter neither the backend nor redis-py knows, or a
    value either refuses (:func:`lease_core._registry.check_url`)."""
    try:
        from redis.connection import URL_QUERY_ARGUMENT_PARSERS as parsers
    except ImportError:  # the driver's absence is reported when connecting
        parsers = {}
    read: dict[str, Any] = {**parsers, **_DRIVER_READERS, "max_connections": positive_whole,
                            "wait_replicas": positive_whole,
                            "wait_timeout": _wait_timeout, "ssl_cert_reqs": _cert_reqs}
    check_url("Redis", url, _OPTIONS, (*_DRIVER_PARAMS, *parsers), read=read)
    parts = urlsplit(url)
    given: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if given.setdefault(name, value) != value:
            # (redis-py reads the first, a Sentinel URL and libpq the last)
            values = ("" if "password" in name
                      else f", as {given[name]!r} and {value!r}")
            raise ConfigurationError(
                f"the Redis URL {redact(url)!r} gives {name!r} twice{values}; give it once")
    for name in ("username", "password") if parts.scheme != SENTINEL_SCHEME else ():
        # (redis-py lets the URL's user and password win over the query's; a Sentinel URL
        # refuses them in the query, below)
        before = getattr(parts, name)
        if before and name in given and unquote(before) != given[name]:
            raise ConfigurationError(
                f"the Redis URL {redact(url)!r} gives a {name} before the host and another "
                f"in ?{name}=; give it once")
    tls = sorted(name for name in given if name.startswith("ssl_"))
    if tls and parts.scheme in ("redis", "unix"):
        # (redis-py keeps them for a plain connection, which refuses them with a TypeError
        # at the first command: start() failed with no word of TLS)
        raise ConfigurationError(
            f"the Redis URL {redact(url)!r} sets {', '.join(tls)}, which apply to TLS only, "
            f"and {parts.scheme}:// connects without TLS: write rediss://host:port/db for "
            "TLS, or drop them")
    for name, kind in _TLS_FILES.items() if parts.scheme.startswith("rediss") else ():
        # (a missing one failed each connection with "Error 2 connecting to host:port. No
        # such file or directory", said to be an unreachable store)
        path = given.get(name)
        found = path and (os.path.isdir(path) if kind == "directory" else os.path.isfile(path))
        if path and not (found and os.access(path, os.R_OK)):
            raise ConfigurationError(
                f"{name}={path!r} in the Redis URL {redact(url)!r} is not a readable {kind}")
    if parts.scheme == SENTINEL_SCHEME:
        sentinel_parts(url)  # its service, db and query, as the adapter will read them
    if is_cluster_url(url):
        check_cluster_url(url)
    database = unquote(parts.path).strip("/")
    if parts.scheme in ("redis", "rediss") and database and not database.isdigit():
        # (redis-py reads a path that is not a number as no path: database 0)
        raise ConfigurationError(
            f"the database in the Redis URL {redact(url)!r} is {database!r}, not a "
            "number: write redis://host:port/<number> (0 to 15 on a default server), or "
            "no path for database 0"
        )
    if parts.scheme in ("redis", "rediss") and database and "db" in given and (
            int(database) != int(given["db"])):
        # (redis-py lets ?db= win over the path)
        raise ConfigurationError(
            f"the Redis URL {redact(url)!r} names database {database} in its path and "
            f"{given['db']} in ?db=; name it once")


def _is_cluster(connection: object) -> bool:
    """Whether ``connection`` is a Cluster client (or an adapter of one), as the adapter
    would tell (:attr:`adapters.redis.RedisAdapter.cluster`)."""
    if isinstance(connection, RedisAdapter):
        return connection.cluster
    if isinstance(connection, str):
        return is_cluster_url(connection)
    return "Cluster" in type(connection).__name__


def _reports_cluster(info: object) -> bool:
    """Whether the reply to ``INFO cluster`` (parsed by the driver into a dict, or its
    text) says ``cluster_enabled:1``; an error reply (no permission) says nothing."""
    if isinstance(info, dict):
        return str(info.get("cluster_enabled", "0")) == "1"
    if isinstance(info, (bytes, str)):
        return "cluster_enabled:1" in as_text(info)
    return False


def _validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"prefix={prefix!r} cannot be used in Redis key names; use 1 to 200 letters, "
            "digits and the characters '_', '.', ':' and '-' (no braces, slashes or spaces)"
        )
    return prefix


class RedisStore(Backend):
    """The options, connection, keys and round trips of a :class:`~backends.redis.RedisBackend`
    (whose docstring describes the options)."""

    def __init__(
        self,
        connection: object = None,
        *,
        prefix: str | None = None,
        namespace: str | None = None,
        wait_replicas: int | None = None,
        wait_timeout: Duration | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        from_url: dict[str, str] = {}
        if isinstance(connection, str):
            connection, from_url = split_url_options(connection, _OPTIONS)
            _check_url(connection)
        elif connection is not None:
            check_client(connection)
        keywords = {"prefix": prefix, "namespace": namespace, "wait_replicas": wait_replicas,
                    "wait_timeout": wait_timeout, **options}
        merged = merge_options("RedisBackend", keywords, from_url, _OPTIONS)
        names = [merged[k] for k in ("prefix", "namespace") if merged.get(k) is not None]
        if len(names) > 1 and names[0] != names[1]:
            raise ConfigurationError(
                f"RedisBackend got prefix={names[0]!r} and namespace={names[1]!r}; "
                "give one of them"
            )
        self.prefix = _validate_prefix(names[0] if names else "anarchon_runs")
        wait_replicas = merged.get("wait_replicas")
        if isinstance(wait_replicas, str) and wait_replicas.isdigit():  # from the URL
            wait_replicas = int(wait_replicas)
        if wait_replicas is not None and (
            isinstance(wait_replicas, bool)
            or not isinstance(wait_replicas, int)
            or wait_replicas < 1
        ):
            raise ConfigurationError(
                f"wait_replicas={wait_replicas!r} must be a whole number of replicas, at "
                "least 1, or None to not wait"
            )
        self.wait_replicas = wait_replicas
        self._wait_timeout_ms = to_ms(
            _wait_timeout(merged.get("wait_timeout", "1s"))
        )
        self._connection = connection
        self._refuse_cluster_options(_is_cluster(connection), connection)
        self._adapter: RedisAdapter | None = None
        # Jobs this process has added to the jobs set ({P}:jobs); a claim of another job
        # adds it in the same round trip.
        self._listed: set[str] = set()
        self._tags: dict[str, str] = {}  # job -> hash tag
        # The marker of each job's data (its job hash's 'sid') as this backend last saw
        # it, and the longest lease it has claimed or renewed: a claim that finds another
        # marker knows the data was lost (see "Data loss" in the module docs).
        self._markers: dict[str, str] = {}
        self._longest_ms = 0
        # Per job, the end of the quarantine its last claim found: until then every
        # missing run of the job was lost with the data (nothing is deleted meanwhile).
        self._quiet: dict[str, int] = {}
        # Fences (issue 21): per job, the highest history sequence ('seq') a claim
        # answered with the current marker: a store below it lost writes.
        self._seqs: dict[str, int] = {}
        # The {P}:meta fields this backend recorded (workflows, schedules), field, value,
        # ...: recorded again with the jobs' registration after a loss of the data.
        self._registered: list[str] = []

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """Make a backend on the server at ``url`` (``redis://``, ``rediss://``, ``unix://``,
        ``redis+sentinel://``, ``redis+cluster://``).

        ``prefix`` (or ``namespace``), ``wait_replicas`` and ``wait_timeout`` may be given
        in the URL's query as well as keywords; the driver's own query parameters
        (``socket_timeout``, ``socket_connect_timeout``, ``max_connections``, ...) pass
        through to redis-py.
        """
        return cls(url, **options)

    def __repr__(self) -> str:
        where = self._adapter.where if self._adapter else "not started"
        return f"{type(self).__name__}(prefix={self.prefix!r}, {where})"

    # -- keys ------------------------------------------------------------------------

    def _tag(self, job: str) -> str:
        tag = self._tags.get(job)
        if tag is None:
            if len(self._tags) > 100_000:  # a bound for processes that make up job names
                self._tags.clear()
            tag = self._tags[job] = "{" + self.prefix + "/" + quote(job, safe="") + "}"
        return tag

    def _run_key(self, job: str, slot: int) -> str:
        return f"{self._tag(job)}:run:{int(slot)}"

    def _job_keys(self, job: str) -> dict[str, str]:
        tag = self._tag(job)
        return {part: f"{tag}:{part}" for part in
                ("job", "open", "hist", "att", "done", "orphan", "hold")}

    @property
    def _meta_key(self) -> str:
        return "{" + self.prefix + "}:meta"

    @property
    def _maintenance_key(self) -> str:
        return "{" + self.prefix + "}:maintenance"

    @property
    def _members_key(self) -> str:
        return "{" + self.prefix + "}:members"

    @property
    def _jobs_key(self) -> str:
        return "{" + self.prefix + "}:jobs"

    # -- plumbing --------------------------------------------------------------------

    async def _new_adapter(self) -> RedisAdapter:
        """The adapter of the connection; an asyncio client is refused off asyncio (under
        trio), where it failed with "no running event loop" (a bare RuntimeError from a
        Cluster client; "cannot reach Redis" from a plain one)."""
        loop = sniffio.current_async_library()
        if is_cluster_url(self._connection):
            assert isinstance(self._connection, str)
            if loop == "asyncio":
                return cluster_adapter(self._connection)
            # the blocking Cluster client connects as it is made
            return await anyio.to_thread.run_sync(cluster_adapter, self._connection)
        adapter = redis_adapter(self._connection)
        if isinstance(adapter, AsyncClientAdapter) and loop != "asyncio":
            raise ConfigurationError(
                f"RedisBackend was given an asyncio client ({type(adapter.client).__name__})"
                f", which runs under asyncio only, not {loop}; under {loop} pass a blocking "
                "client (redis.Redis, or redis.cluster.RedisCluster for a Cluster: run in "
                "worker threads) or a URL")
        return adapter

    async def _open(self) -> None:
        adapter = await self._new_adapter()
        try:
            self._refuse_cluster_options(adapter.cluster, adapter.client)
            await adapter.load_scripts([s.source for s in SCRIPTS.values()])
            self._adapter = adapter
            await self._open_joined()
        except BaseException:
            self._adapter = None
            await adapter.aclose()
            raise

    async def _open_joined(self) -> None:
        """Mark the store with this format (make it), refuse what is not one, check the
        server: at the first start, or at one that may create joining a reader's."""
        adapter = self._adapter
        assert adapter is not None
        # With wait_replicas, a WAIT that waits for nothing: a user that may not run it is
        # refused here, not at each claim after its scripts won runs it then cannot hold.
        probe = [] if self.wait_replicas is None else [("WAIT", 0, 1)]
        ((found, policy, clustered), *_) = await self._run([self._eval(
            "open_store", [self._meta_key, self._members_key],
            [STORE_FORMAT, MEMBER_RETENTION_MS]), *probe])
        if int(clustered) and not adapter.cluster:
            raise adapter.not_a_cluster_client("it reports cluster_enabled:1")
        self._check_format(found)
        self._warn_eviction(as_text(policy), adapter.where)

    def _check_format(self, found: object) -> None:
        """Refuse a store of a newer format, or a ``{P}:meta`` that is not an anarchon
        store's (``found``: its format, ``'type <t>'`` for a key that is no hash, or
        ``'field <f>'`` for a hash without a format holding a field no store writes)."""
        text = as_text(found) if isinstance(found, bytes) else str(found)
        if text.startswith("key "):
            raise StoreFormatError(
                f"the key {text[4:]} exists but {self._meta_key} does not (prefix "
                f"{self.prefix!r}), and it holds entries no running fleet keeps: another "
                "application's, or a fleet's that was down for over an hour before its "
                f"{self._meta_key} was lost (evicted, deleted); give anarchon a prefix of "
                f"its own (namespace= or prefix=), or, if it is the fleet's, delete "
                f"{text[4:]} and start again: nothing was changed")
        try:
            found = int(text)
        except ValueError:
            what = (f"a {text[5:]}, not a hash" if text.startswith("type ")
                    else f"a hash without a store format, with a field {text[6:]!r} no "
                         "store writes" if text.startswith("field ")
                    else f"a hash whose format is {text!r}, not a number")
            raise StoreFormatError(
                f"the key {self._meta_key} (prefix {self.prefix!r}) is {what}: not an "
                "anarchon store's, so something else keeps keys under this prefix; give "
                "anarchon a prefix of its own (namespace= or prefix=)") from None
        if found > STORE_FORMAT:
            raise StoreFormatError(
                f"the keys under prefix {self.prefix!r} were written in store format "
                f"{found}, newer than this anarchon's {STORE_FORMAT}; upgrade anarchon "
                "or use another prefix"
            )

    def _warn_eviction(self, policy: str, where: str) -> None:
        """Warn when the server may evict any key at ``maxmemory`` (``allkeys-*``): an
        evicted run hash is a live lease gone, so another instance wins the run while its
        holder still runs it, and history is lost, with no error anywhere."""
        if policy.startswith("allkeys-"):
            logger.warning(
                "Redis at %s has maxmemory-policy %s: once it reaches maxmemory it evicts "
                "any key, anarchon's too (prefix %r), so a live lease can vanish and a "
                "second instance win its run, and history is lost without an error; set "
                "maxmemory-policy noeviction (or a volatile-* policy: anarchon's keys have "
                "no TTL), or give anarchon a Redis of its own", where, policy, self.prefix)

    async def _open_existing(self) -> None:
        """Open a store that must exist: reads only, :class:`StoreNotFound` if absent."""
        adapter = await self._new_adapter()
        try:
            self._refuse_cluster_options(adapter.cluster, adapter.client)
            await adapter.load_scripts([s.source for s in SCRIPTS.values()])
            # INFO cluster too (through a client of one node): a Cluster node is refused
            # here as at a first start, whichever node holds {P}:meta (a user that may
            # not run INFO is told by the redirect of a key on another node).
            probe: list[Command] = [] if adapter.cluster else [("INFO", "cluster")]
            kind, found, *info = await adapter.execute([
                ("TYPE", self._meta_key), ("HGET", self._meta_key, "format"), *probe])
            if info and _reports_cluster(info[0]):
                raise adapter.not_a_cluster_client("it reports cluster_enabled:1")
            if isinstance(kind, Exception):  # a MOVED: refused, not read as a type
                raise adapter.translate(kind) or kind
            kind = as_text(kind)
            if kind not in ("none", "hash"):
                found = f"type {kind}"
            elif isinstance(found, Exception):
                raise adapter.translate(found) or found
            if found is None:
                raise StoreNotFound(
                    f"no anarchon store at {adapter.where} (key prefix {self.prefix!r}, no "
                    f"key {self._meta_key}); check --url and --namespace, or start a "
                    "scheduler there to create it"
                )
            self._check_format(found)
        except BaseException:
            await adapter.aclose()
            raise
        self._adapter = adapter

    async def _close(self) -> None:
        adapter, self._adapter = self._adapter, None
        if adapter is not None:
            await adapter.aclose()

    async def _require(self) -> RedisAdapter:
        if self._adapter is None:
            if self._connection is None or isinstance(self._connection, str):
                raise ConfigurationError(
                    f"{type(self).__name__} is not started; call await start() first")
            # A client of the user's: started now (its scripts loaded, the store checked),
            # as PostgreSQL uses a pool or a connection it was given; nothing is opened
            # that a close would have to release.
            await self.start()
        assert self._adapter is not None
        return self._adapter

    @staticmethod
    def _eval(name: str, keys: Sequence[str], args: Sequence[str | int]) -> Command:
        return ("EVALSHA", SCRIPTS[name].sha, len(keys), *keys, *args)

    async def _run(self, commands: Sequence[Command], *, resend: bool = True) -> list[Any]:
        """Send ``commands`` in one round trip (the adapter loads scripts the server lost);
        ``resend=False`` for a batch not safe to run twice (see :mod:`adapters.redis`)."""
        adapter = self._adapter or await self._require()
        replies = await adapter.execute(commands, resend=resend)
        for reply in replies:
            if isinstance(reply, Exception):
                raise adapter.translate(reply) or reply
        return replies

    @property
    def wait_timeout(self) -> float:
        """Seconds a write waits for ``wait_replicas`` replicas to acknowledge it."""
        return self._wait_timeout_ms / 1000

    def _refuse_cluster_options(self, cluster: bool, client: object) -> None:
        """``wait_replicas`` on a Cluster, or a Cluster client that reads from replicas: a
        :class:`ConfigurationError` (at construction for a Cluster client, at start for
        anything else that turns out to be one)."""
        if cluster:
            refuse_replica_reads(client)
        if cluster and self.wait_replicas is not None:
            raise ConfigurationError(
                f"wait_replicas={self.wait_replicas} cannot be used on a Redis Cluster: "
                "WAIT names no key, so the Cluster client sends it to a node that made "
                "none of the writes, whose count says nothing about them; drop "
                "wait_replicas, or use a standalone Redis primary with replicas (or "
                "Sentinel, redis+sentinel://) to wait for replicas"
            )

    def _wait(self) -> list[Command]:
        if self.wait_replicas is None:
            return []
        return [("WAIT", self.wait_replicas, self._wait_timeout_ms)]

    # -- wait_replicas on finishes, checkpoints and operations (issue 21, item 3)
    async def _run_acked(self, commands: Sequence[Command], what: str,
                         wrote: Callable[[list[Any]], bool], *,
                         resend: bool = True) -> list[Any]:
        """:meth:`_run`, then ``WAIT`` in the same round trip (with ``wait_replicas``):
        when ``wrote(replies)`` and fewer replicas acknowledged, raise
        :class:`~lease_core.errors.BackendUnavailable` naming ``what``."""
        if self.wait_replicas is None:
            return await self._run(commands, resend=resend)
        replies = await self._run([*commands, *self._wait()], resend=resend)
        if wrote(replies[:-1]):
            self._check_wait(replies[-1], what)
        return replies[:-1]

    def _check_wait(self, reply: Any, what: str, *, undone: bool = False) -> None:
        """Raise :class:`~lease_core.errors.BackendUnavailable` when fewer than
        ``wait_replicas`` replicas acknowledged ``what``. ``undone``: the caller gives the
        write back (a claim's runs, a named lease's hold); else the primary keeps it, and
        the message says so (an operator's operation is in effect, a finish is made)."""
        acks = int(reply)
        if self.wait_replicas is not None and acks < self.wait_replicas:
            kept = ("so it does not count" if undone else
                    "so it is not taken as done, although the Redis primary made it and "
                    "keeps it (a failover may lose it)")
            raise BackendUnavailable(
                f"{what} was acknowledged by {acks} of wait_replicas={self.wait_replicas} "
                f"replicas within {self._wait_timeout_ms} ms, {kept}; check "
                "the replicas of the Redis primary or lower wait_replicas"
            )

    # -- contract ------------------------------------------------------------------

    async def now_ms(self) -> int:
        """Return Redis's ``TIME`` in epoch milliseconds."""
        (reply,) = await self._run([("TIME",)])
        return time_ms(reply)

