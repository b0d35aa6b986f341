"""Connection adapters for the Redis backend: redis-py and valkey-py, async or sync.

:func:`redis_adapter` turns whatever the user passed as ``connection`` into a
:class:`RedisAdapter`, whose only job is to send a batch of commands in **one
non-transactional pipeline** (one round trip) and to translate driver errors into
:class:`~lease_core.errors.BackendUnavailable`.

=====================================  ====================================================
passed                                 what happens
=====================================  ====================================================
nothing                                ``redis://localhost:6379/0``, opened and closed by us
a URL (``redis://``, ``rediss://``,    a client opened by us and closed on the last
``unix://``)                           ``close()``; an asyncio client under asyncio, a sync
                                       client in worker threads under trio
an asyncio client (redis or valkey)    used as is, never closed
a sync client (redis or valkey)        blocking calls run in worker threads; never closed
a connection pool (async or sync)      a client is made on the pool; the pool is never
                                       closed
=====================================  ====================================================

A client opened from a URL keeps at most :data:`MAX_CONNECTIONS` connections (redis-py's
``BlockingConnectionPool``); a call that finds them all busy waits up to
:data:`POOL_TIMEOUT` seconds for one, then raises
:class:`~lease_core.errors.BackendUnavailable`. The URL's ``max_connections`` and
``timeout`` query parameters change them (``redis://host/0?max_connections=32&timeout=5``).

The asyncio clients of redis-py and valkey-py work only under asyncio. Sync clients run in
``anyio.to_thread`` worker threads and so work under trio as well.

Scripts are registered with the driver (``register_script``). A batch of one command is
sent with the client's ``execute_command``, no pipeline (on a plain asyncio client, by
:mod:`adapters.redis_lean`, which does the same with less; on a Cluster client a lone script
call goes through the driver's script object, which routes it and loads the script itself
on a ``NOSCRIPT`` reply). A longer batch is one pipeline. A script the server lost (after
``SCRIPT FLUSH`` or a restart) is loaded through the driver and the affected commands sent
again. (redis-py's own pipeline scripts would add a ``SCRIPT EXISTS`` round trip to every
batch.)

A batch that fails because its pooled connection was closed under it (after a server
restart, or the server's idle ``timeout``) is sent once more on a fresh connection; this
applies to clients passed in too. Most scripts are safe to send again: the fenced ones
change nothing for a token that no longer holds its run; a claim sent again with the
token that now holds the run answers ``WON`` as the first try would have; an operation
carries a key of its own that keeps its answer (a trigger sent twice makes one run).
A retry's end of an attempt is not: sent twice, it answers that the token lost its run.
Its caller passes ``resend=False``: a connection that failed after the server ran the
batch is not told apart from one that never sent it. Timeouts are never retried here.
The driver's own retries are another matter: a client passed in that retries (redis-py's
default for a client made with arguments, not from a URL) may still send a retry's end
again; give it ``retry=Retry(NoBackoff(), 0)`` to rule that out.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import partial
from typing import Any

from adapters._redis_sentinel_url import SENTINEL_SCHEME, Sentinels, sentinel_parts
from adapters.base import WorkerThreads
from adapters.redis_lean import lean_sender
from lease_core._redact import redact
from lease_core.errors import (
    AnarchonError,
    AuthenticationFailed,
    BackendUnavailable,
    ConfigurationError,
    StoreRefused,
)

__all__ = ["DEFAULT_URL", "MAX_CONNECTIONS", "POOL_TIMEOUT", "SENTINEL_SCHEME", "RedisAdapter",
           "check_client", "redis_adapter", "sentinel_parts"]

#: Where the backend connects when it is given nothing.
DEFAULT_URL = "redis://localhost:6379/0"
#: Connections a client opened from a URL keeps at most (``?max_connections=`` in the URL).
#: A scheduler needs few: its claims of one instant go in one pipeline.
MAX_CONNECTIONS = 8
#: Seconds a call waits for a free pooled connection (``?timeout=`` in the URL).
POOL_TIMEOUT = 10.0
#: What redis-py's BlockingConnectionPool raises when no connection became free in time.
_POOL_EXHAUSTED = "No connection available"

Command = tuple[str | int | bytes, ...]

# Server replies that mean "the store is not usable now", as opposed to a bad command.
_UNAVAILABLE_REPLIES = ("LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "OOM")
_AUTH_REPLIES = ("NOAUTH", "WRONGPASS")
_TLS_HINT = "; rediss:// asks for TLS, which a server without it never answers"
# A command (or a command inside a script, which names none) the user's ACL forbids.
_NO_PERMISSION = ("NOPERM", "can't run this command or subcommand",
                  "no permissions to run", "no permissions to access")


def _stale(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection was closed before the reply: worth one retry.

    Timeouts are not (the command may have run), nor refused credentials or a server
    still loading its data (a retry at once would fail the same way).
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"TimeoutError", "AuthenticationError", "BusyLoadingError"}:
        return False
    if str(exc).startswith(_POOL_EXHAUSTED):  # a bounded wait for the pool ran out
        return False
    return "ConnectionError" in names


def _is_noscript(reply: Any) -> bool:
    # redis-py and valkey-py raise NoScriptError and drop the "NOSCRIPT" code from the text
    return isinstance(reply, Exception) and (
        type(reply).__name__ == "NoScriptError" or str(reply).startswith("NOSCRIPT")
    )


def _is_reply_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's reply to one command (not a failed connection)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "ResponseError" in names and not names & {"ConnectionError", "TimeoutError"}


def _describe(client: Any) -> tuple[str, str | None]:
    """Return where ``client`` connects (never with the password) and the password."""
    pool = getattr(client, "connection_pool", None)
    kwargs: dict[str, Any] = dict(getattr(pool, "connection_kwargs", None) or {})
    password = kwargs.get("password")
    if kwargs.get("path"):
        where = f"unix socket {kwargs['path']}"
    elif "host" in kwargs:
        where = f"{kwargs.get('host')}:{kwargs.get('port', 6379)}"
    else:
        where = type(client).__name__
    return where, password if isinstance(password, str) and password else None


class RedisAdapter(ABC):
    """Sends batches of Redis commands for :class:`~backends.redis.RedisBackend`.

    ``owned`` says whether the adapter opened the client itself; only then does
    :meth:`aclose` close it.
    """

    def __init__(self, client: Any, *, owned: bool) -> None:
        self.client = client
        self.owned = owned
        #: Whether the client is a Cluster client (a script may then touch one slot only).
        self.cluster = "Cluster" in type(client).__name__
        self.where, self._password = _describe(client)
        pool = getattr(client, "connection_pool", None)
        options: dict[str, Any] = dict(getattr(pool, "connection_kwargs", None) or {})
        #: How a client that decodes replies decodes them (its ``encoding`` and
        #: ``encoding_errors``): a reply counted in bytes is encoded back the same way.
        self.encoding: tuple[str, str] = (str(options.get("encoding") or "utf-8"),
                                          str(options.get("encoding_errors") or "strict"))
        #: The driver's script objects, by SHA-1 (see :meth:`load_scripts`).
        self.scripts: dict[str, Any] = {}

    @abstractmethod
    async def _execute(self, commands: Sequence[Command]) -> list[Any]:
        """Run the batch on the driver and return its raw replies."""

    async def _execute_loading(self, commands: Sequence[Command]) -> list[Any]:
        """Run the batch; load the scripts the server lost and send those commands again."""
        replies = await self._execute(commands)
        missing = [i for i, r in enumerate(replies) if _is_noscript(r)]
        if missing:
            shas = {str(commands[i][1]) for i in missing}
            await self._load([self.scripts[sha] for sha in shas if sha in self.scripts])
            # the lost scripts' commands, and what follows them in order (WAIT, TIME)
            again = [i for i, c in enumerate(commands) if i in missing or c[0] != "EVALSHA"]
            for i, reply in zip(again, await self._execute([commands[i] for i in again]),
                                strict=True):
                replies[i] = reply
        return replies

    @abstractmethod
    async def _load(self, scripts: Sequence[Any]) -> None:
        """Load the driver's script objects into the server (every primary of a Cluster)."""

    async def execute(self, commands: Sequence[Command], *, resend: bool = True) -> list[Any]:
        """Send ``commands`` in one pipelined round trip; return one reply each.

        A command the server rejected gives its exception object as its reply (the
        caller decides, for instance to load a missing script). A failure of the whole
        batch (unreachable server, refused credentials) raises
        :class:`~lease_core.errors.BackendUnavailable`. ``resend=False``: a batch that
        is not safe to run twice is not sent again after a failed connection.
        """
        try:
            try:
                return await self._execute_loading(commands)
            except Exception as exc:
                if not (resend and _stale(exc)):
                    raise
            # The connection was closed under us (the server restarted, or closed an idle
            # connection): the batch never ran, so it is sent once more on a fresh one.
            return await self._execute_loading(commands)
        except AnarchonError:
            raise
        except Exception as exc:
            translated = self.translate(exc)
            if translated is None:
                raise
            raise translated from None

    async def load_scripts(self, sources: Sequence[str]) -> list[str]:
        """Register Lua scripts with the driver (``register_script``) and load them.

        Returns their SHA-1s, by which ``EVALSHA`` commands of :meth:`execute` name them.
        Loading them now (every primary of a Cluster) spares the first calls a
        ``NOSCRIPT`` reply; a server that loses them later gets them again on demand.
        """
        registered = [self.client.register_script(source) for source in sources]
        for script in registered:
            self.scripts[script.sha] = script
        try:
            await self._load(registered)
        except AnarchonError:
            raise
        except Exception as exc:
            translated = self.translate(exc)
            if translated is None:
                raise
            raise translated from None
        return [script.sha for script in registered]

    def not_a_cluster_client(self, why: str) -> ConfigurationError:
        """The error for a client that is not a Cluster client on a Cluster node."""
        return ConfigurationError(
            f"Redis at {self.where} is a Redis Cluster node ({why}), but the backend was "
            f"given a {type(self.client).__name__} client (a redis:// URL makes one), which "
            "reaches only that node's slots; pass a Cluster client instead: RedisBackend("
            "redis.asyncio.RedisCluster.from_url(url)), or a URL redis+cluster://host:port"
        )

    def translate(self, exc: BaseException) -> AnarchonError | None:
        """Map a driver exception to anarchon's own error; ``None`` when it is not one."""
        names = {cls.__name__ for cls in type(exc).__mro__}
        root = type(exc).__module__.split(".")[0]
        text = redact(str(exc), self._password)
        upper = text.upper()
        if not self.cluster and names & {"MovedError", "AskError"}:
            return self.not_a_cluster_client(f"it redirected a key to {text}")
        if "ConnectionError" in names and text.startswith(_POOL_EXHAUSTED):
            return BackendUnavailable(
                f"no pooled connection to Redis at {self.where} became free in time: every "
                "connection of the client's pool was busy; raise max_connections (default "
                f"{MAX_CONNECTIONS}) or timeout (default {POOL_TIMEOUT:g}s) in the URL, "
                "e.g. ?max_connections=32, or pass a client with a larger pool"
            )
        if "NoPermissionError" in names or any(p.upper() in upper for p in _NO_PERMISSION):
            return StoreRefused(
                f"the Redis user at {self.where} may not run a command anarchon needs "
                f"({text}); besides the data commands on its keys (key pattern "
                "~{<prefix>*), anarchon sends EVALSHA, SCRIPT LOAD, TIME and WAIT, and its "
                "scripts call TIME and INFO (INFO is in the ACL category @dangerous): grant "
                "them, e.g. ACL SETUSER <user> +@all -@dangerous +info"
            )
        if "DB INDEX IS OUT OF RANGE" in upper:
            # The SELECT of the URL's database at connect: the URL is wrong, not the server.
            database = dict(getattr(getattr(self.client, "connection_pool", None),
                                    "connection_kwargs", None) or {}).get("db")
            return ConfigurationError(
                f"Redis at {self.where} has no database {database} ({text}): the path of "
                "the URL names the database, from 0 to the server's 'databases' setting "
                "less 1 (0 to 15 by default); a Cluster has database 0 only")
        if "AuthenticationError" in names or upper.startswith(_AUTH_REPLIES) or (
            "invalid username-password" in text
        ):
            return AuthenticationFailed(
                f"Redis at {self.where} refused the login ({text}); "
                "check the username and password given in the URL or to the client"
            )
        if names & {"ConnectionError", "TimeoutError", "BusyLoadingError"} or isinstance(
            exc, OSError
        ):
            pool = getattr(self.client, "connection_pool", None)
            tls = "SSL" in str(getattr(pool, "connection_class", "")) and "Timeout conn" in text
            return BackendUnavailable(
                f"cannot reach Redis at {self.where} ({text}); check that the server is "
                "running and the address is right" + (_TLS_HINT if tls else ""))
        if root in ("redis", "valkey"):
            if upper.startswith(_UNAVAILABLE_REPLIES):
                return BackendUnavailable(f"Redis at {self.where} is not usable now: {text}")
            return BackendUnavailable(f"Redis at {self.where} failed a command: {text}")
        return None

    async def aclose(self) -> None:
        """Close the client if the adapter opened it; a client passed in is left open."""
        if self.owned:
            await self._close()

    @abstractmethod
    async def _close(self) -> None:
        """Close the owned client."""


