"""The chaos audit itself: each invariant is reported, with its runs, when it breaks."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from lease_core.abc import Attempt, Outcome, Reason, RunInfo, RunStatus
from tests.chaos.run import (
    ChaosConfig,
    Fault,
    Frozen,
    Observed,
    judge,
    results_markdown,
    run_chaos,
)

T0 = 1_800_000_000.0
SLOT = int(T0 * 1000)
KEY = ("job0", SLOT)
CONFIG = ChaosConfig(store="postgres")


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=UTC)


def attempt(n: int, instance: str, claimed: float, outcome: Outcome | None,
            reason: Reason = Reason.SCHEDULED) -> Attempt:
    finished = None if outcome is None else at(claimed + 0.3)
    return Attempt("job0", SLOT, n, instance, reason, at(claimed), finished, outcome)


def event(kind: str, n: int, **fields: Any) -> dict[str, Any]:
    return {"e": kind, "j": "job0", "s": SLOT, "a": n, "i": f"w{n}", "t": T0, **fields}


def observed(**changes: Any) -> Observed:
    """A clean takeover: attempt 1 (w1) is killed, attempt 2 (w2) completes."""
    base: dict[str, Any] = {
        "history": [attempt(1, "w1", 0.0, Outcome.LOST),
                    attempt(2, "w2", 1.7, Outcome.COMPLETED, Reason.TAKEOVER)],
        "open_before": [], "open_after": [],
        "checkpoints": {KEY: {"a": 2, "step": 3}},
        "effects": [("job0", SLOT, 2, "w2")],
        "events": {KEY: [
            event("start", 1, cp=None), event("cp", 1, step=0), event("cp", 1, step=1),
            event("start", 2, cp={"a": 1, "step": 1}), event("cp", 2, step=1),
            event("cp", 2, step=3), event("tx", 2), event("done", 2),
        ]},
        "faults": [Fault("kill", "w1", T0 + 0.2, T0 + 0.5)],
        "started": T0 - 1, "faults_over": T0 + 5, "audit_at": T0 + 20,
    }
    base.update(changes)
    return Observed(**base)


def test_a_clean_takeover_breaks_nothing_and_is_measured() -> None:
    report = judge(CONFIG, observed())
    assert report.violations == {}
    assert (report.slots, report.attempts, report.takeovers) == (1, 2, 1)
    assert report.takeover_latency == [pytest.approx(1.5)]
    assert report.late_takeovers == []
    # The handler started in both attempts: its un-fenced record repeats, by nature.
    assert (report.unfenced_started_twice, report.unfenced_done_twice) == (1, 0)


def test_runs_completed_by_a_skewed_worker_are_counted() -> None:
    assert judge(CONFIG, observed(skewed=frozenset({"w2"}))).skewed_completions == 1
    assert judge(CONFIG, observed(skewed=frozenset({"w1"}))).skewed_completions == 0


BROKEN: dict[str, dict[str, Any]] = {
    "double completions": {"history": [
        attempt(1, "w1", 0.0, Outcome.COMPLETED),
        attempt(2, "w2", 1.7, Outcome.COMPLETED, Reason.TAKEOVER)]},
    "finish from a superseded attempt": {"history": [
        attempt(1, "w1", 0.0, Outcome.FAILED),
        attempt(2, "w2", 1.7, Outcome.COMPLETED, Reason.TAKEOVER)]},
    "double fenced effects": {"events": {KEY: [event("tx", 1), event("tx", 2)]}},
    "transaction from a superseded attempt": {"effects": [("job0", SLOT, 1, "w1")]},
    "checkpoint from a superseded attempt": {"checkpoints": {KEY: {"a": 1, "step": 3}}},
    "checkpoint went backwards": {"events": {KEY: [
        event("cp", 1, step=2), event("start", 2, cp={"a": 1, "step": 1})]}},
    "runs left running": {"open_before": [
        RunInfo("job0", SLOT, RunStatus.RUNNING, 2, "w2")]},
}


def test_an_effect_row_of_an_attempt_that_did_not_complete_is_reported() -> None:
    # the effect commits with the run's completion: attempt 2 failed, yet its row is there
    seen = observed(history=[attempt(1, "w1", 0.0, Outcome.LOST),
                             attempt(2, "w2", 1.7, Outcome.FAILED, Reason.TAKEOVER)])
    report = judge(CONFIG, seen)
    assert report.violations["transaction from a superseded attempt"] == [(*KEY, 2)]


def test_a_stored_checkpoint_below_a_step_written_went_backwards() -> None:
    # attempt 2 wrote step 3, the store holds its step 2: a write was undone
    report = judge(CONFIG, observed(checkpoints={KEY: {"a": 2, "step": 2}}))
    assert report.violations == {"checkpoint went backwards": [(*KEY, 2)]}


@pytest.mark.parametrize("what", list(BROKEN))
def test_each_broken_invariant_is_reported_with_its_run(what: str) -> None:
    report = judge(CONFIG, observed(**BROKEN[what]))
    assert what in report.violations
    assert report.violations[what][0][:2] == KEY


def test_a_checkpoint_changed_under_its_holder_is_reported() -> None:
    events = {KEY: [event("cp_foreign", 2, seen={"a": 1, "step": 2},
                          expected={"a": 2, "step": 1})]}
    report = judge(CONFIG, observed(events=events))
    assert report.violations["checkpoint from a superseded attempt"] == [(*KEY, 2)]


def test_a_read_after_its_lease_ran_out_that_sees_the_next_holder_is_no_violation() -> None:
    """A worker frozen past its lease whose handler read the checkpoint once more before
    the loss's cancellation reached it saw the next holder's write: reported as a
    checkpoint from a superseded attempt, though no stale write happened. Only a read
    while the attempt held the run (before its last known expiry) counts."""
    def read_at(t: float) -> dict[str, Any]:
        return {KEY: [
            event("claim", 1, k="t1", x=(T0 + 1.5) * 1000),
            event("hb", 1, k="t1", x=(T0 + 2.0) * 1000),
            event("cp", 1, step=1),
            event("cp_foreign", 1, t=t, seen={"a": 2, "step": 3},
                  expected={"a": 1, "step": 1})]}

    late = judge(CONFIG, observed(events=read_at(T0 + 3.5)))
    assert "checkpoint from a superseded attempt" not in late.violations
    held = judge(CONFIG, observed(events=read_at(T0 + 1.9)))
    assert held.violations["checkpoint from a superseded attempt"] == [(*KEY, 1)]


def test_a_late_takeover_is_listed() -> None:
    history = [attempt(1, "w1", 0.0, Outcome.LOST),
               attempt(2, "w2", 4.0, Outcome.COMPLETED, Reason.TAKEOVER)]
    report = judge(CONFIG, observed(history=history))
    assert report.late_takeovers == [(*KEY, 2, 3.8)]


def test_slots_missed_while_the_store_answered_nothing_are_counted_apart() -> None:
    # One job every 600 ms; slots +1.2 s and +2.4 s have no run. The store probe got no
    # answer from +1.0 s to +2.0 s (a restart), and one at +2.5 s.
    config = ChaosConfig(store="pgbouncer", jobs=1, flaky=False)
    history = [Attempt("job0", SLOT + 600 * k, 1, "w1", Reason.SCHEDULED, at(0.6 * k),
                       at(0.6 * k + 0.3), Outcome.COMPLETED) for k in (0, 1, 3)]
    answers = [(T0 + t - 0.01, T0 + t) for t in (0.2, 0.6, 0.95, 2.0, 2.5, 2.9)]
    seen = observed(history=history, events={}, effects=[], checkpoints={}, faults=[],
                    faults_over=T0 + 3.0)
    report = judge(config, seen)
    assert (report.missed_slots, report.missed_store_unreachable) == (2, 0)  # not probed
    report = judge(config, observed(**{**vars(seen), "answers": answers}))
    # +1.2 s: no answer from +0.95 s to +2.0 s, and +1.8 s was due meanwhile (only the
    # newest slot missed while the store is unreachable is claimed when it returns).
    # +2.4 s: the store answered at +2.5 s, so that miss is not the store's: a violation.
    assert (report.missed_slots, report.missed_store_unreachable) == (2, 1)
    assert report.summary()["missed_store_unreachable"] == 1
    assert report.violations == {
        "slots never claimed while the store answered": [("job0", SLOT + 2400)]}


def test_a_slot_nobody_claimed_while_the_store_answered_breaks_the_invariant() -> None:
    # Two jobs every 600 ms, the store answering every 100 ms throughout; job1's slot
    # +1.2 s has no run (its first-ranked member was killed, say, and nobody took it).
    # w1 claims job0's slots first, w2 job1's.
    config = ChaosConfig(store="redis", jobs=2, flaky=False)
    history = [Attempt(f"job{n}", SLOT + 600 * k, 1, f"w{n + 1}", Reason.SCHEDULED,
                       at(0.6 * k), at(0.6 * k + 0.3), Outcome.COMPLETED)
               for n in (0, 1) for k in range(5) if (n, k) != (1, 2)]
    answers = [(T0 + t / 10 - 0.01, T0 + t / 10) for t in range(31)]
    seen = observed(history=history, events={}, effects=[], checkpoints={}, answers=answers,
                    faults=[Fault("kill", "w2", T0 + 1.0, T0 + 1.5, jobs=("job1",))],
                    faults_over=T0 + 3.0)
    report = judge(config, seen)
    assert report.violations == {
        "slots never claimed while the store answered": [("job1", SLOT + 1200)]}
    assert report.summary()["missed_while_answered"] == 1
    assert report.owner_faults == 1  # w2 claimed job1's slot +0.6 s first
    # A fault on a member the coordinator ranked first that did not claim first (the
    # fleet ranked another first) is not counted as one on a first-ranked member.
    elsewhere = [Fault("kill", "w3", T0 + 1.0, T0 + 1.5, jobs=("job1",)),
                 Fault("stop", "w1", T0 + 1.0, T0 + 1.5, jobs=("job1",))]
    assert judge(config, observed(**{**vars(seen), "faults": elsewhere})).owner_faults == 0
    # The same slot claimed (late, by the next-ranked member) breaks nothing.
    late = Attempt("job1", SLOT + 1200, 1, "w3", Reason.SCHEDULED, at(1.5), at(1.8),
                   Outcome.COMPLETED)
    report = judge(config, observed(**{**vars(seen), "history": [*history, late]}))
    assert report.violations == {}
    assert max(report.claim_delay) == pytest.approx(0.3)


def test_a_slot_of_the_retried_job_nobody_claimed_breaks_the_invariant_too() -> None:
    # One job and the flaky one (retried within its runs), every 600 ms, the store
    # answering throughout; the flaky job's slot +1.2 s has no run.
    config = ChaosConfig(store="postgres", jobs=1)
    history = [Attempt(job, SLOT + 600 * k, 1, "w1", Reason.SCHEDULED, at(0.6 * k),
                       at(0.6 * k + 0.3), Outcome.COMPLETED)
               for job in ("job0", "flaky") for k in range(5) if (job, k) != ("flaky", 2)]
    answers = [(T0 + t / 10 - 0.01, T0 + t / 10) for t in range(31)]
    seen = observed(history=history, events={}, effects=[], checkpoints={}, answers=answers,
                    faults=[], faults_over=T0 + 3.0)
    report = judge(config, seen)
    assert report.violations == {
        "slots never claimed while the store answered": [("flaky", SLOT + 1200)]}
    # without the flaky job, nothing of it is expected
    assert judge(ChaosConfig(store="postgres", jobs=1, flaky=False), seen).violations == {}


def test_a_new_run_keeps_the_notes_written_below_the_figures(tmp_path: Path) -> None:
    from tests.chaos.__main__ import _notes_of

    results = tmp_path / "RESULTS.md"
    assert _notes_of(results) == ""
    results.write_text("# Chaos results\n\n| a | b |\n\nWall time: 1 s.\n")
    assert _notes_of(results) == ""
    results.write_text("# Chaos results\n\nWall time: 1 s.\n\n## Why\n\nbecause\n")
    assert _notes_of(results) == "\n## Why\n\nbecause\n"
    results.write_text("# Chaos results\n\n## Violations\n\n- x\n\nWall time: 1 s.\n\n"
                       "## Why\n\nbecause\n")
    assert _notes_of(results) == "\n## Why\n\nbecause\n"  # the figures' own section goes
    results.write_text("# Chaos results\n\n## Violations\n\n- x\n")
    assert _notes_of(results) == ""


def _retried(second_claimed: float, first_outcome: Outcome = Outcome.FAILED,
             events: list[dict[str, Any]] | None = None) -> Observed:
    """Attempt 1 fails at 0.3 s (its record says so), attempt 2 retries it."""
    return observed(
        history=[attempt(1, "w1", 0.0, first_outcome),
                 attempt(2, "w2", second_claimed, Outcome.COMPLETED, Reason.RETRY)],
        effects=[], checkpoints={},
        events={KEY: events if events is not None else [
            event("rstart", 1, r="scheduled"), {**event("rfail", 1), "t": T0 + 0.29},
            {**event("rstart", 2, r="retry"), "t": T0 + second_claimed + 0.01},
            {**event("rdone", 2), "t": T0 + second_claimed + 0.2}]},
        faults=[])


def test_a_clean_retry_breaks_nothing_and_is_counted() -> None:
    report = judge(CONFIG, _retried(0.5))
    assert report.violations == {}  # the failure before its retry is no superseded finish
    assert (report.retries, report.stale_finish) == (1, [])


def test_a_retry_before_its_failure_ended_is_reported() -> None:
    early = judge(CONFIG, _retried(0.2))  # claimed before attempt 1's failure was recorded
    assert early.violations == {"retry overlapping the attempt it retries": [(*KEY, 2)]}
    not_failed = judge(CONFIG, _retried(0.5, Outcome.LOST))
    assert not_failed.retry_overlaps == [(*KEY, 2)]
    running = judge(CONFIG, _retried(0.5, events=[  # the failed handler wrote after
        event("rstart", 1, r="scheduled"), {**event("rfail", 1), "t": T0 + 0.9},
        {**event("rstart", 2, r="retry"), "t": T0 + 0.6}]))
    assert running.retry_overlaps == [(*KEY, 2)]
    # claimed before the failure was recorded, with no handler records to show it
    assert judge(CONFIG, _retried(0.2, events=[])).retry_overlaps == [(*KEY, 2)]


def test_records_of_an_attempt_a_failover_lost_are_not_the_retry_s() -> None:
    """Before a failover, w9 ran a retry numbered 2 whose claim the failover lost; the
    store numbered the next retry 2 again (w2): w9's records are not w2's (sentinelfix)."""
    lost = [{**event("rstart", 2, r="retry"), "i": "w9", "t": T0 - 3.0},
            {**event("rstart", 1, r="scheduled"), "i": "w9", "t": T0 - 3.5}]
    report = judge(CONFIG, _retried(0.5, events=[
        *lost, event("rstart", 1, r="scheduled"), {**event("rfail", 1), "t": T0 + 0.29},
        {**event("rstart", 2, r="retry"), "t": T0 + 0.51}]))
    assert report.retry_overlaps == []
    # and the same records as the store's attempts' own still show an overlap
    overlapping = judge(CONFIG, _retried(0.5, events=[
        event("rstart", 1, r="scheduled"), {**event("rfail", 1), "t": T0 + 0.9},
        {**event("rstart", 2, r="retry"), "t": T0 + 0.6}]))
    assert overlapping.retry_overlaps == [(*KEY, 2)]


def cancelled(*history: Attempt) -> Observed:
    """Attempt 1 (w1) cancelled through the store at 0.2 s (the cancel returned at 0.25 s)."""
    return observed(history=list(history), effects=[], events={}, checkpoints={},
                    faults=[Fault("cancel", f"job0@{SLOT}", T0 + 0.2, T0 + 0.25, run=KEY)])


def test_a_cancelled_run_that_stays_cancelled_breaks_nothing() -> None:
    report = judge(CONFIG, cancelled(attempt(1, "w1", 0.0, Outcome.CANCELLED)))
    assert report.violations == {}
    assert report.cancels == 1 and report.outcomes == {"cancelled": 1}


def test_a_cancelled_run_taken_over_or_completed_breaks_the_invariant() -> None:
    report = judge(CONFIG, cancelled(
        attempt(1, "w1", 0.0, Outcome.CANCELLED),
        attempt(2, "w2", 1.7, Outcome.COMPLETED, Reason.TAKEOVER)))
    assert report.violations["cancelled runs taken over"] == [(*KEY, 2)]
    assert report.violations["cancelled runs completed"] == [(*KEY, "completed")]


def test_a_cancelled_run_a_late_write_completed_breaks_the_invariant() -> None:
    """The holder's write that ends the run, sent within the cancel's grace (its token
    still on the run), was accepted: the attempt may stay 'cancelled' in the history (a
    finish never overwrites an outcome), while the run's status or its fenced effect
    shows the completion."""
    seen = cancelled(attempt(1, "w1", 0.0, Outcome.CANCELLED))
    seen.statuses = {KEY: RunStatus.COMPLETED}
    assert judge(CONFIG, seen).violations == {
        "cancelled runs completed": [(*KEY, "status completed")]}
    seen.statuses, seen.effects = {KEY: RunStatus.CANCELLED}, [("job0", SLOT, 1, "w1")]
    assert judge(CONFIG, seen).violations["cancelled runs completed"] == [
        (*KEY, "fenced effect committed")]


def test_a_duplicate_key_refusal_of_a_fenced_effect_is_a_double_effect() -> None:
    # the second attempt's effect reached the table: only the unique key refused it
    seen = observed(events={KEY: [event("tx", 1), event("tx_dup", 2)]},
                    effects=[("job0", SLOT, 1, "w1")])
    assert judge(CONFIG, seen).violations["double fenced effects"] == [KEY]


def test_a_cancel_the_store_did_not_keep_is_reported() -> None:
    report = judge(CONFIG, cancelled(attempt(1, "w1", 0.0, Outcome.LOST)))
    assert report.violations["cancelled runs completed"] == [(*KEY, "not cancelled")]


def test_a_cancel_of_a_run_waiting_for_its_retry_is_kept() -> None:
    # attempt 1 failed and the run waited for its retry when the cancel came: the store
    # ends the run 'cancelled' with an attempt of its own (the retry it prevents)
    prevented = Attempt("job0", SLOT, 2, "chaos", Reason.RETRY, at(0.2), at(0.2),
                        Outcome.CANCELLED)
    seen = cancelled(attempt(1, "w1", -1.0, Outcome.FAILED), prevented)  # ended at -0.7 s
    report = judge(CONFIG, seen)
    assert report.violations == {} and report.cancels == 1
    # a cancel the store acknowledged and did not record is not kept
    seen = cancelled(attempt(1, "w1", -1.0, Outcome.FAILED))
    assert judge(CONFIG, seen).violations == {
        "cancelled runs completed": [(*KEY, "not cancelled")]}


def test_a_takeover_right_after_the_cancel_in_the_store_s_time_is_found() -> None:
    # the store cancelled attempt 1 at +0.2 s; the cancel's answer reached the operator
    # at +0.25 s; attempt 2 took the run over at +0.22 s, in between
    cancelled_1 = Attempt("job0", SLOT, 1, "w1", Reason.SCHEDULED, at(0.0), at(0.2),
                          Outcome.CANCELLED)
    seen = cancelled(cancelled_1, attempt(2, "w2", 0.22, None, Reason.TAKEOVER))
    assert judge(CONFIG, seen).violations["cancelled runs taken over"] == [(*KEY, 2)]
    # an attempt numbered after the cancelled one took it over, whatever its time
    seen = cancelled(cancelled_1, attempt(2, "w2", 0.19, None, Reason.TAKEOVER))
    assert judge(CONFIG, seen).violations["cancelled runs taken over"] == [(*KEY, 2)]


def test_a_cancel_of_a_frozen_holder_s_run_is_counted_apart() -> None:
    seen = cancelled(attempt(1, "w1", 0.0, Outcome.CANCELLED))
    assert judge(CONFIG, seen).cancels_of_frozen == 0
    seen.faults[0].holder = "w1"  # stopped or partitioned when the cancel came
    report = judge(CONFIG, seen)
    assert (report.cancels, report.cancels_of_frozen, report.violations) == (1, 1, {})
    assert "| runs cancelled (of which held by a stopped or partitioned worker) | 1 (1) |" in (
        results_markdown([report.summary()], "test"))


def test_the_operator_sees_which_instances_are_frozen() -> None:
    frozen = Frozen()
    assert frozen.wait(0) == frozenset()
    with frozen.during("w1"):
        assert frozen.wait(0) == {"w1"}
    assert frozen.wait(0.01) == frozenset()


def test_a_refused_cancel_is_not_judged() -> None:
    seen = cancelled(attempt(1, "w1", 0.0, Outcome.COMPLETED))
    seen.faults = [Fault("cancel", "", T0 + 0.2, T0 + 0.25)]
    report = judge(CONFIG, seen)
    assert report.violations == {} and report.cancels == 0


# -- fences and lost commits across a failover (issue 21) ------------------------------


def ev(kind: str, n: int, instance: str, t: float, fence: int, **more: Any) -> Any:
    """A worker's record of attempt ``n`` of KEY, ``t`` s after T0, with its fence."""
    return {"e": kind, "j": "job0", "s": SLOT, "a": n, "i": instance, "t": T0 + t,
            "f": fence, **more}


