"""One run of a scheduler, from start() to the end of stop(): its state and components.

A scheduler makes a new :class:`Session` at every start, so nothing of a run's state is
left over for the next one (what must carry over is in :class:`~.base.Carry`). The session
owns the components, each with one job, and wires them together:

- :class:`~.runs.RunTable`: the runs this instance deals with, and their phases;
- :class:`~.clock.StoreClock`: the store's clock, and whether the store answers;
- :class:`~.fleet.Fleet`: the live members, and which of them claims each job first;
- :class:`~.dispatch.Dispatcher`: when the scheduled jobs are due, catch-up;
- :class:`~.claims.Claimer`: every claim, and what its answer means;
- :class:`~.execution.Executor`: the handlers, their cancellation and their outcome;
- :class:`~.leases.LeaseKeeper`: renewals and backup checks, once per heartbeat;
- :class:`~.steps.StepCoordinator`: the steps of workflows, one after another;
- :class:`~.retention.Retention`: the fleet's history trimming;
- :class:`~.retries.Retrier`: retries within a run (failed attempts that wait, unleased).

The components import none of each other; they reach each other through the session.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import anyio
import sniffio
from anyio.abc import TaskGroup, TaskStatus

from .. import events as ev
from .._outcome import Interruption
from .._structures import JobInfo, Lease, RunStatus, format_slot
from ..operations import Operation, OperationKind
from ..recovery import STEP_SEPARATOR, step_job
from .base import (
    HANDLER_THREADS,
    SUBSCRIBER_THREADS,
    Carry,
    SchedulerState,
    Settings,
    logger,
)
from .bus import EventBus
from .claims import Claimer
from .clock import StoreClock
from .dispatch import Dispatcher
from .execution import Executor
from .fleet import Fleet
from .jobs import JobRegistry
from .leases import LeaseKeeper
from .retention import Retention
from .retries import Retrier
from .runs import RunTable
from .steps import StepCoordinator

__all__ = ["Session", "StartStatus"]


class StartStatus:
    """The task status :meth:`Session.spawn` gives the run in its host task."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.is_started = False
        self.error: BaseException | None = None

    def started(self, value: None = None) -> None:
        """The scheduler runs: ``start()`` returns."""
        self.is_started = True
        self.event.set()


