"""Fleet-wide operations through the store: trigger, pause, resume, retry and cancel.

:class:`Admin` acts on the store only, so any process with the store's URL can act, and
every instance sees the result: a claim of a paused job's new slot records it
``skipped``; a triggered or retried run is a run any instance declaring the job claims
at its next heartbeat (reason ``manual`` or ``retry``, with who asked in the attempt's
``requested_by``); a cancelled run is finished ``cancelled`` at once, so nobody takes it
over, and its holder's next heartbeat answers "cancelled": the handler is asked to stop,
and cancelled once the cancel's grace has passed.

Each backend implements one call, :meth:`~lease_core.abc.Backend.operate`, which answers
an :class:`OperationResult`; :class:`Admin` turns a refusal into
:class:`~lease_core.errors.OperationRefused`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from types import TracebackType
from typing import TYPE_CHECKING

import anyio

from ._backend_check import check_backend
from ._checks import check_lookup_name, check_storable
from ._durations import parse_duration, parse_typed_duration
from ._structures import LAST_SLOT, RunStatus, format_slot
from .errors import BackendUnavailable, ConfigurationError, OperationRefused
from .recovery import step_job

if TYPE_CHECKING:
    from .abc import Backend

__all__ = ["RETRYABLE", "Admin", "Operation", "OperationKind", "OperationResult"]

#: The statuses a retry applies to.
RETRYABLE = frozenset({RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.ESCALATED})
#: The statuses a cancel applies to.
OPEN = frozenset({RunStatus.RUNNING, RunStatus.HANDED_OVER, RunStatus.RETRYING})


class OperationKind(StrEnum):
    """What an operation does."""

    TRIGGER = "trigger"
    PAUSE = "pause"
    RESUME = "resume"
    RETRY = "retry"
    CANCEL = "cancel"


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation as a backend receives it (validated by :class:`Admin`)."""

    kind: OperationKind
    job: str
    slot: int | None
    """The run's slot (retry, cancel); ``None`` for job operations."""
    by: str
    """Who asks: an instance id, ``cli`` or ``http``; recorded with the run."""
    grace_ms: int = 0
    """A cancel's grace: the holder's handler may finish for this long once asked to stop
    (see :meth:`Admin.cancel`); the store keeps it with the cancelled run."""


@dataclass(frozen=True, slots=True)
class OperationResult:
    """A backend's answer to :meth:`~lease_core.abc.Backend.operate`.

    ``refused`` is ``None`` when the operation was made, else ``unknown_job``, ``no_run``
    or ``conflict`` (a run whose status forbids it, a pause of a paused job, a resume of
    one not paused; then nothing changed). ``slot`` is the run's (a trigger's new slot);
    ``status`` the run's status before the operation (for a refusal's message).
    """

    refused: str | None = None
    slot: int | None = None
    status: RunStatus | None = None
    paused_by: str | None = None
    """Who paused the job, when a pause is refused because it is paused already (a
    backend may leave it out: :class:`Admin` then reads it)."""


#: The longest ``grace`` of a cancel: 30 days (a longer one is surely a mistake, and
#: would overflow the stores' expiry arithmetic).
MAX_GRACE_S = 30 * 86400
#: How long a cancel of a workflow's run found between two steps waits for the next
#: step's run to start (its agent claims it at once), and how often it looks.
BETWEEN_STEPS_WAIT_S = 5.0
BETWEEN_STEPS_POLL_S = 0.05

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _epoch_ms(value: datetime) -> int:
    """A tz-aware time in epoch ms, exactly (``timestamp() * 1000`` can be 1 ms off)."""
    return (value - _EPOCH) // timedelta(milliseconds=1)