def _failover(new_fence: int) -> Observed:
    """Attempt 2 (w2) is acknowledged, then lost with the primary; the promoted replica
    numbers w3's attempt 2 again, with fence ``new_fence``."""
    return observed(
        history=[attempt(1, "w1", 0.0, Outcome.LOST),
                 attempt(2, "w3", 4.0, Outcome.COMPLETED, Reason.TAKEOVER)],
        effects=[], checkpoints={},
        events={KEY: [
            ev("claim", 1, "w1", 0.0, 1, k="t1"), ev("start", 1, "w1", 0.1, 1, cp=None),
            ev("claim", 2, "w2", 1.7, 2, k="t2"), ev("start", 2, "w2", 1.8, 2, cp=None),
            ev("claim", 2, "w3", 4.0, new_fence, k="t3"),
            ev("start", 2, "w3", 4.1, new_fence, cp=None),
            ev("fin", 2, "w3", 4.5, new_fence, k="t3", o="completed")]},
        faults=[Fault("kill", "w1", T0 + 0.2, T0 + 0.5),
                Fault("failover", "redis-sentinel", T0 + 2.0, T0 + 3.0)])


def test_a_fence_issued_twice_across_a_failover_is_found() -> None:
    report = judge(CONFIG, _failover(new_fence=2))
    assert report.violations == {"fence numbers issued twice": [(*KEY, 2)]}
    # the lost claim is counted, and explained by the failover just after it
    assert report.lost_claims == [(*KEY, 2, "w2")] and report.lost_unexplained == []


