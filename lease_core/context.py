"""The handler context: what a running job knows about its run."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import sniffio

from ._structures import Lease, Reason, format_slot, ms_to_datetime
from .errors import ConfigurationError, LeaseLost, StopRequested

if TYPE_CHECKING:
    from .abc import Backend

__all__ = ["Checkpoint", "RunContext", "StepCheckpoint"]


def _on_a_loop() -> bool:
    """True on an event loop's thread; False in a worker thread (a sync handler's)."""
    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return False
    return True


def _needs_loop(call: str, sync: str) -> None:
    """Refuse an async method called from a sync handler's thread: its coroutine, which
    nobody would await, would write nothing (and the run would complete regardless)."""
    if not _on_a_loop():
        raise ConfigurationError(
            f"{call} returns a coroutine, which a sync handler (it runs in a worker thread) "
            f"cannot await: call {sync} there, or declare the handler 'async def' and "
            f"await {call}")


def _needs_thread(call: str, async_call: str) -> None:
    """Refuse a ``*_sync`` method called on the event loop (from an async handler)."""
    if _on_a_loop():
        raise ConfigurationError(
            f"{call} is for sync handlers, which run in worker threads; in an async "
            f"handler, await {async_call}")


class Checkpoint:
    """The run's checkpoint: one JSON value scoped to (job, slot), fenced by the token.

    A later attempt of the same run (after a takeover or hand-over) reads what an earlier
    one stored, so a long job resumes where it stopped. A write from an attempt that no
    longer holds the run raises :class:`~lease_core.LeaseLost` and changes nothing, so a
    checkpoint never goes backwards. The ``*_sync`` variants are for sync handlers, which
    run in worker threads.
    """

    def __init__(self, backend: Backend, lease: Lease) -> None:
        self._backend = backend
        self._lease = lease
        #: The tasks inside an open ``ctx.transaction()`` of this run (its context's).
        self._in_transaction: set[int] = set()

    def _refuse_in_transaction(self, what: str) -> None:
        """Raise :class:`ConfigurationError` when the calling task is inside this run's
        fenced transaction: a write of the run's row outside it would wait for the
        transaction's own lock on that row, and the transaction for it, for good."""
        if self._in_transaction and anyio.get_current_task().id in self._in_transaction:
            raise ConfigurationError(
                f"{what} inside `async with ctx.transaction() as tx`: it would wait for "
                "the transaction's own lock on the run for good; pass the transaction "
                "(ctx.checkpoint.set(value, tx=tx)), or call it after the block"
            )

    def get(self) -> Coroutine[Any, Any, Any]:
        """Return the stored value, or ``None`` when there is none (to be awaited)."""
        _needs_loop("ctx.checkpoint.get()", "ctx.checkpoint.get_sync()")
        return self._get()

    def set(self, value: Any, *, tx: Any = None) -> Coroutine[Any, Any, None]:
        """Store ``value`` (JSON-serialisable); raise LeaseLost if this attempt lost the run
        (to be awaited).

        With ``tx``, the transaction of ``ctx.transaction()``, the value is written in it
        and commits with the effects (or not at all).
        """
        _needs_loop("ctx.checkpoint.set()", "ctx.checkpoint.set_sync(value)")
        return self._set(value, tx=tx)

    def delete(self) -> Coroutine[Any, Any, None]:
        """Remove the stored value; raise LeaseLost if this attempt lost the run (to be
        awaited)."""
        _needs_loop("ctx.checkpoint.delete()", "ctx.checkpoint.delete_sync()")
        return self._delete()

    async def _get(self) -> Any:
        return await self._backend.get_checkpoint(self._lease.job, self._lease.slot)

    async def _set(self, value: Any, *, tx: Any = None) -> None:
        if tx is not None:
            await tx.set_checkpoint(value)
            return
        self._refuse_in_transaction("ctx.checkpoint.set() without tx=")
        if not await self._backend.set_checkpoint(self._lease, value):
            raise LeaseLost(
                f"attempt of {self._lease.job!r} slot {self._lease.slot} no longer holds the run; "
                "checkpoint not written"
            )

    async def _delete(self) -> None:
        self._refuse_in_transaction("ctx.checkpoint.delete()")
        if not await self._backend.delete_checkpoint(self._lease):
            raise LeaseLost(
                f"attempt of {self._lease.job!r} slot {self._lease.slot} no longer holds the run; "
                "checkpoint not deleted"
            )

    def get_sync(self) -> Any:
        """:meth:`get` for a sync handler running in a worker thread."""
        _needs_thread("ctx.checkpoint.get_sync()", "ctx.checkpoint.get()")
        return anyio.from_thread.run(self._get)

    def set_sync(self, value: Any) -> None:
        """:meth:`set` for a sync handler running in a worker thread."""
        _needs_thread("ctx.checkpoint.set_sync()", "ctx.checkpoint.set(value)")
        anyio.from_thread.run(self._set, value)

    def delete_sync(self) -> None:
        """:meth:`delete` for a sync handler running in a worker thread."""
        _needs_thread("ctx.checkpoint.delete_sync()", "ctx.checkpoint.delete()")
        anyio.from_thread.run(self._delete)


