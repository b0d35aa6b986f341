"""The ``zombie`` fault's machinery: a worker stops itself just before a fenced write when
the coordinator asks, the coordinator resumes it once another attempt claimed the run,
and the audit counts the writes sent so (and a finish the store took from one)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from lease_core.abc import Attempt, Outcome, Reason
from tests.chaos.run import (
    ChaosConfig,
    Fault,
    Observed,
    freeze_before,
    judge,
    stopped,
    wait_for_takeover,
)
from tests.chaos.test_audit import KEY, SLOT, T0, at, ev, observed

ROOT = Path(__file__).parents[2]

#: A worker stand-in: a checkpoint write every 10 ms, each first asking its Freezer.
WRITER = textwrap.dedent("""
    import sys, time
    from tests.chaos.worker import EventLog, Freezer
    log = EventLog(sys.argv[1], "w1.1")
    freezer = Freezer(sys.argv[2], log)
    while True:
        freezer.before("cp", "job0", 1, "t1")
        time.sleep(0.01)
""")


def test_a_worker_stops_itself_before_the_write_asked_for_only(tmp_path: Path) -> None:
    log, request = tmp_path / "w1.1.jsonl", tmp_path / "w1.1.freeze"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(log), str(request)],
                             cwd=ROOT)
    try:
        # it makes no fenced transaction: that request is withdrawn, never taken late
        assert not freeze_before(child.pid, request, "tx", 0.3)
        assert not request.exists() and not stopped(child.pid)
        assert freeze_before(child.pid, request, "cp", 10.0)
        assert stopped(child.pid)
        (record,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert (record["e"], record["w"], record["k"]) == ("freeze", "cp", "t1")
        child.send_signal(signal.SIGCONT)
    finally:
        child.kill()
        child.wait()


def _claim(instance: str, token: str, n: float) -> str:
    return json.dumps({"e": "claim", "j": "job0", "s": SLOT, "a": 2, "f": 2, "k": token,
                       "n": round((T0 + n) * 1000), "x": 0, "i": instance, "t": T0 + n},
                      separators=(",", ":")) + "\n"


def test_the_coordinator_resumes_a_zombie_once_another_token_claimed_its_run(
        tmp_path: Path) -> None:
    freeze = {"e": "freeze", "w": "cp", "j": "job0", "s": SLOT, "k": "t1", "i": "w1.1",
              "t": T0 + 1.0}
    (tmp_path / "w1.1.jsonl").write_text(
        _claim("w1.1", "t0", 0.0) + json.dumps(freeze, separators=(",", ":")) + "\n")
    # an earlier claim of the run, by another token, is no takeover of the frozen attempt
    (tmp_path / "w2.1.jsonl").write_text(_claim("w2.1", "t9", 0.5))
    assert not wait_for_takeover(tmp_path, "w1.1", 0.2)
    with open(tmp_path / "w2.1.jsonl", "a") as records:
        records.write(_claim("w2.1", "t2", 2.6))
    assert wait_for_takeover(tmp_path, "w1.1", 5.0)


def _zombie(fin_sent: float) -> tuple[ChaosConfig, Observed]:
    """w1's attempt 1 froze before its finish at +0.4 s; w2 took the run over at +1.9 s;
    w1's finish was sent at ``fin_sent`` and acknowledged."""
    seen = observed(
        history=[Attempt("job0", SLOT, 1, "w1", Reason.SCHEDULED, at(0.0), at(1.9),
                         Outcome.LOST),
                 Attempt("job0", SLOT, 2, "w2", Reason.TAKEOVER, at(1.9), at(2.3),
                         Outcome.COMPLETED)],
        effects=[], checkpoints={},
        events={KEY: [
            {**ev("claim", 1, "w1", 0.0, 1, k="t1"), "n": round(T0 * 1000)},
            ev("freeze", 1, "w1", 0.4, 1, k="t1", w="fin"),
            {**ev("claim", 2, "w2", 1.9, 2, k="t2"), "n": round((T0 + 1.9) * 1000)},
            ev("fin", 1, "w1", fin_sent + 0.01, 1, k="t1", o="completed",
               w=round((T0 + fin_sent) * 1000)),
            ev("thawed", 1, "w1", fin_sent + 0.01, 1, k="t1", w="fin", ok=True)]},
        faults=[Fault("zombie-fin", "w1", T0 + 0.4, T0 + 2.0, jobs=("job0",))])
    return ChaosConfig(store="redis"), seen


def test_a_zombie_s_write_after_the_takeover_is_counted() -> None:
    config, seen = _zombie(fin_sent=2.0)
    report = judge(config, seen)
    assert report.zombie_writes == 1
    # ... and its finish, acknowledged, is one the store took from a superseded attempt
    assert report.violations == {"finish from a superseded attempt": [(*KEY, 1)]}


def test_a_zombie_whose_write_was_never_made_sent_nothing() -> None:
    config, seen = _zombie(fin_sent=2.0)
    seen.events[KEY] = [e for e in seen.events[KEY] if e["e"] not in ("thawed", "fin")]
    assert judge(config, seen).zombie_writes == 0


def test_a_finish_sent_before_the_takeover_is_none_of_a_superseded_attempt() -> None:
    config, seen = _zombie(fin_sent=0.5)
    seen.faults[0].end = T0 + 1.0  # (resumed before the takeover)
    report = judge(config, seen)
    assert report.zombie_writes == 0
    assert "finish from a superseded attempt" not in report.violations
