"""MkDocs hook: publish files kept elsewhere in the repository with the site.

The benchmark and chaos results (``benchmarks/RESULTS.md``, ``tests/chaos/RESULTS.md``)
and the benchmark plots become pages and images of the site under the same paths, and the
framework recipes of ``docs/examples/`` downloadable files, so that pages can link to them
and the strict build checks those links.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ("benchmarks/RESULTS.md", "tests/chaos/RESULTS.md", "benchmarks/plots/*.png")
EXAMPLES = Path(__file__).resolve().parent


def on_files(files: Files, config: Any) -> Files:
    """Add the published files to the site's files."""
    for pattern in PUBLISHED:
        for path in sorted(ROOT.glob(pattern)):
            files.append(File(str(path.relative_to(ROOT)), str(ROOT), config["site_dir"],
                              config["use_directory_urls"]))
    for path in sorted((EXAMPLES / "examples").rglob("*.py")):
        files.append(File(str(path.relative_to(EXAMPLES)), str(EXAMPLES), config["site_dir"],
                          config["use_directory_urls"]))
    return files
