"""The claim batcher: claims made at the same instant go to the store together.

When many jobs are due at one slot, every job loop of a scheduler wakes in the same turn
of the event loop and claims its run. Sent one by one, those claims cost one round trip
each, and as many concurrent connections as the pool allows. The batcher collects them
and sends them through one :meth:`Backend.claim_many <lease_core.abc.Backend.claim_many>`
call (one statement on PostgreSQL, one pipelined round trip on Redis), in chunks of at
most :data:`CLAIM_BATCH` claims.

Collection adds no timer: the first claim of a batch (its *leader*) yields to the event
loop until a turn adds no claim (at most :data:`COLLECT_TURNS` turns), so every task woken
at the same instant adds its claim first. A claim that arrives while a batch is being sent
starts the next batch. Each caller awaits its own result; a failed chunk fails each of
its claims, as if each had failed alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.lowlevel

from ._structures import ClaimRequest, ClaimResult
from .abc import Backend

__all__ = ["CLAIM_BATCH", "COLLECT_TURNS", "ClaimAbandoned", "ClaimBatcher"]

#: Claims per ``claim_many`` call at most; a larger batch is sent in chunks, in order.
CLAIM_BATCH = 500
#: Turns of the event loop a batch's leader waits, at most, for more claims of the instant.
COLLECT_TURNS = 8


class ClaimAbandoned(Exception):
    """Raised to the claims of a batch whose sender was cancelled: outcome unknown."""


class _Batch:
    __slots__ = ("done", "requests", "results")

    def __init__(self) -> None:
        self.requests: list[ClaimRequest] = []
        self.results: list[ClaimResult | Exception] = []
        self.done = anyio.Event()


class ClaimBatcher:
    """Collects the claims of one instant and sends them with one ``claim_many`` call."""

    def __init__(self, backend: Backend, *, limit: int = CLAIM_BATCH) -> None:
        self.backend = backend
        self.limit = limit
        self._open: _Batch | None = None
        self.calls = 0
        """``claim_many`` calls made (for tests and metrics)."""

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult | Exception]:
        """Claim ``requests`` with the other claims of this instant; one result each.

        A result is the store's answer, or the exception that failed its chunk
        (:class:`ClaimAbandoned` when the batch's sender was cancelled).
        """
        batch = self._open
        if batch is not None:
            start = len(batch.requests)
            batch.requests.extend(requests)
            await batch.done.wait()
            return batch.results[start:start + len(requests)]
        batch = self._open = _Batch()
        batch.requests.extend(requests)
        try:
            seen = 0
            for _ in range(COLLECT_TURNS):
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
            batch.results += [ClaimAbandoned("the batch's sender was cancelled")] * missing
            batch.done.set()
        return batch.results[:len(requests)]

    async def _send(self, batch: _Batch) -> None:
        for at in range(0, len(batch.requests), self.limit):
            chunk = batch.requests[at:at + self.limit]
            self.calls += 1
            try:
                answered: Sequence[ClaimResult | Exception] = (
                    await self.backend.claim_many(chunk))
                if len(answered) != len(chunk):
                    raise AssertionError(
                        f"claim_many answered {len(answered)} results for {len(chunk)} claims")
            except Exception as exc:
                answered = [exc] * len(chunk)
            batch.results += answered
