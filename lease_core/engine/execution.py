"""Execution: a won run's handler runs here, is cancelled here, and its outcome recorded.

How an attempt ends is decided by one pure function,
:func:`~lease_core._outcome.decide_outcome`; this module runs the handler, gathers what
that function needs, and carries the decision out: it reports the end, stores a workflow
step's result, finishes the run in the store (with the other finishes of the instant, in
one ``finish_many`` call), or backs the run up when its lease was lost.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .. import events as ev
from .._outcome import Interruption, classify, decide_outcome, error_text
from .._structures import (
    ClaimResult,
    Lease,
    Outcome,
    Reason,
    RunState,
    RunStatus,
    fence_of,
    format_slot,
)
from .._wakeups import in_context
from ..context import RunContext
from ..errors import ConfigurationError, StopRequested
from .base import INSIDE, logger, unrun
from .recording import OutcomeRecorder
from .runs import AttemptInfo, Execution, Run

if TYPE_CHECKING:
    from .jobs import Job
    from .session import Session

__all__ = ["Executor"]


@dataclass(slots=True)
class _Ran:
    """What happened to a handler, as :func:`decide_outcome` needs it."""

    value: Any = None
    raised: Exception | None = None
    timed_out: bool = False
    interrupted: Interruption | None = None
    thread: _Thread | None = None
    """A sync handler's call (its thread may outlive a timeout)."""


class _Thread:
    """A sync handler's call in a worker thread, which says when it runs: 0 not started,
    1 running, 2 returned, 3 never to start (:meth:`abandon`)."""

    __slots__ = ("_lock", "state")

    def __init__(self) -> None:
        self.state = 0
        self._lock = threading.Lock()

    def abandon(self) -> bool:
        """The call was cancelled: a call its thread has not started yet never starts
        (on trio, a thread started for it runs it however late unless told: its run
        would be handed over, and the handler run beside the backup's attempt). Return
        True when the handler runs now."""
        with self._lock:
            if self.state == 0:
                self.state = 3
            return self.state == 1

    def call(self, handler: Any, ctx: RunContext) -> Any:
        with self._lock:
            if self.state == 3:
                return None  # abandoned before it started: nobody reads the result
            self.state = 1
        try:
            value = handler(ctx)
            failure = unrun(value, handler, "handler", "which fails its run",
                            where=" in the handler", fix="declare the handler with")
            if failure is not None:
                raise failure
            return value
        except (SystemExit, KeyboardInterrupt) as exc:
            # In a thread these end the thread only; carried to the event loop they would
            # end it (with every scheduler and lease on it): the run fails instead.
            raise _exited(exc) from exc
        finally:
            self.state = 2


def _stray(exc: asyncio.CancelledError) -> bool:
    """True when ``exc`` cancels nothing: the running asyncio task has no cancellation
    pending (anyio's cancel scopes cancel the task, so a cancellation of theirs, a
    timeout, a stop or a lost lease, is pending until the scope exits), or the loop is
    not asyncio's (trio cancels with an exception of its own, never this one)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # not on asyncio (trio)
        return True
    # No task with an asyncio loop running: trio in guest mode on an asyncio host (its
    # code runs in the host loop's callbacks), where it is trio's exception that cancels.
    return task is None or not task.cancelling()


def _stopped_by_its_timeout(ran: _Ran, ctx: RunContext) -> None:
    """A handler stopped by ``ctx.raise_if_stopping()`` at its timeout, before the scope's
    cancellation came (it had not awaited since), timed out: it did not fail."""
    if (ran.raised is not None and classify(ran.raised) is StopRequested
            and ctx.stop_reason == "timed out"):
        ran.raised, ran.timed_out = None, True


def _exited(exc: BaseException) -> RuntimeError:
    """The failure a handler's ``sys.exit()`` (or a raised ``KeyboardInterrupt``) is."""
    return RuntimeError(f"the handler raised {exc!r}, which fails its run (a handler "
                        "cannot exit the process; raise an exception)")


