"""The scheduler: declares jobs, claims their slots, runs handlers, backs up other instances."""

from __future__ import annotations

import contextlib
import heapq
import inspect
import itertools
import logging
import math
import os
import re
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio
import anyio.to_thread
import sniffio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import events as ev
from ._batch import Abandoned, ClaimBatcher, FinishBatcher
from ._durations import Duration, parse_duration, to_ms
from ._outcome import Interruption, decide_outcome
from ._structures import (
    Attempt,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    JobInfo,
    Lease,
    Outcome,
    Reason,
    RunStatus,
    format_slot,
)
from .abc import Backend
from .context import RunContext
from .errors import AnarchonError, ConfigurationError
from .recovery import RecoveryEntry, recovery_log, step_job
from .schedules import CronSchedule, IntervalSchedule, Schedule

if TYPE_CHECKING:
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

logger = logging.getLogger("anarchon")

Handler = Callable[[RunContext], Any]
H = TypeVar("H", bound=Handler)

#: Events a subscriber may fall behind by; later ones are dropped (and counted).
EVENT_BUFFER = 1000
#: Worker threads for sync handlers (beyond them, handlers wait to start). They are not
#: anyio's default threads, which the store's blocking drivers use for heartbeats.
HANDLER_THREADS = 256
#: Worker threads for sync event subscribers, all of a scheduler's together.
SUBSCRIBER_THREADS = 8
#: Catch-up never looks further back than this (milliseconds).
CATCH_UP_WINDOW_MS = 24 * 3_600_000
#: ``catch_up="all"`` runs at most this many missed slots per job.
CATCH_UP_LIMIT = 100
#: The most attempts of each kind (beyond ``history_size``, past ``history_ttl``) the
#: scheduler deletes per job and call when it trims history.
PRUNE_BATCH = 500
#: The most jobs one call of :meth:`Backend.prune_many` trims when the scheduler trims
#: history (one statement on PostgreSQL, one round trip on Redis).
PRUNE_JOBS = 100

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,199}$")
_OVERLAP = ("skip", "allow")
_CATCH_UP = ("latest", "all", "none")


class SchedulerState(StrEnum):
    """Where a scheduler is in its lifecycle."""

    STOPPED = "stopped"
    """Not started, or stopped: jobs may be declared, :meth:`Scheduler.start` may be called."""
    STARTING = "starting"
    """Opening the store and registering the jobs."""
    RUNNING = "running"
    """Claiming slots, running handlers, renewing leases and backing up other instances."""
    STOPPING = "stopping"
    """No new claims; handlers finish or are cancelled, held runs are handed over."""


@dataclass(frozen=True, slots=True)
class Health:
    """What :meth:`Scheduler.health` reports, for liveness and readiness probes."""

    state: SchedulerState
    store_reachable: bool
    """True when the store answered within the last ``lease`` (the scheduler's default)."""
    since_store_answer: float | None
    """Seconds since the store last answered, or ``None`` when it has not since start."""
    runs_held: int
    """Runs this instance is executing."""
    runs_watched: int
    """Runs this instance backs up (or must claim again)."""

    @property
    def ready(self) -> bool:
        """True when the scheduler is running and its store answers."""
        return self.state is SchedulerState.RUNNING and self.store_reachable


# Set inside the scheduler's handler tasks, so stop() called by a handler does not wait
# for itself.
_INSIDE: ContextVar[Scheduler | None] = ContextVar("anarchon_scheduler", default=None)


class _StartStatus:
    """The task status :meth:`Scheduler.start` gives :meth:`Scheduler.run` in its host task."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.is_started = False
        self.error: BaseException | None = None

    def started(self, value: None = None) -> None:
        self.is_started = True
        self.event.set()


@dataclass(frozen=True)
class Job:
    """A declared job: its schedule, handler and options."""

    name: str
    schedule: Schedule
    handler: Handler
    timeout: float | None
    overlap: Literal["skip", "allow"]
    catch_up: Literal["latest", "all", "none"]
    max_attempts: int | None
    lease_ms: int
    is_async: bool
    workflow: Workflow | None = field(default=None, compare=False, repr=False)
    """For a workflow step's job (``<workflow>/<step>``): its workflow."""
    step: str | None = None
    """For a workflow step's job: the step's name."""

    @property
    def next_step(self) -> Job | None:
        """The job of the workflow step after this one, if any."""
        return None if self.workflow is None else self.workflow.next_job(self)

    @property
    def scheduled(self) -> bool:
        """True when the job's own schedule claims its slots (all but later steps)."""
        return self.workflow is None or self.workflow.jobs[0] is self


@dataclass
class _Held:
    """A run this instance holds and is executing."""

    job: Job
    lease: Lease
    ctx: RunContext
    scope: anyio.CancelScope
    cancel_reason: Interruption | None = None
    lost: bool = False
    deadline: float = math.inf
    """The local lease deadline; the scope's, except while a fenced transaction is open."""
    in_transaction: bool = False

    def set_deadline(self, deadline: float) -> None:
        self.deadline = deadline
        if not self.in_transaction:
            self.scope.deadline = deadline

    def transaction_hook(self, active: bool) -> None:
        # An open fenced transaction locks the run: no backup can take it over, so the
        # local deadline waits until the transaction ends.
        self.in_transaction = active
        self.scope.deadline = math.inf if active else self.deadline


@dataclass
class _Watched:
    """A run this instance backs up, or a claim it must retry."""

    job: Job
    retry_reason: Reason | None = None


@dataclass(eq=False)
class _Subscriber:
    """A callback subscribed to events, and its stream while the scheduler runs."""

    callback: Callable[[ev.Event], Any]
    is_async: bool
    send: MemoryObjectSendStream[ev.Event] | None = None
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class _AttemptInfo:
    attempt: int
    reason: Reason
    started: float
    """When the claim was sent (anyio clock)."""


@dataclass
class _ClockSamples:
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=8))
    last_sample: float = -math.inf


def _log_failure(what: str, exc: Exception) -> None:
    # Store errors are expected (outages) and logged briefly; anything else is a bug
    # worth a traceback. Neither may end the scheduler's tasks.
    if isinstance(exc, AnarchonError):
        logger.warning("%s failed: %s", what, exc)
    else:
        logger.error("%s failed unexpectedly", what, exc_info=exc)