class AsyncClientAdapter(RedisAdapter):
    """Drive an asyncio client (``redis.asyncio.Redis``, ``valkey.asyncio.Valkey``)."""

    def __init__(self, client: Any, *, owned: bool) -> None:
        super().__init__(client, owned=owned)
        # redislean: a plain client's single commands skip execute_command's machinery
        # and may keep a connection between calls (adapters/redis_lean.py); None for any
        # other client
        self._lean = lean_sender(client, owned=owned)

    @property
    def lean(self) -> bool:
        """Whether a single command skips ``execute_command`` (:mod:`adapters.redis_lean`)."""
        return self._lean is not None

    @property
    def keeps_connection(self) -> bool:
        """Whether single commands keep a pooled connection between calls."""
        return self._lean is not None and self._lean.keep

    async def _execute(self, commands: Sequence[Command]) -> list[Any]:
        lean = self._lean
        if len(commands) == 1 and lean is not None:
            # one command on a plain client: a lost script's NOSCRIPT reply is returned,
            # and execute() loads the script and sends the command again
            try:
                return [await lean.send(commands[0])]
            except Exception as exc:
                if not _is_reply_error(exc):
                    raise
                return [exc]
        if lean is None:
            return await self._execute_driver(commands)
        lean.waiting += 1  # the pool's connections are the driver's for now
        try:
            await lean.give_back()
            return await self._execute_driver(commands)
        finally:
            lean.waiting -= 1

    async def _execute_driver(self, commands: Sequence[Command]) -> list[Any]:
        if len(commands) == 1 and not self.cluster:
            # one command, no pipeline (as above)
            try:
                return [await self.client.execute_command(*commands[0])]
            except Exception as exc:
                if not _is_reply_error(exc):
                    raise
                return [exc]
        if len(commands) == 1 and commands[0][0] == "EVALSHA":
            script = self.scripts.get(str(commands[0][1]))
            if script is not None:  # one script call: the driver handles NOSCRIPT
                keys = int(commands[0][2])
                try:
                    return [await script(commands[0][3:3 + keys], commands[0][3 + keys:])]
                except Exception as exc:
                    if not _is_reply_error(exc):
                        raise
                    return [exc]
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    async def _load(self, scripts: Sequence[Any]) -> None:
        lean = self._lean
        if lean is not None:
            lean.waiting += 1
        try:
            if lean is not None:
                await lean.give_back()
            for script in scripts:
                await self.client.script_load(script.script)
        finally:
            if lean is not None:
                lean.waiting -= 1

    async def aclose(self) -> None:
        """Give back a kept connection; then close the client if the adapter opened it."""
        if self._lean is not None:
            await self._lean.give_back()
        await super().aclose()

    async def _close(self) -> None:
        close = getattr(self.client, "aclose", None) or self.client.close
        await close()


