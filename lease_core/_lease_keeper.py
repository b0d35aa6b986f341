"""The renewal of :class:`~lease_core.Lease` holds: one task per event loop (private).

:class:`_Hold` is one hold of a lease, from the acquire that won it to its release or
loss; :class:`_Keeper` is the task of an event loop that renews every hold on that loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import os
from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.lowlevel
import sniffio

from ._lease_clock import RESUME_CHECK, lease_clock
from .errors import LeaseLost

if TYPE_CHECKING:
    from .lease import Lease

__all__: list[str] = []  # private: lease.py uses _Hold and _Keeper

logger = logging.getLogger("anarchon")

_ENDED = "its renewal task ended (its event loop closing?)"


_TASKS: set[asyncio.Task[None]] = set()  # strong references to the keepers' tasks


def _spawn(fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
    """Run ``fn`` beside every other task of the event loop, owned by none of them.

    So a lease acquired with ``await lease.acquire()`` outside any task group is still
    renewed: the keeper is a task of the loop itself (asyncio) or a system task (trio).
    """
    if sniffio.current_async_library() == "trio":
        import trio.lowlevel

        trio.lowlevel.spawn_system_task(fn, name=name)
    else:
        task = asyncio.get_running_loop().create_task(fn(), name=name)
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)


class _Hold:
    """One hold of a :class:`Lease`, from the acquire that won it to its release or loss."""

    __slots__ = ("_lost", "alive_until", "error", "orphaned", "over", "pid", "released",
                 "scope", "token")

    def __init__(self, token: int, alive_until: float) -> None:
        self.token = token
        self.alive_until = alive_until  # monotonic: surely live in the store until then
        self._lost: anyio.Event | None = None  # made when first asked for or set
        self.error: LeaseLost | None = None
        self.over = False  # released or lost
        self.released = False  # its release sent (a lost hold's too: the token fences it)
        self.scope: anyio.CancelScope | None = None  # the renewal in flight
        self.pid = os.getpid()  # the process holding it (not a forked child of it)
        self.orphaned = False  # lost as its event loop ended (its client may be that loop's)

    @property
    def lost(self) -> anyio.Event:
        """Set when this hold is lost."""
        if self._lost is None:
            self._lost = anyio.Event()
        return self._lost


class _Keeper:
    """The one task per event loop that renews every lease held on that loop.

    It sleeps until the earliest renewal is due and runs each due renewal as a task of
    its own (a store that hangs delays no other lease's renewal). Acquiring and releasing
    cost no task of their own: a hold is pushed on the heap, a released one skipped.

    A renewal also queues its hold's *deadline*, the moment the hold may have expired in
    the store (``alive_until``): a hold not renewed by then is lost at once, even while
    its renewal still waits for the store. A driver call is not interrupted mid-statement
    (see ``adapters.base.settle_scope``), so the renewal alone would report the loss only
    once the driver gave up, seconds after another holder could have taken the name.
    """

    loops: ClassVar[dict[object, _Keeper]] = {}

    #: The heap is compacted (released holds dropped) when it grows past this many
    #: entries, and then past twice what it kept: a released hold stays queued until its
    #: renewal would have been due, so leases taken and released at a high rate would
    #: otherwise queue a ttl's worth of them.
    COMPACT_AT = 1024

    def __init__(self) -> None:
        # (when, order, lease, hold, is the hold's deadline rather than its renewal)
        self.due: list[tuple[float, int, Lease, _Hold, bool]] = []
        self.order = itertools.count()
        self.wake = anyio.Event()
        self.next = math.inf
        self.compact_at = self.COMPACT_AT
        self.renewing: dict[_Hold, Lease] = {}  # the renewals in flight

    async def _renew(self, lease: Lease, hold: _Hold) -> None:
        self.renewing[hold] = lease
        self._push(hold.alive_until, lease, hold, deadline=True)
        try:
            await lease._renew_hold(hold)
        except BaseException:
            # Cancelled with the keeper (a release cancels only the renewal's own scope,
            # which ends it quietly): nothing renews the hold any more.
            if not hold.over:
                lease._mark_lost(hold, _ENDED)
            raise
        finally:
            del self.renewing[hold]

    @classmethod
    def schedule(cls, lease: Lease, hold: _Hold, at: float) -> None:
        """Renew ``hold`` of ``lease`` at ``at`` (:func:`lease_clock`; on the current loop)."""
        loop = anyio.lowlevel.current_token()
        keeper = cls.loops.get(loop)
        if keeper is None:
            keeper = cls.loops[loop] = _Keeper()
            _spawn(partial(keeper.run, loop), "anarchon-lease-keeper")
        keeper._push(at, lease, hold, deadline=False)

    def _push(self, at: float, lease: Lease, hold: _Hold, *, deadline: bool) -> None:
        heapq.heappush(self.due, (at, next(self.order), lease, hold, deadline))
        if len(self.due) > self.compact_at:
            self.due = [entry for entry in self.due if not entry[3].over]
            heapq.heapify(self.due)
            self.compact_at = max(self.COMPACT_AT, 2 * len(self.due))
        if at < self.next:
            self.wake.set()

    @staticmethod
    def _expire(lease: Lease, hold: _Hold, now: float) -> None:
        """``hold``'s deadline came: lost if no renewal moved it since it was queued."""
        if hold.over or hold.alive_until > now:
            return
        lease._mark_lost(hold, "no renewal succeeded within the ttl (the store has not "
                               "answered yet)")
        if hold.scope is not None:
            hold.scope.cancel()  # the renewal in flight gives up as soon as it can

    async def run(self, loop: object) -> None:
        """Renew what is due, then sleep until the next renewal or a new earlier one."""
        try:
            async with anyio.create_task_group() as tg:
                timed_out = False
                while True:
                    now = lease_clock()
                    # After a timed wake-up, released holds ahead of the first live one
                    # are dropped too, not each when its renewal would have been due: so
                    # leases taken and released at a high rate wake the keeper about
                    # twice per ttl / 3, not once per lease. (After a wake-up by a new
                    # hold, they stay: that hold is often released by now, and dropping
                    # it would make the next new hold wake the keeper again.)
                    while self.due and (self.due[0][0] <= now
                                        or (timed_out and self.due[0][3].over)):
                        _, _, lease, hold, deadline = heapq.heappop(self.due)
                        if deadline:
                            self._expire(lease, hold, now)
                        elif not hold.over:
                            tg.start_soon(self._renew, lease, hold)
                    self.next = self.due[0][0] if self.due else math.inf
                    self.wake = anyio.Event()
                    # (a hold queued: at most RESUME_CHECK, so that one lost while the
                    # machine was suspended is found soon after it resumes)
                    nap = self.next - now if not self.due else min(self.next - now,
                                                                   RESUME_CHECK)
                    with anyio.move_on_after(nap) as sleep:
                        await self.wake.wait()
                    timed_out = sleep.cancelled_caught
        except Exception:  # pragma: no cover - the renewals catch their own errors
            logger.exception("the lease keeper failed; leases held on this loop are lost")
        finally:
            if self.loops.get(loop) is self:
                del self.loops[loop]
            # Cancelled (its loop shutting down, a task cancelling every other) or failed:
            # nothing renews these holds any more, so they are lost, not silently held.
            live = [*((lease, hold) for _, _, lease, hold, _ in self.due),
                    *((lease, hold) for hold, lease in self.renewing.items())]
            for lease, hold in live:
                if not hold.over:
                    hold.orphaned = True
                    lease._mark_lost(hold, _ENDED)
