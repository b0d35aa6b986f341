"""The recovery log of a run: what happened to it, attempt by attempt, oldest first.

It is derived from the attempts the store records (:class:`~lease_core.Attempt`), so every
backend has it and nothing extra is written while runs execute. For a workflow run, the
attempts of all its steps (jobs ``<workflow>/<step>`` at the same slot) make one log.

Each attempt gives one entry when it starts and one when it ends:

=====================  ==============================================================
entry                  when
=====================  ==============================================================
``started``            an attempt claimed the run (reason scheduled, catch-up,
                       hand-over, or an operation's manual or retry with who asked
                       for it: the detail says which)
``taken_over``         an attempt claimed the run after the previous one's lease
                       expired (reason takeover)
``retried``            an attempt claimed the run to retry the previous one's failure
                       (reason retry; the detail is that failure's error)
``completed``,         the attempt ended so (``lost``: its lease expired unrenewed;
``failed``,            ``handed_over``: its instance stopped and released the run;
``timed_out``,         ``escalated``: it was the last attempt ``max_attempts`` allows)
``lost``,
``handed_over``,
``escalated``,
``skipped``,
``cancelled``          (``cancelled``: an operation ended it; the detail names who)
=====================  ==============================================================

A run cancelled while nobody held it has one entry for that attempt, ``cancelled``, whose
detail says so (and for what it was waiting): no attempt started.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ._structures import Attempt, Outcome, Reason

if TYPE_CHECKING:
    from .abc import Backend

__all__ = ["STEP_SEPARATOR", "RecoveryEntry", "attempts_by_slot", "cancelled_unclaimed",
           "other_steps", "read_recovery_log", "recovery_log", "run_steps", "sibling_steps",
           "step_job"]

#: Separates a workflow's name from a step's in the job name of the step's runs.
STEP_SEPARATOR = "/"


def step_job(workflow: str, step: str) -> str:
    """The job name of a workflow step's runs: ``<workflow>/<step>``."""
    return f"{workflow}{STEP_SEPARATOR}{step}"


def sibling_steps(job: str, workflows: Mapping[str, Sequence[str]]) -> list[str]:
    """The job names of every step of the workflow that ``job`` is a step of, ``job``
    included, in order; empty when ``job`` is no step of a workflow in ``workflows`` (as
    :meth:`Backend.workflows <lease_core.abc.Backend.workflows>` returns them). Trimming
    keeps a workflow run's steps together (:meth:`Backend.prune
    <lease_core.abc.Backend.prune>`)."""
    workflow, separator, step = job.partition(STEP_SEPARATOR)
    steps = workflows.get(workflow, ()) if separator else ()
    return [step_job(workflow, s) for s in steps] if step in steps else []


