"""What every engine component shares: the settings, the lifecycle states, the limits."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .._backend_check import check_backend
from .._checks import check_storable
from .._durations import parse_duration, to_ms
from ..abc import Backend
from ..errors import ConfigurationError

__all__ = [
    "CATCH_UP_LIMIT",
    "CATCH_UP_WINDOW_MS",
    "EVENTS_PER_JOB",
    "EVENT_BUFFER",
    "HANDLER_THREADS",
    "INSIDE",
    "PRUNE_BATCH",
    "PRUNE_JOBS",
    "SUBSCRIBER_THREADS",
    "Carry",
    "SchedulerState",
    "Settings",
    "check_clock",
    "check_options",
    "is_async",
    "logger",
    "timer_slack_ms",
    "unrun",
]

logger = logging.getLogger("anarchon")

#: Events a subscriber may fall behind by; later ones are dropped (and counted).
EVENT_BUFFER = 1000
#: ... or this many per declared job, when more: every job due at the same instant is
#: claimed and ended within a few turns of the event loop, faster than a subscriber that
#: keeps up takes the events (one a turn), and such a burst must fit in its buffer.
EVENTS_PER_JOB = 4
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

#: Set inside a scheduler's handler and subscriber tasks to the scheduler that owns them,
#: so that stop() called by one of them only requests the stop instead of waiting for
#: itself.
INSIDE: ContextVar[object | None] = ContextVar("anarchon_scheduler", default=None)


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


@dataclass(slots=True)
class Settings:
    """A scheduler's options, as every component of its engine reads them.

    Components read ``backend`` at every call, so a backend replaced on the scheduler (a
    test's wrapper, say) is used from the next call on.
    """

    backend: Backend
    instance_id: str
    heartbeat: float
    """Seconds between two ticks (renewals and backup checks)."""
    lease: float
    """The default lease of a job, in seconds."""
    history_size: int
    history_ttl_ms: int | None
    prune_every: float | None
    """Seconds between the fleet's history trimmings, or ``None`` for none."""
    clock: Callable[[], float]
    """The local monotonic clock, in seconds."""
    owner: object
    """The scheduler these settings belong to (the value of :data:`INSIDE` in its tasks)."""
    max_running: int | None = None
    """The most handlers this instance runs at once; at that number it claims nothing."""
    timer_slack_ms: int = 0
    """How late (ms) a slot may be claimed so that it shares a wake-up with later ones."""


@dataclass
class Carry:
    """What a scheduler keeps from one start to the next."""

    prune_next: str | None = None
    """The job the next history trimming starts with (where the last one's budget ran out)."""
    quarantine_logged: dict[str, int | None] = field(default_factory=dict)
    """Per job, the end of the store's quarantine last logged (logged once each)."""
    shared_id_warned: bool = False
    """A run held under this instance's id by another process was logged (once)."""
    abandoned: set[Any] = field(default_factory=set)
    """Threads of sync handlers still running after their run stopped waiting for them (a
    timeout, a stop): they count against ``max_running`` after a restart too."""


def check_options(backend: object, instance_id: object, history_size: object,
                  max_running: object) -> None:
    """Refuse a scheduler's options that are not what :class:`Scheduler` takes."""
    check_backend(backend)
    if instance_id is not None and (
        not isinstance(instance_id, str) or not instance_id.strip()
    ):
        raise ConfigurationError(f"instance_id={instance_id!r} must be a non-empty string")
    if instance_id is not None:
        check_storable("instance_id", instance_id)
    if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 1:
        raise ConfigurationError(f"history_size={history_size!r} must be an integer >= 1")
    if max_running is not None and (
        isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1
    ):
        raise ConfigurationError(
            f"max_running={max_running!r} must be an integer >= 1, or None for no limit")


def check_clock(clock: object) -> None:
    """Refuse ``Scheduler(clock=...)`` that is not callable (it failed at ``start()``)."""
    if clock is not None and not callable(clock):
        raise ConfigurationError(
            f"clock={clock!r} is not callable; pass a function returning the local "
            "monotonic time in seconds (such as time.monotonic), or None")


def timer_slack_ms(value: object, *, heartbeat: tuple[float, object]) -> int:
    """``Scheduler(timer_slack=value)`` in milliseconds, or a :class:`ConfigurationError`.

    ``heartbeat`` is the scheduler's heartbeat in seconds and as it was given: the slack
    must be shorter (the dispatcher never uses more than a quarter of it anyway).
    """
    seconds = parse_duration(value, what="timer_slack", allow_zero=True)
    if seconds >= heartbeat[0]:
        raise ConfigurationError(
            f"timer_slack={value!r} must be shorter than the heartbeat ({heartbeat[1]!r}); "
            "the default is 50ms, and 0 claims every slot at its own instant")
    return to_ms(seconds)


def is_async(handler: Callable[..., Any]) -> bool:
    """True when ``handler`` (a function or a callable object) is a coroutine function."""
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - callable objects too
    return call is not None and inspect.iscoroutinefunction(call)


def unrun(value: Any, function: Any, what: str, effect: str, *, where: str = "",
          fix: str) -> TypeError | None:
    """The failure of a plain ``function`` (a ``what``: a handler, an event subscriber)
    that returned ``value`` without running it, or ``None`` when ``value`` is not one.

    A lambda or a wrapper without ``async`` around an ``async def`` returns a coroutine
    nobody awaits; around a function with ``yield``, a generator: none of the work ran.
    ``effect`` says what became of the call, ``where`` where to do the work instead of
    yielding, ``fix`` how to declare it (followed by the lambda and wrapper case). The
    value is closed, so no "coroutine was never awaited" warning comes at its collection.
    """
    generator = inspect.isgenerator(value) or inspect.isasyncgen(value)
    if not (generator or inspect.isawaitable(value)):
        return None
    close = getattr(value, "close", None)
    if (inspect.iscoroutine(value) or inspect.isgenerator(value)) and callable(close):
        close()
    name = getattr(function, "__qualname__", None) or repr(function)
    made = getattr(value, "__qualname__", None)
    return TypeError(
        f"the {what} {name} is a plain function that returned a {type(value).__name__}"
        f"{f' of {made}' if made else ''} without running it, {effect}: "
        + (f"a function with 'yield' runs none of its body when called; do the work{where} "
           "without 'yield'" if generator else
           f"{fix} 'async def' (a lambda or a wrapper that calls an async function must be "
           "'async def' and await it)"))
