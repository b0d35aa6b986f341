""".ci/shape.py, the shape check of ``make lint``, on small trees made for each test.

Each limit is checked on both sides: a tree just within it passes, the same tree one step
over it fails, and the failure names what broke it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "shape.py"

if not SCRIPT.is_file():  # pragma: no cover - an sdist ships tests/ but not .ci/
    pytest.skip("no .ci/shape.py (not a checkout)", allow_module_level=True)


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shape", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["shape"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


shape = _load()


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (path: source) under ``root``, with the library's packages."""
    for package in ("lease_core", "backends", "adapters", "tests"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def run(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = shape.main(["--root", str(root), *args])
    return code, capsys.readouterr().out


def lines(n: int) -> str:
    return "x = 1\n" * n


def klass(n: int) -> str:
    """A class of ``n`` lines."""
    return "class Big:\n" + "    x = 1\n" * (n - 1)


def verdict(out: str) -> str:
    return out.strip().splitlines()[-1]


# ---------------------------------------------------------------------------- sizes


def test_a_module_of_600_lines_passes_and_one_of_601_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = run(tree(tmp_path / "ok", {"backends/big.py": lines(600)}), capsys)
    assert code == 0, out
    assert "modules: largest backends/big.py, 600 lines" in out
    assert verdict(out) == "shape: ok"

    code, out = run(tree(tmp_path / "over", {"backends/big.py": lines(601)}), capsys)
    assert code == 1
    assert "  backends/big.py: 601" in out
    assert verdict(out) == "shape: broken: modules"


def test_the_kits_modules_may_be_larger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    root = tree(tmp_path, {"lease_core/testing/kit.py": lines(900),
                           "lease_core/demo/fleet.py": klass(700)})
    code, out = run(root, capsys)
    assert code == 0, out
    # The same modules outside the kits break both limits.
    root = tree(tmp_path / "outside", {"lease_core/kit.py": lines(900),
                                       "lease_core/fleet.py": klass(700)})
    code, out = run(root, capsys)
    assert code == 1
    assert verdict(out) == "shape: broken: modules, classes"


def test_a_class_of_400_lines_passes_and_one_of_401_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = run(tree(tmp_path / "ok", {"lease_core/big.py": klass(400)}), capsys)
    assert code == 0, out
    assert "classes: largest lease_core/big.py:Big, 400 lines" in out

    code, out = run(tree(tmp_path / "over", {"lease_core/big.py": klass(401)}), capsys)
    assert code == 1
    assert "  lease_core/big.py:Big: 401" in out
    assert verdict(out) == "shape: broken: classes"


def test_a_class_inside_a_function_counts_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    source = "def make():\n" + textwrap.indent(klass(401), "    ")
    code, out = run(tree(tmp_path, {"adapters/nested.py": source}), capsys)
    assert code == 1
    assert "  adapters/nested.py:make.<locals>.Big: 401" in out


def test_limits_can_be_given_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    root = tree(tmp_path, {"lease_core/big.py": klass(401)})
    assert run(root, capsys, "--limits", "class_lines=401")[0] == 0
    assert run(root, capsys, "--limits", "module_lines=400")[0] == 1
    with pytest.raises(SystemExit) as exc:
        run(root, capsys, "--limits", "lines=3")
    assert exc.value.code == 2


# ---------------------------------------------------------------------------- cycles


def test_two_modules_importing_each_other_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    one_way = {"lease_core/a.py": "from lease_core import b\n", "lease_core/b.py": "x = 1\n"}
    code, out = run(tree(tmp_path / "ok", one_way), capsys)
    assert code == 0, out
    assert "import cycles in lease_core, backends, adapters (TYPE_CHECKING imports aside): 0" \
        in out

    both = {**one_way, "lease_core/b.py": "import lease_core.a\n"}
    code, out = run(tree(tmp_path / "cycle", both), capsys)
    assert code == 1
    assert "  lease_core.a, lease_core.b import each other, for one: " \
           "lease_core.a -> lease_core.b -> lease_core.a" in out
    assert "    lease_core/a.py:1 imports lease_core.b (at module level)" in out
    assert "    lease_core/b.py:1 imports lease_core.a (at module level)" in out
    assert verdict(out) == "shape: broken: import cycles"


def test_a_cycle_through_an_import_inside_a_function_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    files = {
        "adapters/sql.py": """\
            def adapter_for(url):
                if url:
                    from .pg import PgAdapter
                    return PgAdapter()
            """,
        "adapters/pg.py": "from .sql import adapter_for\n\nclass PgAdapter:\n    pass\n",
    }
    code, out = run(tree(tmp_path, files), capsys)
    assert code == 1
    assert "    adapters/sql.py:3 imports adapters.pg (in adapter_for())" in out
    assert verdict(out) == "shape: broken: import cycles"


def test_imports_under_type_checking_do_not_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    guarded = textwrap.dedent("""\
        from __future__ import annotations

        import typing
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from lease_core.scheduler import Scheduler
        if typing.TYPE_CHECKING:
            import lease_core.scheduler
        """)
    files = {"lease_core/scheduler.py": "from . import workflows\n",
             "lease_core/workflows.py": guarded}
    code, out = run(tree(tmp_path / "ok", files), capsys)
    assert code == 0, out
    # The same import outside the guard (here in its else branch) is a cycle.
    files["lease_core/workflows.py"] = guarded + "else:\n    import lease_core.scheduler\n"
    code, out = run(tree(tmp_path / "else", files), capsys)
    assert code == 1
    assert "lease_core/workflows.py:11 imports lease_core.scheduler (at module level)" in out


def test_a_longer_cycle_across_packages_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    files = {
        "lease_core/core.py": "from backends.store import Store\n",
        "backends/store.py": "from adapters import driver\n",
        "adapters/driver.py": "x = 1\n",
    }
    assert run(tree(tmp_path / "ok", files), capsys)[0] == 0
    files["adapters/driver.py"] = "def f():\n    import lease_core.core\n"
    code, out = run(tree(tmp_path / "cycle", files), capsys)
    assert code == 1
    assert "adapters.driver -> lease_core.core -> backends.store -> adapters.driver" in out


def test_importing_a_package_imports_its_init(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    files = {
        "lease_core/__init__.py": "from .scheduler import Scheduler\n",
        "lease_core/scheduler.py": "class Scheduler:\n    pass\n",
        "backends/memory.py": "from lease_core import Scheduler\n",
    }
    assert run(tree(tmp_path / "ok", files), capsys)[0] == 0
    # A name of the package (not a submodule) imported back from a module of it.
    files["lease_core/scheduler.py"] += "def f():\n    from lease_core import errors\n"
    files["lease_core/__init__.py"] += "errors = 1\n"
    code, out = run(tree(tmp_path / "cycle", files), capsys)
    assert code == 1
    assert "lease_core, lease_core.scheduler import each other" in out
    assert "lease_core/scheduler.py:4 imports lease_core (in f())" in out


def test_relative_imports_are_resolved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    files = {
        "backends/embedded/__init__.py": "from . import postgres\n",
        "backends/embedded/postgres.py": "from .. import memory\n",
        "backends/memory.py": "x = 1\n",
    }
    assert run(tree(tmp_path / "ok", files), capsys)[0] == 0
    files["backends/memory.py"] = "from .embedded.postgres import x\n"
    code, out = run(tree(tmp_path / "cycle", files), capsys)
    assert code == 1
    assert "backends.embedded.postgres, backends.memory import each other" in out


# ---------------------------------------------------------------------------- private touches


EXEMPT = textwrap.dedent("""\
    import os
    import sys
    import lease_core._structures
    from lease_core import _structures
    from lease_core import _structures as structures


    class Helper:
        _count = 0

        def __init__(self):
            self._x = 1
            super().__init__()
            super()._setup()

        @classmethod
        def make(cls):
            return cls._count


    def test():
        sys._getframe(0)
        os._exit
        lease_core._structures._private
        _structures._private
        structures._private
        obj = Helper()
        obj.__class__
        obj.__dict__
        obj.public
    """)


def touches(n: int) -> str:
    return "".join(f"obj._attr{i % 3}\n" for i in range(n))


def test_twenty_private_touches_pass_and_twenty_one_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    files = {"tests/test_a.py": EXEMPT + touches(12),
             "tests/stores/helper.py": touches(8),
             "lease_core/_structures.py": "x = 1\n"}
    code, out = run(tree(tmp_path / "ok", files), capsys)
    assert code == 0, out
    assert "private touches in tests/: 20 (limit 20)" in out
    assert "  files: tests/test_a.py 12, tests/stores/helper.py 8" in out

    files["tests/stores/helper.py"] = touches(9)
    code, out = run(tree(tmp_path / "over", files), capsys)
    assert code == 1
    assert "private touches in tests/: 21 (limit 20)" in out
    assert "  attributes: _attr0 7, _attr1 7, _attr2 7" in out
    assert verdict(out) == "shape: broken: private touches"


def test_touches_through_getattr_and_monkeypatch_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    source = """\
        def test(monkeypatch, s):
            getattr(s, "_claim")
            setattr(s, "_held", {})
            hasattr(s, "_watch")
            delattr(s, "_x")
            monkeypatch.setattr(s, "_claim", None)
            monkeypatch.delattr(s, "_claim")
            getattr(s, "public")
            getattr(self, "_own")
            monkeypatch.setattr("lease_core.scheduler._INSIDE", None)
        """
    code, out = run(tree(tmp_path, {"tests/test_a.py": source}), capsys,
                    "--limits", "private_touches=5", "--verbose")
    assert code == 1
    assert "private touches in tests/: 6 (limit 5)" in out
    assert "    tests/test_a.py:7: ._claim" in out


def test_touches_outside_the_tests_do_not_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    files = {"lease_core/testing/hooks.py": touches(30), "benchmarks/run.py": touches(30)}
    code, out = run(tree(tmp_path, files), capsys)
    assert code == 0, out
    assert "private touches in tests/: 0 (limit 20)" in out


# ---------------------------------------------------------------------------- this repository


def test_the_repository_s_figures_are_printed_and_the_exit_code_follows_them() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.stderr == ""
    for figure in ("modules: largest ", "classes: largest ", "import cycles in ",
                   "private touches in tests/: "):
        assert figure in out.stdout
    last = verdict(out.stdout)
    assert out.returncode == (0 if last == "shape: ok" else 1), out.stdout