class Executor:
    """Runs the handlers of one scheduler's won runs, and records how each attempt ended."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self._recorder = OutcomeRecorder(session)
        # Sync handlers whose run stopped waiting for them (a timeout, a stop, a lost
        # lease) while their thread still runs: they still count against max_running,
        # in the next session too (a stop and a start do not end a thread).
        self._abandoned: set[_Thread] = session.carry.abandoned
        # Runs whose handler, or what follows it (the finish, the next step's claim),
        # is in progress; a stop waits for them before it hands over (drain).
        self._executing = 0
        self._none_executing: anyio.Event | None = None
        # Each handler runs in a fresh copy of this context (the scheduler's, at its
        # start), as in a new task: never in one a handler before it changed.
        self._context = contextvars.copy_context()

    def launch(self, job: Job, lease: Lease, result: ClaimResult, sent_loop: float,
               attempt: AttemptInfo | None, *, deferred: list[Run] | None = None) -> None:
        """Start the handler of a run whose claim ``result`` won ``lease``.

        With ``deferred``, the run is held and appended there instead, for the caller to
        run at once (:meth:`execute`, in a task of the caller's choosing).
        """
        s = self._s
        assert s.tg is not None
        reason = result.reason or Reason.SCHEDULED
        ctx = RunContext(
            backend=s.settings.backend, lease=lease, attempt=result.attempt, reason=reason,
            instance_id=s.settings.instance_id, logger=logger,
            workflow=None if job.workflow is None else job.workflow.name, step=job.step,
            fence=fence_of(result.epoch, result.attempt),
        )
        if job.workflow is not None:
            ctx._before_commit = s.steps.result_in_transaction
        execution = Execution(ctx, anyio.CancelScope())
        run = s.runs.hold(job, lease, execution, attempt)
        # The store's lease started no earlier than the claim was sent.
        execution.set_deadline(self.deadline(sent_loop, job))
        ctx._transaction_hook = lambda active, renewed: execution.transaction_hook(
            active, None if renewed is None else self.deadline(renewed, job))
        if logger.isEnabledFor(logging.INFO):  # format_slot is not free, times a burst
            logger.info("%s slot %s (%d): %s won attempt %d (%s)", job.name,
                        format_slot(lease.slot), lease.slot, s.settings.instance_id,
                        result.attempt, reason)
        if deferred is None:
            s.tg.start_soon(self._execute_afresh, run)
        else:
            deferred.append(run)  # run by a worker, in a fresh copy of its context

    async def _execute_afresh(self, run: Run) -> None:
        # Started from the task of a handler that just ended (its workflow's next step,
        # its retry), the task would inherit what that handler set in context variables.
        await in_context(self._execute(run), self._context.copy())

    async def execute(self, run: Run) -> None:
        """Run a deferred run's handler in the calling task (a worker of the dispatcher's,
        or a task of the session's group) and record its outcome."""
        await self._execute(run)

    def deadline(self, sent_loop: float, job: Job) -> float:
        """The local deadline of a lease whose claim or renewal was sent at ``sent_loop``."""
        # Stop the handler locally before the store could consider the lease expired,
        # even if heartbeats cannot reach the store: counted from when the claim or the
        # renewal was sent, which is no later than when the store started the lease.
        return sent_loop + job.lease_ms / 1000 - self._s.settings.heartbeat / 2

    def lose(self, run: Run, why: Interruption) -> None:
        """Cancel a held run's handler: its lease is lost, or about to be."""
        execution, lease = run.execution, run.lease
        assert execution is not None and lease is not None
        execution.lost = True
        execution.cancel_reason = why
        execution.ctx._request_stop(str(why))
        execution.scope.cancel()
        logger.warning("%s slot %s: %s; handler cancelled", run.job.name,
                       format_slot(lease.slot), why)

    def cancel_after(self, run: Run, grace_ms: int) -> None:
        """An operator cancelled the held run (its heartbeat answered "cancelled"): ask
        its handler to stop now (``ctx.stopping``), cancel it ``grace_ms`` later."""
        execution, lease = run.execution, run.lease
        assert execution is not None and lease is not None
        if execution.cancelled:
            return
        execution.cancelled = True
        execution.cancel_reason = Interruption.CANCELLED
        execution.ctx._request_stop("run cancelled by an operator")
        # Nobody takes a cancelled run over: the lease's own deadline no longer applies.
        execution.set_deadline(anyio.current_time() + grace_ms / 1000)
        logger.warning("%s slot %s: cancelled by an operator; the handler has %gs to stop",
                       run.job.name, format_slot(lease.slot), grace_ms / 1000)

    def ended(self, kind: type[ev.AttemptEnded], lease: Lease, **extra: Any) -> None:
        """Report the end of the attempt holding ``lease`` (once)."""
        s = self._s
        info = s.runs.ended_attempt(lease)
        if info is None or not s.bus.wanted:
            return
        s.bus.emit(kind(
            instance_id=s.settings.instance_id, job=lease.job, slot=lease.slot,
            attempt=info.attempt, reason=info.reason,
            duration=anyio.current_time() - info.started, **extra,
        ))

    async def drain(self, seconds: float) -> None:
        """Wait, for ``seconds`` at most, until no handler runs and none's ending is in
        progress: its finish, and the next step's claim, whose run a stop hands over."""
        with anyio.move_on_after(seconds):
            while self._executing:
                self._none_executing = anyio.Event()
                await self._none_executing.wait()

    async def _execute(self, run: Run) -> None:
        self._executing += 1
        try:
            await self._execute_run(run)
        finally:
            self._executing -= 1
            if not self._executing and self._none_executing is not None:
                self._none_executing.set()

    async def _execute_run(self, run: Run) -> None:
        s = self._s
        job, execution, lease = run.job, run.execution, run.lease
        assert execution is not None and lease is not None
        INSIDE.set(s.settings.owner)
        outlived = False
        try:
            ran = await self._run_handler(job, execution, lease.slot)
            if (ran.timed_out and ran.thread is not None and job.retry is not None
                    and job.retry.retries_error(None)):
                outlived = await self._outlived(ran.thread, execution)
        finally:
            s.runs.finishing(run)
        if outlived:
            # A stop's grace ended with the timed-out thread still running: a retry now,
            # or a hand-over, would start the run again beside it. Nothing is written;
            # the lease lapses and a backup takes the run over (reason takeover).
            logger.warning("%s slot %s: the stop's grace ended while the timed-out sync "
                           "handler's thread still ran; its lease is left to lapse",
                           job.name, format_slot(lease.slot))
            self.ended(ev.Lost, lease, why="timed-out handler still running at the end of "
                       "the stop")
            s.runs.release(run)
            return
        ending = decide_outcome(
            raised=ran.raised, timed_out=ran.timed_out, timeout=job.timeout,
            interrupted=ran.interrupted, lost=execution.lost, stopping=s.stopping,
            crashed=s.crashed, cancelled=execution.cancelled,
        )
        outcome, error = ending.outcome, ending.error
        if outcome is None:
            return
        if (execution.ctx.completed_by_transaction
                and outcome not in (Outcome.COMPLETED, Outcome.CANCELLED)):
            # The store recorded the step completed in its fenced transaction: whatever
            # the handler did after the commit (raised, timed out, was stopped or lost the
            # lease) changes nothing; the next step runs.
            logger.warning("%s slot %s: the step completed in its transaction, then %s; "
                           "it stays completed", job.name, format_slot(lease.slot),
                           error or outcome)
            outcome, error, ran.raised = Outcome.COMPLETED, None, None
        elif (execution.ctx.completed_by_transaction and job.workflow is not None
              and ran.value is not None and ran.value != execution.ctx.result):
            # Its result committed with the transaction: what the handler returns after it
            # cannot be stored (the step is completed), and the next step reads the other.
            logger.warning("%s slot %s: the step returned %r after its transaction "
                           "completed it; that value is not its result (%r, set inside "
                           "the transaction): call ctx.set_result() inside `async with "
                           "ctx.transaction()`", job.name, format_slot(lease.slot),
                           ran.value, execution.ctx.result)
        if outcome is Outcome.CANCELLED:  # the store ended the run already (Admin.cancel)
            self.ended(ev.Cancelled, lease)
            s.runs.release(run)
            return
        if outcome is Outcome.LOST:
            self._lost(run, error or "lease lost", ran.interrupted)
            return
        if outcome is Outcome.HANDED_OVER:
            if ran.thread is not None and ran.thread.state == 1:
                # A sync handler stopped by the stop whose thread still runs: a hand-over
                # would start the run again beside it. The lease lapses instead.
                logger.warning("%s slot %s: the stop's grace ended while the sync "
                               "handler's thread still ran; its lease is left to lapse",
                               job.name, format_slot(lease.slot))
                self.ended(ev.Lost, lease, why="handler still running at the end of the stop")
                s.runs.release(run)
                return
            s.runs.hand_over_later(job, lease, None)
            s.hand_over_soon(lease)
            return
        # A step whose result cannot be stored returned: running its handler again (a
        # retry) would apply its effects again, to the same end.
        unstorable = False
        if (outcome is Outcome.COMPLETED and job.workflow is not None
                and not execution.ctx.completed_by_transaction):
            stored = await s.steps.store_result(run, ran.value)
            if isinstance(stored, ConfigurationError):
                ran.raised, unstorable = stored, True
                outcome, error = Outcome.FAILED, error_text(f"the step's result: {stored}")
            elif not stored:
                return
        if outcome is Outcome.TIMED_OUT:
            execution.ctx._request_stop("timed out")
        if not unstorable and s.retries.wanted(job, outcome, ran.raised):  # issue 19
            await s.retries.fail(run, outcome, error or str(outcome),
                                 lambda: self._report(run, outcome, error, ran.raised))
            return
        finished: bool | None = (outcome is Outcome.COMPLETED
                                 and execution.ctx.completed_by_transaction)
        if not finished:
            finished = await self._recorder.finish(run, outcome, error)
        # Reported once the store answered: an operator's cancel that ended the run after
        # the handler returned (before its holder's heartbeat could tell) made the store
        # refuse the finish, and the attempt ended cancelled, not as the handler did.
        completed = finished and outcome is Outcome.COMPLETED
        if finished is False:
            completed = await self.settle_refused(
                run, lambda: self._report(run, outcome, error, ran.raised))
        else:
            self._report(run, outcome, error, ran.raised)
        if finished is None:
            # Unknown whether it finished (reported as the handler ended): watch it, so
            # that it is taken over if not.
            s.runs.rewatch(run, completed=outcome is Outcome.COMPLETED)
        else:
            s.runs.release(run)
        if completed:
            await s.steps.completed(job, lease.slot)

    async def settle_refused(self, run: Run, report: Callable[[], None], *,
                             why: str = "lease lost before finishing") -> bool:
        """Report the end of an attempt whose finish (or ``retry_later``) the store
        refused, as the store has the run: ``Cancelled`` when an operator's cancel ended
        this attempt meanwhile; ``Completed`` when it is completed (a step's fenced
        transaction committed, and its answer was lost: the handler saw an error), and
        then True, for the caller to go on to the next step; else the lease was lost
        (``Lost`` with ``why``, as the history records the attempt), and ``report()``
        logs what the handler did (its own report of the end is then a no-op)."""
        lease = run.lease
        assert lease is not None
        state = await self._recorder.state_in_store(lease)
        status = None if state is None else state.status
        attempt = None if run.execution is None else run.execution.ctx.attempt
        if state is not None and status is RunStatus.CANCELLED and state.attempt == attempt:
            self.ended(ev.Cancelled, lease)
            return False
        if (state is not None and status is RunStatus.COMPLETED
                and self._completed_here(run, state.attempt)):
            logger.warning("%s slot %s: the store has the run completed by this attempt (its "
                           "transaction committed, and the answer was lost); it stays "
                           "completed", lease.job, format_slot(lease.slot))
            self.ended(ev.Completed, lease)
            return True
        # Refused, and not this attempt's cancel nor completion: another attempt holds
        # or held the run (a backup took it over), and the history has this one lost.
        self.ended(ev.Lost, lease, why=why)
        report()
        return False

    async def state_in_store(self, lease: Lease) -> RunState | None:
        """``lease``'s run as the store has it now (``None``: no run, or no answer)."""
        return await self._recorder.state_in_store(lease)

    def _completed_here(self, run: Run, attempt: int) -> bool:
        """Whether this attempt completed the run itself: the store's completed attempt is
        this one, and it opened a transaction that completes it
        (:meth:`RunContext.transaction`)."""
        execution = run.execution
        return (execution is not None and execution.ctx._completion_tried
                and execution.ctx.attempt == attempt)

    async def _outlived(self, thread: _Thread, execution: Execution) -> bool:
        """A sync handler timed out, and its run may be retried: the retry waits until its
        thread returns (asked to stop through ``ctx.stopping``), the run's lease still
        held and renewed, so that the run never runs twice at once. A lost lease ends the
        wait (the run is then backed up as usual), and so does the end of a stop's grace:
        then returns True, the thread still running."""
        if thread.state != 1:
            return False
        self._abandoned.discard(thread)  # its run, still held, counts against max_running
        execution.ctx._request_stop("timed out")
        logger.warning("%s: a sync handler timed out and its thread still runs; its retry "
                       "waits until it returns", execution.ctx.job)
        try:
            # Polled: three conditions end the wait (the thread, a lost lease, a stop), on
            # a rare path; an event set from the worker thread would need the loop alive.
            while (thread.state == 1 and not execution.lost  # noqa: ASYNC110
                   and execution.cancel_reason is not Interruption.STOPPED):
                await anyio.sleep(0.05)
        finally:
            if thread.state == 1 and self._s.settings.max_running is not None:
                self._abandoned.add(thread)
        return thread.state == 1 and not execution.lost

    async def _run_handler(self, job: Job, execution: Execution, slot: int) -> _Ran:
        ran = _Ran()
        ctx = execution.ctx
        if execution.deadline <= anyio.current_time():
            # The claim's answer was read after the lease's local deadline (the process
            # was frozen, or its loop blocked, between the store's answer and reading
            # it): a backup may own the run by now, so no handler code runs at all.
            ran.interrupted = execution.cancel_reason = Interruption.DEADLINE
            execution.lost = True
            logger.warning("%s slot %s: the claim was answered after its lease's local "
                           "deadline; handler not started", job.name, format_slot(slot))
            return ran
        with execution.scope:
            try:
                if not job.timeout:  # no scope that could never fire: one fewer per run
                    ran.value = await self._call(job, ctx, slot, ran)
                else:
                    ctx._timeout_at = time.monotonic() + job.timeout  # before the scope's
                    with anyio.move_on_after(job.timeout) as timeout_scope:
                        ran.value = await self._call(job, ctx, slot, ran)
                    ran.timed_out = timeout_scope.cancelled_caught
            except Exception as exc:
                ran.raised = exc
            except SystemExit as exc:  # it would end the event loop, and every task on it
                ran.raised = _exited(exc)
                ran.raised.__cause__ = exc
        _stopped_by_its_timeout(ran, ctx)
        if execution.scope.cancelled_caught:
            ran.interrupted = execution.cancel_reason or Interruption.DEADLINE
        return ran

    async def _call(self, job: Job, ctx: RunContext, slot: int, ran: _Ran) -> Any:
        try:
            return await self._call_handler(job, ctx, slot, ran)
        except asyncio.CancelledError as exc:
            if not _stray(exc):
                raise
            # Not a cancellation of this task (no cancel scope asked for it): the handler
            # let out the CancelledError of a task or future it awaited. Carried on, it
            # would cancel the scheduler's task group and stop the scheduler, silently,
            # with the run left to be taken over (and the next instance stopped alike).
            raise RuntimeError(
                f"the handler raised {exc!r} without being cancelled (a task or future it "
                "awaited was cancelled), which fails its run") from exc

    async def _call_handler(self, job: Job, ctx: RunContext, slot: int, ran: _Ran) -> Any:
        if job.workflow is not None:
            done, result = await self._s.steps.earlier_result(ctx)
            if done:
                return result
            ctx.results = await self._s.steps.load_results(job, slot)
        if job.is_async:
            return await job.handler(ctx)
        thread = ran.thread = _Thread()
        try:
            return await anyio.to_thread.run_sync(
                thread.call, job.handler, ctx, abandon_on_cancel=True,
                limiter=self._s.handler_threads)
        except BaseException:
            if thread.abandon() and self._s.settings.max_running is not None:
                self._abandoned.add(thread)  # abandoned: the thread goes on
            raise

    @property
    def abandoned_threads(self) -> int:
        """Sync handlers still running in their threads after their runs stopped waiting
        (a timeout, a stop, a lost lease); they count against ``max_running``."""
        ended = [thread for thread in self._abandoned if thread.state != 1]
        self._abandoned.difference_update(ended)
        return len(self._abandoned)

    def _lost(self, run: Run, error: str, interrupted: Interruption | None) -> None:
        execution, lease = run.execution, run.lease
        assert execution is not None and lease is not None
        self.ended(ev.Lost, lease, why=error)
        if not execution.lost:
            execution.lost = True
            execution.ctx._request_stop(error)
            name, slot = run.job.name, format_slot(lease.slot)
            if interrupted is Interruption.DEADLINE:
                logger.warning("%s slot %s: %s; handler cancelled", name, slot, error)
            else:
                logger.warning("%s slot %s: lease lost: %s", name, slot, error)
        self._s.runs.rewatch(run)

    def _report(self, run: Run, outcome: Outcome, error: str | None,
                raised: Exception | None) -> None:
        execution, lease = run.execution, run.lease
        assert execution is not None and lease is not None
        if outcome is Outcome.TIMED_OUT:
            self.ended(ev.TimedOut, lease)
            logger.warning("%s slot %s (%d) attempt %d %s", run.job.name,
                           format_slot(lease.slot), lease.slot, execution.ctx.attempt,
                           error or "timed out")
        elif outcome is Outcome.COMPLETED:
            self.ended(ev.Completed, lease)
        elif outcome is Outcome.FAILED:
            assert raised is not None
            self.ended(ev.Failed, lease, error=raised)
            logger.warning("%s slot %s (%d) attempt %d failed: %s", run.job.name,
                           format_slot(lease.slot), lease.slot, execution.ctx.attempt, error,
                           exc_info=raised)
