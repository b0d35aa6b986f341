"""Recording how an attempt ended: its finish in the store (with the other finishes of
the instant, in one ``finish_many`` call; sent again after a blip of the store while the
lease is still the attempt's), and what the store has after it refused one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import anyio

from .._batch import Abandoned, FinishBatcher
from .._structures import Lease, Outcome, RunState, RunStatus, format_slot
from .base import logger

if TYPE_CHECKING:
    from .runs import Run
    from .session import Session

__all__ = ["OutcomeRecorder"]


class OutcomeRecorder:
    """Records the ends of one scheduler's attempts in its store."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self._finisher = FinishBatcher(session.settings.backend)

    async def finish(self, run: Run, outcome: Outcome, error: str | None) -> bool | None:
        """Record the outcome in the store: True when recorded, False when the store
        refused it (the token no longer holds the run), None when unknown (the caller
        then backs the run up).

        A finish that failed (the store did not answer) is sent again, a check interval
        later, while the lease is still this attempt's: backed up at once, the run would
        be taken over once its lease ran out, and its handler run again (or, past
        ``max_attempts``, the run escalated), for a blip of the store. Sent again after
        it was recorded, the store refuses it, and :meth:`ended_by` finds the run ended
        by this attempt."""
        lease, execution = run.lease, run.execution
        assert lease is not None
        s = self._s
        name, slot = run.job.name, lease.slot
        deadline = math.inf if execution is None else execution.deadline
        sent_before = False
        while True:
            failed = False
            finished: bool | None = None
            with anyio.move_on_after(10, shield=True):  # unanswered by then: None
                # With the other finishes of this instant, in one finish_many call. Only
                # a handler still running here, or one whose claim is being answered, can
                # end in the next turns: with none, waiting turns for their finishes
                # would be a loop turn per run for nothing.
                (answer,) = await self._finisher.call_many(
                    [(lease, outcome, error)],
                    collect=s.runs.held_count > 0 or s.claims.in_flight > 0)
                if isinstance(answer, Exception):
                    failed = not isinstance(answer, Abandoned)
                    if failed:
                        s.clock.failed(f"finish of {name} slot {format_slot(slot)}", answer,
                                       write=True)
                else:
                    if answer:  # a finish the store refused (lease lost) wrote nothing
                        s.clock.wrote()
                    finished = answer
                    if not finished and sent_before:
                        finished = await self.ended_by(run, outcome) or False
                    if not finished:
                        logger.warning("%s slot %s: lease lost before finishing (%s)",
                                       name, format_slot(slot), outcome)
            sent_before = True
            pause = s.settings.heartbeat
            # Not while stopping: a stop would wait for it up to the lease (minutes);
            # unrecorded, the run is taken over as before.
            if (not failed or s.crashed or s.stopping
                    or anyio.current_time() + pause >= deadline):
                return finished
            with anyio.CancelScope(shield=True):  # bounded by the lease
                await anyio.sleep(pause)

    async def ended_by(self, run: Run, outcome: Outcome) -> bool:
        """Whether the store has ``run`` ended with ``outcome`` by this attempt: a finish
        sent again after one whose answer was lost is refused when that one was
        recorded."""
        lease, execution = run.lease, run.execution
        assert lease is not None
        state = await self.state_in_store(lease)
        return (state is not None and execution is not None
                and state.attempt == execution.ctx.attempt
                and state.status == RunStatus(outcome.value))

    async def state_in_store(self, lease: Lease) -> RunState | None:
        """``lease``'s run as the store has it (read after a refused finish)."""
        with anyio.move_on_after(10, shield=True):
            try:
                found = (await self._s.settings.backend.check([(lease.job, lease.slot)])).runs
            except Exception as exc:
                self._s.clock.failed(f"check of {lease.job} slot {format_slot(lease.slot)}", exc)
                return None
            return found.get((lease.job, lease.slot))
        return None