def test_a_fence_above_the_lost_attempts_breaks_nothing() -> None:
    report = judge(CONFIG, _failover(new_fence=(1_800_000_002_000 << 20) + 2))
    assert report.violations == {}
    assert report.lost_claims == [(*KEY, 2, "w2")]


def test_one_worker_with_the_same_attempt_before_and_after_a_failover_repeats_no_fence(
        ) -> None:
    """w2's attempt 2 (fence 2) is lost with the primary; the promoted replica, in a new
    epoch, gives w2 attempt 2 again (a far higher fence). The store's one record of
    attempt 2 by w2 is the later claim's: the lost one is ordered by its own time, not by
    that record's (which put fence 2 after the new epoch's fences, as if issued twice)."""
    big = (1_800_000_002_000 << 20)
    seen = observed(
        history=[attempt(1, "w1", 3.5, Outcome.FAILED),
                 attempt(2, "w2", 4.0, Outcome.COMPLETED, Reason.RETRY)],
        effects=[], checkpoints={},
        events={KEY: [
            ev("claim", 1, "w2", 0.0, 1, k="t1"), ev("start", 1, "w2", 0.1, 1, cp=None),
            ev("claim", 2, "w2", 1.7, 2, k="t2"), ev("start", 2, "w2", 1.8, 2, cp=None),
            ev("claim", 1, "w1", 3.5, big + 1, k="t3"),
            ev("start", 1, "w1", 3.6, big + 1, cp=None),
            ev("claim", 2, "w2", 4.0, big + 2, k="t4"),
            ev("start", 2, "w2", 4.1, big + 2, cp=None),
            ev("fin", 2, "w2", 4.5, big + 2, k="t4", o="completed")]},
        faults=[Fault("failover", "pgreplica", T0 + 2.0, T0 + 3.0)])
    report = judge(CONFIG, seen)
    assert "fence numbers issued twice" not in report.violations, report.violations


