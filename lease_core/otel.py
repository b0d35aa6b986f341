"""OpenTelemetry metrics for a scheduler, built on its events (extra ``otel``).

``instrument(scheduler)`` subscribes to the scheduler's events and records:

- ``anarchon.attempts`` (counter): every attempt that ended, with the attributes ``job``,
  ``reason`` and ``outcome`` (skipped and escalated runs included);
- ``anarchon.run.duration`` (histogram, seconds): from the claim to the end of each of this
  instance's attempts, with ``job`` and ``outcome``;
- ``anarchon.claim.duration`` (histogram, seconds): each claim the store answered ``won``,
  ``running`` (held elsewhere, or a retry not due yet), ``skipped`` or ``escalated``, with
  ``job`` and that ``status`` (a claim of a run already finished is not recorded);
- ``anarchon.leases.held`` (up-down counter): the runs this instance holds, by ``job``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import ConfigurationError
from .events import AttemptEnded, Claimed, Escalated, Event, Skipped, StandingBy

try:
    from opentelemetry import metrics
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ConfigurationError(
        f"lease_core.otel needs {exc.name!r}; install it with: pip install 'anarchon[otel]'"
    ) from None

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["CLAIM_BUCKETS", "RUN_BUCKETS", "instrument"]

#: Histogram buckets (seconds) of ``anarchon.run.duration``: jobs run for seconds to hours.
RUN_BUCKETS = [0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0]
#: Histogram buckets (seconds) of ``anarchon.claim.duration``: a claim is one round trip.
CLAIM_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


def instrument(
    scheduler: Scheduler, meter_provider: metrics.MeterProvider | None = None
) -> Callable[[], None]:
    """Record the scheduler's metrics with ``meter_provider`` (the global one by default).

    Returns a function that stops recording. The metrics are recorded by an event
    subscriber, so they never delay the scheduler. A run held when the process is killed
    stays counted in ``anarchon.leases.held`` of that process, which ends with it.
    """
    from . import __version__

    meter = metrics.get_meter("anarchon", __version__, meter_provider=meter_provider)
    attempts = meter.create_counter(
        "anarchon.attempts", unit="{attempt}", description="Attempts that ended, by outcome")
    run_duration = meter.create_histogram(
        "anarchon.run.duration", unit="s", description="From claim to end of an attempt",
        explicit_bucket_boundaries_advisory=RUN_BUCKETS)
    claim_duration = meter.create_histogram(
        "anarchon.claim.duration", unit="s", description="Claims in the store",
        explicit_bucket_boundaries_advisory=CLAIM_BUCKETS)
    held = meter.create_up_down_counter(
        "anarchon.leases.held", unit="{lease}", description="Runs this instance holds")

    async def record(event: Event) -> None:
        if isinstance(event, Claimed):
            held.add(1, {"job": event.job})
            claim_duration.record(event.claim_duration, {"job": event.job, "status": "won"})
        elif isinstance(event, StandingBy):
            claim_duration.record(event.claim_duration,
                                  {"job": event.job, "status": "running"})
        elif isinstance(event, Skipped | Escalated):
            outcome = "skipped" if isinstance(event, Skipped) else "escalated"
            claim_duration.record(event.claim_duration, {"job": event.job, "status": outcome})
            attempts.add(1, {"job": event.job, "reason": str(event.reason),
                             "outcome": outcome})
        elif isinstance(event, AttemptEnded):
            outcome = str(event.outcome)
            held.add(-1, {"job": event.job})
            attempts.add(1, {"job": event.job, "reason": str(event.reason),
                             "outcome": outcome})
            run_duration.record(event.duration, {"job": event.job, "outcome": outcome})

    return scheduler.subscribe(record)