class StepCheckpoint(Checkpoint):
    """A workflow step's progress: the step run's checkpoint holds ``{"progress": value}``.

    Once the step completes, its checkpoint holds ``{"result": value}`` instead (read by
    later steps as ``ctx.results``); :meth:`get` returns only the progress, ``None``
    when there is none.
    """

    async def _get(self) -> Any:
        payload = await super()._get()
        return payload.get("progress") if isinstance(payload, dict) else None

    async def _set(self, value: Any, *, tx: Any = None) -> None:
        await super()._set({"progress": value}, tx=tx)


class _RunLog(logging.LoggerAdapter[logging.Logger]):
    """Prefixes each message with the run, and adds job, slot and attempt as record fields."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        slot = extra["slot"]
        slot = format_slot(slot) if isinstance(slot, int) else slot
        return f"[{extra['job']} slot {slot} attempt {extra['attempt']}] {msg}", kwargs


class RunContext:
    """Passed to every handler: which run this is, cancellation, checkpoint and logging.

    The handler is cancelled (anyio cancellation) when its timeout passes, when the lease
    is lost (or could not be renewed in time), when ``stop()``'s grace period ends, or
    when an operator's cancel (:meth:`~lease_core.Admin.cancel`) has given it its grace.
    Before the last two, :attr:`stopping` is set, which a handler can poll between items
    with :meth:`raise_if_stopping`.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        lease: Lease,
        attempt: int,
        reason: Reason,
        instance_id: str,
        logger: logging.Logger,
        workflow: str | None = None,
        step: str | None = None,
        fence: int | None = None,
    ) -> None:
        self.job: str = lease.job
        """The job's name."""
        self.slot: int = lease.slot
        """The run's slot: its scheduled time in epoch milliseconds (UTC)."""
        self.scheduled_at: datetime = ms_to_datetime(lease.slot)
        """The slot as a tz-aware UTC datetime."""
        self.attempt: int = attempt
        """1, 2, 3 ...: increases on every takeover or hand-over of the run."""
        self.token: str = lease.token
        """This attempt's token inside the store: random, it fences every call to the
        store (checkpoint, transaction, finish)."""
        self.fence: int = attempt if fence is None else fence
        """The number to hand to systems outside the store: it grows with every attempt of
        the run, across a failover that lost acknowledged writes too (see
        :func:`lease_core.fence_of`), so such a system can refuse any write carrying a
        fence below the highest it has seen. Equal to :attr:`attempt` on PostgreSQL and in
        memory until the store has detected a loss; on Redis a job new to the server
        starts an epoch, so its fences are far larger (store them in 64 bits)."""
        self.reason: Reason = reason
        """Why this attempt claimed the run."""
        self.instance_id: str = instance_id
        """The instance running this attempt."""
        self.stopping: anyio.Event = anyio.Event()
        """Set when the scheduler is stopping or the run must end soon."""
        self.workflow: str | None = workflow
        """The workflow this step belongs to; ``None`` for a job's run."""
        self.step: str | None = step
        """The workflow step this run executes; ``None`` for a job's run."""
        self.results: dict[str, Any] = {}
        """For a workflow step: the results of the steps before it, by step name."""
        self.result: Any = None
        """For a workflow step: its result when the handler returns ``None`` (set it with
        :meth:`set_result`, needed when the step completes through :meth:`transaction`)."""
        self.checkpoint: Checkpoint = (
            Checkpoint(backend, lease) if step is None else StepCheckpoint(backend, lease))
        """The run's fenced checkpoint (for a step: its progress, see :class:`StepCheckpoint`)."""
        self.log: logging.LoggerAdapter[logging.Logger] = _RunLog(
            logger,
            {"job": lease.job, "slot": lease.slot, "attempt": attempt, "instance": instance_id},
        )
        """A logger bound to the job, slot and attempt."""
        self._backend = backend
        self._lease = lease
        self._stop_reason: str | None = None
        #: ``time.monotonic()`` at which the run's ``timeout`` ends it (None: no timeout).
        #: Its cancellation has no hook to set the reason first: read at the deadline.
        self._timeout_at: float | None = None
        self._transaction_hook: Callable[[bool, float | None], None] | None = None
        self._before_commit: Callable[[RunContext, Any], Awaitable[None]] | None = None
        self.completed_by_transaction = False
        #: A transaction that completes the run was opened: it may have committed even
        #: when its answer never came (the handler then saw an error).
        self._completion_tried = False

    def set_result(self, value: Any) -> None:
        """Set a workflow step's result (a JSON value), read later as ``ctx.results[step]``.

        A step's result is normally the value its handler returns. A step that completes
        through :meth:`transaction` must set it before the transaction's block ends: the
        result commits in that same transaction.
        """
        self.result = value

    def _request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        self.stopping.set()

    @property
    def stop_reason(self) -> str | None:
        """Why the run was asked to stop (``"stopping"``, ``"lease lost"``, ``"timed
        out"``...), if it was: ``"timed out"`` from the instant the job's ``timeout``
        passed, so the ``finally`` of a handler its timeout cancels knows why."""
        if (self._stop_reason is None and self._timeout_at is not None
                and time.monotonic() >= self._timeout_at):
            return "timed out"
        return self._stop_reason

    def raise_if_stopping(self) -> None:
        """Raise :class:`~lease_core.StopRequested` if the run was asked to stop.

        Call it between items of a batch. Safe to call from a sync handler's thread.
        """
        reason = self.stop_reason
        if reason is not None:
            raise StopRequested(f"run {self.job!r} slot {self.slot} asked to stop: {reason}")

    @asynccontextmanager
    async def transaction(self, *, complete: bool = True) -> AsyncIterator[Any]:
        """Run the handler's own SQL in a transaction that also completes the run.

        With ``complete=False`` it does not complete the run: the effects commit, fenced,
        and the handler goes on (one transaction per batch of a long run, each with its
        progress: ``await ctx.checkpoint.set(value, tx=tx)`` inside the block).

        The run row is locked first where this attempt's token is still current
        (:class:`~lease_core.LeaseLost` otherwise). The effects written through the
        yielded object and the run's completion commit together, or not at all. While it
        is open, the lock keeps every backup out, so the lease needs no renewal and the
        local lease deadline is suspended (the job's ``timeout`` still applies). Only SQL
        backends support it. In a workflow step, the step's result (:meth:`set_result`)
        commits in the same transaction.
        """
        inside = self.checkpoint._in_transaction
        task = anyio.get_current_task().id
        if task in inside:
            raise ConfigurationError(
                "ctx.transaction() inside another ctx.transaction() of the same run: it "
                "would wait for the outer transaction's lock on the run for good; write "
                "everything through the outer transaction"
            )
        if self._transaction_hook is not None:
            self._transaction_hook(True, None)
        renewed: float | None = None
        self._completion_tried = self._completion_tried or complete
        inside.add(task)
        try:
            async with self._backend.transaction(self._lease, complete=complete) as tx:
                yield tx
                if complete and self._before_commit is not None:
                    await self._before_commit(self, tx)
                # Without completing, the backend renews the lease from here, in the
                # commit: a transaction about as long as the lease does not lose it.
                renewed = None if complete else anyio.current_time()
            if complete:
                self.completed_by_transaction = True
        finally:
            inside.discard(task)
            if self._transaction_hook is not None:
                self._transaction_hook(False, renewed)