def _slot(value: object, where: object) -> int:
    if isinstance(value, bool):
        raise ConfigurationError(f"slot {value!r} of {where!r} is not a slot")
    slot: int | None = None
    if isinstance(value, int):
        slot = value
    elif isinstance(value, datetime):
        if value.tzinfo is None:
            raise ConfigurationError(f"slot {value!r} is a naive datetime; give a tz-aware one")
        slot = _epoch_ms(value)
    elif isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?[0-9]+", text):  # ASCII digits: "²".isdigit() is True
            digits = text.lstrip("-").lstrip("0") or "0"
            # int() refuses over 4300 digits (a bare ValueError): any such is out of range.
            slot = int(text) if len(digits) <= len(str(LAST_SLOT)) else LAST_SLOT + 1
        else:
            try:
                parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
            except ValueError:
                parsed = None
            if parsed is not None and parsed.tzinfo is not None:
                slot = _epoch_ms(parsed)
    if slot is not None:
        if 0 <= slot <= LAST_SLOT:
            return slot
        raise ConfigurationError(
            f"slot {value!r} of {where!r} is out of range: epoch milliseconds from 0 to "
            f"{LAST_SLOT} (9999-12-31)")
    raise ConfigurationError(
        f"slot {value!r} of {where!r} is neither epoch milliseconds nor a tz-aware ISO time")