class SyncClientAdapter(RedisAdapter):
    """Drive a blocking client (``redis.Redis``, ``valkey.Valkey``) in worker threads of
    its own: :data:`THREADS` batches at a time, never queued behind the application's
    ``anyio.to_thread`` calls (see :class:`~adapters.base.WorkerThreads`)."""

    #: How many batches run at once, each in a worker thread (anyio's default limiter
    #: has as many, shared with the whole application).
    THREADS = 40

    def __init__(self, client: Any, *, owned: bool) -> None:
        super().__init__(client, owned=owned)
        self._threads = WorkerThreads(self.THREADS)

    def _execute_blocking(self, commands: Sequence[Command]) -> list[Any]:
        if len(commands) == 1 and not self.cluster:  # as AsyncClientAdapter._execute
            try:
                return [self.client.execute_command(*commands[0])]
            except Exception as exc:
                if not _is_reply_error(exc):
                    raise
                return [exc]
        if len(commands) == 1 and commands[0][0] == "EVALSHA":
            script = self.scripts.get(str(commands[0][1]))
            if script is not None:  # one script call: the driver handles NOSCRIPT
                keys = int(commands[0][2])
                try:
                    return [script(commands[0][3:3 + keys], commands[0][3 + keys:])]
                except Exception as exc:
                    if not _is_reply_error(exc):
                        raise
                    return [exc]
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

    async def _execute(self, commands: Sequence[Command]) -> list[Any]:
        return await self._threads.run(partial(self._execute_blocking, commands))

    def _load_blocking(self, scripts: Sequence[Any]) -> None:
        for script in scripts:
            self.client.script_load(script.script)

    async def _load(self, scripts: Sequence[Any]) -> None:
        await self._threads.run(partial(self._load_blocking, scripts))

    async def _close(self) -> None:
        await self._threads.run(self.client.close)


