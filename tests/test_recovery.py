"""The recovery log, derived from recorded attempts (no store needed)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from lease_core import Attempt, Outcome, Reason
from lease_core.recovery import RecoveryEntry, recovery_log, step_job

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
SLOT = int(T0.timestamp() * 1000)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def attempt(job: str, n: int, inst: str, reason: Reason, start: float,
            end: float | None = None, outcome: Outcome | None = None,
            error: str | None = None) -> Attempt:
    return Attempt(job, SLOT, n, inst, reason, at(start),
                   None if end is None else at(end), outcome, error)


def events(log: list[RecoveryEntry]) -> list[tuple[str | None, int, str, str]]:
    return [(e.step, e.attempt, e.event, e.instance_id) for e in log]


def test_a_job_run_crashed_taken_over_and_completed() -> None:
    history = [  # newest first, as history() returns them
        attempt("export", 2, "b", Reason.TAKEOVER, 31, 40, Outcome.COMPLETED),
        attempt("export", 1, "a", Reason.SCHEDULED, 0, 31, Outcome.LOST,
                "lease expired without renewal"),
    ]
    log = recovery_log(history)
    assert events(log) == [
        (None, 1, "started", "a"),
        (None, 1, "lost", "a"),
        (None, 2, "taken_over", "b"),
        (None, 2, "completed", "b"),
    ]
    assert log[0].detail == "scheduled" and log[1].detail == "lease expired without renewal"
    assert [e.at for e in log] == [at(0), at(31), at(31), at(40)]
    assert log[3].as_json() == {"at": "2026-11-30T02:00:40.000+00:00", "step": None,
                                "attempt": 2, "event": "completed", "instance_id": "b",
                                "detail": None}


def test_a_workflow_run_handed_over_then_escalated() -> None:
    wf = "close"
    history = [
        attempt(step_job(wf, "interest"), 3, "c", Reason.TAKEOVER, 50, 60, Outcome.ESCALATED,
                "lease lost on attempt 3 of max_attempts=2; escalated"),
        attempt(step_job(wf, "interest"), 2, "b", Reason.HAND_OVER, 21, 50, Outcome.LOST),
        attempt(step_job(wf, "interest"), 1, "a", Reason.SCHEDULED, 10, 20, Outcome.HANDED_OVER),
        attempt(step_job(wf, "snapshot"), 1, "a", Reason.SCHEDULED, 0, 9, Outcome.COMPLETED),
        attempt("close-other/snapshot", 1, "z", Reason.SCHEDULED, 1),  # another workflow
    ]
    log = recovery_log([a for a in history if a.job.startswith("close/")], workflow=wf)
    assert events(log) == [
        ("snapshot", 1, "started", "a"),
        ("snapshot", 1, "completed", "a"),
        ("interest", 1, "started", "a"),
        ("interest", 1, "handed_over", "a"),
        ("interest", 2, "started", "b"),
        ("interest", 2, "lost", "b"),
        ("interest", 3, "taken_over", "c"),
        ("interest", 3, "escalated", "c"),
    ]
    assert log[4].detail == "hand-over"


def test_skipped_and_running_attempts() -> None:
    log = recovery_log([
        attempt("tick", 1, "a", Reason.SCHEDULED, 5, 5, Outcome.SKIPPED,
                "an earlier run of the job still holds its lease"),
    ])
    assert events(log) == [(None, 1, "skipped", "a")]
    running = recovery_log([attempt("tick", 1, "a", Reason.CATCH_UP, 5)])
    assert events(running) == [(None, 1, "started", "a")]
    assert running[0].detail == "catch-up"


def test_entries_of_one_millisecond_keep_their_order() -> None:
    wf = "close"
    same = 30.0
    history = [
        attempt(step_job(wf, "publish"), 1, "a", Reason.SCHEDULED, same),
        attempt(step_job(wf, "interest"), 1, "a", Reason.SCHEDULED, 10, same, Outcome.COMPLETED),
    ]
    log = recovery_log(history, workflow=wf, steps=["snapshot", "interest", "publish"])
    assert events(log) == [
        ("interest", 1, "started", "a"),
        ("interest", 1, "completed", "a"),
        ("publish", 1, "started", "a"),
    ]


def test_a_cancel_of_a_run_nobody_held_is_one_cancelled_entry() -> None:
    """The store records a cancel of a run waiting for its retry as an attempt of its own
    (instance: the canceller, claimed and finished at the cancel): no attempt started."""
    history = [
        attempt("export", 2, "cli", Reason.RETRY, 50, 50, Outcome.CANCELLED,
                "cancelled by cli"),
        attempt("export", 1, "a", Reason.SCHEDULED, 0, 10, Outcome.FAILED, "disk full"),
    ]
    log = recovery_log(history)
    assert events(log) == [
        (None, 1, "started", "a"),
        (None, 1, "failed", "a"),
        (None, 2, "cancelled", "cli"),
    ]
    assert log[-1].detail == "cancelled by cli before any instance claimed it (retry)"
    triggered = Attempt("export", SLOT, 1, "ops", Reason.MANUAL, at(5), at(5),
                        Outcome.CANCELLED, "cancelled by ops", requested_by="http")
    assert [(e.event, e.detail) for e in recovery_log([triggered])] == [
        ("cancelled", "cancelled by ops before any instance claimed it (manual, requested "
                      "by http)")]


def test_reading_no_attempt_back_ends() -> None:
    """``read_recovery_log(limit=0)`` answered ``[]``; reading further back while a run's
    first attempt is missing multiplied the limit, 0, for ever."""
    import anyio

    from lease_core import MemoryBackend
    from lease_core.recovery import read_recovery_log

    async def read() -> list[RecoveryEntry]:
        with anyio.fail_after(2):
            return await read_recovery_log(MemoryBackend(), "job", 1, limit=0)

    assert anyio.run(read) == []