class Admin:
    """Operations on the runs of a store, for the whole fleet (DESIGN 4c, "Operations").

    ``by`` names who acts (recorded with each operation): ``scheduler.admin`` uses the
    scheduler's instance id, the CLI ``cli`` and the HTTP API ``http``. The backend is
    started for each call (never creating a store: an operation on a store that does not
    exist raises :class:`~lease_core.errors.StoreNotFound`) and released after it, as
    :meth:`~lease_core.Scheduler.history` does: a backend started already stays open, and
    ``async with Admin(backend) as admin:`` keeps it open across calls. An older store is
    upgraded in place when an operation is made on it (each call), or at the start of
    ``async with``; a refused call leaves it as it is.
    Every refusal raises :class:`~lease_core.errors.OperationRefused` and changes nothing.
    """

    def __init__(self, backend: Backend, *, by: str = "admin") -> None:
        check_backend(backend)
        if not isinstance(by, str) or not by.strip():
            raise ConfigurationError(f"by={by!r} must name who acts (a non-empty string)")
        check_storable("by", by)
        self.backend = backend
        self.by = by

    async def _start(self) -> None:
        """Start the backend on an existing store, upgraded in place when it is older.

        ``start(create=False)`` raises StoreNotFound where there is none (an operation
        never creates a store). It reads an older store as it is, so it is closed again
        and ``start()`` follows, which upgrades it (the operations need this release's
        store code) and creates nothing, the store being there. (A backend its owner
        started already stays open throughout: both are counted.)
        """
        await self.backend.start(create=False)
        await self.backend.close()
        await self.backend.start()

    async def __aenter__(self) -> Admin:
        await self._start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.backend.close()

    async def trigger(self, job: str) -> int:
        """Make one extra run of ``job`` now (reason ``manual``); return its slot.

        ``job`` may name a workflow: the new run starts at its first step, and the later
        steps follow as usual.

        The slot is the store's now in epoch ms, moved off a whole second (where
        schedules put their slots) and off any slot the job has a run at. An instance
        that declares the job claims it within one heartbeat.
        """
        result = await self._operate(OperationKind.TRIGGER, job, None)
        assert result.slot is not None
        return result.slot

    async def pause(self, job: str) -> None:
        """Stop every instance claiming new slots of ``job``; runs in progress go on.

        Slots due while paused are recorded ``skipped`` and never caught up. ``job`` may
        name a workflow: its new slots are skipped (at its first step); a run in
        progress goes on through its later steps. A trigger or a retry of a paused job
        still runs: a pause stops the schedule, not an operator. A job paused already is refused
        (:class:`~lease_core.errors.OperationRefused`, ``conflict``, naming who paused
        it): a second pause would hide the first one's author.
        """
        await self._operate(OperationKind.PAUSE, job, None)

    async def resume(self, job: str) -> None:
        """Let the fleet claim the slots of ``job`` (or a workflow) again.

        The slots due while it was paused are never caught up, even those no instance
        was running to record ``skipped``. A job not paused is refused
        (:class:`~lease_core.errors.OperationRefused`, ``conflict``).

        A workflow's resume also ends the pause of a former first step, or of the former
        job of its name, that a release which changed its first step left paused (the
        pause was carried to the new first step at that release's start)."""
        former = await self._formerly_first(job)
        try:
            await self._operate(OperationKind.RESUME, job, None)
        except OperationRefused as refused:
            if refused.kind != "conflict" or not former:
                raise
        for name in former:
            await self._made(Operation(OperationKind.RESUME, name, None, self.by))

    async def _formerly_first(self, workflow: str) -> list[str]:
        """The paused jobs that were ``workflow``'s first before a release changed it: a
        later step's, or the job of its own name (a job turned into the workflow)."""
        if not isinstance(workflow, str) or not workflow:
            return []  # refused by the resume itself, naming it
        await self.backend.start(create=False)
        try:
            steps = (await self.backend.workflows()).get(workflow) or []
            paused = await self.backend.paused() if steps else {}
        finally:
            await self.backend.close()
        return [name for name in [workflow, *(step_job(workflow, s) for s in steps[1:])]
                if name in paused]

    async def _made(self, op: Operation) -> None:
        """``op`` made as it is (no lookup of names), the store started for it."""
        await self.backend.start()
        try:
            await self.backend.operate(op)
        finally:
            await self.backend.close()

    async def retry(self, job: str, slot: int | str | datetime) -> None:
        """Run a ``failed``, ``timed_out`` or ``escalated`` run again (reason ``retry``).

        The run starts anew: ``max_attempts`` counts its takeovers from now, and its
        job's ``retry=`` grants its retries again.

        ``job`` may name a workflow: its run resumes at the step that failed (that step's
        run is retried; the steps after it follow as usual).
        """
        await self._operate(OperationKind.RETRY, job, _slot(slot, job))

    async def cancel(self, job: str, slot: int | str | datetime,
                     grace: float | str | object = "10s") -> None:
        """End a running, handed-over or retrying run ``cancelled``; nobody takes it over.

        ``job`` may name a workflow: the step in progress is cancelled, so the workflow
        stops there. Between two steps (one completed, the next not claimed yet) the
        cancel waits up to :data:`BETWEEN_STEPS_WAIT_S` for the next step to start and
        cancels it, else raises :class:`~lease_core.errors.OperationRefused`
        (``conflict``) saying so.

        The run ends ``cancelled`` in the store at once. Its holder learns of it at its
        next heartbeat (the heartbeat answers "cancelled", not "lost"): the handler gets
        ``ctx.stopping`` (``ctx.stop_reason`` says it was cancelled), may finish
        cooperatively within ``grace`` (default ``"10s"``; a number of seconds, even as
        text, also works; ``0`` cancels it at that heartbeat) and is cancelled once the
        grace has passed. Either way the attempt ends ``cancelled``, never
        ``completed``.
        """
        grace_s = (parse_typed_duration(grace, what="grace", allow_zero=True)  # "0", "30":
                   if isinstance(grace, str)  # seconds, as the CLI and HTTP pass them
                   else parse_duration(grace, what="grace", allow_zero=True))
        if grace_s > MAX_GRACE_S:
            raise ConfigurationError(
                f"grace={grace!r} is longer than {MAX_GRACE_S // 86400:g} days; a cancelled "
                "handler is given at most that long to stop")
        await self._operate(OperationKind.CANCEL, job, _slot(slot, job),
                            grace_ms=int(grace_s * 1000))

    async def paused(self) -> dict[str, str]:
        """The paused jobs and workflows (by their own names), each with who paused it.

        A read: the store is read as it is (an older one is not upgraded, nor a missing
        one created: :class:`~lease_core.errors.StoreNotFound`)."""
        await self.backend.start(create=False)
        try:
            paused = await self.backend.paused()
            firsts = {step_job(name, steps[0]): name
                      for name, steps in (await self.backend.workflows()).items() if steps}
        finally:
            await self.backend.close()
        return {firsts.get(job, job): by for job, by in paused.items()}

    async def _operate(self, kind: OperationKind, job: str, slot: int | None, *,
                       grace_ms: int = 0) -> OperationResult:
        if not isinstance(job, str) or not job:
            raise ConfigurationError(f"job {job!r} must be a non-empty job name")
        name = check_lookup_name(job)
        # The store as it is (an older one is read, not upgraded), counted: cheap when
        # the backend runs already.
        await self.backend.start(create=False)
        started, upgraded = True, False
        # A cancel that finds a workflow's run between two steps (one completed, the next
        # not claimed yet: its agent claims it at once, unless the next step waits for
        # capacity or the agent died) waits a little for the next step's run.
        deadline = anyio.current_time() + BETWEEN_STEPS_WAIT_S
        try:
            while True:
                after: str | None = None  # the step a workflow's run is between steps at
                if slot is None:
                    job = await self._first_step(name, kind)
                else:
                    job, after = await self._step_of(name, slot, kind)
                result = await self._refusal_read(kind, job, slot) or OperationResult()
                if result.refused is None:
                    if not upgraded:
                        # Upgraded only now that the operation will be made: a refused
                        # one (a typo) must not change an older store that older
                        # instances still use.
                        await self.backend.close()
                        started = False
                        await self.backend.start()
                        started, upgraded = True, True
                    try:
                        result = await self.backend.operate(
                            Operation(kind, job, slot, self.by, grace_ms))
                    except BackendUnavailable as exc:
                        # Sent: the store may have made it before its answer was lost.
                        if exc.changed_nothing:
                            raise
                        raise BackendUnavailable(_unanswered(kind, name, slot, exc)) from exc
                    if (result.refused == "conflict" and kind is OperationKind.CANCEL
                            and result.status is RunStatus.COMPLETED and name != job
                            and anyio.current_time() < deadline):
                        continue  # the step completed meanwhile: look again (bounded)
                if after is None or anyio.current_time() >= deadline:
                    break
                await anyio.sleep(BETWEEN_STEPS_POLL_S)
            if (result.refused == "conflict" and kind is OperationKind.PAUSE
                    and result.paused_by is None):  # paused meanwhile: by whom
                result = OperationResult(
                    "conflict", paused_by=(await self.backend.paused()).get(job))
        finally:
            if started:
                await self.backend.close()
        if after is not None and slot is not None:
            raise OperationRefused("conflict", _between_steps(name, slot, after))
        if result.refused is not None:
            raise OperationRefused(result.refused, _refusal(kind, job, slot, result, name))
        return result

    async def _refusal_read(self, kind: OperationKind, job: str,
                            slot: int | None) -> OperationResult | None:
        """The refusal the store would answer, read without writing (``None``: the
        operation looks possible; the store still decides, atomically)."""
        if slot is None:
            if job not in await self.backend.jobs():
                return OperationResult("unknown_job")
            if kind in (OperationKind.PAUSE, OperationKind.RESUME):
                by = (await self.backend.paused()).get(job)
                if (by is None) is (kind is OperationKind.RESUME):
                    return OperationResult("conflict", paused_by=by)
            return None
        state = (await self.backend.check([(job, slot)])).runs.get((job, slot))
        if state is None:
            known = job in await self.backend.jobs()
            return OperationResult("no_run" if known else "unknown_job", slot)
        wanted = RETRYABLE if kind is OperationKind.RETRY else OPEN
        if state.status not in wanted:
            return OperationResult("conflict", slot, state.status)
        return None

    async def _first_step(self, name: str, kind: OperationKind) -> str:
        """The job a job operation acts on: ``name`` itself, or for a workflow its first
        step (a trigger starts the workflow there; a pause skips its new slots there, and
        a run in progress goes on through its later steps). A later step's own job is
        refused for a trigger or a pause: its run would start without the steps before
        it, or each run of the workflow would stop half applied there (skipped)."""
        workflows = await self.backend.workflows()
        steps = workflows.get(name)
        if steps:
            return step_job(name, steps[0])
        workflow, _, step = name.rpartition("/")
        later = workflows.get(workflow, [])[1:]
        if step in later and kind in (OperationKind.TRIGGER, OperationKind.PAUSE):
            raise ConfigurationError(
                f"job {name!r} is step {step!r} of workflow {workflow!r}, not its first: "
                f"{kind.value} the workflow itself ({workflow!r})")
        return name

    async def _step_of(self, name: str, slot: int,
                       kind: OperationKind) -> tuple[str, str | None]:
        """The job a run operation acts on: ``name`` itself, or for a workflow the step
        run it concerns (a retry: the step that failed; a cancel: the step in progress).

        The second item, for a cancel only, is the step job whose run completed when the
        workflow's run is between two steps (no step in progress, a later one to come);
        else ``None``."""
        steps = (await self.backend.workflows()).get(name)
        if not steps:
            return name, None
        jobs = [step_job(name, step) for step in steps]
        found = (await self.backend.check([(job, slot) for job in jobs])).runs
        wanted = RETRYABLE if kind is OperationKind.RETRY else OPEN
        for job in jobs:
            state = found.get((job, slot))
            if state is not None and state.status in wanted:
                return job, None
        last = next((job for job in reversed(jobs) if (job, slot) in found), jobs[0])
        state = found.get((last, slot))
        between = (kind is OperationKind.CANCEL and last != jobs[-1] and state is not None
                   and state.status is RunStatus.COMPLETED)
        return last, last if between else None


