"""The ``anarchon`` command line and the demo on the memory backend."""

from __future__ import annotations

import io
import subprocess
import sys

from lease_core.cli import main
from lease_core.demo import run_demo


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "lease_core.cli", "--help"],
                         capture_output=True, text=True, check=True)
    for command in ("demo", "migrate", "history"):
        assert command in out.stdout


def test_memory_demo_shows_takeover_hand_over_and_a_verdict() -> None:
    out = io.StringIO()
    assert run_demo("memory", out=out)
    text = out.getvalue()
    assert "stand by" in text
    assert "attempt 2 (takeover)" in text
    assert "attempt 2 (hand-over)" in text
    assert "VERDICT: OK" in text


def test_history_command_reads_a_store(capsys: object) -> None:
    assert main(["history", "--url", "memory://"]) == 0


def test_errors_are_reported_without_traceback(capsys: object) -> None:
    code = main(["history", "--url", "nosuch://x"])
    assert code == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "anarchon:" in err and "'nosuch'" in err and "Traceback" not in err