@dataclass(frozen=True, slots=True)
class RecoveryEntry:
    """One event of a run's recovery log."""

    at: datetime
    step: str | None
    """The workflow step the event concerns; ``None`` for a plain job's run."""
    attempt: int
    event: str
    """``started``, ``completed``, ``failed``, ``timed_out``, ``lost``, ``taken_over``,
    ``retried``, ``handed_over``, ``escalated``, ``skipped`` or ``cancelled``."""
    instance_id: str
    detail: str | None = None

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``at`` as ISO-8601 UTC)."""
        return {
            "at": self.at.isoformat(timespec="milliseconds"),
            "step": self.step,
            "attempt": self.attempt,
            "event": self.event,
            "instance_id": self.instance_id,
            "detail": self.detail,
        }


def recovery_log(attempts: Iterable[Attempt], *, workflow: str | None = None,
                 steps: Sequence[str] = ()) -> list[RecoveryEntry]:
    """The recovery log of the run these attempts belong to, oldest entry first.

    With ``workflow``, attempts of jobs ``<workflow>/<step>`` are entries of that step.
    Entries of one millisecond keep the order they happened in: an attempt's start before
    its end, before the next attempt; a step's entries before the next step's, in the
    order of ``steps`` (the workflow's declaration).
    """
    entries: list[tuple[datetime, int, int, int, RecoveryEntry]] = []
    prefix = None if workflow is None else workflow + STEP_SEPARATOR
    order = {name: i for i, name in enumerate(steps)}
    attempts = list(attempts)
    errors = {(a.job, a.attempt): a.error for a in attempts}
    for a in attempts:
        step = a.job[len(prefix):] if prefix and a.job.startswith(prefix) else None
        rank = order.get(step, len(order)) if step is not None else 0
        if a.outcome is Outcome.SKIPPED:
            entries.append((a.claimed_at, rank, a.attempt, 1, RecoveryEntry(
                a.claimed_at, step, a.attempt, "skipped", a.instance_id, a.error)))
            continue
        if cancelled_unclaimed(a):
            detail = f"{a.error} before any instance claimed it ({a.reason}"
            detail += f", requested by {a.requested_by})" if a.requested_by else ")"
            entries.append((a.claimed_at, rank, a.attempt, 1, RecoveryEntry(
                a.claimed_at, step, a.attempt, "cancelled", a.instance_id, detail)))
            continue
        if a.reason is Reason.TAKEOVER:
            start, detail = "taken_over", "the previous attempt's lease expired"
        elif a.reason is Reason.RETRY:
            start = "retried"
            detail = errors.get((a.job, a.attempt - 1)) or "the previous attempt failed"
        else:
            start, detail = "started", str(a.reason)
        if a.requested_by is not None:  # an operation: a trigger (manual) or a retry
            detail += f", requested by {a.requested_by}"
        entries.append((a.claimed_at, rank, a.attempt, 0,
                        RecoveryEntry(a.claimed_at, step, a.attempt, start, a.instance_id,
                                      detail)))
        if a.outcome is not None:
            at = a.finished_at or a.claimed_at
            entries.append((at, rank, a.attempt, 1, RecoveryEntry(
                at, step, a.attempt, str(a.outcome), a.instance_id, a.error)))
    entries.sort(key=lambda e: (e[0], e[1], e[2], e[3]))
    return [e[4] for e in entries]


def cancelled_unclaimed(a: Attempt) -> bool:
    """True for the record of a cancel of a run nobody held (triggered or retried and not
    claimed yet, handed over, or waiting for a retry): the store records it as an
    attempt of its own, its instance the canceller, claimed and finished at the cancel."""
    return (a.outcome is Outcome.CANCELLED and a.finished_at == a.claimed_at
            and a.error == f"cancelled by {a.instance_id}")


async def read_recovery_log(backend: Backend, name: str, slot: int, *, limit: int,
                            steps: Sequence[str] | None = None) -> list[RecoveryEntry]:
    """Read the recovery log of run (``name``, ``slot``) from a started ``backend``.

    ``steps`` are the workflow's steps when ``name`` is a workflow declared by the caller;
    otherwise the store's record of workflows says whether it is one. ``limit`` attempts
    per job are read first, more while the run's first attempt is older
    (:func:`attempts_by_slot`).
    """
    if steps is None:
        steps = (await backend.workflows()).get(name)
    if steps is None:
        return recovery_log((await attempts_by_slot(backend, name, {slot}, limit)
                             ).get(slot, []))
    steps = await run_steps(backend, name, steps, slot)
    attempts: list[Attempt] = []
    for step in steps:
        attempts += (await attempts_by_slot(backend, step_job(name, step), {slot}, limit)
                     ).get(slot, [])
    return recovery_log(attempts, workflow=name, steps=steps)


async def run_steps(backend: Backend, name: str, steps: Sequence[str], slot: int,
                    ) -> list[str]:
    """The steps of workflow ``name``'s run at ``slot``: ``steps`` (its definition), then
    any other step of it the store has a run of at that slot, in name order: a step that
    a deploy removed or renamed since, which an instance of the release before ran for
    this run (its attempts are this run's too, and it may still be open)."""
    others = await other_steps(backend, name, steps)
    if not others:
        return list(steps)
    found = (await backend.check([(step_job(name, step), slot) for step in others])).runs
    return [*steps, *(step for step in others if (step_job(name, step), slot) in found)]


async def other_steps(backend: Backend, name: str, steps: Sequence[str], *,
                      jobs: Sequence[str] | None = None) -> list[str]:
    """The steps of workflow ``name`` the store knows a job of (``<name>/<step>``) that
    are not among ``steps``, in name order: steps a deploy removed or renamed since. A
    job named ``<name>/<a>/<b>`` is no step of it (a step's name has no ``/``): a plain
    job's, whose runs are not the workflow's. ``jobs``: the store's jobs, when the caller
    has read them (else read here)."""
    prefix = name + STEP_SEPARATOR
    return [job[len(prefix):] for job in (await backend.jobs() if jobs is None else jobs)
            if job.startswith(prefix) and STEP_SEPARATOR not in job[len(prefix):]
            and job[len(prefix):] not in steps]


async def attempts_by_slot(backend: Backend, job: str, slots: set[int], limit: int,
                           ) -> dict[int, list[Attempt]]:
    """The job's recorded attempts by slot, oldest first, every one of ``slots`` complete.

    The newest ``limit`` attempts are read first; a slot whose first attempt (attempt 1:
    attempt numbers grow with each claim of a run) is not among them has older ones, so
    eight times more are read, and so on up to the job's whole history. A run whose first
    attempt was trimmed away costs one read of everything the store keeps of the job.
    """
    while True:
        found = await backend.history(job, limit)
        by_slot: dict[int, list[Attempt]] = {}
        for a in found:
            by_slot.setdefault(a.slot, []).append(a)
        if not found or len(found) < limit or all(
                any(a.attempt <= 1 for a in by_slot.get(slot, ())) for slot in slots):
            break
        limit *= 8
    for attempts in by_slot.values():
        attempts.sort(key=lambda a: (a.attempt, a.claimed_at))
    return by_slot