class Session:
    """The state of one run of a scheduler, and the components that act on it."""

    def __init__(self, settings: Settings, registry: JobRegistry, bus: EventBus,
                 carry: Carry, *, offset_ms: float = 0.0) -> None:
        self.settings = settings
        self.registry = registry
        self.jobs = registry.jobs
        """The declared jobs, by name."""
        self.bus = bus
        self.carry = carry
        self.state = SchedulerState.STARTING
        self.crashed = False
        """True once cancelled from outside or aborted: nothing is finished or handed over."""
        self.aborted = False  # abort() was called (a crash asked for, not an accident)
        self._eager_hand_over = False
        self._handed: set[str] = set()  # the tokens a hand-over was sent for
        self._soon: list[Lease] = []  # for hand_over_soon's sender, and whether it runs
        self._sending = False
        self.grace = 0.0
        self._grace_scope: anyio.CancelScope | None = None  # the grace's wait, once it runs
        self.tg: TaskGroup | None = None
        """The task group of the jobs, while the scheduler runs them."""
        self.run_scope = anyio.CancelScope()
        self.stop_requested = anyio.Event()
        self.done = anyio.Event()
        self._loop_scopes: set[anyio.CancelScope] = set()
        # Sync handlers and subscribers get worker threads of their own, so that however
        # many of them block, the store's blocking drivers keep anyio's default threads.
        self.handler_threads = anyio.CapacityLimiter(HANDLER_THREADS)
        self.subscriber_threads = anyio.CapacityLimiter(SUBSCRIBER_THREADS)
        self.clock = StoreClock(settings, bus.emit, offset_ms)
        self.runs = RunTable()
        self.fleet = Fleet(self)
        self.claims = Claimer(self)
        self.execution = Executor(self)
        self.dispatch = Dispatcher(self)
        self.leases = LeaseKeeper(self)
        self.steps = StepCoordinator(self)
        self.retention = Retention(self)
        self.retries = Retrier(self)
        self._failure: BaseException | None = None
        self._host_task: object | None = None
        """The asyncio task hosting a run started by spawn() (kept from the GC)."""

    @property
    def stopping(self) -> bool:
        """True once a stop (or an abort) began, and when not running at all: no new claims."""
        return self.state in (SchedulerState.STOPPING, SchedulerState.STOPPED)

    @contextlib.contextmanager
    def stoppable(self) -> Iterator[None]:
        """A scope that stop() cancels (a job's catch-up, the dispatcher, the trimming)."""
        scope = anyio.CancelScope()
        if self.stopping:
            scope.cancel()
        self._loop_scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._loop_scopes.discard(scope)

    def request_stop(self, grace: float) -> None:
        """Begin a graceful stop with ``grace`` seconds for the handlers; a later request
        with a shorter grace (a second Ctrl-C, ``stop(grace=0)``) shortens the one under
        way, counted from now. Called on the scheduler's event loop."""
        if not self.stop_requested.is_set():
            self.grace = grace
            self.stop_requested.set()
        elif grace < self.grace:
            self.grace = grace
            if self._grace_scope is not None:
                self._grace_scope.deadline = min(self._grace_scope.deadline,
                                                 anyio.current_time() + grace)

    def abort(self) -> None:
        """Stop at once, as a crash would: nothing is finished or handed over."""
        self.crashed = self.aborted = True
        self.state = SchedulerState.STOPPING
        self.run_scope.cancel()

    def spawn(self) -> StartStatus:
        """Run in a host task of its own, which outlives the caller's task."""
        # anyio has no detached tasks: a system task on trio, a plain task on asyncio.
        status = StartStatus()
        name = f"anarchon scheduler {self.settings.instance_id}"
        if sniffio.current_async_library() == "trio":
            import trio

            trio.lowlevel.spawn_system_task(self._host, status, name=name)
        else:
            import asyncio

            self._host_task = asyncio.get_running_loop().create_task(
                self._host(status), name=name)
        return status

    def take_failure(self) -> BaseException | None:
        """What ended a spawned run unexpectedly (reported once)."""
        failure, self._failure = self._failure, None
        return failure

    async def _host(self, status: StartStatus) -> None:
        try:
            await self.run(status)
        except anyio.get_cancelled_exc_class():
            if status.is_started and not self.aborted and not self.stop_requested.is_set():
                # The event loop ended under it (`anyio.run(scheduler.start)` returns at
                # once, ending the loop): nothing else would say why nothing ran.
                logger.warning(
                    "scheduler %s was cancelled from outside (its event loop ending, or "
                    "its task group cancelled) without stop(): as a crashed instance, "
                    "nothing handed over; keep the loop running while it should "
                    "run (`async with scheduler:` around the application's work; "
                    "anyio.run(scheduler.start) returns at once, ending it), or use "
                    "SyncScheduler", self.settings.instance_id)
            raise
        except BaseException as exc:
            # Nothing may escape a host task (on trio it would end the whole event loop).
            if not status.is_started:
                status.error = exc
            else:
                logger.error("scheduler %s ended unexpectedly", self.settings.instance_id,
                             exc_info=exc)
                self._failure = exc
        finally:
            status.event.set()
            self._host_task = None

    async def run(self, task_status: TaskStatus[None]) -> None:
        """Open the store, run the jobs until stopped, close the store."""
        settings = self.settings
        opened = False
        try:
            with self.run_scope:
                infos = await self._open()
                opened = True
                try:
                    async with anyio.create_task_group() as events_tg:
                        self.bus.open(events_tg, self.subscriber_threads, jobs=len(self.jobs))
                        await self._run_jobs(infos, task_status)
                        # Runs won or stopped after the last round (their endings
                        # outlived the drain): every execution and claim has ended now.
                        if not self.crashed:
                            await self._hand_over(self.runs.awaiting_hand_over())
                        # Deliver what is left, for a moment at most.
                        self.bus.close(senders_only=True)
                        events_tg.cancel_scope.deadline = (
                            anyio.current_time() + max(1.0, settings.heartbeat))
                except anyio.get_cancelled_exc_class():
                    # Cancelled from outside (or aborted): behave like a crash.
                    self.crashed = True
                    raise
        finally:
            self.state = SchedulerState.STOPPING
            self.tg = None
            self.bus.close()
            self.runs.clear()
            try:
                if opened:
                    with anyio.move_on_after(10, shield=True):
                        await settings.backend.close()
            finally:
                self.state = SchedulerState.STOPPED
                self.done.set()
                logger.info("instance %s stopped", settings.instance_id)

    async def _open(self) -> dict[str, JobInfo]:
        backend = self.settings.backend
        await backend.start()
        try:
            for _ in range(3):
                await self.clock.sample()
            infos = await backend.register_jobs(list(self.jobs))
            await self.fleet.renew()
            await self._describe_workflows()
            # Read first: a schedule that differs from the recorded one takes effect now.
            recorded = (await backend.schedules()
                        if any(job.scheduled for job in self.jobs.values()) else {})
            await backend.register_schedules(
                self.dispatch.schedule_records(recorded, self.clock.now_ms()))
            return infos
        except BaseException:
            with anyio.CancelScope(shield=True):
                await backend.close()
            raise

    async def _describe_workflows(self) -> None:
        """Record this scheduler's workflows in the store, and end the record of a former
        workflow that one of its plain jobs is named after (a workflow turned into a job
        of the same name in a new release), which readers of the store would otherwise
        still take for the workflow."""
        backend = self.settings.backend
        described: dict[str, list[str]] = {
            name: list(wf.steps) for name, wf in self.registry.workflows.items()}
        plain = {name for name, job in self.jobs.items()
                 if job.workflow is None and STEP_SEPARATOR not in name}
        recorded = await backend.workflows() if plain or described else {}
        if plain:
            described.update({name: [] for name in plain & set(recorded)})
        if described:
            await backend.register_workflows(described)
        await self._carry_pauses(recorded)

    async def _carry_pauses(self, recorded: dict[str, list[str]]) -> None:
        """A workflow whose first step this release changed (a step put before it, or
        renamed; or a job turned into the workflow): the pause of the former first job is
        carried to the new first step's job, by the same author. The former stays paused
        (the old release's instances skip it meanwhile); resuming the workflow
        (:meth:`Admin.resume <lease_core.Admin.resume>`) resumes both. Else the new first
        step would run at every slot and each run stop at the former one, paused."""
        moved = {}
        for name, wf in self.registry.workflows.items():
            steps = recorded.get(name)
            former = step_job(name, steps[0]) if steps else name
            if former != wf.jobs[0].name:
                moved[wf.jobs[0].name] = former
        paused = await self.settings.backend.paused() if moved else {}
        for first, former in moved.items():
            if former in paused and first not in paused:
                await self.settings.backend.operate(
                    Operation(OperationKind.PAUSE, first, None, paused[former]))
                logger.info("%s: paused by %s as %s was (the workflow's first step "
                            "changed)", first, paused[former], former)

    async def _run_jobs(self, infos: dict[str, JobInfo], task_status: TaskStatus[None]) -> None:
        async with anyio.create_task_group() as tg:
            self.tg = tg
            for name, job in self.jobs.items():
                info = infos[name]
                for slot in info.open_slots:
                    self.runs.watch(job, slot)
                if not job.scheduled:
                    pass
                elif not info.new and job.catch_up != "none":
                    tg.start_soon(self.dispatch.start_job, job, info)
                else:
                    self.dispatch.schedule_next(job, self.clock.now_ms())
            tg.start_soon(self.dispatch.wake_due_jobs)
            for wf in self.registry.workflows.values():
                tg.start_soon(self.steps.resume, wf, infos[wf.jobs[0].name], infos)
            tg.start_soon(self.leases.ticker)
            tg.start_soon(self.retention.run)
            if self.state is SchedulerState.STARTING:
                self.state = SchedulerState.RUNNING
            if self.jobs:
                logger.info("instance %s started with %d job%s", self.settings.instance_id,
                            len(self.jobs), "" if len(self.jobs) == 1 else "s")
            else:  # declared on another Scheduler object, or in a module never imported
                logger.warning("instance %s started with no jobs, so it runs nothing: "
                               "declare them with every(), cron() or workflow() on this "
                               "scheduler before start()", self.settings.instance_id)
            task_status.started()
            await self.stop_requested.wait()
            await self._stop_gracefully()
            tg.cancel_scope.cancel()

    async def _wait_no_handler(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            while self.runs.held_count:
                self.runs.idle = anyio.Event()
                await self.runs.idle.wait()

    async def _stop_gracefully(self) -> None:
        self.state = SchedulerState.STOPPING
        # A run whose handler stops itself in the grace (ctx.raise_if_stopping), or that is
        # won meanwhile, is handed over at once: held unrenewed until the grace ends, its
        # lease would lapse in a grace longer than it, and a backup would wait for that.
        self._eager_hand_over = True
        for scope in list(self._loop_scopes):
            scope.cancel()
        await self._leave_fleet()
        for run in self.runs.held():
            assert run.execution is not None
            run.execution.ctx._request_stop("stopping")
        with anyio.CancelScope(deadline=anyio.current_time() + self.grace) as scope:
            self._grace_scope = scope
            await self._wait_no_handler(math.inf)
        self._grace_scope = None
        for run in self.runs.held():
            assert run.execution is not None
            run.execution.cancel_reason = Interruption.STOPPED
            run.execution.scope.cancel()
        await self._wait_no_handler(max(self.settings.heartbeat, 1.0))
        # Hand-over in two rounds. First the runs already waiting for it (those
        # hand_over_soon has not sent yet), so that a short lease does not lapse while the
        # stop waits for the other runs' endings.
        await self._hand_over(self.runs.awaiting_hand_over())
        # Then the runs those endings gave: a step completed in the grace claims its next
        # step, which is won here and handed over (no backup has to start it, see
        # Claims.claim_many).
        longest = max(j.lease_ms for j in self.jobs.values()) / 2000 if self.jobs else 0
        await self.execution.drain(longest)
        await self.claims.drain(longest)
        # An agent's claim of a next step that failed (or waited for capacity) in the stop
        # is made once more: no other instance may start that step past its trimmed
        # history (see Claims.claim_many), so the workflow run would stop there.
        with anyio.move_on_after(longest):
            await self.claims.claim_many(self.runs.successors_waiting(), after_step=True)
        await self._hand_over(self.runs.awaiting_hand_over())
        # A handler still running (an async one that ignores its cancellation) is not
        # handed over: a backup would run the run beside it. The stop waits for it, its
        # lease no longer renewed; its ending is reported then, as the history records
        # it (it was reported Lost here, and its real ending never).
        for run in self.runs.held():
            if run.lease is not None:
                logger.warning("%s slot %s: the handler ignores its cancellation; the stop "
                               "waits for it, its lease no longer renewed", run.job.name,
                               format_slot(run.lease.slot))

    def hand_over_soon(self, lease: Lease) -> None:
        """A run to hand over while the scheduler stops: hand it over now, with the others
        of the moment (the handlers the grace's end cancels end together: one call)."""
        if not self._eager_hand_over or self.tg is None:
            return
        self._soon.append(lease)
        if not self._sending:
            self._sending = True
            self.tg.start_soon(self._send_soon)

    async def _send_soon(self) -> None:
        try:
            while self._soon:
                leases, self._soon = self._soon, []
                await self._hand_over(leases)
        finally:
            self._sending = False

    async def _hand_over(self, leases: list[Lease]) -> None:
        leases = [lease for lease in leases if lease.token not in self._handed]
        if not leases:
            return
        self._handed.update(lease.token for lease in leases)
        backend = self.settings.backend
        done: set[str] = set()
        cancelled: set[tuple[str, int]] = set()
        with anyio.move_on_after(10, shield=True):
            answered = unsure = False
            # Sent again every heartbeat while the store does not answer (a failover, a
            # dropped connection), for as long as it is worth it: once the leases lapse,
            # the backups take the runs over anyway.
            until = anyio.current_time() + min(5.0, min(x.lease_ms for x in leases) / 1000)
            while not answered:
                try:
                    done.update(await backend.hand_over(leases))
                    answered = True
                    logger.info("instance %s handed over %d runs",
                                self.settings.instance_id, len(done))
                except Exception as exc:
                    self.clock.failed("hand-over", exc, write=True)
                    unsure = True
                    if anyio.current_time() + self.settings.heartbeat >= until:
                        break
                    await anyio.sleep(self.settings.heartbeat)
            # A run the store did not hand over may have been cancelled by an operator
            # since its last heartbeat: that attempt ended cancelled. A hand-over whose
            # answer was lost (an earlier call's too) may have been made: the store says.
            kept = {(lease.job, lease.slot): lease for lease in leases
                    if lease.token not in done}
            try:
                found = (await backend.check(list(kept))).runs if kept else {}
            except Exception as exc:
                found = {}
                if answered:  # else the outage the hand-over reported
                    self.clock.failed("hand-over", exc, write=True)
            for key, state in found.items():
                # This attempt's ending, not another's (the run taken over meanwhile).
                if state.attempt == self._attempt_of(key):
                    if state.status is RunStatus.CANCELLED:
                        cancelled.add(key)
                    elif state.status is RunStatus.HANDED_OVER and unsure:
                        done.add(kept[key].token)
        for lease in leases:
            if lease.token in done:
                self.execution.ended(ev.HandedOver, lease)
            elif (lease.job, lease.slot) in cancelled:
                self.execution.ended(ev.Cancelled, lease)
            else:
                self.execution.ended(ev.Lost, lease, why="not handed over")
        self.runs.handed_over(leases)

    def _attempt_of(self, key: tuple[str, int]) -> int | None:
        """The number of the attempt this instance holds ``key`` with, if it knows it."""
        run = self.runs.get(key)
        return None if run is None or run.attempt is None else run.attempt.attempt

    async def _leave_fleet(self) -> None:
        # It claims nothing new from now on: the others re-rank its jobs at their next
        # renewal rather than a lease on (its runs are handed over, or taken over, as ever).
        with anyio.move_on_after(max(self.settings.heartbeat, 1.0), shield=True):
            try:
                await self.fleet.leave()
            except Exception as exc:
                self.clock.failed("leaving the fleet", exc, write=True)
