"""A blocking front end to the scheduler, for sync code (Django, Flask, scripts, workers).

:class:`SyncScheduler` declares jobs on an inner :class:`~lease_core.Scheduler` and runs it
on the process's background event loop (anyio's blocking portal, on a thread of its own),
which every :class:`~lease_core.SyncLease` uses too; every call from the caller's thread
goes through that portal, so the sync API never duplicates the async engine.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, wait
from datetime import datetime
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from . import events as ev
from ._durations import Duration, parse_duration
from ._lease_loop import _Loop, answered_within
from ._structures import Attempt
from .abc import Backend
from .engine.base import INSIDE as _INSIDE
from .engine.base import SchedulerState
from .engine.jobs import Job
from .errors import AnarchonError
from .operations import Admin
from .recovery import RecoveryEntry
from .scheduler import Health, Scheduler

__all__ = ["SyncAdmin", "SyncScheduler"]

logger = logging.getLogger("anarchon")

_T = TypeVar("_T")


def _check_options(options: dict[str, Any]) -> None:
    """Refuse an option neither :class:`SyncScheduler` nor :class:`Scheduler` takes,
    naming SyncScheduler (Python's own error named ``Scheduler.__init__()``, which the
    caller never called) and the option meant."""
    known = [name for name, parameter in inspect.signature(Scheduler).parameters.items()
             if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    known += ["exit_grace", "call_timeout"]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise TypeError(
                f"SyncScheduler() got an unexpected option {name!r}"
                + (f"; did you mean {close[0]!r}?" if close else
                   f"; it takes {', '.join(sorted(known))}"))


def _host_ended(started: Future[None], host: Future[None]) -> None:
    """Pass the host task's end to start() when it ended before the scheduler ran."""
    if started.done():
        return
    with contextlib.suppress(Exception):  # InvalidStateError: started meanwhile
        if host.cancelled():
            started.cancel()
        elif host.exception() is not None:
            started.set_exception(host.exception())
        else:
            started.set_exception(AnarchonError("the scheduler ended before it started"))


def _request_stop(sync: SyncScheduler, grace: float, requested: anyio.Event | None) -> None:
    """Ask ``sync``'s host task to stop (on the loop); ``requested`` is the host's event as
    the caller saw it, which a stop from outside may have cleared meanwhile. A stop under
    way is shortened by a shorter grace."""
    requested = requested or sync._stop_requested
    if requested is None:
        return  # ended meanwhile
    if requested.is_set():
        session = sync.scheduler._session
        if grace < sync._grace and session is not None:
            session.request_stop(grace)
        grace = min(grace, sync._grace)
    sync._grace = grace
    requested.set()