def _under_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _AsyncSentinelAdapter(AsyncClientAdapter):
    """An asyncio client of a Sentinel's primary; closing it closes the Sentinel clients."""

    def __init__(self, client: Any, watcher: Any, found: Sentinels) -> None:
        super().__init__(client, owned=True)
        self.watcher = watcher
        self._found = found
        self.where = found.where()

    def translate(self, exc: BaseException) -> AnarchonError | None:
        return self._found.translate(exc, self._password) or super().translate(exc)

    async def _close(self) -> None:
        await super()._close()
        for sentinel in self.watcher.sentinels:
            await sentinel.aclose()


class _SyncSentinelAdapter(SyncClientAdapter):
    """A blocking client of a Sentinel's primary; closing it closes the Sentinel clients."""

    def __init__(self, client: Any, watcher: Any, found: Sentinels) -> None:
        super().__init__(client, owned=True)
        self.watcher = watcher
        self._found = found
        self.where = found.where()

    def translate(self, exc: BaseException) -> AnarchonError | None:
        return self._found.translate(exc, self._password) or super().translate(exc)

    async def _close(self) -> None:
        await super()._close()
        for sentinel in self.watcher.sentinels:
            await self._threads.run(sentinel.close)


def _from_sentinel_url(url: str) -> RedisAdapter:
    """The primary of a Sentinel-watched service, found again after each failover.

    Its pool is bounded like a ``redis://`` URL's: a call that finds every connection busy
    waits for one (``POOL_TIMEOUT``). redis-py's own Sentinel pool raises "Too many
    connections" at once instead, which read as the store being unreachable while it
    answered: at a burst of takeovers after a failover, handlers failed and ranked
    members' claims were lost (sentinelfix).
    """
    sentinels, service, kwargs = sentinel_parts(url)
    watch = {"sentinel_kwargs": kwargs.pop("sentinel_kwargs", None)}
    bounds: dict[str, Any] = {"max_connections": kwargs.pop("max_connections", MAX_CONNECTIONS),
                              "timeout": kwargs.pop("timeout", POOL_TIMEOUT)}
    if _under_asyncio():
        import redis.asyncio
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel
        from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool

        class AsyncBlockingSentinelPool(
                AsyncSentinelPool, redis.asyncio.BlockingConnectionPool):
            """The Sentinel's primary's pool; waits for a free connection."""

        # Called through Any: redis-py types Sentinel's constructor from 8.2 on, not before.
        sentinel: Any = AsyncSentinel
        watcher: Any = sentinel(sentinels, **watch)
        client = watcher.master_for(service, connection_pool_class=AsyncBlockingSentinelPool,
                                    **bounds, **kwargs)
        return _AsyncSentinelAdapter(client, watcher, Sentinels(watcher, sentinels, service))
    import redis
    from redis.sentinel import Sentinel, SentinelConnectionPool

    class BlockingSentinelPool(
            SentinelConnectionPool, redis.BlockingConnectionPool):
        """The Sentinel's primary's pool; waits for a free connection."""

    sync_sentinel: Any = Sentinel
    sync_watcher: Any = sync_sentinel(sentinels, **watch)
    sync_client = sync_watcher.master_for(service, connection_pool_class=BlockingSentinelPool,
                                          **bounds, **kwargs)
    return _SyncSentinelAdapter(sync_client, sync_watcher,
                                Sentinels(sync_watcher, sentinels, service))