def test_a_claim_read_late_by_a_stopped_worker_repeats_no_fence() -> None:
    # w1 was stopped (SIGSTOP) between the store's answer and reading it: it logs its
    # claim of attempt 1 after w2's takeover (attempt 2); the store's claim times order
    # the fences, so nothing repeats.
    seen = observed()
    seen.events[KEY] = [
        {**event("claim", 2, k="t2", f=2), "t": T0 + 1.7},
        {**event("start", 2, cp=None, f=2), "t": T0 + 1.8},
        {**event("claim", 1, k="t1", f=1), "t": T0 + 3.0},
        {**event("start", 1, cp=None, f=1), "t": T0 + 3.0}]
    seen.checkpoints, seen.effects = {}, []
    assert judge(CONFIG, seen).violations == {}


def test_a_lost_commit_with_no_failover_near_it_is_a_violation() -> None:
    seen = _failover(new_fence=(1_800_000_002_000 << 20) + 2)
    seen.faults = [f for f in seen.faults if f.kind != "failover"]
    report = judge(CONFIG, seen)
    assert report.violations == {
        "lost commits not explained by a failover": [(*KEY, 2, "w2")]}


def test_an_acknowledged_finish_missing_from_the_store_is_counted() -> None:
    seen = _failover(new_fence=(1_800_000_002_000 << 20) + 2)
    seen.history = [attempt(1, "w1", 0.0, Outcome.LOST),
                    attempt(2, "w3", 4.0, None, Reason.TAKEOVER)]
    seen.events[KEY][-1]["t"] = T0 + 1.9  # acknowledged just before the failover
    report = judge(CONFIG, seen)
    assert report.lost_finishes == [(*KEY, 2, "w3")] and report.lost_unexplained == []


