"""Test hooks into a running scheduler, for tests of the engine and of third-party backends.

A scheduler claims a run when its slot is due, and a test rarely wants to wait for a
clock: :func:`claim_now` claims one run at once, as the scheduler does when the slot is
due. The other hooks read what no public property shows: the runs a stopping instance has
yet to hand over, whether the event subscribers' streams are released, how many users
hold a backend open, and :func:`close_backend` releases every one of them (a fixture's
teardown).

For what the public API shows, use it: :attr:`Scheduler.running
<lease_core.Scheduler.running>`, :attr:`~lease_core.Scheduler.watching`,
:meth:`~lease_core.Scheduler.health`, :meth:`~lease_core.Scheduler.history`, events through
:meth:`~lease_core.Scheduler.subscribe`, and the backend's own ``runs()`` and ``check()``.

These hooks are for tests, not applications. They rest on the engine's internals, each
read through one small function at the top of this module (the only code of anarchon's
test suite that touches a scheduler's private attributes), so that a change of the engine
is followed here, in one place, and tests written against the hooks keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lease_core._structures import ClaimResult, Lease, Reason

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal

    from lease_core.abc import Backend
    from lease_core.scheduler import Job, Scheduler
    from lease_core.sync import SyncScheduler

__all__ = [
    "awaiting_hand_over",
    "backend_users",
    "claim_now",
    "claim_now_sync",
    "close_backend",
    "open_event_streams",
    "renew_membership",
    "subscriber_count",
]

# ------------------------------------------------------------------ the engine's internals
# Every private attribute the hooks use, one function each. When the engine changes,
# these are the lines to remap.


async def _engine_claim(s: Scheduler, job: Job, slot: int, reason: Reason) -> ClaimResult | None:
    session = s._session
    return None if session is None else await session.claims.claim(job, slot, reason)


def _engine_to_hand_over(s: Scheduler) -> list[Lease]:
    return [] if s._session is None else s._session.runs.awaiting_hand_over()


async def _engine_renew_membership(s: Scheduler) -> tuple[str, ...] | None:
    session = s._session
    if session is None:
        return None
    await session.fleet.renew()
    return session.fleet.members


def _engine_subscribers(s: Scheduler) -> int:
    return s._bus.subscriber_count


def _engine_receivers(s: Scheduler) -> int:
    return s._bus.open_streams


def _backend_users(backend: Backend) -> int:
    return backend._users


async def _backend_close(backend: Backend) -> None:
    await backend._close()


def _sync_portal(s: SyncScheduler) -> BlockingPortal | None:
    return s._portal


# ------------------------------------------------------------------ hooks


def _declared_job(scheduler: Scheduler, job: str | Job) -> Job:
    jobs = scheduler.jobs
    if not isinstance(job, str):
        if jobs.get(job.name) is not job:
            raise ValueError(f"job {job.name!r} is not declared on scheduler "
                             f"{scheduler.instance_id!r}")
        return job
    if job in jobs:
        return jobs[job]
    workflows = scheduler.workflows
    if job in workflows:
        return workflows[job].jobs[0]
    raise ValueError(f"scheduler {scheduler.instance_id!r} declares no job or workflow "
                     f"{job!r}; it declares {sorted(jobs)}")


async def claim_now(scheduler: Scheduler, job: str | Job, slot: int,
                    reason: Reason | str = Reason.SCHEDULED) -> ClaimResult | None:
    """Claim the run (``job``, ``slot``) now, as ``scheduler`` does when the slot is due.

    ``job`` is a :class:`~lease_core.Job` declared on ``scheduler``, or its name; a
    workflow's name claims its first step, which starts the workflow run. ``slot`` is in
    epoch milliseconds, any slot (not only the current one); ``reason`` is what the claim
    says about itself (the store's answer tells why a won attempt runs: ``scheduled``,
    ``takeover``, ``hand-over``).

    The claim goes the way of the scheduler's own: batched with the claims of the same
    instant, settled, and reported through the events. When it is won, the handler starts
    in the scheduler's task group (this returns without waiting for it); when another
    instance holds the run, this one backs it up (:attr:`Scheduler.watching
    <lease_core.Scheduler.watching>`). Returns the store's answer, or ``None`` when the
    scheduler is not running or is stopping (nothing is claimed), or when the answer is
    unknown (a store error, or too slow: the scheduler retries the claim at its next
    heartbeat). Raises :class:`ValueError` for a job ``scheduler`` does not declare.
    """
    return await _engine_claim(scheduler, _declared_job(scheduler, job), slot, Reason(reason))


def claim_now_sync(scheduler: SyncScheduler, job: str | Job, slot: int,
                   reason: Reason | str = Reason.SCHEDULED) -> ClaimResult | None:
    """:func:`claim_now` on a running :class:`~lease_core.SyncScheduler`, from a thread
    other than its event loop's (the one that started it, say); blocks until settled.

    Raises :class:`RuntimeError` when the scheduler is not running.
    """
    portal = _sync_portal(scheduler)
    if portal is None:
        raise RuntimeError(f"SyncScheduler {scheduler.instance_id!r} is not running; "
                           "start it first")
    return portal.call(claim_now, scheduler.scheduler, job, slot, Reason(reason))


def awaiting_hand_over(scheduler: Scheduler) -> list[Lease]:
    """The leases of the runs ``scheduler`` won but must hand over unrun.

    A claim answered once the scheduler is stopping (it was in flight when :meth:`stop
    <lease_core.Scheduler.stop>` began) is won in the store, but its handler never
    starts: :meth:`~lease_core.Scheduler.stop` hands the run over with the runs still
    held. Empty once the scheduler is stopped.
    """
    return _engine_to_hand_over(scheduler)


async def renew_membership(scheduler: Scheduler) -> tuple[str, ...] | None:
    """Renew ``scheduler``'s fleet membership now, as its tick does every half lease, and
    return the live members it then knows (sorted; ``None``: its backend keeps no
    membership, or the scheduler is not running).

    So a test of the fleet need not wait for the next renewal to see a member join or
    leave; :attr:`Health.fleet_size <lease_core.Health.fleet_size>` shows the same count.
    """
    return await _engine_renew_membership(scheduler)


def subscriber_count(scheduler: Scheduler) -> int:
    """How many callbacks are subscribed to ``scheduler``'s events (unsubscribed ones
    are gone at once)."""
    return _engine_subscribers(scheduler)


def open_event_streams(scheduler: Scheduler) -> int:
    """How many event streams ``scheduler`` holds open: one per subscriber while it runs.

    An unsubscribed callback's stream is released once its delivery task has seen it
    closed; every stream is released when the scheduler stops.
    """
    return _engine_receivers(scheduler)


def backend_users(backend: Backend) -> int:
    """How many :meth:`~lease_core.abc.Backend.start` calls ``backend`` counts that no
    :meth:`~lease_core.abc.Backend.close` has released yet (0: closed)."""
    return _backend_users(backend)


async def close_backend(backend: Backend) -> None:
    """Release every user of ``backend``, then close what it opened itself.

    For a fixture's teardown, whatever the test left open: ``close()`` until no user
    is left, then the backend's own closing (a no-op for a backend already closed).
    """
    while _backend_users(backend):
        await backend.close()
    await _backend_close(backend)