def _from_url(url: str) -> RedisAdapter:
    # A bounded pool: without it, every concurrent call opens a connection of its own
    # (redis-py's default pool has no limit), each costing a handshake.
    bounds = {"max_connections": MAX_CONNECTIONS, "timeout": POOL_TIMEOUT}
    try:
        if url.split("://", 1)[0].lower() == SENTINEL_SCHEME:
            return _from_sentinel_url(url)
        if _under_asyncio():
            import redis.asyncio

            pool = redis.asyncio.BlockingConnectionPool.from_url(url, **bounds)
            return AsyncClientAdapter(redis.asyncio.Redis.from_pool(pool), owned=True)
        import redis

        sync_pool = redis.BlockingConnectionPool.from_url(url, **bounds)
        return SyncClientAdapter(redis.Redis.from_pool(sync_pool), owned=True)
    except ModuleNotFoundError as exc:
        raise ConfigurationError(
            "the Redis backend needs redis-py; install it with 'pip install anarchon[redis]'"
        ) from exc
    except ConfigurationError:
        raise
    except ValueError as exc:
        raise ConfigurationError(
            f"connection URL is not a Redis URL ({exc}); use redis://host:port/db, "
            "rediss://host:port/db or unix:///path/to/socket"
        ) from None


def _client_for_pool(pool: Any) -> Any:
    module = type(pool).__module__
    root = module.split(".")[0]
    is_async = ".asyncio" in module or inspect.iscoroutinefunction(
        getattr(pool, "get_connection", None)
    )
    client_module = importlib.import_module(f"{root}.asyncio" if is_async else root)
    client_class = getattr(client_module, "Redis", None) or client_module.Valkey
    return client_class(connection_pool=pool)