def test_a_checkpoint_lost_with_the_primary_is_a_lost_commit_not_a_violation() -> None:
    seen = _failover(new_fence=(1_800_000_002_000 << 20) + 2)
    events = seen.events[KEY]
    events.append({"e": "cp", "j": "job0", "s": SLOT, "a": 1, "i": "w1", "t": T0 + 0.15,
                   "f": 1, "step": 3})  # acknowledged, then lost with the primary
    events[5]["cp"] = {"a": 1, "step": 0}  # w3's attempt 2 read less
    report = judge(CONFIG, seen)
    # (both attempts 2 read less: the one lost with the primary, and w3's)
    assert report.violations == {} and set(report.lost_checkpoints) == {(*KEY, 2)}
    # with no failover near it, the same regression is a violation
    seen.faults = [f for f in seen.faults if f.kind != "failover"]
    assert set(judge(CONFIG, seen).violations["checkpoint went backwards"]) == {(*KEY, 2)}


# -- effects and checkpoint reads a lossy PostgreSQL failover lost (issue 21; pglossy) -----


def _lost_effect() -> Observed:
    """w1's attempt 1 commits its fenced effect at +1.5 s, then the failover (+2..+3 s)
    loses the effect with the finish; w2's takeover writes it again: two records, one row."""
    seen = observed(
        history=[attempt(1, "w1", 0.0, Outcome.LOST),
                 attempt(2, "w2", 4.0, Outcome.COMPLETED, Reason.TAKEOVER)],
        faults=[Fault("failover", "pgreplica", T0 + 2.0, T0 + 3.0)])
    seen.events[KEY] = [
        event("start", 1, cp=None), event("cp", 1, step=1), event("tx", 1, t=T0 + 1.5),
        event("start", 2, cp=None, t=T0 + 4.0), event("cp", 2, step=1, t=T0 + 4.1),
        event("tx", 2, t=T0 + 4.5), event("done", 2, t=T0 + 4.5)]
    seen.checkpoints = {KEY: {"a": 2, "step": 1}}
    return seen