def _is_async(handler: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - callable objects too
    return call is not None and inspect.iscoroutinefunction(call)


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Scheduler:
    """Runs each scheduled slot of each job once across every instance sharing ``backend``.

    For every slot, the first instance whose claim succeeds runs the handler; the others
    watch the run and take it over when its lease expires (reason ``takeover``) or when
    the holder hands it over on :meth:`stop` (reason ``hand-over``).

    ``lease`` is the default lease of every job; heartbeats renew held leases every
    ``heartbeat``, and each instance checks the runs it backs up at the same interval. The
    lease must be at least three heartbeats long.

    History is trimmed in a task of its own, never on the claim path: every
    ``prune_every`` (``None``: never; run ``anarchon prune`` instead) one instance of the
    fleet, the one whose :meth:`Backend.maintenance_due
    <lease_core.abc.Backend.maintenance_due>` wins the period, trims every job in the store,
    declared or not, to its newest ``history_size`` attempts and drops attempts finished
    more than ``history_ttl`` ago, :data:`PRUNE_JOBS` jobs per
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
    ) -> None:
        if not isinstance(backend, Backend):
            raise ConfigurationError(
                f"backend={backend!r} is not an anarchon backend; pass MemoryBackend(), "
                "PostgresBackend(...), RedisBackend(...) or backend_from_url(url)"
            )
        if instance_id is not None and (
            not isinstance(instance_id, str) or not instance_id.strip()
        ):
            raise ConfigurationError(f"instance_id={instance_id!r} must be a non-empty string")
        if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 1:
            raise ConfigurationError(f"history_size={history_size!r} must be an integer >= 1")
        self.backend = backend
        self.instance_id: str = instance_id or _default_instance_id()
        self.heartbeat: float = parse_duration(heartbeat, what="heartbeat")
        self.lease: float = parse_duration(lease, what="lease")
        self._check_lease(self.lease, "lease", lease)
        self.history_size = history_size
        self.history_ttl_ms = (
            None if history_ttl is None else to_ms(parse_duration(history_ttl, what="history_ttl"))
        )
        self.prune_every: float | None = (
            None if prune_every is None else parse_duration(prune_every, what="prune_every")
        )
        """Seconds between the fleet's history trimmings, or ``None`` for none."""
        self._prune_next: str | None = None
        """The job the next trimming starts with (where the last one's budget ran out)."""
        self._clock = clock or time.monotonic
        self._jobs: dict[str, Job] = {}
        self._workflows: dict[str, Workflow] = {}
        self._held: dict[str, _Held] = {}
        self._watch: dict[tuple[str, int], _Watched] = {}
        # Per job, the end of the store's quarantine last logged (see _claim).
        self._quarantine_logged: dict[str, int | None] = {}
        self._to_hand_over: dict[str, Lease] = {}
        self._clock_samples = _ClockSamples()
        self._offset_ms = 0.0
        self._last_answer: float | None = None
        """When the store last answered (local monotonic clock), for health()."""
        self._store_down_since: float | None = None
        self._subscribers: list[_Subscriber] = []
        self._events_tg: TaskGroup | None = None
        self._events_dropped = 0
        self._receivers: list[MemoryObjectReceiveStream[ev.Event]] = []
        self._failure: BaseException | None = None
        """What ended a scheduler started with :meth:`start` unexpectedly; :meth:`stop`
        raises it."""
        self._handler_threads: anyio.CapacityLimiter | None = None
        self._subscriber_threads: anyio.CapacityLimiter | None = None
        self._attempts: dict[str, _AttemptInfo] = {}
        self._state = SchedulerState.STOPPED
        self._tg: TaskGroup | None = None
        self._claims_in_flight = 0
        self._batcher = ClaimBatcher(backend)
        self._finisher = FinishBatcher(backend)
        self._caught_up: dict[str, int] = {}
        self._grace = 0.0
        self._crashed = False
        self._host_task: object | None = None
        """The asyncio task hosting a scheduler started by start() (kept from the GC)."""
        # Made when a run begins: anyio objects need a running event loop.
        self._loop_scopes: set[anyio.CancelScope] = set()
        # The scheduled jobs' next slots, earliest first: (slot, order, job, last slot
        # dealt with); one task (_wake_due_jobs) wakes the jobs of each instant together.
        self._due: list[tuple[int, int, Job, int]] = []
        self._due_order = itertools.count()
        self._due_added: anyio.Event | None = None
        self._run_scope: anyio.CancelScope | None = None
        self._stop_requested: anyio.Event | None = None
        self._done: anyio.Event | None = None
        self._idle: anyio.Event | None = None
        self._claims_idle: anyio.Event | None = None

    # ----------------------------------------------------------------- declaring jobs

    def _check_lease(self, seconds: float, what: str, given: object) -> None:
        if to_ms(seconds) < 3 * to_ms(self.heartbeat):
            raise ConfigurationError(
                f"{what}={given!r} is shorter than 3 heartbeats ({self.heartbeat:g}s each); "
                f"use a {what} of at least {3 * self.heartbeat:g}s or a shorter heartbeat"
            )

    @overload
    def every(
        self, name: str, interval: Duration, handler: None = None, *,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ...,
        offset: Duration | None = ...,
    ) -> Callable[[H], H]: ...

    @overload
    def every(
        self, name: str, interval: Duration, handler: H, *,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ...,
        offset: Duration | None = ...,
    ) -> H: ...

    def every(
        self,
        name: str,
        interval: Duration,
        handler: H | None = None,
        *,
        timeout: Duration | None = None,
        overlap: str = "skip",
        catch_up: str = "latest",
        max_attempts: int | None = None,
        lease: Duration | None = None,
        offset: Duration | None = None,
    ) -> Any:
        """Declare a job that runs every ``interval``; slots are aligned to the epoch.

        ``offset`` shifts the slots (e.g. ``every("x", "1h", offset="5m")`` runs at :05).
        Without ``handler`` this returns a decorator.
        """
        schedule = IntervalSchedule(interval, offset or 0)
        return self._declare(name, schedule, handler, timeout, overlap, catch_up,
                             max_attempts, lease)

    @overload
    def cron(
        self, name: str, expression: str, handler: None = None, *, tz: str = ...,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ...,
    ) -> Callable[[H], H]: ...

    @overload
    def cron(
        self, name: str, expression: str, handler: H, *, tz: str = ...,
        timeout: Duration | None = ..., overlap: str = ..., catch_up: str = ...,
        max_attempts: int | None = ..., lease: Duration | None = ...,
    ) -> H: ...

    def cron(
        self,
        name: str,
        expression: str,
        handler: H | None = None,
        *,
        tz: str = "UTC",
        timeout: Duration | None = None,
        overlap: str = "skip",
        catch_up: str = "latest",
        max_attempts: int | None = None,
        lease: Duration | None = None,
    ) -> Any:
        """Declare a job that runs at the fire times of a cron ``expression`` in ``tz``.

        Without ``handler`` this returns a decorator.
        """
        schedule = CronSchedule(expression, tz)
        return self._declare(name, schedule, handler, timeout, overlap, catch_up,
                             max_attempts, lease)

    def _declare(
        self,
        name: str,
        schedule: Schedule,
        handler: H | None,
        timeout: Duration | None,
        overlap: str,
        catch_up: str,
        max_attempts: int | None,
        lease: Duration | None,
    ) -> Any:
        if not isinstance(name, str) or not _JOB_NAME.match(name):
            raise ConfigurationError(
                f"job name {name!r} is invalid; use 1-200 characters: letters, digits and "
                "_ - . : / @, starting with a letter or digit"
            )
        if name in self._jobs:
            raise ConfigurationError(f"job {name!r} is already declared; job names must be unique")
        if self._state is not SchedulerState.STOPPED:
            raise ConfigurationError(f"job {name!r} declared after start(); declare jobs first")
        if overlap not in _OVERLAP:
            raise ConfigurationError(f"overlap={overlap!r} is unknown; use one of {_OVERLAP}")
        if catch_up not in _CATCH_UP:
            raise ConfigurationError(f"catch_up={catch_up!r} is unknown; use one of {_CATCH_UP}")
        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
        ):
            raise ConfigurationError(
                f"max_attempts={max_attempts!r} must be an integer >= 1, or None for no limit"
            )
        timeout_s = None if timeout is None else parse_duration(timeout, what="timeout")
        lease_s = self.lease if lease is None else parse_duration(lease, what="lease")
        self._check_lease(lease_s, "lease", lease)

        def register(fn: H) -> H:
            if not callable(fn):
                raise ConfigurationError(f"handler {fn!r} of job {name!r} is not callable")
            if name in self._jobs:
                raise ConfigurationError(f"job {name!r} is already declared")
            self._jobs[name] = Job(
                name, schedule, fn, timeout_s, overlap, catch_up, max_attempts,  # type: ignore[arg-type]
                to_ms(lease_s), _is_async(fn),
            )
            return fn

        if handler is None:
            return register
        return register(handler)

    # ----------------------------------------------------------------- workflows

    def workflow(
        self,
        name: str,
        *,
        every: Duration | None = None,
        cron: str | None = None,
        tz: str = "UTC",
        offset: Duration | None = None,
        max_attempts: int | None = None,
        timeout: Duration | None = None,
        lease: Duration | None = None,
        catch_up: str = "latest",
    ) -> Workflow:
        """Declare a workflow that runs ``every`` interval or on a ``cron`` expression.

        Exactly one of ``every`` and ``cron`` is required (``tz`` applies to ``cron``,
        ``offset`` to ``every``). ``max_attempts``, ``timeout`` and ``lease`` are the
        defaults of its steps; ``catch_up`` applies to workflow runs missed while no
        instance was up, as for jobs. Add steps with :meth:`Workflow.step
        <lease_core.workflows.Workflow.step>`, in order; see :mod:`lease_core.workflows`.
        """
        from .workflows import Workflow, check_name

        check_name("workflow", name)
        self._check_declarable(f"workflow {name!r}")
        if name in self._workflows or any(j.startswith(name + "/") for j in self._jobs):
            raise ConfigurationError(f"workflow {name!r} is already declared; "
                                     "workflow names must be unique")
        if (every is None) == (cron is None):
            raise ConfigurationError(
                f"workflow {name!r}: give exactly one of every=... (an interval) or "
                f"cron=... (an expression); got every={every!r}, cron={cron!r}"
            )
        if offset is not None and every is None:
            raise ConfigurationError(f"workflow {name!r}: offset={offset!r} needs every=...")
        schedule: Schedule = (
            IntervalSchedule(every, offset or 0) if every is not None
            else CronSchedule(cron or "", tz)
        )
        if catch_up not in _CATCH_UP:
            raise ConfigurationError(f"catch_up={catch_up!r} is unknown; use one of {_CATCH_UP}")
        self._check_max_attempts(max_attempts)
        timeout_s = None if timeout is None else parse_duration(timeout, what="timeout")
        if lease is not None:
            self._check_lease(parse_duration(lease, what="lease"), "lease", lease)
        wf = Workflow(self, name, schedule, timeout=timeout_s, max_attempts=max_attempts,
                      lease=lease, catch_up=catch_up)
        self._workflows[name] = wf
        return wf

    def _check_declarable(self, what: str) -> None:
        if self._state is not SchedulerState.STOPPED:
            raise ConfigurationError(f"{what} declared after start(); declare it first")

    def _check_max_attempts(self, max_attempts: object) -> None:
        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
        ):
            raise ConfigurationError(
                f"max_attempts={max_attempts!r} must be an integer >= 1, or None for no limit"
            )

    def _declare_step(
        self,
        workflow: Workflow,
        step: str,
        handler: Handler,
        *,
        timeout: Duration | None,
        max_attempts: int | None,
        lease: Duration | None,
        first: bool,
    ) -> Job:
        name = step_job(workflow.name, step)
        if not callable(handler):
            raise ConfigurationError(f"handler {handler!r} of step {name!r} is not callable")
        if name in self._jobs:
            raise ConfigurationError(f"job {name!r} is already declared; job names must be unique")
        self._check_max_attempts(max_attempts)
        timeout_s = None if timeout is None else parse_duration(timeout, what="timeout")
        lease_s = self.lease if lease is None else parse_duration(lease, what="lease")
        self._check_lease(lease_s, "lease", lease)
        job = Job(
            name, workflow.schedule, handler, timeout_s,
            # One workflow run at a time: a new run is skipped while the first step of an
            # earlier one holds its lease. Later steps are never skipped.
            "skip" if first else "allow",
            workflow.catch_up,  # type: ignore[arg-type]
            max_attempts, to_ms(lease_s), _is_async(handler), workflow=workflow, step=step,
        )
        self._jobs[name] = job
        return job

    @property
    def workflows(self) -> dict[str, Workflow]:
        """The declared workflows, by name."""
        return dict(self._workflows)

    def _check_workflows(self) -> None:
        for wf in self._workflows.values():
            if not wf.steps:
                raise ConfigurationError(
                    f"workflow {wf.name!r} has no steps; add them with @workflow.step(name) "
                    "before start()"
                )

    @property
    def jobs(self) -> dict[str, Job]:
        """The declared jobs, by name (a workflow's steps are jobs ``<workflow>/<step>``)."""
        return dict(self._jobs)

    @property
    def running(self) -> list[tuple[str, int]]:
        """The runs (job, slot) this instance is executing now."""
        return [(h.lease.job, h.lease.slot) for h in self._held.values()]

    @property
    def watching(self) -> list[tuple[str, int]]:
        """The runs (job, slot) this instance backs up."""
        return list(self._watch)

    def health(self) -> Health:
        """Whether the store answered within the last lease, and what this instance holds.

        An idle running instance asks the store once per heartbeat, so ``store_reachable``
        turns false within a lease of the store becoming unreachable, and true again at
        the first heartbeat it answers.
        """
        since = None if self._last_answer is None else max(0.0, self._clock() - self._last_answer)
        return Health(
            state=self._state,
            store_reachable=(self._state is not SchedulerState.STOPPED and since is not None
                             and since <= self.lease),
            since_store_answer=since,
            runs_held=len(self._held),
            runs_watched=len(self._watch),
        )

    # ----------------------------------------------------------------- store clock

    def store_now_ms(self) -> int:
        """The store's clock as this instance estimates it, in epoch milliseconds."""
        return int(self._clock() * 1000 + self._offset_ms)

    def _note_clock(self, store_ms: int, sent: float, received: float) -> None:
        rtt = received - sent
        offset = store_ms - (sent + received) * 500
        s = self._clock_samples
        s.samples.append((rtt, offset))
        s.last_sample = received
        self._last_answer = received
        if self._store_down_since is not None:
            downtime, self._store_down_since = received - self._store_down_since, None
            logger.info("the store answers again after %.1fs", downtime)
            self._emit(ev.StoreBack(instance_id=self.instance_id, downtime=downtime))
        self._offset_ms = min(s.samples)[1]

    async def _sample_clock(self) -> None:
        sent = self._clock()
        now = await self.backend.now_ms()
        self._note_clock(now, sent, self._clock())

    # ----------------------------------------------------------------- lifecycle

    @property
    def state(self) -> SchedulerState:
        """The scheduler's lifecycle state."""
        return self._state

    @property
    def _stopping(self) -> bool:
        # No new claims once a stop (or an abort) began, nor when not running at all.
        return self._state in (SchedulerState.STOPPING, SchedulerState.STOPPED)

    def _begin(self) -> None:
        if self._state is not SchedulerState.STOPPED:
            raise AnarchonError(
                f"scheduler {self.instance_id!r} is already {self._state}; call stop() and "
                "wait for it to return before starting it again"
            )
        self._check_workflows()
        self._state = SchedulerState.STARTING
        self._crashed = False
        self._last_answer = None
        self._grace = 0.0
        self._loop_scopes = set()
        self._due = []
        self._due_added = None
        self._run_scope = anyio.CancelScope()
        self._stop_requested = anyio.Event()
        self._done = anyio.Event()
        self._idle = anyio.Event()
        self._claims_in_flight = 0
        self._batcher = ClaimBatcher(self.backend)
        self._finisher = FinishBatcher(self.backend)
        self._claims_idle = anyio.Event()
        self._caught_up = {}
        self._failure = None
        self._store_down_since = None
        self._clock_samples = _ClockSamples()
        # Sync handlers and subscribers get worker threads of their own, so that however
        # many of them block, the store's blocking drivers keep anyio's default threads.
        self._handler_threads = anyio.CapacityLimiter(HANDLER_THREADS)
        self._subscriber_threads = anyio.CapacityLimiter(SUBSCRIBER_THREADS)

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
        self._begin()
        status = _StartStatus()
        self._spawn_host(status)
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

    def _spawn_host(self, status: _StartStatus) -> None:
        # anyio has no detached tasks; the scheduler's host task must outlive the caller's.
        name = f"anarchon scheduler {self.instance_id}"
        if sniffio.current_async_library() == "trio":
            import trio

            trio.lowlevel.spawn_system_task(self._host, status, name=name)
        else:
            import asyncio

            self._host_task = asyncio.get_running_loop().create_task(
                self._host(status), name=name
            )

    async def _host(self, status: _StartStatus) -> None:
        try:
            await self._run(status)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            # Nothing may escape a host task (on trio it would end the whole event loop).
            if not status.is_started:
                status.error = exc
            else:
                logger.error("scheduler %s ended unexpectedly", self.instance_id, exc_info=exc)
                self._failure = exc
        finally:
            status.event.set()
            self._host_task = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the scheduler in the calling task until :meth:`stop` returns.

        For code that owns a task group: ``await tg.start(scheduler.run)`` returns once the
        scheduler runs. Cancelling the task group (or any scope around ``run()``) behaves
        like a crash: nothing is handed over or finished, and backups take the held runs
        over when their leases expire.
        """
        self._begin()
        await self._run(task_status)

    async def _run(self, task_status: TaskStatus[None]) -> None:
        assert self._run_scope is not None and self._done is not None
        opened = False
        try:
            with self._run_scope:
                infos = await self._open()
                opened = True
                try:
                    async with anyio.create_task_group() as events_tg:
                        self._events_tg = events_tg
                        for sub in self._subscribers:
                            self._open_subscriber(sub)
                        await self._run_jobs(infos, task_status)
                        # Deliver what is left, for a moment at most.
                        self._close_subscribers(senders_only=True)
                        events_tg.cancel_scope.deadline = (
                            anyio.current_time() + max(1.0, self.heartbeat))
                except anyio.get_cancelled_exc_class():
                    # Cancelled from outside (or aborted): behave like a crash.
                    self._crashed = True
                    raise
        finally:
            self._state = SchedulerState.STOPPING
            self._tg = self._events_tg = None
            self._close_subscribers()
            self._held.clear()
            self._watch.clear()
            self._to_hand_over.clear()
            self._attempts.clear()
            try:
                if opened:
                    with anyio.move_on_after(10, shield=True):
                        await self.backend.close()
            finally:
                self._state = SchedulerState.STOPPED
                self._done.set()
                logger.info("instance %s stopped", self.instance_id)

    async def _run_jobs(self, infos: dict[str, JobInfo], task_status: TaskStatus[None]) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for name, job in self._jobs.items():
                info = infos[name]
                for slot in info.open_slots:
                    self._watch[(name, slot)] = _Watched(job)
                if not job.scheduled:
                    pass
                elif not info.new and job.catch_up != "none":
                    tg.start_soon(self._start_job, job, info)
                else:
                    self._schedule_next(job, self.store_now_ms())
            tg.start_soon(self._wake_due_jobs)
            for wf in self._workflows.values():
                tg.start_soon(self._resume_workflow, wf, infos[wf.jobs[0].name])
            tg.start_soon(self._ticker)
            tg.start_soon(self._maintenance)
            if self._state is SchedulerState.STARTING:
                self._state = SchedulerState.RUNNING
            logger.info("instance %s started with %d jobs", self.instance_id, len(self._jobs))
            task_status.started()
            assert self._stop_requested is not None
            await self._stop_requested.wait()
            await self._stop_gracefully()
            tg.cancel_scope.cancel()

    # ----------------------------------------------------------------- events

    def subscribe(self, callback: Callable[[ev.Event], Any]) -> Callable[[], None]:
        """Call ``callback`` with every event (see :mod:`lease_core.events`); return a
        function that unsubscribes it.

        ``callback`` may be a coroutine function (awaited in a task of the scheduler) or
        a plain function (called in a worker thread). Each subscriber gets the events in
        order through its own buffer of :data:`EVENT_BUFFER` events: a slow subscriber
        never delays heartbeats or claims; when its buffer is full, newer events are
        dropped and counted (:attr:`events_dropped`). An exception raised by ``callback``
        is logged, and the subscriber stays subscribed. May be called before or after
        :meth:`start`, from the event loop's thread.
        """
        if not callable(callback):
            raise ConfigurationError(f"subscribe({callback!r}): the callback must be callable")
        sub = _Subscriber(callback, _is_async(callback))
        if self._events_tg is not None:
            self._open_subscriber(sub)  # raises, registering nothing, off the loop's thread
        self._subscribers.append(sub)

        def unsubscribe() -> None:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            if sub.send is not None:
                sub.send.close()

        return unsubscribe

    @property
    def events_dropped(self) -> int:
        """Events dropped because a subscriber's buffer was full (since creation)."""
        return self._events_dropped

    def _open_subscriber(self, sub: _Subscriber) -> None:
        assert self._events_tg is not None
        send, receive = anyio.create_memory_object_stream[ev.Event](EVENT_BUFFER)
        dispatch = self._dispatch(sub, receive)
        try:
            self._events_tg.start_soon(lambda: dispatch)
        except BaseException:
            dispatch.close()
            send.close()
            receive.close()
            raise
        sub.send = send
        self._receivers.append(receive)

    def _close_subscribers(self, *, senders_only: bool = False) -> None:
        for sub in self._subscribers:
            if sub.send is not None:
                sub.send.close()
                sub.send = None
        if not senders_only:
            for receive in self._receivers:
                receive.close()
            self._receivers.clear()

    def _emit(self, event: ev.Event) -> None:
        for sub in self._subscribers:
            if sub.send is None:
                continue
            try:
                sub.send.send_nowait(event)
            except anyio.WouldBlock:
                sub.dropped += 1
                self._events_dropped += 1
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    async def _dispatch(self, sub: _Subscriber,
                        receive: MemoryObjectReceiveStream[ev.Event]) -> None:
        _INSIDE.set(self)  # stop() or abort() from a subscriber only requests it
        try:
            with receive, contextlib.suppress(anyio.ClosedResourceError):
                async for event in receive:
                    try:
                        if sub.is_async:
                            await sub.callback(event)
                        else:
                            await anyio.to_thread.run_sync(sub.callback, event,
                                                           abandon_on_cancel=True,
                                                           limiter=self._subscriber_threads)
                    except Exception as exc:
                        logger.error("event subscriber %r failed on %s", sub.callback,
                                     type(event).__name__, exc_info=exc)
        finally:
            # An unsubscribed callback leaves nothing behind in a long-running scheduler.
            if receive in self._receivers:
                self._receivers.remove(receive)

    async def _open(self) -> dict[str, JobInfo]:
        await self.backend.start()
        try:
            for _ in range(3):
                await self._sample_clock()
            infos = await self.backend.register_jobs(list(self._jobs))
            if self._workflows:
                await self.backend.register_workflows(
                    {name: wf.steps for name, wf in self._workflows.items()})
            return infos
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.backend.close()
            raise

    async def stop(self, grace: Duration = "10s") -> None:
        """Stop claiming, let handlers finish for ``grace``, hand over the rest.

        Running handlers see :attr:`RunContext.stopping` at once and are cancelled when
        ``grace`` ends. Every run still held is handed over, so a backup claims it at its
        next check without waiting for the lease to expire. Heartbeats stop last. Events
        still buffered are delivered for at most ``max(1s, heartbeat)`` more. Returns once
        the scheduler is stopped and the store closed; a no-op when it is stopped.

        May be awaited from any task of the event loop the scheduler runs on (called by
        one of the scheduler's own handlers or event subscribers, it only requests the
        stop). If the caller is cancelled while waiting, the scheduler is aborted (see
        :meth:`abort`). When a scheduler started with :meth:`start` had ended unexpectedly
        (a bug, logged when it happened), ``stop()`` raises :class:`AnarchonError` from
        its cause.
        """
        grace_s = parse_duration(grace, what="grace", allow_zero=True)
        if self._state is SchedulerState.STOPPED:
            failure, self._failure = self._failure, None
            if failure is not None:
                raise AnarchonError(
                    f"scheduler {self.instance_id!r} had ended unexpectedly: {failure!r}"
                ) from failure
            return
        assert self._stop_requested is not None and self._done is not None
        if not self._stop_requested.is_set():
            self._grace = grace_s
            self._stop_requested.set()
        if _INSIDE.get() is self:
            return
        try:
            await self._done.wait()
        except BaseException:
            await self.abort()
            raise

    async def abort(self) -> None:
        """Stop at once, as a crashed instance would; return when the store is closed.

        Handlers are cancelled, nothing is finished or handed over: backups take the held
        runs over when their leases expire. A no-op when the scheduler is stopped.
        """
        if self._state is SchedulerState.STOPPED:
            return
        assert self._run_scope is not None and self._done is not None
        self._crashed = True
        self._state = SchedulerState.STOPPING
        self._run_scope.cancel()
        if _INSIDE.get() is self:
            return
        with anyio.CancelScope(shield=True):
            await self._done.wait()

    async def _stop_gracefully(self) -> None:
        assert self._idle is not None and self._claims_idle is not None
        self._state = SchedulerState.STOPPING
        for scope in list(self._loop_scopes):
            scope.cancel()
        for held in list(self._held.values()):
            held.ctx._request_stop("stopping")
        with anyio.move_on_after(self._grace):
            while self._held:
                self._idle = anyio.Event()
                await self._idle.wait()
        for held in list(self._held.values()):
            held.cancel_reason = Interruption.STOPPED
            held.scope.cancel()
        with anyio.move_on_after(max(self.heartbeat, 1.0)):
            while self._held:
                self._idle = anyio.Event()
                await self._idle.wait()
        with anyio.move_on_after(max(j.lease_ms for j in self._jobs.values()) / 2000
                                 if self._jobs else 0):
            while self._claims_in_flight:
                self._claims_idle = anyio.Event()
                await self._claims_idle.wait()
        leases = list(self._to_hand_over.values()) + [h.lease for h in self._held.values()]
        if leases:
            with anyio.move_on_after(10, shield=True):
                done: frozenset[str] = frozenset()
                try:
                    done = await self.backend.hand_over(leases)
                    logger.info("instance %s handed over %d runs", self.instance_id, len(done))
                except Exception as exc:
                    self._store_failed("hand-over", exc)
            for lease in leases:
                if lease.token in done:
                    self._ended(ev.HandedOver, lease)
                else:
                    self._ended(ev.Lost, lease, why="not handed over")
        self._to_hand_over.clear()

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
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"limit={limit!r} must be an integer >= 1")
        await self.backend.start()
        try:
            return await self.backend.history(job, limit)
        finally:
            await self.backend.close()

    async def recovery_log(self, run: str | tuple[str, int | str]) -> list[RecoveryEntry]:
        """Return the recovery log of one run, oldest entry first.

        ``run`` is ``"<name>@<slot>"`` or ``(name, slot)``, the slot in epoch milliseconds
        or ISO-8601 UTC (``2026-11-30T02:00:00Z``). For a workflow (declared here, or
        recorded in the store), the log gathers the attempts of every step at that slot;
        for a job, the attempts of that run. A run the store has no attempt of (never run,
        or trimmed like history) gives an empty list; a malformed ``run`` raises
        :class:`ConfigurationError`. See :mod:`lease_core.recovery`.
        """
        name, slot = parse_run_id(run)
        await self.backend.start()
        try:
            steps = (self._workflows[name].steps if name in self._workflows
                     else (await self.backend.workflows()).get(name))
            limit = max(self.history_size, 100) * 10
            if steps is None:
                attempts = [a for a in await self.backend.history(name, limit)
                            if a.slot == slot]
                return recovery_log(attempts)
            attempts = []
            for step in steps:
                attempts += [a for a in await self.backend.history(step_job(name, step), limit)
                             if a.slot == slot]
            return recovery_log(attempts, workflow=name, steps=steps)
        finally:
            await self.backend.close()

    # ----------------------------------------------------------------- scheduled jobs

    @contextlib.contextmanager
    def _stoppable(self) -> Iterator[None]:
        # A scope that stop() cancels (a job's catch-up, the dispatcher, the trimming).
        scope = anyio.CancelScope()
        if self._stopping:
            scope.cancel()
        self._loop_scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._loop_scopes.discard(scope)

    def _schedule_next(self, job: Job, last: int) -> None:
        """Queue ``job``'s first slot after ``last`` (store ms) for the dispatcher."""
        if self._stopping:
            return
        slot = job.schedule.next_after(last)
        heapq.heappush(self._due, (slot, next(self._due_order), job, last))
        if self._due_added is not None and self._due[0][0] == slot:
            self._due_added.set()

    async def _start_job(self, job: Job, info: JobInfo) -> None:
        # A job the store knew before this start: its missed slots first (catch-up).
        now = self.store_now_ms()
        with self._stoppable():
            if job.overlap == "skip":
                # Runs left open by stopped or dead instances are taken over first (by
                # the ticker); caught-up slots would only be skipped meanwhile.
                for slot in info.open_slots:
                    await self._wait_run_ended(job.name, slot)
            watermark = max(info.first_seen_ms, info.last_slot or info.first_seen_ms)
            await self._catch_up(job, watermark, now, final_reason=Reason.CATCH_UP)
            self._schedule_next(job, now)

    async def _wake_due_jobs(self) -> None:
        """Wake the jobs due at each instant together, and claim their runs in one go.

        One task for every scheduled job rather than one per job: at an instant when
        thousands of jobs are due, waking a task per job cost more than their claims'
        round trip, and an idle scheduler woke each of them once per heartbeat.
        """
        with self._stoppable():
            while True:
                # Not rounded to the millisecond: every job due at one instant is woken
                # in the same turn, so their claims go in one batch. The wait is at most
                # a heartbeat, so a changed estimate of the store's clock is followed.
                local_now = self._clock() * 1000 + self._offset_ms
                wait = self.heartbeat
                if self._due:
                    wait = min(wait, (self._due[0][0] - local_now) / 1000)
                if wait > 0:
                    self._due_added = anyio.Event()
                    with anyio.move_on_after(wait):
                        await self._due_added.wait()
                    self._due_added = None
                    continue
                now = self.store_now_ms()
                claims: list[tuple[Job, int, int]] = []
                while self._due and self._due[0][0] <= local_now:
                    slot, _, job, _ = heapq.heappop(self._due)
                    due = job.schedule.previous_at_or_before(now) or slot
                    if due > slot:
                        # The job fell behind (a suspended process): its catch-up policy.
                        assert self._tg is not None
                        self._tg.start_soon(self._catch_up_then_next, job, slot, due)
                    else:
                        self._caught_up.pop(job.name, None)
                        claims.append((job, slot, max(due, slot)))
                if claims:
                    assert self._tg is not None
                    self._tg.start_soon(self._claim_due, claims)

    async def _claim_due(self, claims: list[tuple[Job, int, int]]) -> None:
        # A job's next slot is queued once its claim is settled, as a loop per job would.
        await self._claim_many([(job, slot, Reason.SCHEDULED) for job, slot, _ in claims])
        for job, _, last in claims:
            self._schedule_next(job, last)

    async def _catch_up_then_next(self, job: Job, slot: int, due: int) -> None:
        with self._stoppable():
            await self._catch_up(job, slot - 1, due, final_reason=Reason.SCHEDULED)
            self._schedule_next(job, due)

    async def _catch_up(self, job: Job, after: int, until: int, *, final_reason: Reason) -> None:
        limit = CATCH_UP_LIMIT if job.catch_up == "all" else 1
        if job.catch_up == "none":
            limit = 1 if final_reason is Reason.SCHEDULED else 0
        if limit == 0:
            return
        after = max(after, until - CATCH_UP_WINDOW_MS)
        missed = job.schedule.slots_between(after, until, limit)
        on_time = until - self.heartbeat * 1000
        previous = self._caught_up.pop(job.name, None)
        if previous is not None and missed and job.overlap == "skip":
            # The run an earlier catch-up claimed last may still be going.
            await self._wait_run_ended(job.name, previous)
        for i, slot in enumerate(missed):
            last = i == len(missed) - 1
            # A slot that is due right now is simply scheduled, even at start-up.
            reason = final_reason if last else Reason.CATCH_UP
            result = await self._claim(job, slot, Reason.SCHEDULED if slot >= on_time else reason)
            active = result is not None and result.status in (ClaimStatus.WON,
                                                               ClaimStatus.RUNNING)
            if active and job.overlap == "skip":
                if last:
                    self._caught_up[job.name] = slot
                else:
                    # Missed slots of a job that must not overlap run one after another;
                    # claiming the next one now would only record it as skipped.
                    await self._wait_run_ended(job.name, slot)

    async def _wait_run_ended(self, job: str, slot: int) -> None:
        key = (job, slot)
        while not self._stopping:
            await anyio.sleep(self.heartbeat)
            try:
                result = await self.backend.check([key])
            except Exception as exc:
                self._store_failed(f"check of {job} slot {format_slot(slot)}", exc)
                continue
            state = result.runs.get(key)
            if state is None or state.status.finished:
                return

    async def _claim(self, job: Job, slot: int, reason: Reason) -> ClaimResult | None:
        (result,) = await self._claim_many([(job, slot, reason)])
        return result

    async def _claim_many(
        self, claims: Sequence[tuple[Job, int, Reason]]
    ) -> list[ClaimResult | None]:
        # The claims go to the store with every other claim this instance makes at the
        # same instant, in one claim_many call (see lease_core._batch); each is then
        # settled as if it had been made alone.
        if not claims:
            return []
        if self._stopping or self._tg is None:
            return [None] * len(claims)
        requests = [
            ClaimRequest(
                job.name, slot, self.instance_id, os.urandom(16).hex(), job.lease_ms, reason,
                job.overlap == "skip", job.max_attempts, self.history_size,
                self.history_ttl_ms,
            )
            for job, slot, reason in claims
        ]
        sent = self._clock()
        sent_loop = anyio.current_time()
        answers: list[ClaimResult | Exception] | None = None
        # Shielded: a claim cancelled mid-flight could win in the store without the
        # instance knowing, leaving the run unattended until its lease expires. stop()
        # waits for claims in flight before it hands over.
        self._claims_in_flight += 1
        try:
            with anyio.move_on_after(min(job.lease_ms for job, _, _ in claims) / 2000,
                                     shield=True):
                answers = await self._batcher.claim_many(requests)
        finally:
            self._claims_in_flight -= 1
            if not self._claims_in_flight and self._claims_idle is not None:
                self._claims_idle.set()
        received = self._clock()
        answered = next((a for a in answers or () if isinstance(a, ClaimResult)), None)
        if answered is not None:
            self._note_clock(answered.now_ms, sent, received)
        results: list[ClaimResult | None] = []
        for i, (job, slot, reason) in enumerate(claims):
            answer = None if answers is None else answers[i]
            if isinstance(answer, Exception):
                if not isinstance(answer, Abandoned):
                    self._store_failed(
                        f"claim of {job.name} slot {format_slot(slot)} (will retry)", answer)
                answer = None
            results.append(await self._settle(job, slot, reason, requests[i].token, answer,
                                              received - sent, sent_loop))
        return results

    async def _settle(self, job: Job, slot: int, reason: Reason, token: str,
                      result: ClaimResult | None, took: float,
                      sent_loop: float) -> ClaimResult | None:
        if result is None:
            # Unknown outcome (error or too slow): retry, or take it over if it was won.
            self._watch[(job.name, slot)] = _Watched(job, retry_reason=reason)
            return None
        key = (job.name, slot)
        lease = Lease(job.name, slot, token, job.lease_ms)
        # Events are made only for subscribers: in a burst, thousands of claims are settled
        # in one go, and every object made costs the garbage collector too.
        events = bool(self._subscribers)
        run: dict[str, Any] = {"instance_id": self.instance_id, "job": job.name, "slot": slot}
        if result.status is ClaimStatus.WON:
            won = result.reason or Reason.SCHEDULED
            self._attempts[token] = _AttemptInfo(result.attempt, won, sent_loop)
            if events:
                self._emit(ev.Claimed(**run, attempt=result.attempt, reason=won,
                                      claim_duration=took))
            if events and won in (Reason.TAKEOVER, Reason.HAND_OVER):
                self._emit(ev.TakenOver(**run, attempt=result.attempt, reason=won))
        if result.status is ClaimStatus.WON and (self._stopping or self._tg is None):
            self._to_hand_over[token] = lease
        elif result.status is ClaimStatus.WON:
            self._watch.pop(key, None)
            self._launch(job, lease, result, sent_loop)
        elif result.status is ClaimStatus.RUNNING and result.run_status is None:
            # No run: the store is in quarantine after losing its data; claim again at
            # the next tick (the claim writes nothing until the quarantine ends).
            self._watch[key] = _Watched(job, retry_reason=reason)
            if self._quarantine_logged.get(job.name) != result.expires_ms:
                self._quarantine_logged[job.name] = result.expires_ms
                logger.warning(
                    "%s slot %s: the store lost its data; no new attempt before store time "
                    "%s, when every lease it may have held has expired", job.name,
                    format_slot(slot), result.expires_ms)
        elif result.status is ClaimStatus.RUNNING:
            self._watch[key] = _Watched(job)
            if events:
                self._emit(ev.StandingBy(**run, holder=result.instance_id, claim_duration=took))
        else:
            self._watch.pop(key, None)
            if result.status is ClaimStatus.SKIPPED:
                logger.info("%s slot %s skipped: an earlier run still holds its lease",
                            job.name, format_slot(slot))
                self._emit(ev.Skipped(**run, reason=reason, claim_duration=took))
            elif result.status is ClaimStatus.ESCALATED:
                logger.error("%s slot %s escalated after %d attempts", job.name,
                             format_slot(slot), result.attempt)
                self._emit(ev.Escalated(**run, attempt=result.attempt, reason=reason,
                                        claim_duration=took))
            next_step = job.next_step
            if (result.status is ClaimStatus.FINISHED and next_step is not None
                    and result.run_status is RunStatus.COMPLETED and self._tg is not None):
                # The step completed before this instance saw it run: back up its
                # successor, in a task of its own: the claims settled after this one (a
                # whole instant's, in a burst) must not wait for that round trip.
                self._tg.start_soon(self._claim, next_step, slot, Reason.SCHEDULED)
        return result

    # ----------------------------------------------------------------- running handlers

    def _launch(self, job: Job, lease: Lease, result: ClaimResult, sent_loop: float) -> None:
        assert self._tg is not None
        reason = result.reason or Reason.SCHEDULED
        ctx = RunContext(
            backend=self.backend, lease=lease, attempt=result.attempt, reason=reason,
            instance_id=self.instance_id, logger=logger,
            workflow=None if job.workflow is None else job.workflow.name, step=job.step,
        )
        if job.workflow is not None:
            ctx._before_commit = self._result_in_transaction
        scope = anyio.CancelScope()
        held = self._held[lease.token] = _Held(job, lease, ctx, scope)
        # The store's lease started no earlier than the claim was sent.
        held.set_deadline(self._deadline(sent_loop, job))
        ctx._transaction_hook = held.transaction_hook
        if logger.isEnabledFor(logging.INFO):  # format_slot is not free, times a burst
            logger.info("%s slot %s (%d): %s won attempt %d (%s)", job.name,
                        format_slot(lease.slot), lease.slot, self.instance_id, result.attempt,
                        reason)
        self._tg.start_soon(self._execute, held)

    def _deadline(self, sent_loop: float, job: Job) -> float:
        # Stop the handler locally before the store could consider the lease expired,
        # even if heartbeats cannot reach the store: counted from when the claim or the
        # renewal was sent, which is no later than when the store started the lease.
        return sent_loop + job.lease_ms / 1000 - self.heartbeat / 2

    async def _execute(self, held: _Held) -> None:
        job, ctx = held.job, held.ctx
        raised: Exception | None = None
        timed_out = False
        interrupted: Interruption | None = None
        value: Any = None
        _INSIDE.set(self)
        try:
            with held.scope:
                try:
                    with anyio.move_on_after(job.timeout or math.inf) as timeout_scope:
                        if job.workflow is not None:
                            ctx.results = await self._load_results(job, held.lease.slot)
                        if job.is_async:
                            value = await job.handler(ctx)
                        else:
                            value = await anyio.to_thread.run_sync(
                                job.handler, ctx, abandon_on_cancel=True,
                                limiter=self._handler_threads,
                            )
                    timed_out = timeout_scope.cancelled_caught
                except Exception as exc:
                    raised = exc
            if held.scope.cancelled_caught:
                interrupted = held.cancel_reason or Interruption.DEADLINE
        finally:
            self._held.pop(held.lease.token, None)
            if not self._held and self._idle is not None:
                self._idle.set()
        ending = decide_outcome(
            raised=raised, timed_out=timed_out, timeout=job.timeout, interrupted=interrupted,
            lost=held.lost, stopping=self._stopping, crashed=self._crashed,
        )
        outcome, error, slot = ending.outcome, ending.error, held.lease.slot
        if outcome is None:
            return
        if outcome is Outcome.LOST:
            self._ended(ev.Lost, held.lease, why=error or "lease lost")
            if not held.lost:
                held.lost = True
                ctx._request_stop(error or "lease lost")
                if interrupted is Interruption.DEADLINE:
                    logger.warning("%s slot %s: %s; handler cancelled", job.name,
                                   format_slot(slot), error)
                else:
                    logger.warning("%s slot %s: lease lost: %s", job.name, format_slot(slot),
                                   error)
            self._watch[(job.name, slot)] = _Watched(job)
            return
        if outcome is Outcome.HANDED_OVER:
            self._to_hand_over[held.lease.token] = held.lease
            return
        if (outcome is Outcome.COMPLETED and job.workflow is not None
                and not ctx.completed_by_transaction):
            # The step's result is durable before its completion, so the next step,
            # wherever it runs, reads it.
            stored: bool | None = None
            with anyio.move_on_after(10, shield=True):
                try:
                    stored = await self.backend.set_checkpoint(
                        held.lease, {"result": ctx.result if value is None else value})
                except ConfigurationError as exc:
                    raised = exc
                    outcome, error = Outcome.FAILED, f"the step's result: {exc}"
                except Exception as exc:
                    self._store_failed(f"result of {job.name} slot {format_slot(slot)}", exc)
            if stored is None and raised is None:
                # Unknown whether the result was stored: finishing could complete the
                # step without it. Its lease runs out and a backup runs it again.
                self._ended(ev.Lost, held.lease, why="result not stored")
                self._watch[(job.name, slot)] = _Watched(job)
                return
            if stored is False:
                self._ended(ev.Lost, held.lease, why="lease lost before the result was stored")
                logger.warning("%s slot %s: lease lost before its result was stored",
                               job.name, format_slot(slot))
                self._watch[(job.name, slot)] = _Watched(job)
                return
        if outcome is Outcome.TIMED_OUT:
            ctx._request_stop("timed out")
            self._ended(ev.TimedOut, held.lease)
        elif outcome is Outcome.COMPLETED:
            self._ended(ev.Completed, held.lease)
        elif outcome is Outcome.FAILED:
            assert raised is not None
            self._ended(ev.Failed, held.lease, error=raised)
            logger.warning("%s slot %s (%d) attempt %d failed: %s", job.name,
                           format_slot(slot), slot, ctx.attempt, error, exc_info=raised)
        finished = outcome is Outcome.COMPLETED and ctx.completed_by_transaction
        if not finished:
            with anyio.move_on_after(10, shield=True) as finish_scope:
                # With the other finishes of this instant, in one finish_many call.
                (answer,) = await self._finisher.call_many([(held.lease, outcome, error)])
                if isinstance(answer, Exception):
                    if not isinstance(answer, Abandoned):
                        self._store_failed(
                            f"finish of {job.name} slot {format_slot(slot)}", answer)
                    self._watch[(job.name, slot)] = _Watched(job)
                    finished = False
                else:
                    finished = answer
                    if not finished:
                        logger.warning("%s slot %s: lease lost before finishing (%s)",
                                       job.name, format_slot(slot), outcome)
            if finish_scope.cancelled_caught:
                # Unknown whether it finished: watch it, so it is taken over if not.
                self._watch[(job.name, slot)] = _Watched(job)
        next_step = job.next_step
        if finished and outcome is Outcome.COMPLETED and next_step is not None:
            # The completion is durable: dispatch the next step now, without a tick.
            await self._claim(next_step, slot, Reason.SCHEDULED)

    async def _load_results(self, job: Job, slot: int) -> dict[str, Any]:
        assert job.workflow is not None
        results: dict[str, Any] = {}
        for step in job.workflow.previous_steps(job):
            name = step_job(job.workflow.name, step)
            for tries_left in (2, 1, 0):
                # A brief store outage must not fail the workflow run: try again within
                # the step's lease before giving up.
                try:
                    payload = await self.backend.get_checkpoint(name, slot)
                    break
                except AnarchonError as exc:
                    if not tries_left:
                        raise
                    self._store_failed(f"reading the result of {name}", exc)
                    await anyio.sleep(self.heartbeat)
            results[step] = payload.get("result") if isinstance(payload, dict) else None
        return results

    async def _result_in_transaction(self, ctx: RunContext, tx: Any) -> None:
        # A step completed by its fenced transaction stores its result in that same
        # transaction (FencedTransaction.set_checkpoint).
        store = getattr(tx, "set_checkpoint", None)
        if store is None:
            raise ConfigurationError(
                f"{type(self.backend).__name__} cannot store a step's result inside its "
                "fenced transaction")
        await store({"result": ctx.result})

    async def _resume_workflow(self, wf: Workflow, info: JobInfo) -> None:
        # A workflow run whose step completed but whose next step was never claimed (its
        # agent died in between) is continued by the first instance that starts.
        if info.last_slot is None:
            return
        keys = [(job.name, info.last_slot) for job in wf.jobs]
        try:
            result = await self.backend.check(keys)
        except Exception as exc:
            self._store_failed(f"check of workflow {wf.name}", exc)
            return
        for job, key in zip(wf.jobs[:-1], keys[1:], strict=True):
            state = result.runs.get((job.name, key[1]))
            if (state is not None and state.status is RunStatus.COMPLETED
                    and key not in result.runs):
                next_step = job.next_step
                assert next_step is not None
                await self._claim(next_step, key[1], Reason.SCHEDULED)
                return

    def _ended(self, kind: type[ev.AttemptEnded], lease: Lease, **extra: Any) -> None:
        info = self._attempts.pop(lease.token, None)
        if info is None or not self._subscribers:
            return
        self._emit(kind(
            instance_id=self.instance_id, job=lease.job, slot=lease.slot, attempt=info.attempt,
            reason=info.reason, duration=anyio.current_time() - info.started, **extra,
        ))

    def _lose(self, held: _Held, why: Interruption) -> None:
        held.lost = True
        held.cancel_reason = why
        held.ctx._request_stop(str(why))
        held.scope.cancel()
        logger.warning("%s slot %s: %s; handler cancelled", held.job.name,
                       format_slot(held.lease.slot), why)

    # ----------------------------------------------------------------- heartbeats, backups

    async def _ticker(self) -> None:
        while True:
            await anyio.sleep(self.heartbeat)
            # A hung store must not stall later ticks; the handlers' own deadlines
            # cancel them before their leases could expire.
            with anyio.move_on_after(self._tick_limit()) as scope:
                try:
                    await self._tick()
                except Exception as exc:
                    self._store_failed("heartbeat and backup check", exc)
            if scope.cancelled_caught:
                logger.warning("tick took longer than %gs; the store is slow",
                               self._tick_limit())
                self._store_failed("tick", TimeoutError(
                    f"the store did not answer within {self._tick_limit():g}s"), log=False)

    async def _maintenance(self) -> None:
        # Its own task: renewals and backup checks never wait behind the trimming.
        if self.prune_every is None:
            return
        every = self.prune_every
        with self._stoppable():
            await anyio.sleep(min(self.heartbeat, every))
            while not self._stopping:
                began = anyio.current_time()
                with anyio.move_on_after(every):
                    try:
                        await self._trim_history(began + every / 2)
                    except Exception as exc:
                        self._store_failed("history trimming", exc)
                await anyio.sleep(max(0.0, began + every - anyio.current_time()))

    async def _trim_history(self, budget_ends: float) -> None:
        """Trim every job of the store, if this instance wins the period's maintenance."""
        assert self.prune_every is not None
        if not await self.backend.maintenance_due(self.instance_id, to_ms(self.prune_every)):
            return
        began = anyio.current_time()
        names = await self.backend.jobs()
        start = self._prune_next
        if start is not None:  # go on where the last budget ran out
            names = [j for j in names if j >= start] + [j for j in names if j < start]
        deleted = 0
        trimmed: dict[str, None] = {}
        complete = True
        # PRUNE_JOBS jobs per prune_many call (one statement or round trip); a job that
        # lost a full batch goes again first, in the next call.
        pending = names
        while pending:
            self._prune_next = pending[0]
            if anyio.current_time() >= budget_ends:
                complete = False
                break
            chunk = pending[:PRUNE_JOBS]
            counts = await self.backend.prune_many(
                chunk, keep=self.history_size, older_than_ms=self.history_ttl_ms,
                batch=PRUNE_BATCH)
            again = [name for name in chunk if counts.get(name, 0) >= PRUNE_BATCH]
            trimmed.update(dict.fromkeys(name for name in chunk if counts.get(name)))
            deleted += sum(counts.get(name, 0) for name in chunk)
            pending = again + pending[len(chunk):]
        else:
            self._prune_next = None
        took = anyio.current_time() - began
        if deleted or not complete:
            logger.info("instance %s trimmed %d attempts of %d jobs in %.2fs%s",
                        self.instance_id, deleted, len(trimmed), took,
                        "" if complete else f"; {self._prune_next} next")
        if deleted:
            self._emit(ev.HistoryTrimmed(instance_id=self.instance_id, attempts=deleted,
                                         jobs=tuple(trimmed), complete=complete,
                                         duration=took))

    def _tick_limit(self) -> float:
        shortest = min((j.lease_ms for j in self._jobs.values()), default=to_ms(self.lease))
        return max(self.heartbeat, shortest / 1000 - self.heartbeat)

    def _store_failed(self, what: str, exc: Exception, *, log: bool = True) -> None:
        if log:
            _log_failure(what, exc)
        if self._store_down_since is None:
            self._store_down_since = self._clock()
            self._emit(ev.StoreUnreachable(instance_id=self.instance_id, error=exc))

    async def _tick(self) -> None:
        await self._renew()
        await self._check_watched()
        # An idle instance still asks the store once per heartbeat, so health() knows it
        # answers; the clock is sampled at least every minute.
        if self._clock() - self._clock_samples.last_sample > min(60.0, self.heartbeat / 2):
            await self._sample_clock()

    async def _renew(self) -> None:
        # A run inside its fenced transaction is locked by it: no backup can take it over,
        # whatever its expiry, so it needs no renewal and is never reported lost here.
        helds = [h for h in self._held.values() if not h.lost and not h.in_transaction]
        if not helds:
            return
        sent = self._clock()
        sent_loop = anyio.current_time()
        result = await self.backend.heartbeat([h.lease for h in helds])
        self._note_clock(result.now_ms, sent, self._clock())
        renewed = result.held if result.renewed is None else result.renewed
        for held in helds:
            if held.lease.token in renewed:
                held.set_deadline(self._deadline(sent_loop, held.job))
            elif held.lease.token in result.held:
                pass  # held but locked by its fenced transaction; renewed next time
            elif held.lease.token in self._held and not held.in_transaction:
                self._lose(held, Interruption.LEASE_LOST)

    async def _check_watched(self) -> None:
        if not self._watch or self._stopping:
            return
        retries = [(k, w) for k, w in self._watch.items() if w.retry_reason is not None]
        newest: dict[str, int] = {}
        again: list[tuple[Job, int, Reason]] = []
        for (name, slot), _ in retries:
            newest[name] = max(slot, newest.get(name, slot))
        for key, retry in retries:
            older = key[1] < newest[key[0]]
            if (older and retry.retry_reason is not Reason.TAKEOVER
                    and (retry.job.catch_up != "all" or retry.job.overlap == "skip")):
                # The store was unreachable for several slots: as with catch-up, only
                # the newest missed slot is claimed (all of them only for a job with
                # catch_up="all" whose runs may overlap). The older run is still watched,
                # in case an unanswered claim won it.
                self._watch[key] = _Watched(retry.job)
                logger.warning("%s slot %s not claimed while the store was unreachable; "
                               "claiming the newer slot instead", key[0], format_slot(key[1]))
                continue
            assert retry.retry_reason is not None
            self._watch.pop(key, None)
            again.append((retry.job, key[1], retry.retry_reason))
        await self._claim_many(again)
        keys = [k for k, w in self._watch.items() if w.retry_reason is None]
        if not keys:
            return
        sent = self._clock()
        result = await self.backend.check(keys)
        self._note_clock(result.now_ms, sent, self._clock())
        claims: list[tuple[Job, int, Reason]] = []
        for key in keys:
            watched = self._watch.get(key)
            if watched is None:
                continue
            state = result.runs.get(key)
            if key in result.lost:
                # Lost with the store's data while its holder may still run it: claim it
                # again; the claim waits out the store's quarantine.
                self._watch.pop(key, None)
                await self._claim(watched.job, key[1], Reason.TAKEOVER)
            elif state is None or state.status.finished:
                self._watch.pop(key, None)
                next_step = watched.job.next_step
                if (state is not None and state.status is RunStatus.COMPLETED
                        and next_step is not None):
                    # Supervisor: the step completed; make sure its successor is claimed
                    # (by its agent, or by this instance if the agent died before).
                    claims.append((next_step, key[1], Reason.SCHEDULED))
            elif state.claimable(result.now_ms):
                claims.append((watched.job, key[1], Reason.TAKEOVER))
        await self._claim_many(claims)


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
