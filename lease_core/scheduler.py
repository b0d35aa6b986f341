"""The scheduler: the public facade over the engine in :mod:`lease_core.engine`.

:class:`Scheduler` declares jobs and workflows, owns the lifecycle (start, run, stop,
abort), and answers questions (state, health, history, recovery logs). Everything a
running scheduler does happens in the engine's components, wired together by one
:class:`~lease_core.engine.session.Session` per start.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
from anyio.abc import TaskStatus

from . import events as ev
from ._checks import check_history_query
from ._durations import Duration, parse_duration, to_ms
from ._structures import Attempt
from .abc import Backend
from .engine.base import (
    CATCH_UP_LIMIT,
    CATCH_UP_WINDOW_MS,
    EVENT_BUFFER,
    INSIDE,
    PRUNE_BATCH,
    PRUNE_JOBS,
    Carry,
    SchedulerState,
    Settings,
    check_clock,
    check_options,
    timer_slack_ms,
)
from .engine.bus import EventBus
from .engine.jobs import Handler, Job, JobRegistry
from .engine.session import Session
from .errors import AnarchonError, ConfigurationError
from .operations import Admin
from .recovery import RecoveryEntry, read_recovery_log
from .schedules import CronSchedule, IntervalSchedule

if TYPE_CHECKING:
    from .retry import RetryOption
    from .workflows import Workflow

__all__ = [
    "CATCH_UP_LIMIT",
    "CATCH_UP_WINDOW_MS",
    "EVENT_BUFFER",
    "PRUNE_BATCH",
    "PRUNE_JOBS",
    "Health",
    "Job",
    "Scheduler",
    "SchedulerState",
]

H = TypeVar("H", bound=Handler)

#: The scheduler whose handler or subscriber task this is (see :mod:`lease_core.sync`).
_INSIDE = INSIDE


@dataclass(frozen=True, slots=True)
class Health:
    """What :meth:`Scheduler.health` reports, for liveness and readiness probes."""

    state: SchedulerState
    store_reachable: bool
    """True when the store answered within the last ``lease`` (the scheduler's default).
    After a write failed, only an accepted write counts as an answer: a store that
    answers reads but refuses writes (a standby, a full disk, Redis short of memory or
    of replicas) runs no slot, so it is not reachable here."""
    since_store_answer: float | None
    """Seconds since the store last answered (after a failed write: since it last
    accepted one), or ``None`` when it has not since start."""
    runs_held: int
    """Runs this instance is executing."""
    runs_watched: int
    """Runs this instance backs up (or must claim again)."""
    fleet_size: int | None = None
    """The live instances this one knows that declare the same jobs, itself included
    (``None``: unknown, the backend keeps no membership, or this instance left the
    fleet: it stops or stopped)."""

    @property
    def ready(self) -> bool:
        """True when the scheduler is running and its store answers."""
        return self.state is SchedulerState.RUNNING and self.store_reachable


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Scheduler:
    """Runs each scheduled slot of each job once across every instance sharing ``backend``.

    For every slot, the first instance whose claim succeeds runs the handler; the others
    watch the run and take it over when its lease expires (reason ``takeover``) or when
    the holder hands it over on :meth:`stop` (reason ``hand-over``). Where the backend
    keeps a membership, the live instances are ranked per job (rendezvous hashing): the
    first claims each slot, the next ones only if it is still unclaimed a check interval
    later, so a slot costs about one claim whatever the fleet's size. ``max_running``
    caps the handlers this instance runs at once (at that number it claims nothing new;
    the next-ranked instance takes the slot). Slots due within ``timer_slack`` of each
    other share a wake-up, claim and finish (never early; ``0``: each at its instant).

    ``lease`` is the default lease of every job; heartbeats renew held leases every
    ``heartbeat``, and each instance checks the runs it backs up at the same interval. The
    lease must be at least three heartbeats long.

    History is trimmed in a task of its own, never on the claim path: every
    ``prune_every`` (``None``: never; run ``anarchon prune --keep N`` instead) one instance of the
    fleet, the one whose :meth:`Backend.maintenance_due
    <lease_core.abc.Backend.maintenance_due>` wins the period, trims every job in the store,
    declared or not, to its newest ``history_size`` attempts (and any still running) and
    drops attempts finished more than ``history_ttl`` ago, :data:`PRUNE_JOBS` jobs per
    :meth:`~lease_core.abc.Backend.prune_many` call and at most :data:`PRUNE_BATCH`
    attempts of each kind per job and call, for at most half the period (the next period
    goes on where it stopped). It reports
    :class:`~lease_core.events.HistoryTrimmed`. ``clock`` is the local monotonic clock in
    seconds (injectable for tests); lease arithmetic always uses the store's clock, and the
    scheduler estimates its offset to it, so a skewed local clock shifts nothing.

    .. note:: The scheduler calls ``backend.start()`` and ``backend.close()``; a backend
       closes only what it opened itself, never a pool or client the user passed in.

    Run it with ``async with scheduler:``, with :meth:`start` and :meth:`stop` (any number of
    schedulers, in any order, from any task of one event loop), or with
    ``await tg.start(scheduler.run)`` in a task group of your own. Its lifecycle is
    :attr:`state`. Cancellation from outside (of the ``async with`` body, or of the task
    group running :meth:`run`) and :meth:`abort` behave like a crash: nothing is handed over.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        instance_id: str | None = None,
        lease: Duration = "30s",
        heartbeat: Duration = "5s",
        history_size: int = 100,
        history_ttl: Duration | None = None,
        clock: Callable[[], float] | None = None,
        prune_every: Duration | None = "60s",
        max_running: int | None = None,
        timer_slack: Duration = "50ms",
    ) -> None:
        check_options(backend, instance_id, history_size, max_running)
        self.instance_id: str = instance_id or _default_instance_id()
        self.heartbeat: float = parse_duration(heartbeat, what="heartbeat")
        self.lease: float = parse_duration(lease, what="lease")
        self._registry = JobRegistry(heartbeat=self.heartbeat, lease=self.lease,
                                     is_open=lambda: self.state is SchedulerState.STOPPED)
        self._registry.check_lease(self.lease, "lease", lease)
        self.history_size = history_size
        self.history_ttl_ms = None if history_ttl is None else to_ms(
            parse_duration(history_ttl, what="history_ttl"))
        self.prune_every: float | None = (
            None if prune_every is None else parse_duration(prune_every, what="prune_every")
        )
        """Seconds between the fleet's history trimmings, or ``None`` for none."""
        check_clock(clock)
        self._clock = clock or time.monotonic
        self._settings = Settings(
            backend, self.instance_id, self.heartbeat, self.lease, history_size,
            self.history_ttl_ms, self.prune_every, self._clock, self, max_running,
            timer_slack_ms(timer_slack, heartbeat=(self.heartbeat, heartbeat)))
        self._bus = EventBus(self)
        self._carry = Carry()
        self._session: Session | None = None
        """The current or last run of the scheduler (None before the first start)."""

    @property
    def backend(self) -> Backend:
        """The store this scheduler claims runs in."""
        return self._settings.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._settings.backend = backend

    # ----------------------------------------------------------------- declaring jobs

    @overload
    def every(
        self, name: str, interval: Duration, handler: None = None, *,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ...,
        offset: Duration | None = ..., retry: RetryOption = ...,
    ) -> Callable[[H], H]: ...

    @overload
    def every(
        self, name: str, interval: Duration, handler: H, *,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ...,
        offset: Duration | None = ..., retry: RetryOption = ...,
    ) -> H: ...

    def every(
        self, name: str, interval: Duration, handler: H | None = None, *,
        timeout: Duration | None = None, overlap: str = "skip", catch_up: str = "latest",
        max_attempts: int | None = None, lease: Duration | None = None,
        offset: Duration | None = None, retry: RetryOption = None,
    ) -> Any:
        """Declare a job that runs every ``interval``; slots are aligned to the epoch.

        ``offset`` shifts the slots (e.g. ``every("x", "1h", offset="5m")`` runs at :05).
        ``retry`` (a number of retries or a :class:`~lease_core.Retry`) retries a failure
        within its run. Without ``handler`` this returns a decorator.
        """
        schedule = IntervalSchedule(interval, offset or 0)
        return self._registry.declare(name, schedule, handler, timeout, overlap, catch_up,
                                      max_attempts, lease, retry)

    @overload
    def cron(
        self, name: str, expression: str, handler: None = None, *, tz: str = ...,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ..., retry: RetryOption = ...,
    ) -> Callable[[H], H]: ...

    @overload
    def cron(
        self, name: str, expression: str, handler: H, *, tz: str = ...,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ..., retry: RetryOption = ...,
    ) -> H: ...

    def cron(
        self, name: str, expression: str, handler: H | None = None, *, tz: str = "UTC",
        timeout: Duration | None = None, overlap: str = "skip", catch_up: str = "latest",
        max_attempts: int | None = None, lease: Duration | None = None, retry: RetryOption = None,
    ) -> Any:
        """Declare a job that runs at the fire times of a cron ``expression`` in ``tz``.

        ``retry`` as for :meth:`every`. Without ``handler`` this returns a decorator.
        """
        schedule = CronSchedule(expression, tz)
        return self._registry.declare(name, schedule, handler, timeout, overlap, catch_up,
                                      max_attempts, lease, retry)

    # ----------------------------------------------------------------- workflows

    def workflow(
        self,
        name: str,
        *,
        every: Duration | None = None,
        cron: str | None = None,
        tz: str = "UTC",
        offset: Duration | None = None,
        max_attempts: int | None = None, retry: RetryOption = None,
        timeout: Duration | None = None,
        lease: Duration | None = None,
        catch_up: str = "latest",
    ) -> Workflow:
        """Declare a workflow that runs ``every`` interval or on a ``cron`` expression.

        Exactly one of ``every`` and ``cron`` is required (``tz`` only with ``cron``,
        ``offset`` with ``every``). ``max_attempts``, ``retry``, ``timeout``, ``lease`` are the
        defaults of its steps; ``catch_up`` applies to workflow runs missed while no
        instance was up, as for jobs. Add steps with :meth:`Workflow.step
        <lease_core.workflows.Workflow.step>`, in order; see :mod:`lease_core.workflows`.
        """
        return self._registry.workflow(
            name, every=every, cron=cron, tz=tz, offset=offset, max_attempts=max_attempts,
            timeout=timeout, lease=lease, catch_up=catch_up, retry=retry)

    @property
    def workflows(self) -> dict[str, Workflow]:
        """The declared workflows, by name."""
        return dict(self._registry.workflows)

    @property
    def jobs(self) -> dict[str, Job]:
        """The declared jobs, by name (a workflow's steps are jobs ``<workflow>/<step>``)."""
        return dict(self._registry.jobs)

    @property
    def running(self) -> list[tuple[str, int]]:
        """The runs (job, slot) this instance is executing now."""
        s = self._session
        return [] if s is None else [run.key for run in s.runs.held()]

    @property
    def watching(self) -> list[tuple[str, int]]:
        """The runs (job, slot) this instance backs up."""
        s = self._session
        return [] if s is None else [run.key for run in s.runs.watched()]

    def health(self) -> Health:
        """Whether the store answered within the last lease, and what this instance holds.

        An idle running instance asks the store once per heartbeat: ``store_reachable``
        turns false within a lease of the store becoming unreachable (or refusing writes:
        :attr:`Health.store_reachable`), true again within a heartbeat of its driver
        reconnecting (a DSN's PostgreSQL pool tries every 2 s at most)."""
        s = self._session
        last = None if s is None else s.clock.last_answer
        since = None if last is None else max(0.0, self._clock() - last)
        state = self.state
        return Health(
            state=state,
            store_reachable=(state is not SchedulerState.STOPPED and since is not None
                             and since <= self.lease),
            since_store_answer=since,
            runs_held=0 if s is None else s.runs.held_count,
            runs_watched=0 if s is None else s.runs.watched_count,
            fleet_size=None if s is None else s.fleet.size,
        )

    @property
    def admin(self) -> Admin:
        """Fleet-wide operations (:class:`~lease_core.Admin`), made as this instance."""
        return Admin(self.backend, by=self.instance_id)

    def store_now_ms(self) -> int:
        """The store's clock as this instance estimates it, in epoch milliseconds."""
        s = self._session
        return int(self._clock() * 1000) if s is None else s.clock.now_ms()

    # ----------------------------------------------------------------- lifecycle

    @property
    def state(self) -> SchedulerState:
        """The scheduler's lifecycle state."""
        return SchedulerState.STOPPED if self._session is None else self._session.state

    def _begin(self) -> Session:
        if self.state is not SchedulerState.STOPPED:
            raise AnarchonError(
                f"scheduler {self.instance_id!r} is already {self.state}; call stop() and "
                "wait for it to return before starting it again"
            )
        self._registry.check_complete()
        previous = self._session
        self._session = Session(
            self._settings, self._registry, self._bus, self._carry,
            offset_ms=0.0 if previous is None else previous.clock.offset_ms)
        return self._session

    async def start(self) -> None:
        """Start the backend, register the jobs, and begin claiming and backing up.

        Returns once the scheduler runs, in a background task of its own on the current
        event loop (a system task on trio), so any number of schedulers can be started and
        stopped in any order, and :meth:`stop` may be awaited from any task of this event
        loop, or through a blocking portal. Raises :class:`AnarchonError` when the scheduler
        is not stopped, and the store's error when it cannot be reached.

        A scheduler started this way ends like a crashed instance (nothing handed over,
        backups take over when the leases expire) when :meth:`abort` is awaited, or when
        its event loop ends without :meth:`stop`.
        """
        status = self._begin().spawn()
        try:
            await status.event.wait()
        except BaseException:
            # Cancelled while starting: nothing may keep running behind the caller's back.
            await self.abort()
            raise
        if status.error is not None:
            raise status.error
        if not status.is_started:
            raise AnarchonError(
                f"scheduler {self.instance_id!r} was cancelled while starting: its event "
                "loop is closing"
            )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the scheduler in the calling task until :meth:`stop` returns.

        For code that owns a task group: ``await tg.start(scheduler.run)`` returns once the
        scheduler runs. Cancelling the task group (or any scope around ``run()``) behaves
        like a crash: nothing is handed over or finished, and backups take the held runs
        over when their leases expire.
        """
        await self._begin().run(task_status)

    # ----------------------------------------------------------------- events

    def subscribe(self, callback: Callable[[ev.Event], Any]) -> Callable[[], None]:
        """Call ``callback`` with every event (see :mod:`lease_core.events`); return a
        function that unsubscribes it.

        ``callback`` may be a coroutine function (awaited in a task of the scheduler) or
        a plain function (called in a worker thread). Each gets the events in order
        through its own buffer of :data:`EVENT_BUFFER` events (4 per job when more: a
        burst of every job fits): a slow subscriber never delays heartbeats or claims;
        when its buffer is full, newer events are dropped and counted
        (:attr:`events_dropped`). A callback's exception is logged, and it stays
        subscribed. Call it before or after :meth:`start`, from the event loop's thread.
        """
        return self._bus.subscribe(callback)

    @property
    def events_dropped(self) -> int:
        """Events dropped because a subscriber's buffer was full (since creation)."""
        return self._bus.dropped

    async def stop(self, grace: Duration = "10s") -> None:
        """Stop claiming, let handlers finish for ``grace``, hand over the rest.

        Running handlers see :attr:`RunContext.stopping` at once and are cancelled when
        ``grace`` ends (a later, shorter ``grace`` shortens it). Every run still held is
        handed over: a backup claims it at its next check, before its lease expires.
        Heartbeats stop last; buffered events are delivered for at most ``max(1s,
        heartbeat)`` more. Returns once stopped, the store closed; a no-op when stopped.

        May be awaited from any task of the event loop the scheduler runs on (called by
        one of the scheduler's own handlers or event subscribers, it only requests the
        stop). If the caller is cancelled while waiting, the scheduler is aborted (see
        :meth:`abort`). When a scheduler started with :meth:`start` had ended unexpectedly
        (a bug, logged when it happened), ``stop()`` raises :class:`AnarchonError` from
        its cause.
        """
        grace_s = parse_duration(grace, what="grace", allow_zero=True)
        session = self._session
        if session is None or session.state is SchedulerState.STOPPED:
            failure = None if session is None else session.take_failure()
            if failure is not None:
                raise AnarchonError(
                    f"scheduler {self.instance_id!r} had ended unexpectedly: {failure!r}"
                ) from failure
            return
        session.request_stop(grace_s)
        if INSIDE.get() is self:
            return
        try:
            await session.done.wait()
        except BaseException:
            await self.abort()
            raise

    async def abort(self) -> None:
        """Stop at once, as a crashed instance would; return when the store is closed.

        Handlers are cancelled, nothing is finished or handed over (buffered events are
        dropped): backups take the held runs over when their leases expire. A no-op when
        the scheduler is stopped."""
        session = self._session
        if session is None or session.state is SchedulerState.STOPPED:
            return
        session.abort()
        if INSIDE.get() is self:
            return
        with anyio.CancelScope(shield=True):
            await session.done.wait()

    async def __aenter__(self) -> Scheduler:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and issubclass(exc_type, anyio.get_cancelled_exc_class()):
            # Cancelled from outside: behave like a crash (no hand-over, no finish), so
            # backups take over when the leases expire.
            await self.abort()
        else:
            await self.stop()

    async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return the recorded attempts, newest first, of ``job`` or of every job."""
        check_history_query(job, limit)
        await self.backend.start()
        try:
            return await self.backend.history(job, limit)
        finally:
            await self.backend.close()

    async def recovery_log(self, run: str | tuple[str, int | str]) -> list[RecoveryEntry]:
        """Return the recovery log of one run, oldest entry first.

        ``run`` is ``"<name>@<slot>"`` or ``(name, slot)``, the slot in epoch ms or
        ISO-8601 UTC. A workflow's log gathers the attempts of every step at that slot.
        A run without attempts gives ``[]``; a malformed ``run`` raises
        :class:`ConfigurationError`. See :mod:`lease_core.recovery`.
        """
        name, slot = parse_run_id(run)
        await self.backend.start()
        try:
            workflow = self._registry.workflows.get(name)
            return await read_recovery_log(
                self.backend, name, slot, limit=max(self.history_size, 100) * 10,
                steps=None if workflow is None else workflow.steps)
        finally:
            await self.backend.close()


def parse_run_id(run: str | tuple[str, int | str]) -> tuple[str, int]:
    """Split a run id, ``"<name>@<slot>"`` or ``(name, slot)``, into (name, slot in ms).

    The slot is epoch milliseconds or an ISO-8601 time (UTC unless it names an offset);
    anything else raises :class:`ConfigurationError`.
    """
    from ._status import parse_run_id as parse_text

    if isinstance(run, str):
        return parse_text(run)
    if isinstance(run, tuple) and len(run) == 2 and isinstance(run[0], str):
        name, slot = run
        if isinstance(slot, int) and not isinstance(slot, bool) and run[0]:
            return name, slot
        return parse_text(f"{name}@{slot}")
    raise ConfigurationError(
        f"run id {run!r} is malformed; use '<name>@<slot>' (slot in epoch milliseconds "
        "or ISO-8601 UTC) or a (name, slot) tuple")


def run_sync(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run an async callable to completion on a fresh event loop (for the CLI)."""
    return anyio.run(fn)