class SyncScheduler:
    """A :class:`~lease_core.Scheduler` for sync code, running on a background thread.

    ``SyncScheduler(backend, **options)`` takes the options of :class:`Scheduler`
    (``instance_id``, ``lease``, ``heartbeat``, ``history_size``, ``history_ttl``,
    ``clock``, ``prune_every``, ``max_running``, ``timer_slack``), ``exit_grace``, and
    ``call_timeout`` (default 30 s): how long :meth:`history`, :meth:`recovery_log` and
    the :attr:`admin` operations wait for the store before they raise
    :class:`~lease_core.errors.BackendUnavailable` (a partition would otherwise block
    the calling thread for as long as the network stays silent).
    Jobs and workflows are declared with the same :meth:`every`, :meth:`cron` and
    :meth:`workflow`, directly or as decorators; handlers may be sync (run in worker
    threads) or async (run on the background thread's event loop).

    :meth:`start` returns once the scheduler runs on the process's background thread and
    its asyncio event loop (one for every SyncScheduler and :class:`~lease_core.SyncLease`
    of the process, so one backend serves them all), and raises the scheduler's start
    error (store unreachable, bad configuration) in the caller's thread, leaving nothing
    running. :meth:`stop` blocks
    until every run still held is handed over; ``with SyncScheduler(...) as s:`` does both.
    At interpreter exit a running SyncScheduler stops with a hand-over (grace
    ``exit_grace``); a process killed by a signal's default action (SIGTERM without a
    handler, SIGKILL) exits without it, and backups take its runs over when their leases
    expire.

    .. warning:: **Fork safety.** The background thread does not survive ``fork()``. Start
       a SyncScheduler in the process that uses it, *after* the server forks its workers:
       gunicorn's ``post_fork`` or ``post_worker_init`` hook, uwsgi with ``lazy-apps =
       true``, or the app factory of each worker process. Declaring jobs before the fork
       is fine. Using a scheduler started before a fork in the forked child raises
       :class:`AnarchonError` instead of hanging.

    An async handler runs on the loop every SyncScheduler and SyncLease of the process
    shares: one that blocks (``time.sleep``, a blocking driver's call) stalls them all,
    their renewals too. Make such a handler sync (it then runs in a worker thread).

    .. note:: The inner scheduler starts and closes ``backend`` on the background thread's
       event loop, so an async pool or client passed in must not be bound to another loop
       (a DSN, a URL or a blocking driver object always works); it is never closed. The
       same backend object may serve SyncSchedulers and SyncLeases together (they share
       the loop), but not an async scheduler of the application's own loop as well.
    """

    def __init__(self, backend: Backend, *, exit_grace: Duration = "10s",
                 call_timeout: Duration = "30s", **options: Any) -> None:
        self.exit_grace: float = parse_duration(exit_grace, what="exit_grace", allow_zero=True)
        """Grace of the :meth:`stop` made at interpreter exit, in seconds."""
        self.call_timeout: float = parse_duration(call_timeout, what="call_timeout")
        """Seconds :meth:`history`, :meth:`recovery_log` and the :attr:`admin` operations
        wait for the store's answer before raising ``BackendUnavailable``."""
        _check_options(options)
        self.scheduler = Scheduler(backend, **options)
        """The async scheduler this one drives; its jobs, options and state."""
        self.every = self.scheduler.every
        """Declare a job that runs every ``interval``: see :meth:`Scheduler.every`."""
        self.cron = self.scheduler.cron
        """Declare a job that runs on a cron expression: see :meth:`Scheduler.cron`."""
        self.workflow = self.scheduler.workflow
        """Declare a workflow and its steps: see :meth:`Scheduler.workflow`."""
        self._lock = threading.RLock()
        self._state = SchedulerState.STOPPED
        self._pid: int | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._host: Future[None] | None = None
        self._stop_requested: anyio.Event | None = None
        self._loop_thread: threading.Thread | None = None
        self._grace = 0.0
        self._stop_pending: float | None = None  # stop() called while starting

    @property
    def backend(self) -> Backend:
        """The backend the scheduler claims runs in."""
        return self.scheduler.backend

    @property
    def admin(self) -> SyncAdmin:
        """Fleet-wide operations (:class:`SyncAdmin`), made as this instance; blocking
        calls for any thread but the background loop's, before, during or after a run."""
        return SyncAdmin(self.backend, by=self.instance_id, call_timeout=self.call_timeout,
                         _owner=self)

    @property
    def instance_id(self) -> str:
        """This instance's id, recorded in every attempt it makes."""
        return self.scheduler.instance_id

    @property
    def jobs(self) -> dict[str, Job]:
        """The declared jobs, by name."""
        return self.scheduler.jobs

    @property
    def running(self) -> list[tuple[str, int]]:
        """The runs (job, slot) this instance is executing now."""
        return self._on_loop(lambda: self.scheduler.running)

    @property
    def state(self) -> SchedulerState:
        """Where the scheduler is in its lifecycle, as :attr:`Scheduler.state` says.

        ``STARTING`` while :meth:`start` waits for the background thread, ``STOPPING``
        while :meth:`stop` hands runs over; ``STOPPED`` in a forked child, where the
        background thread does not exist, and once the scheduler has ended on its own (a
        bug, logged when it happened; :meth:`stop` then raises it and frees the thread).
        """
        if self._pid not in (None, os.getpid()):
            return SchedulerState.STOPPED
        state = self._state
        if state is SchedulerState.RUNNING and self.scheduler.state in (
                SchedulerState.STOPPING, SchedulerState.STOPPED):
            return self.scheduler.state  # stop requested by a handler, or interrupted
        return state

    def health(self) -> Health:
        """Whether the store answered within the last lease, and what this instance holds.

        The same :class:`~lease_core.Health` as :meth:`Scheduler.health`, read on the
        background thread's loop; callable from any thread, and before :meth:`start`.
        """
        return self._on_loop(self.scheduler.health)

    def _live_portal(self) -> anyio.from_thread.BlockingPortal | None:
        """The loop's portal while the scheduler starts, runs or stops, else ``None``.

        Read without the lifecycle lock, which :meth:`stop` holds for its whole grace: a
        handler reading the history while its scheduler stops must not wait for the
        stop, which waits for the handler. A portal whose loop ended meanwhile raises
        ``RuntimeError``, and its callers then read on the background loop anew."""
        portal = self._portal
        running = self._state in (SchedulerState.STARTING, SchedulerState.RUNNING,
                                  SchedulerState.STOPPING)
        return portal if running else None

    def _on_loop(self, read: Callable[[], _T]) -> _T:
        """Call ``read`` on the loop's thread, which changes what it reads."""
        self._check_process()
        portal = self._portal
        if (portal is not None and threading.current_thread() is not self._loop_thread
                and not _Loop.here()):
            try:
                return portal.call(read)
            except RuntimeError:
                if self._portal is portal:
                    raise
                # stopped meanwhile
        return read()

    @property
    def started(self) -> bool:
        """Whether the scheduler runs in this process (between :meth:`start` and :meth:`stop`,
        unless it ended on its own: see :attr:`state`)."""
        return self.state is SchedulerState.RUNNING and self._pid == os.getpid()

    # ----------------------------------------------------------------- lifecycle

    def _check_process(self) -> None:
        if self._pid is not None and self._pid != os.getpid():
            raise AnarchonError(
                f"this SyncScheduler was started in process {self._pid}, and process "
                f"{os.getpid()} is a fork of it, where its background thread does not exist; "
                "start the SyncScheduler after the server forks (gunicorn: post_fork or "
                "post_worker_init hook; uwsgi: lazy-apps = true)"
            )

    def _check_thread(self, what: str) -> None:
        if threading.current_thread() is self._loop_thread or _Loop.here():
            instead = (
                "call it from sync code (the main thread, a thread of your own, a sync "
                "handler)" if what == "start" else
                f"from an async handler, use 'await sync_scheduler.scheduler.{what}(...)' "
                "instead")
            raise AnarchonError(
                f"SyncScheduler.{what}() would block the event loop it runs on; {instead}"
            )

    def start(self) -> None:
        """Start the scheduler on the background loop; return once it runs.

        Raises the scheduler's start error (e.g. :class:`BackendUnavailable`,
        :class:`ConfigurationError`) here, with nothing left running, and
        :class:`AnarchonError` if it is already started, or when called on the
        background loop (by an async handler), which it would block.
        """
        self._check_process()
        self._check_thread("start")
        with self._lock:
            if self._state is not SchedulerState.STOPPED:
                if self._state is not SchedulerState.RUNNING or self.started:
                    raise AnarchonError(f"SyncScheduler {self.instance_id!r} is already "
                                        "started; call stop() first")
                raise AnarchonError(
                    f"SyncScheduler {self.instance_id!r} is {self.state.value}: a handler "
                    "called stop(), or it ended on its own, and no stop() from outside has "
                    "ended it since; call stop() first (it waits for the hand-over, and "
                    "raises the error it ended with), then start()")
            self._state = SchedulerState.STARTING
            self._stop_pending = None
            host: Future[None] | None = None
            try:
                # Set first: a subscribe() from another thread while it starts is made
                # on the loop's thread, as the subscribers are opened there meanwhile.
                self._portal = portal = _Loop.get()
                started: Future[None] = Future()
                self._host = host = portal.start_task_soon(
                    self._run_host, started, name=f"anarchon-{self.instance_id}")
                host.add_done_callback(partial(_host_ended, started))
                started.result()
                self._pid = os.getpid()
                self._state = SchedulerState.RUNNING
                atexit.register(self._stop_at_exit)
            except BaseException:
                # The start's own error, or the caller interrupted (Ctrl-C, a signal
                # handler's exception): nothing may go on starting, and then running,
                # on the loop with nobody to stop it.
                if host is not None and not host.done():
                    host.cancel()
                    with contextlib.suppress(BaseException):
                        wait([host])
                atexit.unregister(self._stop_at_exit)
                self._portal = self._host = None
                self._stop_requested = self._loop_thread = None
                self._pid = None
                self._state = SchedulerState.STOPPED
                raise
            pending, self._stop_pending = self._stop_pending, None
        if pending is not None:
            # stop() was called while this thread started it (a signal's handler): honour it
            self.stop(pending)

    async def _run_host(self, started: Future[None]) -> None:
        # start() and stop() of the async scheduler run in this one task.
        stop_requested = self._stop_requested = anyio.Event()
        self._loop_thread = threading.current_thread()
        try:
            async with self.scheduler:
                started.set_result(None)
                await stop_requested.wait()
                await self.scheduler.stop(self._grace)
        except Exception:
            raise
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            # SystemExit or KeyboardInterrupt raised by a handler or a subscriber: raised
            # as it is, it would end the loop every SyncScheduler and SyncLease of the
            # process shares. It ends this scheduler only; stop() raises it.
            raise AnarchonError(
                f"SyncScheduler {self.instance_id!r} ended: {exc!r} was raised in it "
                "(by a handler or a subscriber?)") from exc

    def _request_stop(self, grace: float, requested: anyio.Event | None = None) -> None:
        """Ask the host task to stop (on the loop): see :func:`_request_stop`."""
        _request_stop(self, grace, requested)

    def stop(self, grace: Duration = "10s") -> None:
        """Stop claiming, let handlers finish for ``grace``, hand over the rest; block.

        Returns once every run still held is handed over and the scheduler has ended on
        the background loop (which goes on for the process's other SyncSchedulers and
        SyncLeases). A no-op when not started, so it may be called more than once. Called
        by one of the scheduler's own sync handlers, it only requests the stop and returns
        (the handler's run can then complete); a later ``stop()`` from outside, or the
        interpreter's exit, waits for the scheduler. Interrupted while it waits (a second
        Ctrl-C), it raises that; the scheduler goes on handing over, and a later
        ``stop()`` or the interpreter's exit waits for it. Called by a signal's handler
        that interrupted :meth:`start`, the scheduler stops as soon as it has started. A
        ``stop()`` with a shorter grace than the one under way (from another thread, or
        after a second Ctrl-C) shortens it.
        """
        grace_s = parse_duration(grace, what="grace", allow_zero=True)
        self._check_process()
        self._check_thread("stop")
        if _INSIDE.get() is self.scheduler:
            # Called by one of its own sync handlers: waiting would wait for the caller.
            # (Read once: a stop from outside ending meanwhile clears them.)
            portal, requested = self._portal, self._stop_requested
            if portal is not None and requested is not None:
                portal.call(self._request_stop, grace_s, requested)
            return
        if self._state is SchedulerState.STOPPING and (portal := self._portal) is not None:
            with contextlib.suppress(Exception):  # another stop() holds the lock: shorten it
                portal.call(self._request_stop, grace_s)  # (or it ended: portal closed)
        with self._lock:
            if self._state is SchedulerState.STARTING:
                # Only this thread can be here now (start() holds the lock): a signal's
                # handler that interrupted start(). start() stops it once it runs.
                self._stop_pending = grace_s
                return
            if self._state is not SchedulerState.RUNNING:
                return
            self._state = SchedulerState.STOPPING
            portal, host = self._portal, self._host
            assert portal is not None and host is not None
            atexit.unregister(self._stop_at_exit)
            error: BaseException | None = None
            try:
                if not host.done():
                    portal.call(self._request_stop, grace_s)
                host.result()
            except BaseException as exc:
                if not host.done():
                    # The caller was interrupted (a second Ctrl-C, a signal's handler
                    # raising) while the scheduler hands over: it goes on stopping on the
                    # loop, and a later stop(), or the interpreter's exit, waits for it
                    # (else the exit would cancel it, and its runs would lapse).
                    self._state = SchedulerState.RUNNING
                    atexit.register(self._stop_at_exit)
                    raise
                error = exc
            finally:
                if self._state is SchedulerState.STOPPING:
                    self._portal = self._host = None
                    self._stop_requested = self._loop_thread = None
                    self._pid = None
                    self._state = SchedulerState.STOPPED
            if error is not None:
                raise error

    def _stop_at_exit(self) -> None:
        if self._pid != os.getpid():
            return  # a forked child: the scheduler runs in the parent, not here
        try:
            self.stop(self.exit_grace)
        except Exception:
            logger.exception("SyncScheduler %s failed to stop at exit", self.instance_id)

    def __enter__(self) -> SyncScheduler:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def events_dropped(self) -> int:
        """Events dropped because a subscriber's buffer was full (since creation), as
        :attr:`Scheduler.events_dropped`; readable from any thread."""
        return self.scheduler.events_dropped

    def subscribe(self, callback: Callable[[ev.Event], Any]) -> Callable[[], None]:
        """Call ``callback`` with every event; return a function that unsubscribes it.

        As :meth:`Scheduler.subscribe`, from any thread, before or after :meth:`start`
        (while running, the subscription is made on the scheduler's own thread, and so is
        the unsubscription, wherever the subscription was made).
        """
        self._check_process()
        portal = self._live_portal()
        unsubscribe: Callable[[], None]
        if portal is None or threading.current_thread() is self._loop_thread or _Loop.here():
            unsubscribe = self.scheduler.subscribe(callback)
        else:
            unsubscribe = portal.call(self.scheduler.subscribe, callback)

        def off() -> None:
            # Made before start() too: while the scheduler runs, the subscriber's stream
            # is closed on the loop's thread, not beside the loop feeding it.
            self._on_loop(unsubscribe)

        return off

    # ----------------------------------------------------------------- history

    def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return the recorded attempts, newest first, of ``job`` or of every job.

        Works before :meth:`start` and after :meth:`stop` too (on the background loop).
        """
        return self._read("history", self.scheduler.history, job, limit)

    def recovery_log(self, run: str | tuple[str, int | str]) -> list[RecoveryEntry]:
        """Return the recovery log of one run, oldest first: see :meth:`Scheduler.recovery_log`.

        Works before :meth:`start` and after :meth:`stop` too (on the background loop).
        """
        return self._read("recovery_log", self.scheduler.recovery_log, run)

    def _read(self, what: str, read: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """``read(*args)`` on the scheduler's loop (the background loop's), bounded by
        :attr:`call_timeout`."""
        self._check_process()
        self._check_thread(what)
        async def bounded() -> _T:
            return await answered_within(self.call_timeout, f"SyncScheduler.{what}()",
                                         "nothing was read", read, *args)

        portal = self._live_portal()
        if portal is not None:
            try:
                return portal.call(bounded)
            except RuntimeError:
                if self._portal is portal:
                    raise
                # stopped meanwhile: read on the background loop anew
        return _Loop.get().call(bounded)


class SyncAdmin:
    """:class:`~lease_core.Admin` for sync code: the same operations, each blocking
    until the store has it.

    ``SyncAdmin(backend, by="ops")`` makes them on the process's background event loop,
    the one every :class:`SyncScheduler` and :class:`~lease_core.SyncLease` uses, so the
    same backend object may serve them all (an :class:`~lease_core.Admin` driven by
    ``anyio.run`` in another thread may not use a backend a SyncScheduler holds open:
    its connections belong to the background loop). ``sync_scheduler.admin`` is one,
    made as that instance. Every refusal raises
    :class:`~lease_core.errors.OperationRefused` and changes nothing, as :class:`Admin`'s.

    From an async handler (on the background loop), use ``await
    sync_scheduler.scheduler.admin.trigger(...)``: a blocking call there would wait on
    the loop it blocks, and raises :class:`~lease_core.errors.AnarchonError`. In a
    forked child, make a SyncAdmin and its backend anew. A call interrupted while it
    waits (Ctrl-C) raises that at once, but the operation goes on on the background loop
    and may still be made: read the store (:meth:`paused`, the history) to know.

    Each call waits ``call_timeout`` (default 30 s) at most for the store's answer, then
    raises :class:`~lease_core.errors.BackendUnavailable`; an operation given up so may
    still have been made, as one interrupted.
    """

    def __init__(self, backend: Backend, *, by: str = "admin",
                 call_timeout: Duration = "30s",
                 _owner: SyncScheduler | None = None) -> None:
        self.admin = Admin(backend, by=by)
        """The async :class:`~lease_core.Admin` whose operations this one makes."""
        self.call_timeout: float = parse_duration(call_timeout, what="call_timeout")
        """Seconds each call waits for the store's answer before raising
        ``BackendUnavailable``."""
        self._owner = _owner
        self._pid: int | None = None

    @property
    def by(self) -> str:
        """Who acts, as recorded with each operation."""
        return self.admin.by

    def _call(self, what: str, operation: Callable[..., Any], *args: Any) -> Any:
        if self._owner is not None:
            self._owner._check_process()
        # A fork of a process that used it, or that held its backend open on the
        # background loop (no loop here yet): the connections are the parent's, and
        # using them here breaks the parent's.
        if self._pid not in (None, os.getpid()) or (
                _Loop.pid not in (0, os.getpid()) and self.admin.backend._users):
            raise AnarchonError(
                f"SyncAdmin.{what}(): this process is a fork of one that used it or had its "
                "backend open (its connections are the parent's); make a SyncAdmin, and "
                "its backend, in the child")
        if _Loop.here():
            raise AnarchonError(
                f"SyncAdmin.{what}() would block the event loop it runs on (called from an "
                f"async handler?); there, use 'await scheduler.admin.{what}(...)'")
        self._pid = os.getpid()
        after = ("nothing was read" if what == "paused" else
                 "the operation may still have been made: read the store (paused(), the "
                 "history) to know")
        return _Loop.get().call(partial(answered_within, self.call_timeout,
                                        f"SyncAdmin.{what}()", after, operation, *args))

    def trigger(self, job: str) -> int:
        """Make one extra run of ``job`` now; return its slot (:meth:`Admin.trigger`)."""
        slot: int = self._call("trigger", self.admin.trigger, job)
        return slot

    def pause(self, job: str) -> None:
        """Stop the fleet claiming new slots of ``job`` (:meth:`Admin.pause`)."""
        self._call("pause", self.admin.pause, job)

    def resume(self, job: str) -> None:
        """Let the fleet claim new slots of a paused ``job`` again (:meth:`Admin.resume`)."""
        self._call("resume", self.admin.resume, job)

    def retry(self, job: str, slot: int | str | datetime) -> None:
        """Run a failed, timed-out or escalated run again (:meth:`Admin.retry`); a cancelled
        one is refused."""
        self._call("retry", self.admin.retry, job, slot)

    def cancel(self, job: str, slot: int | str | datetime,
               grace: float | str | object = "10s") -> None:
        """End a run ``cancelled``; nobody takes it over (:meth:`Admin.cancel`)."""
        self._call("cancel", self.admin.cancel, job, slot, grace)

    def paused(self) -> dict[str, str]:
        """The paused jobs and workflows, each with who paused it (:meth:`Admin.paused`)."""
        found: dict[str, str] = self._call("paused", self.admin.paused)
        return found
