"""Retries within a run (issue 19, part 1): a failed attempt with retries left waits, unleased.

When a handler of a job with ``retry=`` fails (or times out) with an error its policy
retries, the attempt ends in the store with :meth:`~lease_core.abc.Backend.retry_later`
instead of ``finish``: the store counts the run's retries so far and, with one left, marks
the run ``retrying`` until the backoff has passed (store clock), holding no lease. The
instance then backs the run up like any other: at its due time it claims it (a local timer
makes that prompt; every backup's check finds it claimable too), and whichever instance
claims first makes the retry, reason ``retry``. A stop or a crash meanwhile loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio

from .. import events as ev
from .._structures import Outcome, Reason, RunStatus, format_slot
from ..errors import ConfigurationError
from ..retry import supports_retries
from .base import logger
from .runs import Phase, Run

#: :meth:`Retrier._send`'s answer for a ``retry_later`` recorded by an earlier send.
_RECORDED = -2

if TYPE_CHECKING:
    from .jobs import Job
    from .session import Session

__all__ = ["Retrier"]

#: The outcomes a retry policy may retry (a timeout counts as a failure).
_RETRIED = (Outcome.FAILED, Outcome.TIMED_OUT)


class Retrier:
    """Ends one scheduler's failed attempts that may be retried, and makes their retries due."""

    def __init__(self, session: Session) -> None:
        self._s = session
        backend = session.settings.backend
        wanting = sorted(job.name for job in session.jobs.values() if job.retry is not None)
        if wanting and not supports_retries(backend):
            raise ConfigurationError(
                f"job {wanting[0]!r} has retry=..., which {type(backend).__name__} does not "
                "support (it implements no retry_later()); drop retry= or use a built-in "
                "backend")

    def wanted(self, job: Job, outcome: Outcome, raised: BaseException | None) -> bool:
        """True when this failure of ``job`` is for :meth:`fail`, not a plain finish."""
        return (job.retry is not None and outcome in _RETRIED
                and job.retry.retries_error(None if outcome is Outcome.TIMED_OUT else raised))

    async def fail(self, run: Run, outcome: Outcome, error: str,
                   report: Callable[[], None]) -> int | None:
        """End the failed attempt; the retry's number, 0 when the run ended, ``None``
        when the store did not record it: unanswered (the run is then backed up), or
        refused because the token no longer holds the run (another instance has it, or
        an operator cancelled it).

        ``report`` emits the attempt's own end (``Failed``, ``TimedOut``); it is called
        once the store answered, before ``Retried``, and not at all when the store shows
        the run cancelled: the attempt then ends ``Cancelled``, as the history has it."""
        s, job, lease = self._s, run.job, run.lease
        assert lease is not None and job.retry is not None
        delays = job.retry.delays_ms()
        answer = await self._send(run, outcome, error, delays)
        if answer is None:  # unknown whether it ended: watch it, as a finish would
            report()
            s.runs.rewatch(run)
            return None
        if answer == _RECORDED:  # recorded by a send whose answer was lost
            report()
            s.runs.release(run)
            s.runs.watch(job, lease.slot)  # its retry is claimed by the next check
            logger.info("%s slot %s: retry recorded (its first answer was lost)",
                        job.name, format_slot(lease.slot))
            return None
        if answer < 0:
            def lost() -> None:
                report()
                logger.warning("%s slot %s: lease lost before finishing (%s)", job.name,
                               format_slot(lease.slot), outcome)

            completed = await s.execution.settle_refused(run, lost)
            s.runs.release(run)
            if completed:
                await s.steps.completed(job, lease.slot)
            return None
        report()
        s.runs.release(run)
        if answer == 0:
            logger.warning("%s slot %s: failed after %d retries", job.name,
                           format_slot(lease.slot), len(delays))
            return 0
        delay = delays[answer - 1] / 1000
        logger.info("%s slot %s: retry %d of %d in %gs", job.name, format_slot(lease.slot),
                    answer, len(delays), delay)
        if s.bus.wanted:
            s.bus.emit(ev.Retried(
                instance_id=s.settings.instance_id, job=job.name, slot=lease.slot,
                attempt=run.execution.ctx.attempt if run.execution else 0, retry=answer,
                delay=delay, error=error))
        s.runs.watch(job, lease.slot)
        if s.tg is not None and not s.stopping:
            s.tg.start_soon(self._claim_when_due, job, lease.slot, delay)
        return answer

    async def _send(self, run: Run, outcome: Outcome, error: str,
                    delays: Sequence[int]) -> int | None:
        """``retry_later`` for ``run``: its answer, ``None`` when the store did not answer.

        As a finish, sent again a check interval later while the lease is still the
        attempt's (not once the scheduler stops): backed up at once, the run would be
        taken over, not retried. Sent again after the first was recorded, it is refused;
        then :data:`_RECORDED` when the store has the run waiting for its retry by this
        attempt, 0 when this attempt ended it (no retry was left), as the first answer
        would have said."""
        s, lease, execution = self._s, run.lease, run.execution
        assert lease is not None
        deadline = math.inf if execution is None else execution.deadline
        sent_before = False
        while True:
            answer: int | None = None
            with anyio.move_on_after(10, shield=True):
                try:
                    (answer,) = await s.settings.backend.retry_later(
                        [(lease, outcome, error, delays)])
                except Exception as exc:
                    s.clock.failed(f"end of {run.job.name} slot {format_slot(lease.slot)}",
                                   exc, write=True)
                else:
                    if answer < 0 and sent_before and execution is not None:
                        state = await s.execution.state_in_store(lease)
                        if state is not None and state.attempt == execution.ctx.attempt:
                            if state.status is RunStatus.RETRYING:
                                return _RECORDED
                            if state.status is RunStatus(outcome.value):
                                return 0  # ended by it: no retry was left
                    return answer
            pause = s.settings.heartbeat
            if s.crashed or s.stopping or anyio.current_time() + pause >= deadline:
                return None
            sent_before = True
            with anyio.CancelScope(shield=True):  # bounded by the lease
                await anyio.sleep(pause)

    async def _claim_when_due(self, job: Job, slot: int, delay: float) -> None:
        s = self._s
        with s.stoppable():
            # A little after the store's due time; an early claim only stands by, and the
            # next backup check claims it then.
            await anyio.sleep(delay + 0.01)
            run = s.runs.get((job.name, slot))
            if run is not None and run.phase is Phase.WATCHING:
                await s.claims.claim(job, slot, Reason.RETRY)
