"""Declaring jobs and workflows: names, options and their checks, before a scheduler starts."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from .._durations import Duration, parse_duration, to_ms
from ..context import RunContext
from ..errors import ConfigurationError
from ..recovery import step_job
from ..retry import Retry, to_retry
from ..schedules import CronSchedule, IntervalSchedule, Schedule
from ..workflows import Workflow, check_name
from .base import is_async

__all__ = ["Handler", "Job", "JobRegistry"]

Handler = Callable[[RunContext], Any]
H = TypeVar("H", bound=Handler)

_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,199}")
_OVERLAP = ("skip", "allow")
_CATCH_UP = ("latest", "all", "none")


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
    retry: Retry | None = None
    """How failures are retried within the run (``None``: never)."""

    @property
    def next_step(self) -> Job | None:
        """The job of the workflow step after this one, if any."""
        return None if self.workflow is None else self.workflow.next_job(self)

    @property
    def scheduled(self) -> bool:
        """True when the job's own schedule claims its slots (all but later steps)."""
        return self.workflow is None or self.workflow.jobs[0] is self


def _check_max_attempts(max_attempts: object) -> None:
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
    ):
        raise ConfigurationError(
            f"max_attempts={max_attempts!r} must be an integer >= 1, or None for no limit"
        )


def check_handler(handler: object, what: str) -> None:
    """Refuse a handler that cannot be called with the run's context, its one argument
    (``def job(): ...`` was declared, and then failed every run with a TypeError)."""
    if not callable(handler):
        hint = ""
        if inspect.iscoroutine(handler):
            # every("j", "5m", job(ctx)) or job(): the call's coroutine, not the function.
            handler.close()  # never awaited, on purpose: no RuntimeWarning
            hint = (f"; pass the function itself ({handler.__qualname__}), "
                    "not the coroutine a call of it made")
        raise ConfigurationError(f"handler {handler!r} of {what} is not callable{hint}")
    call = getattr(handler, "__call__", None)  # noqa: B004 - callable objects too
    for kind, test in (("an async generator", inspect.isasyncgenfunction),
                       ("a generator", inspect.isgeneratorfunction)):
        if test(handler) or (call is not None and test(call)):
            # Calling it only makes a generator: its body never ran, and every run was
            # recorded completed.
            raise ConfigurationError(
                f"handler {handler!r} of {what} is {kind} function (its body has "
                "'yield'): calling it would run none of its body; declare it as "
                "'def handler(ctx)' or 'async def handler(ctx)' without 'yield'")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # no signature to read (some builtins): it may work
        return
    try:
        signature.bind(None)
    except TypeError as exc:
        raise ConfigurationError(
            f"handler {handler!r} of {what} cannot be called with one argument, the run's "
            f"context ({exc}); declare it as 'def handler(ctx)' or 'async def handler(ctx)'"
        ) from None