def check_client(connection: object) -> None:
    """Refuse an object that is not a Redis client, pool or adapter (a URL is checked
    where it is parsed): :class:`~lease_core.errors.ConfigurationError` naming it."""
    if isinstance(connection, RedisAdapter):
        return
    usable = (hasattr(connection, "execute_command") and hasattr(connection, "pipeline")) or (
        not hasattr(connection, "pipeline") and hasattr(connection, "get_connection"))
    if not usable:
        raise ConfigurationError(
            f"connection={redact(repr(connection))[:80]} is not a Redis URL, client or pool; pass "
            "'redis://host:port/db', a redis-py or valkey-py client (async or sync) or "
            "a connection pool"
        )


def redis_adapter(connection: object) -> RedisAdapter:
    """Return an adapter for what the user passed as ``connection`` (see module docs).

    Raises :class:`~lease_core.errors.ConfigurationError` for an object it cannot use.
    """
    if connection is None:
        return _from_url(DEFAULT_URL)
    if isinstance(connection, str):
        return _from_url(connection)
    if isinstance(connection, RedisAdapter):
        return connection
    check_client(connection)
    client: Any = connection
    if not hasattr(client, "pipeline") and hasattr(client, "get_connection"):
        client = _client_for_pool(client)
    execute = client.execute_command
    if inspect.iscoroutinefunction(execute):
        return AsyncClientAdapter(client, owned=False)
    return SyncClientAdapter(client, owned=False)