def test_a_fenced_effect_lost_with_the_primary_is_a_lost_commit_not_a_double() -> None:
    report = judge(CONFIG, _lost_effect())
    assert report.violations == {} and report.lost_effects == [(*KEY, 1, "w1")]
    # with no failover near it, the same records are a double effect
    seen = _lost_effect()
    seen.faults = []
    broken = judge(CONFIG, seen).violations
    assert broken["double fenced effects"] == [KEY]
    assert broken["transaction from a superseded attempt"] == [(*KEY, 1)]
    # and a duplicate-key refusal stays one, failover or not
    seen = _lost_effect()
    seen.events[KEY].append(event("tx_dup", 2, t=T0 + 4.4))
    assert judge(CONFIG, seen).violations["double fenced effects"] == [KEY]


def test_a_checkpoint_read_back_older_after_a_failover_is_a_lost_commit() -> None:
    seen = observed(faults=[Fault("failover", "pgreplica", T0 + 2.0, T0 + 3.0)])
    seen.events[KEY] = [*seen.events[KEY][:3],  # w1 wrote step 1 at T0, within the window
                        event("cp_foreign", 1, t=T0 + 3.5, seen=None,
                              expected={"a": 1, "step": 1}), *seen.events[KEY][3:]]
    report = judge(CONFIG, seen)
    assert report.violations == {} and report.lost_checkpoints == [(*KEY, 1)]
    # a value nobody had written before (a foreign writer's) is still a violation
    seen.events[KEY][3]["seen"] = {"a": 2, "step": 1}
    assert judge(CONFIG, seen).violations == {
        "checkpoint from a superseded attempt": [(*KEY, 1)]}


