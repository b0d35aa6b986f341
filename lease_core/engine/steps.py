"""Workflow coordination: each step is a run of its own; this layer chains them.

The engine runs a step like any job's run. This layer adds what makes steps a workflow
(see :mod:`lease_core.workflows`): a step's handler reads the results of the steps before
it; its own result is stored, fenced, before its completion; the instance that completes a
step (or, as supervisor, sees it completed) claims the next step at once; a starting
instance continues a workflow run whose next step was never claimed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from .. import events as ev
from .._structures import JobInfo, Outcome, Reason, RunStatus, format_slot
from ..context import RunContext
from ..errors import AnarchonError, BackendUnavailable, ConfigurationError, LeaseLost
from ..recovery import step_job
from .base import logger
from .runs import Phase

if TYPE_CHECKING:
    from ..workflows import Workflow
    from .jobs import Job
    from .runs import Run
    from .session import Session

__all__ = ["RESUME_SCAN", "RESUME_SCAN_MAX", "StepCoordinator"]

#: How many of the newest runs of each step (but the last) a starting instance reads to
#: find workflow runs left between two steps: ``history_size`` when it is more, up to
#: :data:`RESUME_SCAN_MAX` (see :meth:`StepCoordinator.resume`).
RESUME_SCAN = 100
RESUME_SCAN_MAX = 1000


class StepCoordinator:
    """Chains the steps of one scheduler's workflows, through the engine's claims."""

    def __init__(self, session: Session) -> None:
        self._s = session

    @staticmethod
    def successor(job: Job, status: RunStatus | None) -> Job | None:
        """The step to claim once ``job``'s run has ``status``: the next, if it completed."""
        return job.next_step if status is RunStatus.COMPLETED else None

    async def completed(self, job: Job, slot: int) -> None:
        """This instance completed ``job``'s run: claim the next step now, without a tick.

        The only claim of a later step that starts a run past the step's trimmed history
        (``after_step``): this instance knows the step was never claimed before.
        """
        next_step = job.next_step
        if next_step is not None:
            await self._s.claims.claim_many([(next_step, slot, Reason.SCHEDULED)],
                                            after_step=True)

    def seen_finished(self, job: Job, slot: int, status: RunStatus | None) -> None:
        """A claim found ``job``'s run finished: back up the next step if it completed."""
        next_step = self.successor(job, status)
        if next_step is not None and self._s.tg is not None:
            # The step completed before this instance saw it run: claim its successor in
            # a task of its own: the claims settled after this one (a whole instant's, in
            # a burst) must not wait for that round trip.
            self._s.tg.start_soon(self._continue, job, next_step, slot)

    @staticmethod
    def result_payload(job: Job, value: Any) -> dict[str, Any]:
        """The checkpoint that stores a completed step's result: ``{"result": value}``,
        with ``"last": True`` when the step is its workflow's last in this instance's
        definition (a step added later is then not run for this run; see
        :meth:`_goes_on_with`), else with ``"next": <the next step's name>`` (the run
        is continued by a backup or at start only with that step; see :meth:`resume`);
        both with ``"steps"``, the definition's steps: an instance of another release
        tells a step inserted since (not among them) from a step moved
        (:meth:`_goes_on_with`, :meth:`load_results`)."""
        next_step = job.next_step
        assert job.workflow is not None
        steps = job.workflow.steps
        if next_step is None:
            return {"result": value, "last": True, "steps": steps}
        return {"result": value, "next": next_step.step, "steps": steps}

    async def _goes_on_with(self, job: Job, slot: int) -> Job | None:
        """The step that ``job``'s completed run at ``slot`` goes on with: the step after
        it in this instance's definition, unless the run was completed under another
        definition of its workflow. Then ``None`` when that definition did not go on
        with a step this one has after ``job``: completed as the last step (a step was
        added after it since), or naming a next step this definition does not have
        after it (renamed or replaced since): a deploy's new step runs from the next run
        on, not for a run that completed, or went on, under the old definition. When
        the result names a later step of this definition (a step was inserted before it
        since), that step: the run goes on as it did, and the inserted step runs from
        the next run on. A run whose result cannot be read, or was stored by an earlier
        build (no mark), is continued as before."""
        next_step = job.next_step
        assert next_step is not None and job.workflow is not None
        try:
            payload = await self._s.settings.backend.get_checkpoint(job.name, slot)
        except Exception as exc:
            self._s.clock.failed(f"reading the checkpoint of {job.name}", exc)
            return next_step
        if not isinstance(payload, dict):
            return next_step
        if payload.get("last") is True:
            logger.info("%s slot %s: its run ended with step %r, before step %r was added "
                        "to the workflow; that step runs from the next run on",
                        job.workflow.name, format_slot(slot), job.step, next_step.step)
            return None
        went = payload.get("next")
        if isinstance(went, str) and went != next_step.step:
            instead = self._past_inserted(job, went, payload.get("steps"))
            logger.info("%s slot %s: its run went on from step %r with step %r, under an "
                        "earlier definition of the workflow%s; step %r runs from the next "
                        "run on", job.workflow.name, format_slot(slot), job.step, went,
                        "" if instead is None else ", and goes on so", next_step.step)
            return instead
        if went is None and await self._went_on_past(job, next_step, slot):
            return None
        return next_step

    @staticmethod
    def _past_inserted(job: Job, went: str, steps: Any) -> Job | None:
        """The job of step ``went``, named as the next one by ``job``'s result, stored
        under the definition of ``steps``: when it comes later in this instance's
        definition, after steps that one did not have only (inserted since: the run goes
        on without them). ``None`` otherwise: a step between them was in the run's
        definition (moved since), or the result does not say which steps it had (stored
        by an earlier build)."""
        assert job.workflow is not None
        if not isinstance(steps, list):
            return None
        jobs = job.workflow.jobs
        for later in jobs[jobs.index(job) + 1:]:
            if later.step == went:
                return later
            if later.step in steps:
                return None
        return None

    async def _went_on_past(self, job: Job, next_step: Job, slot: int) -> bool:
        """True when a step after ``next_step`` has a run at ``slot``: the workflow run
        went on without ``next_step`` (inserted since). Read for a result that names no
        next step (stored by an earlier build, before results were marked so): a step
        inserted by the deploy that brings the marks must not run for the runs the
        earlier build completed, nor for those it went on with."""
        assert job.workflow is not None
        jobs = job.workflow.jobs
        later = jobs[jobs.index(next_step) + 1:]
        if not later:
            return False
        try:
            found = await self._s.settings.backend.check([(j.name, slot) for j in later])
        except Exception as exc:
            self._s.clock.failed(f"check of workflow {job.workflow.name}", exc)
            return False
        went = [j.step for j in later if (j.name, slot) in found.runs]
        if went:
            logger.info("%s slot %s: its run went on without step %r (with step %r), "
                        "under an earlier definition of the workflow; step %r runs from "
                        "the next run on", job.workflow.name, format_slot(slot),
                        next_step.step, went[0], next_step.step)
            return True
        return False

    def continue_later(self, run: Run) -> bool:
        """``run`` is a later step's, pending, found unclaimed at this member's turn after
        the step before completed elsewhere: True when it is claimed in a task of its
        own, once that step's result shows the workflow run goes on with it
        (:meth:`_goes_on_with`; a step added by a release rolling out must not run for
        a run the old release ended, or went on with another step). The read is made only
        here, where nobody claimed the step, not at every completion a member backs up."""
        job = run.job
        if job.workflow is None or job.scheduled or run.successor or self._s.tg is None:
            return False
        before = self._s.jobs.get(step_job(job.workflow.name,
                                           job.workflow.previous_steps(job)[-1]))
        if before is None:
            return False
        run.phase = Phase.CLAIMING  # out of the ticks' hands while the result is read
        self._s.tg.start_soon(self._continue_pending, before, run)
        return True

    async def _continue_pending(self, before: Job, run: Run) -> None:
        going = await self._goes_on_with(before, run.slot)
        if going is run.job:
            await self._s.claims.claim(run.job, run.slot,
                                       run.reclaim_reason or Reason.SCHEDULED)
            return
        self._s.runs.forget(run.key)
        if going is not None:
            await self._s.claims.claim(going, run.slot, Reason.SCHEDULED)

    async def _continue(self, job: Job, next_step: Job, slot: int) -> None:
        """Claim ``next_step`` at ``slot``, seen unclaimed after ``job`` completed, unless
        the run ended with ``job`` or went on with another step: then the step it went
        on with, if this instance's definition has it later (:meth:`_goes_on_with`)."""
        going = await self._goes_on_with(job, slot)
        if going is not None:
            await self._s.claims.claim(going, slot, Reason.SCHEDULED)

    async def earlier_result(self, ctx: RunContext) -> tuple[bool, Any]:
        """(True, its result) when an earlier attempt of this step completed it (its
        handler returned and its result was stored, fenced) but lost its lease before
        its finish was recorded: this attempt completes the step with that result,
        without running the handler again (which would apply its effects twice).
        (False, None) otherwise. The read is tried again within the lease, as the earlier
        steps' results are; a store that still does not answer ends the attempt lost
        (:meth:`_read_checkpoint`) rather than run a step that may have completed."""
        if ctx.attempt < 2:
            return False, None
        payload = await self._read_checkpoint(ctx.job, ctx.slot)
        if not isinstance(payload, dict) or "result" not in payload:
            return False, None
        logger.warning("%s slot %s: completed by attempt %d before it lost its lease; "
                       "attempt %d keeps its result and does not run the step again",
                       ctx.job, format_slot(ctx.slot), ctx.attempt - 1, ctx.attempt)
        return True, payload["result"]

    async def _read_checkpoint(self, job: str, slot: int) -> Any:
        """A step run's checkpoint. A brief store outage must not fail the workflow run:
        the read is tried again within the step's lease. A store that still does not
        answer ends the attempt lost (:class:`LeaseLost`: no handler ran, and the step
        is taken over once the store answers, as after a failed renewal), not failed,
        which would have ended the workflow run; another error of the store is raised."""
        s = self._s
        for tries_left in (2, 1, 0):
            try:
                return await s.settings.backend.get_checkpoint(job, slot)
            except AnarchonError as exc:
                if not tries_left:
                    if isinstance(exc, BackendUnavailable):
                        raise LeaseLost(f"the store did not answer reading the checkpoint "
                                        f"of {job} ({exc})") from exc
                    raise
                s.clock.failed(f"reading the checkpoint of {job}", exc)
                await anyio.sleep(s.settings.heartbeat)
        raise AssertionError("unreachable")  # pragma: no cover

    async def load_results(self, job: Job, slot: int) -> dict[str, Any]:
        """The results of the steps before ``job``'s, by step name.

        A step the workflow run went on past has none, and is left out: the result before
        it names a later step as the next one, and was stored under a definition without
        that step (the step was inserted by a deploy while the run was in flight, or is a
        step the release that ran the step before it does not have). A step that was in
        that definition (moved since) still fails the attempt. A step taken over from an
        instance of another release then runs with the results its run has, rather than
        failing for want of a result that was never to be."""
        assert job.workflow is not None
        results: dict[str, Any] = {}
        went: Any = None  # the step the last result read names as the next one
        steps: Any = None  # and the steps of the definition it was stored under
        for step in job.workflow.previous_steps(job):
            payload = await self._read_checkpoint(step_job(job.workflow.name, step), slot)
            if not isinstance(payload, dict) or "result" not in payload:
                if (isinstance(went, str) and went != step and isinstance(steps, list)
                        and step not in steps):
                    # The run went on past this step, which its definition did not have
                    # (inserted since, or removed by the release that completed the step
                    # before): it never ran for this run, and has no result to give.
                    continue
                # A completed step's result is stored before (or with) its completion:
                # none means its run is gone (history trimmed past it: the store does
                # not keep a workflow run's steps together, or no step of the run was
                # claimed for longer than history_ttl). Running on with None would apply
                # this step to nothing.
                raise AnarchonError(
                    f"the result of step {step!r} of {job.workflow.name} slot "
                    f"{format_slot(slot)} is no longer in the store (its history was "
                    "trimmed while no step of the run was running or waiting for a "
                    "retry); keep history_ttl longer than a step waits to be claimed")
            results[step] = payload["result"]
            went, steps = payload.get("next"), payload.get("steps")
        return results

    async def store_result(self, run: Run, value: Any) -> bool | ConfigurationError:
        """Store a completed step's result before its completion.

        True when it is stored; a :class:`ConfigurationError` when it cannot be (the step
        then fails); False when the lease was lost or the store did not answer: the run
        is then reported lost and backed up, and a backup runs the step again.
        """
        s = self._s
        lease, execution = run.lease, run.execution
        assert lease is not None and execution is not None
        ctx = execution.ctx
        stored: bool | None = None
        with anyio.move_on_after(10, shield=True):
            try:
                stored = await s.settings.backend.set_checkpoint(
                    lease, self.result_payload(run.job, ctx.result if value is None else value))
            except ConfigurationError as exc:
                return exc
            except Exception as exc:
                s.clock.failed(f"result of {run.job.name} slot {format_slot(lease.slot)}",
                               exc, write=True)
        if stored is None:
            # Unknown whether the result was stored: finishing could complete the step
            # without it. Its lease runs out and a backup runs it again.
            s.execution.ended(ev.Lost, lease, why="result not stored")
            s.runs.rewatch(run)
            return False
        if stored is False:  # refused: an operator's cancel, or the lease was lost
            lost: list[bool] = []

            def report() -> None:
                lost.append(True)
                s.execution.ended(ev.Lost, lease, why="lease lost before the result was "
                                  "stored")
                logger.warning("%s slot %s: lease lost before its result was stored",
                               run.job.name, format_slot(lease.slot))

            completed = await s.execution.settle_refused(
                run, report, why="lease lost before the result was stored")
            if lost:
                s.runs.rewatch(run)
            else:
                s.runs.release(run)
            if completed:  # its transaction committed (the handler caught the lost answer)
                await self.completed(run.job, lease.slot)
            return False
        return True

    async def result_in_transaction(self, ctx: RunContext, tx: Any) -> None:
        """Store the result of a step completed by its fenced transaction, in that one."""
        # FencedTransaction.set_checkpoint writes in the transaction itself.
        store = getattr(tx, "set_checkpoint", None)
        if store is None:
            raise ConfigurationError(
                f"{type(self._s.settings.backend).__name__} cannot store a step's result "
                "inside its fenced transaction")
        await store(self.result_payload(self._s.jobs[ctx.job], ctx.result))

    async def resume(self, wf: Workflow, info: JobInfo,
                     infos: Mapping[str, JobInfo] | None = None) -> None:
        """Claim the next step of each of ``wf``'s workflow runs where a step completed
        and the next one was never claimed (its agent and supervisors died in between).

        Not only the latest run: an older run can be left so while newer runs went on.
        The candidates are the workflow's latest run and the newest :data:`RESUME_SCAN`
        runs (at least ``history_size``, at most :data:`RESUME_SCAN_MAX`) of each step but
        the last that completed: one read of each step's runs and one batched check of
        their successors, once, at start; nothing is added to any claim. An older run is
        continued only when its completed step's result names the same next step
        (:meth:`_went_on_with`): after a deploy changed the workflow, its old runs are not
        given the new steps; and only when the store knew the next step's job as the step
        completed (``infos``, the jobs' registrations at start; :meth:`_known_then`): the
        next step's runs of older runs lost with its data (a Redis Cluster shard's loss)
        are not gaps, and are not run again."""
        s = self._s
        slots: set[int] = set() if info.last_slot is None else {info.last_slot}
        limit = min(max(s.settings.history_size, RESUME_SCAN), RESUME_SCAN_MAX)
        finished: dict[str, dict[int, int]] = {}  # job -> slot -> its completion (ms)
        try:
            for job in wf.jobs[:-1]:
                slots.update(r.slot for r in await s.settings.backend.runs(job.name,
                                                                         limit=limit)
                             if r.status is RunStatus.COMPLETED)
            if not slots:
                return
            keys = [(job.name, slot) for slot in sorted(slots) for job in wf.jobs]
            result = await s.settings.backend.check(keys)
        except Exception as exc:
            s.clock.failed(f"check of workflow {wf.name}", exc)
            return
        for slot in sorted(slots, reverse=True):
            for job in wf.jobs[:-1]:
                state = result.runs.get((job.name, slot))
                next_step = job.next_step
                assert next_step is not None
                if (state is not None and state.status is RunStatus.COMPLETED
                        and (next_step.name, slot) not in result.runs):
                    if slot == info.last_slot:
                        await self._continue(job, next_step, slot)
                    elif (await self._went_on_with(job, next_step, slot)
                          and await self._known_then(job, next_step, slot, infos,
                                                     finished, limit)):
                        await s.claims.claim(next_step, slot, Reason.SCHEDULED)
                    break

    async def _known_then(self, job: Job, next_step: Job, slot: int,
                          infos: Mapping[str, JobInfo] | None,
                          finished: dict[str, dict[int, int]], limit: int) -> bool:
        """True when the store first saw ``next_step``'s job before ``job``'s run at
        ``slot`` completed: its missing run there is a gap, not a run lost with the job's
        data (the store sees a job whose data was lost anew, at the next registration or
        claim). Read from the slot alone when the job was first seen by then, else from
        ``job``'s history (its completed attempt's end; read once per step, kept in
        ``finished``); not found there: False."""
        first_seen = None if infos is None else infos.get(next_step.name)
        if first_seen is None or first_seen.first_seen_ms <= slot:
            return True
        ends = finished.get(job.name)
        if ends is None:
            try:
                history = await self._s.settings.backend.history(job.name, limit=2 * limit)
            except Exception as exc:
                self._s.clock.failed(f"reading the history of {job.name}", exc)
                return False
            ends = finished[job.name] = {
                a.slot: int(a.finished_at.timestamp() * 1000) for a in history
                if a.outcome == Outcome.COMPLETED and a.finished_at is not None}
        end = ends.get(slot)
        if end is not None and end >= first_seen.first_seen_ms:
            return True
        logger.info("%s slot %s: step %r completed before the store knew step %r (its "
                    "data lost since, or the step added since); it is not run for that "
                    "run", job.workflow and job.workflow.name, format_slot(slot), job.step,
                    next_step.step)
        return False

    async def _went_on_with(self, job: Job, next_step: Job, slot: int) -> bool:
        """True when ``job``'s run at ``slot``, completed, named ``next_step`` as the step
        after it (its result's ``"next"``): the workflow run was to go on with it. An
        older run whose step completed under another definition (a step added, renamed
        or removed since; its result stored by an earlier build, with no mark) is not
        continued at start: that would run a step for runs that ended long ago."""
        try:
            payload = await self._s.settings.backend.get_checkpoint(job.name, slot)
        except Exception as exc:
            self._s.clock.failed(f"reading the checkpoint of {job.name}", exc)
            return False
        if isinstance(payload, dict) and payload.get("next") == next_step.step:
            return True
        logger.debug("%s slot %s: step %r completed under another definition of the "
                     "workflow; step %r is not run for it", job.workflow and
                     job.workflow.name, format_slot(slot), job.step, next_step.step)
        return False
