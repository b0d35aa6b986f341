"""The library's import paths hold only the library; benchmarks use public names only."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("lease_core", "backends", "adapters")
TOOLING = ("lease_core.demo", "backends.embedded", "lease_core.testing")
#: Needed by lease_core.testing only (the ``testing`` extra), never by the library.
TEST_FRAMEWORKS = ("pytest", "_pytest", "hypothesis")
#: The command line is the demo's entry point: ``anarchon demo`` imports it when it runs.
FRONT_ENDS = ("lease_core.cli",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _library_modules() -> Iterator[tuple[str, Path]]:
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            if not name.startswith(TOOLING):
                yield name, path


def _imports(path: Path, module: str) -> Iterator[str]:
    """Every module ``path`` imports, at any depth (functions too), made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def test_no_library_module_imports_the_demo_or_the_embedded_servers() -> None:
    offenders = [
        f"{name} imports {target}"
        for name, path in _library_modules() if name not in FRONT_ENDS
        for target in _imports(path, name)
        if target.startswith(TOOLING)
    ]
    assert offenders == []


def test_importing_the_whole_library_loads_no_tooling() -> None:
    modules = [name for name, _ in _library_modules()]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "import lease_core\n"
        "for name in lease_core.__all__:\n"
        "    getattr(lease_core, name)\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({TOOLING!r})\n"
        f"                or m.partition('.')[0] in {TEST_FRAMEWORKS!r})\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tooling_lives_in_its_own_subpackages() -> None:
    assert (ROOT / "lease_core" / "demo" / "__init__.py").is_file()
    assert (ROOT / "backends" / "embedded" / "__init__.py").is_file()
    assert not list((ROOT / "lease_core").glob("demo.py"))
    assert not list((ROOT / "backends").glob("_embedded*.py"))


def test_benchmarks_use_public_names_only() -> None:
    private = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        module = _module_name(path)
        for target in _imports(path, module):
            if not target.startswith(LIBRARY):
                continue
            if any(part.startswith("_") for part in target.split(".")):
                private.append(f"{path.name}: {target}")
    assert private == []


def test_no_tracked_file_is_ignored() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist, say)")
    out = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []


def test_lease_core_testing_imports_hypothesis_only_for_the_differential_test() -> None:
    code = (
        "import sys\n"
        "import lease_core.testing as kit\n"
        "print('pytest' in sys.modules, 'hypothesis' in sys.modules)\n"
        "kit.run_differential\n"
        "print('hypothesis' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True"]
