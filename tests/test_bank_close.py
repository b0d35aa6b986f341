"""``anarchon demo --workflow bank-close``: worker processes, a SIGKILL mid-step, a verdict."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

from tests.stores.postgres import PgServer


def test_bank_close_demo_takes_the_interest_step_over_and_serves_the_status_page(
    pg16_server: PgServer,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lease_core.cli", "demo", "--workflow", "bank-close",
         "--url", pg16_server.dsn, "--serve"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    served: dict[str, object] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"Status page: (http://127\.0\.0\.1:\d+/)", line)
            if found:
                with urllib.request.urlopen(found.group(1) + "jobs", timeout=10) as reply:
                    served = json.load(reply)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        stderr = proc.stderr.read() if proc.stderr is not None else ""
        if proc.stderr is not None:
            proc.stderr.close()
    out = "".join(lines)
    assert proc.returncode == 0, out + stderr
    assert "jobs" in served
    assert "*** SIGKILL" in out
    assert re.search(r"interest attempt 2  taken_over", out), out
    assert re.search(r"interest attempt 1  lost", out), out
    verdict = re.search(r"VERDICT: OK - checked in the store: (\d+) positive balances credited "
                        r"exactly once \(attempt 1: (\d+), attempt 2: (\d+)\)", out)
    assert verdict, out
    total, first, second = map(int, verdict.groups())
    assert first + second == total and first > 0 and second > 0
    assert "one snapshot of 3000 accounts; 3000 statements published once" in out
