"""Workflows: a scheduled run made of steps that run one after another, on any instance.

A **workflow run** is (workflow, slot). Each step is a run of its own: job
``<workflow>/<step>`` (:func:`~lease_core.recovery.step_job`) at the workflow run's slot, so
it is claimed, leased, heartbeated, fenced, taken over and handed over exactly like a job's
run, on every backend.

- The **scheduler** claims the first step at each slot of the workflow's schedule (with its
  ``catch_up``; a new workflow run is skipped while the first step of an earlier one still
  holds its lease). The instance that completes step *k* claims step *k + 1* at once, at the
  same slot, with reason ``scheduled``.
- The **agent** is whichever instance holds a step. The step's result (the JSON value its
  handler returns) is stored as the step run's checkpoint, fenced by its token, *before*
  the step's completion, so the next step reads it as ``ctx.results[step]``.
- The **supervisors** are the other instances: each backs up the steps it knows of, takes a
  step over when its lease expires (attempt + 1) or at once after a hand-over, and, when a
  watched step completed but its successor was never claimed (its agent died in between),
  claims the successor itself. A starting instance looks for such a gap in each
  workflow's latest run and in its recent runs (the newest ``history_size`` of each step,
  at least 100, at most 1000); an older run is continued only when its completed step's
  result names the same next step (a deploy that changed the workflow does not give its
  old runs the new steps).

**Checkpoint payload of a step run.** While a step runs, ``ctx.checkpoint`` stores its own
progress as ``{"progress": value}``; once it completes, the payload is
``{"result": value}`` (the last step's with ``"last": True``: a step added to the
workflow later is not run for that run; the others' with ``"next": <next step's name>``;
both with ``"steps"``, the definition's step names: another release tells a step inserted
since from one moved).
``ctx.checkpoint.get()`` returns only the progress, and ``ctx.results`` only the results:
the two never collide.

**Failures.** A step whose handler raises or times out is recorded ``failed`` /
``timed_out``: the workflow run is then failed at once, and later steps never run. Past a
step's ``max_attempts`` (the step's own, else the workflow's), the step is ``escalated``,
with the same consequence. A workflow run's status is derived from its steps' runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ._durations import Duration
from .errors import ConfigurationError
from .recovery import step_job
from .retry import Retry, RetryOption
from .schedules import Schedule

if TYPE_CHECKING:
    from .context import RunContext
    from .engine.jobs import Job, JobRegistry

__all__ = ["Workflow"]

Handler = Callable[["RunContext"], Any]
H = TypeVar("H", bound=Handler)

#: Names of workflows and steps: like job names, without "/" (which separates them).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,99}")


def check_name(what: str, name: object) -> str:
    """Return ``name`` if it is a valid workflow or step name, else raise ConfigurationError."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigurationError(
            f"{what} name {name!r} is invalid; use 1-100 characters: letters, digits and "
            "_ - . : @ (no '/'), starting with a letter or digit"
        )
    return name


class Workflow:
    """A declared workflow: its schedule, options and ordered steps.

    Made by :meth:`Scheduler.workflow <lease_core.Scheduler.workflow>`, which passes the
    scheduler's job registry (where each step is declared as a job); add steps with
    :meth:`step`, in the order they must run, before the scheduler starts.
    """

    def __init__(
        self,
        registry: JobRegistry,
        name: str,
        schedule: Schedule,
        *,
        timeout: float | None,
        max_attempts: int | None,
        lease: Duration | None,
        catch_up: str,
    ) -> None:
        self.name = name
        """The workflow's name; its steps run as jobs ``<name>/<step>``."""
        self.schedule = schedule
        """When its runs are due (the slots of its first step)."""
        self.timeout = timeout
        """The default timeout of each step, in seconds (``None``: none)."""
        self.max_attempts = max_attempts
        """The default ``max_attempts`` of each step."""
        self.lease = lease
        """The default lease of each step (``None``: the scheduler's)."""
        self.catch_up = catch_up
        """What happens to workflow runs missed while no instance was up."""
        self.retry: Retry | None = None
        """The default ``retry=`` of each step: a failed step is retried, never the
        steps already completed."""
        self._registry = registry
        self._steps: list[Job] = []

    @property
    def steps(self) -> list[str]:
        """The step names, in order."""
        return [job.step or "" for job in self._steps]

    @property
    def jobs(self) -> list[Job]:
        """The job of each step, in order."""
        return list(self._steps)

    def job(self, step: str) -> Job:
        """The job running ``step``."""
        for job in self._steps:
            if job.step == step:
                return job
        raise KeyError(step)

    def next_job(self, job: Job) -> Job | None:
        """The job of the step after ``job``'s, or ``None`` after the last step."""
        index = self._steps.index(job)
        return self._steps[index + 1] if index + 1 < len(self._steps) else None

    def previous_steps(self, job: Job) -> list[str]:
        """The steps before ``job``'s, in order."""
        return [j.step or "" for j in self._steps[: self._steps.index(job)]]

    @overload
    def step(self, name: str, handler: None = None, *, timeout: Duration | None = ...,
             max_attempts: int | None = ..., lease: Duration | None = ...,
             retry: RetryOption = ...) -> Callable[[H], H]: ...

    @overload
    def step(self, name: str, handler: H, *, timeout: Duration | None = ...,
             max_attempts: int | None = ..., lease: Duration | None = ...,
             retry: RetryOption = ...) -> H: ...

    def step(
        self,
        name: str,
        handler: H | None = None,
        *,
        timeout: Duration | None = None,
        max_attempts: int | None = None,
        lease: Duration | None = None,
        retry: RetryOption = None,
    ) -> Any:
        """Add the next step; without ``handler`` this returns a decorator.

        The handler gets a :class:`~lease_core.RunContext` with ``ctx.step`` and
        ``ctx.results`` (the results of the steps before it) and may return a JSON value,
        its result. ``timeout``, ``max_attempts``, ``lease`` and ``retry`` override the
        workflow's (a failed step with retries left is tried again, alone: the steps
        already completed never run again).
        Steps run in the order they are added; a duplicate name, or a step added after
        the scheduler started, raises :class:`ConfigurationError`.
        """
        check_name("step", name)
        if name in self.steps:
            raise ConfigurationError(
                f"step {name!r} is already declared in workflow {self.name!r}; "
                "step names must be unique within a workflow"
            )
        self._registry.check_declarable(f"step {name!r} of workflow {self.name!r}")

        def register(fn: H) -> H:
            job = self._registry.declare_step(
                self, name, fn,
                timeout=self.timeout if timeout is None else timeout,
                max_attempts=self.max_attempts if max_attempts is None else max_attempts,
                lease=self.lease if lease is None else lease,
                first=not self._steps,
                retry=self.retry if retry is None else retry,
            )
            self._steps.append(job)
            return fn

        if handler is None:
            return register
        return register(handler)

    def step_job(self, step: str) -> str:
        """The job name of ``step``'s runs: ``<workflow>/<step>``."""
        return step_job(self.name, step)

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, steps={self.steps!r})"