class JobRegistry:
    """The jobs and workflows of one scheduler, checked as they are declared.

    ``heartbeat`` and ``lease`` are the scheduler's (seconds); ``is_open`` tells whether
    declarations are still accepted (the scheduler is stopped).
    """

    def __init__(self, *, heartbeat: float, lease: float, is_open: Callable[[], bool]) -> None:
        self.heartbeat = heartbeat
        self.lease = lease
        self._is_open = is_open
        self.jobs: dict[str, Job] = {}
        """The declared jobs, by name (a workflow's steps are jobs ``<workflow>/<step>``)."""
        self.workflows: dict[str, Workflow] = {}
        """The declared workflows, by name."""

    def check_lease(self, seconds: float, what: str, given: object) -> None:
        """Refuse a lease shorter than three heartbeats."""
        beat_ms = to_ms(self.heartbeat)  # (both counted in whole ms, as the store does)
        if to_ms(seconds) < 3 * beat_ms:
            raise ConfigurationError(
                f"{what}={given!r} is shorter than 3 heartbeats ({beat_ms / 1000:g}s each); "
                f"use a {what} of at least {3 * beat_ms / 1000:g}s or a shorter heartbeat"
            )

    def check_declarable(self, what: str) -> None:
        """Refuse a declaration once the scheduler has started."""
        if not self._is_open():
            raise ConfigurationError(f"{what} declared after start(); declare it first")

    def declare(
        self,
        name: str,
        schedule: Schedule,
        handler: H | None,
        timeout: Duration | None,
        overlap: str,
        catch_up: str,
        max_attempts: int | None,
        lease: Duration | None,
        retry: object = None,
    ) -> Any:
        """Declare a job; without ``handler``, return a decorator that declares it."""
        if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
            raise ConfigurationError(
                f"job name {name!r} is invalid; use 1-200 characters: letters, digits and "
                "_ - . : / @, starting with a letter or digit"
            )
        if name in self.jobs:
            raise ConfigurationError(f"job {name!r} is already declared; job names must be unique")
        if name in self.workflows or name.rpartition("/")[0] in self.workflows:
            raise ConfigurationError(
                f"job {name!r}: a workflow of that name is declared (or its steps' jobs "
                "are named so); operations, the status and the recovery log would name "
                "both alike, so give the job another name")
        if not self._is_open():
            raise ConfigurationError(f"job {name!r} declared after start(); declare jobs first")
        if overlap not in _OVERLAP:
            raise ConfigurationError(f"overlap={overlap!r} is unknown; use one of {_OVERLAP}")
        if catch_up not in _CATCH_UP:
            raise ConfigurationError(f"catch_up={catch_up!r} is unknown; use one of {_CATCH_UP}")
        _check_max_attempts(max_attempts)
        policy = to_retry(retry)
        timeout_s = None if timeout is None else parse_duration(timeout, what="timeout")
        lease_s = self.lease if lease is None else parse_duration(lease, what="lease")
        self.check_lease(lease_s, "lease", lease)

        def register(fn: H) -> H:
            check_handler(fn, f"job {name!r}")
            if name in self.jobs:
                raise ConfigurationError(f"job {name!r} is already declared")
            self.jobs[name] = Job(
                name, schedule, fn, timeout_s, overlap, catch_up, max_attempts,  # type: ignore[arg-type]
                to_ms(lease_s), is_async(fn), retry=policy,
            )
            return fn

        if handler is None:
            return register
        return register(handler)

    def workflow(
        self,
        name: str,
        *,
        every: Duration | None,
        cron: str | None,
        tz: str,
        offset: Duration | None,
        max_attempts: int | None,
        timeout: Duration | None,
        lease: Duration | None,
        catch_up: str,
        retry: object = None,
    ) -> Workflow:
        """Declare a workflow (see :meth:`Scheduler.workflow <lease_core.Scheduler.workflow>`)."""
        check_name("workflow", name)
        self.check_declarable(f"workflow {name!r}")
        if name in self.workflows:
            raise ConfigurationError(f"workflow {name!r} is already declared; "
                                     "workflow names must be unique")
        under = sorted(j for j in self.jobs if j.startswith(name + "/"))
        if under:  # a job named as this workflow's step jobs are, <workflow>/<step>
            raise ConfigurationError(
                f"workflow {name!r}: the job {under[0]!r} is declared, named as this "
                f"workflow's steps' jobs are ('{name}/<step>'); give the job or the "
                "workflow another name")
        if name in self.jobs:
            raise ConfigurationError(
                f"workflow {name!r}: a job of that name is declared; operations, the status "
                "and the recovery log name both alike, so give the workflow another name")
        if (every is None) == (cron is None):
            raise ConfigurationError(
                f"workflow {name!r}: give exactly one of every=... (an interval) or "
                f"cron=... (an expression); got every={every!r}, cron={cron!r}"
            )
        if offset is not None and every is None:
            raise ConfigurationError(f"workflow {name!r}: offset={offset!r} needs every=...")
        if tz != "UTC" and cron is None:
            # An interval's slots are counted from the epoch: a time zone changes nothing,
            # and was ignored (every="24h", tz="Europe/Lisbon" ran at 00:00 UTC).
            raise ConfigurationError(
                f"workflow {name!r}: tz={tz!r} needs cron=... (every=... counts its "
                "intervals from the epoch, whatever the time zone; shift them with "
                "offset=...)")
        schedule: Schedule = (
            IntervalSchedule(every, offset or 0) if every is not None
            else CronSchedule(cron or "", tz)
        )
        if catch_up not in _CATCH_UP:
            raise ConfigurationError(f"catch_up={catch_up!r} is unknown; use one of {_CATCH_UP}")
        _check_max_attempts(max_attempts)
        timeout_s = None if timeout is None else parse_duration(timeout, what="timeout")
        if lease is not None:
            self.check_lease(parse_duration(lease, what="lease"), "lease", lease)
        wf = Workflow(self, name, schedule, timeout=timeout_s, max_attempts=max_attempts,
                      lease=lease, catch_up=catch_up)
        wf.retry = to_retry(retry)
        self.workflows[name] = wf
        return wf

    def declare_step(
        self,
        workflow: Workflow,
        step: str,
        handler: Handler,
        *,
        timeout: Duration | None,
        max_attempts: int | None,
        lease: Duration | None,
        first: bool,
        retry: object = None,
    ) -> Job:
        """Declare the job of a workflow's step (called by :meth:`Workflow.step`)."""
        name = step_job(workflow.name, step)
        check_handler(handler, f"step {name!r}")
        if name in self.jobs:
            raise ConfigurationError(f"job {name!r} is already declared; job names must be unique")
        _check_max_attempts(max_attempts)
        timeout_s = None if timeout is None else parse_duration(timeout, what="timeout")
        lease_s = self.lease if lease is None else parse_duration(lease, what="lease")
        self.check_lease(lease_s, "lease", lease)
        job = Job(
            name, workflow.schedule, handler, timeout_s,
            # One workflow run at a time: a new run is skipped while the first step of an
            # earlier one holds its lease. Later steps are never skipped.
            "skip" if first else "allow",
            workflow.catch_up,  # type: ignore[arg-type]
            max_attempts, to_ms(lease_s), is_async(handler), workflow=workflow, step=step,
            retry=to_retry(retry),
        )
        self.jobs[name] = job
        return job

    def check_complete(self) -> None:
        """Refuse to start with a workflow that has no steps."""
        for wf in self.workflows.values():
            if not wf.steps:
                raise ConfigurationError(
                    f"workflow {wf.name!r} has no steps; add them with @workflow.step(name) "
                    "before start()"
                )