def test_a_cancel_lost_with_the_primary_is_a_lost_commit() -> None:
    seen = cancelled(attempt(1, "w1", 0.0, Outcome.LOST),
                     attempt(2, "w2", 4.0, Outcome.COMPLETED, Reason.TAKEOVER))
    broken = judge(CONFIG, seen).violations
    assert "cancelled runs taken over" in broken and "cancelled runs completed" in broken
    seen.faults.append(Fault("failover", "pgreplica", T0 + 1.0, T0 + 3.0))
    report = judge(CONFIG, seen)
    assert report.violations == {} and report.lost_cancels == [KEY]


# -- one live lease at a time: claims and renewals the store acknowledged ------------------


def ms(t: float) -> int:
    """T0 + ``t`` seconds in epoch milliseconds (the store's clock)."""
    return round((T0 + t) * 1000)


def _leases(renewed_at: float, second: Attempt, lease: float = 1.5) -> Observed:
    """w1 wins attempt 1 at T0 and renews at ``renewed_at`` (both acknowledged); w2 wins
    ``second`` (its claim acknowledged at its claim time)."""
    claimed = second.claimed_at.timestamp() - T0
    lost = Attempt("job0", SLOT, 1, "w1", Reason.SCHEDULED, at(0.0), at(claimed), Outcome.LOST)
    seen = observed(history=[lost, second], effects=[], checkpoints={}, faults=[])
    seen.events = {KEY: [
        {**ev("claim", 1, "w1", 0.0, 1, k="t1", x=ms(lease)), "n": ms(0.0)},
        ev("hb", 1, "w1", renewed_at, 1, k="t1", x=ms(renewed_at + lease)),
        {**ev("claim", second.attempt, "w2", claimed, 2, k="t2", x=ms(claimed + lease)),
         "n": ms(claimed)}]}
    return seen