def _unanswered(kind: OperationKind, name: str, slot: int | None,
                exc: BaseException) -> str:
    """The message of an operation sent to the store that did not answer (a connection
    cut, a Redis write short of its ``wait_replicas``): it may have been made."""
    what = repr(name) if slot is None else f"run {name}@{slot} ({format_slot(slot)})"
    again = (" (a second trigger makes a second run)" if kind is OperationKind.TRIGGER
             else "")
    return (f"{exc}; if the {kind} of {what} reached the store, it may have been made "
            f"before its answer was lost: look at the job (`anarchon status`) before "
            f"making it again{again}")


def _between_steps(name: str, slot: int, done: str) -> str:
    step = done.removeprefix(step_job(name, ""))
    return (f"cannot cancel run {name}@{slot} ({format_slot(slot)}): the workflow is between "
            f"two steps (step {step!r} completed, the next one has not started within "
            f"{BETWEEN_STEPS_WAIT_S:g} s: it waits for capacity, or for an instance to "
            "continue the workflow); cancel again once it has started")


def _refusal(kind: OperationKind, job: str, slot: int | None, result: OperationResult,
             name: str | None = None) -> str:
    """The message of a refusal of the operation on ``job``; ``name`` is the name given,
    when it is a workflow's (``job`` one of its steps): a refusal about the workflow as a
    whole (unknown, no run at that slot, paused or not) names the workflow as given,
    not its step's job, which the caller never wrote."""
    what, shown = "job", job
    if name is not None and name != job:
        what, shown = "workflow", name

    def run_of(of: str) -> str:
        return f"{of}@{slot}" if slot is None else f"{of}@{slot} ({format_slot(slot)})"

    if result.refused == "unknown_job":
        return (f"cannot {kind} {what} {shown!r}: the store has never seen it; check the "
                "name (`anarchon status` lists them)")
    if result.refused == "no_run":
        return (f"cannot {kind} run {run_of(shown)}: the store has no run of {shown!r} at "
                "that slot")
    if kind is OperationKind.PAUSE:
        by = "" if result.paused_by is None else f" by {result.paused_by!r}"
        return (f"cannot pause {what} {shown!r}: it is paused already{by}; resume it first "
                "to pause it in another name")
    if kind is OperationKind.RESUME:
        return f"cannot resume {what} {shown!r}: it is not paused"
    run = run_of(job)
    status = "" if result.status is None else str(result.status)
    if result.status is RunStatus.HANDED_OVER:
        status = ("handed_over (waiting to be claimed: handed over at a stop, or triggered "
                  "or retried already)")
    elif result.status is RunStatus.RETRYING:
        status = ("retrying (it failed and waits for its next automatic retry, by the job's "
                  "retry=, which an instance makes when it is due; cancel it to stop it)")
    if kind is OperationKind.RETRY:
        return (f"cannot retry run {run}: it is {status}; only failed, timed_out or "
                "escalated runs are retried")
    return f"cannot {kind} run {run}: it is {status} (already finished)"

