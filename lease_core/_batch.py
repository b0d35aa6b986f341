"""Batchers: the claims (or finishes) an instance makes at the same instant go together.

When many jobs are due at one slot, a scheduler wakes them together and claims their
runs at once; when their handlers are quick, they end in the same turn of the event loop
too. Sent one by one, those calls cost one round trip each, and as many concurrent
connections as the pool allows. A batcher collects them and sends them through one
:meth:`Backend.claim_many <lease_core.abc.Backend.claim_many>` (or
:meth:`Backend.finish_many <lease_core.abc.Backend.finish_many>`) call: one statement on
PostgreSQL, one pipelined round trip on Redis, in chunks of at most :data:`CLAIM_BATCH`.

Collection adds no timer: the first call of a batch (its *leader*) yields to the event
loop until a turn adds no call (at most :data:`COLLECT_TURNS` turns), so every task woken
at the same instant adds its call first. A call that arrives while a batch is being sent
starts the next batch. A caller that knows no other call can come in those turns (no
other caller is active) passes ``collect=False``: its batch is sent at once, with no turn
of the event loop before it.
Each caller awaits its own result; a failed chunk fails each of
its calls, as if each had failed alone. A batch of one is sent with the single-call
method (:meth:`~lease_core.abc.Backend.claim`, :meth:`~lease_core.abc.Backend.finish`),
so that a wrapper instrumenting it still sees lone calls. (A backend that implements
only the batch method inherits the single one, a batch of one: the lone call then
reaches its batch method too, from inside the single one.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

from ._structures import ClaimRequest, ClaimResult, Lease, Outcome
from .abc import Backend

__all__ = ["CLAIM_BATCH", "COLLECT_TURNS", "Abandoned", "Batcher", "ClaimAbandoned",
           "ClaimBatcher", "FinishBatcher", "FinishItem"]

#: Calls per ``claim_many``/``finish_many`` call at most; a larger batch goes in chunks.
CLAIM_BATCH = 500
#: Turns of the event loop a batch's leader waits, at most, for more calls of the instant.
COLLECT_TURNS = 8

#: What :meth:`Backend.finish_many <lease_core.abc.Backend.finish_many>` takes per
#: attempt: its lease, its outcome and the error text (or None).
FinishItem = tuple[Lease, Outcome, "str | None"]

Req = TypeVar("Req")
Res = TypeVar("Res")


class Abandoned(Exception):
    """Raised to the calls of a batch whose sender was cancelled: outcome unknown."""


#: The name the claim batcher's callers know it by.
ClaimAbandoned = Abandoned


class _Batch(Generic[Req, Res]):
    __slots__ = ("done", "requests", "results")

    def __init__(self) -> None:
        self.requests: list[Req] = []
        self.results: list[Res | Exception] = []
        # Made by the first follower: most batches of spread slots have none.
        self.done: anyio.Event | None = None


class Batcher(Generic[Req, Res]):
    """Collects the calls of one instant and sends them with one batch call.

    Subclasses say how to send one call (:meth:`_one`) and a chunk (:meth:`_many`); both
    look the backend's method up at each call, so a method patched later is used.
    """

    def __init__(self, backend: Backend, *, limit: int = CLAIM_BATCH) -> None:
        self.backend = backend
        self.limit = limit
        self._open: _Batch[Req, Res] | None = None
        self.calls = 0
        """Store calls made (for tests and metrics)."""

    async def _one(self, request: Req) -> Res:
        raise NotImplementedError

    async def _many(self, requests: Sequence[Req]) -> Sequence[Res]:
        raise NotImplementedError

    async def call_many(self, requests: Sequence[Req], *,
                        collect: bool = True) -> list[Res | Exception]:
        """Send ``requests`` with the other calls of this instant; one result each.

        A result is the store's answer, or the exception that failed its chunk
        (:class:`Abandoned` when the batch's sender was cancelled). With
        ``collect=False``, a new batch is sent without waiting for more calls (a batch
        already collecting is still joined).
        """
        batch = self._open
        if batch is not None:
            start = len(batch.requests)
            batch.requests.extend(requests)
            if batch.done is None:
                batch.done = anyio.Event()
            await batch.done.wait()
            return batch.results[start:start + len(requests)]
        batch = self._open = _Batch()
        batch.requests.extend(requests)
        try:
            seen = 0
            for _ in range(COLLECT_TURNS if collect else 0):
                if len(batch.requests) == seen:
                    break
                seen = len(batch.requests)
                await anyio.lowlevel.checkpoint()
            if self._open is batch:
                self._open = None
            await self._send(batch)
        finally:
            if self._open is batch:
                self._open = None
            missing = len(batch.requests) - len(batch.results)
            batch.results += [Abandoned("the batch's sender was cancelled")] * missing
            if batch.done is not None:
                batch.done.set()
        return batch.results[:len(requests)]

    async def _send(self, batch: _Batch[Req, Res]) -> None:
        for at in range(0, len(batch.requests), self.limit):
            chunk = batch.requests[at:at + self.limit]
            self.calls += 1
            try:
                answered: Sequence[Res | Exception] = (
                    [await self._one(chunk[0])] if len(chunk) == 1
                    else await self._many(chunk))
                if len(answered) != len(chunk):
                    raise AssertionError(
                        f"the store answered {len(answered)} results for {len(chunk)} calls")
            except Exception as exc:
                answered = [exc] * len(chunk)
            batch.results += answered


class ClaimBatcher(Batcher[ClaimRequest, ClaimResult]):
    """Claims of one instant in one :meth:`~lease_core.abc.Backend.claim_many` call."""

    async def _one(self, request: ClaimRequest) -> ClaimResult:
        return await self.backend.claim(request)

    async def _many(self, requests: Sequence[ClaimRequest]) -> Sequence[ClaimResult]:
        return await self.backend.claim_many(requests)

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult | Exception]:
        """Claim ``requests`` with the other claims of this instant (see :meth:`call_many`)."""
        return await self.call_many(requests)


class FinishBatcher(Batcher[FinishItem, bool]):
    """Finishes of one instant in one :meth:`~lease_core.abc.Backend.finish_many` call."""

    async def _one(self, request: FinishItem) -> bool:
        return await self.backend.finish(*request)

    async def _many(self, requests: Sequence[FinishItem]) -> Sequence[bool]:
        return await self.backend.finish_many(requests)