def test_a_takeover_while_the_holder_s_renewed_lease_was_live_is_reported() -> None:
    # renewed at +1.0 s: live until +2.5 s at least; taken over at +1.7 s
    seen = _leases(1.0, attempt(2, "w2", 1.7, Outcome.COMPLETED, Reason.TAKEOVER))
    report = judge(CONFIG, seen)
    assert report.violations == {"two attempts holding a live lease at once": [(*KEY, 2)]}
    assert report.summary()["lease_overlaps"] == 1
    # renewed at +0.1 s: expired at +1.6 s, before the takeover at +1.7 s
    assert judge(CONFIG, _leases(
        0.1, attempt(2, "w2", 1.7, Outcome.COMPLETED, Reason.TAKEOVER))).violations == {}
    # the claim's own lease counts too: won at T0, live until +1.5 s
    seen = _leases(0.0, attempt(2, "w2", 1.2, Outcome.COMPLETED, Reason.TAKEOVER))
    assert judge(CONFIG, seen).lease_overlaps == [(*KEY, 2)]


def test_a_holder_that_ended_its_attempt_released_its_lease() -> None:
    # attempt 1 renewed at +0.1 s (live until +1.6 s), failed at +0.3 s, retried at +0.5 s
    seen = _leases(0.1, attempt(2, "w2", 0.5, Outcome.COMPLETED, Reason.RETRY))
    seen.history[0] = attempt(1, "w1", 0.0, Outcome.FAILED)  # finished at +0.3 s
    assert judge(CONFIG, seen).lease_overlaps == []
    # ... but ended after the retry's claim, or not by itself (lost), it still held it
    seen.history[0] = attempt(1, "w1", 0.3, Outcome.FAILED)  # finished at +0.6 s
    assert judge(CONFIG, seen).lease_overlaps == [(*KEY, 2)]
    seen.history[0] = attempt(1, "w1", 0.0, Outcome.LOST)
    assert judge(CONFIG, seen).lease_overlaps == [(*KEY, 2)]


def test_the_operator_s_cancels_are_no_injected_faults() -> None:
    report = judge(CONFIG, cancelled(attempt(1, "w1", 0.0, Outcome.CANCELLED)))
    assert report.faults == {"cancel": 1} and report.injected == 0
    seen = cancelled(attempt(1, "w1", 0.0, Outcome.CANCELLED))
    seen.faults += [Fault("kill", "w2", T0 + 1, T0 + 2), Fault("failover-own", "s", T0, T0)]
    assert judge(CONFIG, seen).injected == 1


def test_a_run_refuses_a_directory_with_an_earlier_run_s_records(tmp_path: Path) -> None:
    (tmp_path / "w0.1.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="earlier chaos run"):
        run_chaos(ChaosConfig(store="no such store"), tmp_path)


def test_a_claim_a_failover_lost_is_judged_with_the_lost_commits_not_as_an_overlap() -> None:
    # w2's takeover at +1.2 s was acknowledged, then lost with the primary: the store kept
    # w1's attempt 1 only (lost at +4 s, by w3's claim after the quarantine)
    seen = _leases(0.0, attempt(2, "w2", 1.2, Outcome.COMPLETED, Reason.TAKEOVER))
    seen.history = [Attempt("job0", SLOT, 1, "w1", Reason.SCHEDULED, at(0.0), at(4.0),
                            Outcome.LOST),
                    attempt(2, "w3", 4.0, Outcome.COMPLETED, Reason.TAKEOVER)]
    seen.faults = [Fault("failover", "pgreplica", T0 + 1.5, T0 + 2.5)]
    report = judge(CONFIG, seen)
    assert report.lease_overlaps == [] and report.lost_claims == [(*KEY, 2, "w2")]
