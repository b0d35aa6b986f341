"""Choosing a backend by URL, third-party backends through entry points, lazy imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lease_core import ConfigurationError, MemoryBackend, backend_from_url
from lease_core._registry import known_schemes
from tests.helpers import install_toy_backend


def test_memory_url() -> None:
    assert isinstance(backend_from_url("memory://"), MemoryBackend)


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(ConfigurationError) as info:
        backend_from_url("mongodb://user:secret@host/db")
    message = str(info.value)
    assert "'mongodb'" in message and "memory://" in message and "redis://" in message
    assert "secret" not in message


@pytest.mark.parametrize(("url", "hint"), [
    ("valkey://localhost:6379/0", "for Valkey, write redis://"),
    ("valkeys://localhost:6379/0", "write rediss://"),
    ("pg://db/app", "write postgresql://"),
    ("postgresql+asyncpg://db/app", "asyncpg is not supported"),
    ("postgresql+psycopg2://db/app", "psycopg2 is not supported: write postgresql://"),
    ("redis+tls://localhost:6379/0", "for Redis over TLS, write rediss://"),
    ("redis+ssl://localhost:6379/0", "for Redis over TLS, write rediss://"),
])
def test_another_tool_s_scheme_says_what_to_write(url: str, hint: str) -> None:
    with pytest.raises(ConfigurationError, match="is unknown") as refused:
        backend_from_url(url)
    assert hint in str(refused.value)


def test_url_without_scheme() -> None:
    with pytest.raises(ConfigurationError, match="has no scheme"):
        backend_from_url("localhost:5432")


def test_builtin_schemes_are_known() -> None:
    assert {"memory", "postgresql", "postgres", "redis", "rediss", "unix"} <= set(known_schemes())


def test_the_redis_backend_lists_every_scheme_the_registry_maps_to_it() -> None:
    """``Backend.schemes`` is "the URL schemes backend_from_url maps to this backend":
    RedisBackend's left out redis+cluster:// and rediss+cluster://, mapped to it since
    the Cluster URLs came."""
    from backends.redis import RedisBackend
    from lease_core._registry import _BUILTIN

    mapped = {scheme for scheme, (_, cls, _) in _BUILTIN.items() if cls == "RedisBackend"}
    assert mapped <= set(RedisBackend.schemes)


def test_third_party_backend_through_an_installed_entry_point(tmp_path: Path) -> None:
    """A distribution on sys.path declares scheme 'toy' in group anarchon.backends."""
    install_toy_backend(tmp_path, """
        from backends.memory import MemoryBackend

        class ToyBackend(MemoryBackend):
            schemes = ("toy",)

            @classmethod
            def from_url(cls, url, **options):
                made = cls()
                made.url = url
                made.options = options
                return made
    """, {"toy": "ToyBackend"})
    code = textwrap.dedent("""
        import sys
        from lease_core import backend_from_url
        from lease_core._registry import known_schemes
        b = backend_from_url("toy://here", flavour="x")
        print(type(b).__name__, b.url, b.options, "toy" in known_schemes())
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "ToyBackend toy://here {'flavour': 'x'} True"


def test_a_third_party_backend_that_fails_to_load_names_its_plugin(tmp_path: Path) -> None:
    """A plugin whose module fails to import (a driver of its own missing) raised a raw
    ImportError from importlib, naming neither the scheme nor the package."""
    install_toy_backend(tmp_path, """
        import toy_driver_not_installed
    """, {"toy": "ToyBackend"})
    code = textwrap.dedent("""
        from lease_core import ConfigurationError, backend_from_url
        try:
            backend_from_url("toy://here")
        except ConfigurationError as exc:
            print(exc)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == (
        "the backend for toy:// (entry point 'toy_backend:ToyBackend' of the package "
        "'toy-backend') failed to load: ModuleNotFoundError: No module named "
        "'toy_driver_not_installed'; install what it needs, or reinstall it"), out


def test_importing_lease_core_needs_no_driver() -> None:
    """With the drivers hidden, the core imports, and a backend names its extra."""
    code = textwrap.dedent("""
        import sys
        for name in ("psycopg", "psycopg_pool", "pg8000", "redis"):
            sys.modules[name] = None
        import lease_core
        from lease_core import Scheduler, MemoryBackend, ConfigurationError
        assert "psycopg" not in sys.modules or sys.modules["psycopg"] is None
        import anyio
        cases = (("PostgresBackend", "postgresql://127.0.0.1:1/x", "postgres"),
                 ("RedisBackend", "redis://127.0.0.1:1/0", "redis"))
        for name, url, extra in cases:
            for make in (lambda: getattr(lease_core, name)(url),
                         lambda: lease_core.backend_from_url(url)):
                try:
                    anyio.run(make().start)
                except ConfigurationError as exc:
                    assert f"anarchon[{extra}]" in str(exc), exc
                else:
                    raise SystemExit(f"{name} started without its driver")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


SHADOW_CHECK = """
import sys
from lease_core import ConfigurationError
try:
    {statement}
except ConfigurationError as exc:
    print("refused:", exc)
else:
    print("accepted")
"""


@pytest.mark.parametrize(
    ("package", "statement"),
    [
        ("backends", "from lease_core import MemoryBackend"),
        ("backends", "from lease_core import PostgresBackend"),
        ("backends", "from lease_core import backend_from_url; backend_from_url('memory://')"),
        ("backends", "from lease_core import backend_from_url; "
                     "backend_from_url('postgresql://h/db')"),
        ("adapters", "from lease_core import RedisBackend"),
        ("adapters", "from lease_core import backend_from_url; "
                     "backend_from_url('postgresql://h/db')"),
        ("adapters", "from lease_core import backend_from_url; "
                     "backend_from_url('redis://h/0')"),
        ("adapters", "import backends.postgres"),
    ],
)
def test_a_foreign_package_shadowing_ours_is_named(
    tmp_path: Path, package: str, statement: str
) -> None:
    """A user's own ``backends`` or ``adapters`` first on sys.path is refused, by its file."""
    foreign = tmp_path / package / "__init__.py"
    foreign.parent.mkdir()
    foreign.write_text('"""Some application\'s own package."""\n')
    code = SHADOW_CHECK.format(statement=statement)
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + code],
        capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.startswith("refused:"), out.stdout + out.stderr
    assert str(foreign) in out.stdout and "shadows" in out.stdout and "rename" in out.stdout


def test_memory_backend_works_beside_a_foreign_adapters_package(tmp_path: Path) -> None:
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "__init__.py").write_text("")
    code = SHADOW_CHECK.format(statement="from lease_core import backend_from_url; "
                                         "backend_from_url('memory://')")
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + code],
        capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.strip() == "accepted", out.stderr
