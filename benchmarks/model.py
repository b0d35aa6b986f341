"""The scale model: store load and instance memory of a fleet, from per-operation costs.

A fleet is ``jobs`` jobs, each every ``interval_s`` seconds (slots spread evenly), run by
``instances`` schedulers with a heartbeat of ``heartbeat_s`` seconds, a lease of
``lease_s`` seconds and handlers of ``handler_s`` seconds. The scheduler's own rules
give the store calls per second (design section 6, the fleet):

- the member ranked first for a job claims its slot; the others claim it only when that
  one is late, so ``claims_per_slot`` (about 1, not ``instances``) claims per slot; the
  winner finishes the run (``jobs / interval_s`` finishes/s), the others find the run
  claimed at their next check and watch it;
- an instance wakes once for the slots due within its ``timer_slack`` (``slack_s``,
  never more than a quarter of the interval or of the heartbeat) of the first: with
  slots spread evenly, ``k = floor(slack / spacing) + 1`` slots per wake-up, of which
  it claims those ranked first for it in one call (a call when any is, chance
  ``1 - (1 - 1/instances)^k``), and their handlers, of equal length, end together and
  are finished in one call too;
- each instance renews its membership every half lease: ``2 x instances / lease_s``
  ``members`` calls/s;
- each instance renews **all** its leases with one heartbeat call per tick, and only in
  a tick where it holds a lease; it checks all the runs it watches with one check call
  per tick, only when it watches some;
- runs held at a time follow Little's law, ``held = jobs / interval_s x handler_s``,
  spread evenly over the instances; a backup watches a run from its claim until the
  first tick after the run ended, ``handler_s + heartbeat_s / 2`` on average;
- an instance asks the store for its clock only when no claim or heartbeat answered for
  half a heartbeat.

``Fleet(design="every_instance")`` is the model before the fleet design (every instance
claims every slot, ``instances x jobs / interval_s`` claims/s, no membership), kept for
comparison.

Costs (:class:`Costs`) come from the same run: statements (or round trips) per call,
the store's CPU per call and per lease or watched run, the store's idle CPU, and an
instance's RSS at start plus its RSS per declared job. The model is linear in these;
see ``benchmarks/RESULTS.md``, "Scale model", for the assumptions and where it is off.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lease_core.engine.dispatch import WINDOW_LIMIT

__all__ = ["Costs", "Fleet", "predict"]

#: The calls the model counts, in the order it reports them.
CALLS = ("claim", "finish", "heartbeat", "check", "members", "now")
#: The designs :func:`predict` knows.
DESIGNS = ("fleet", "every_instance")


@dataclass(frozen=True)
class Fleet:
    """A fleet of schedulers: the model's input."""

    jobs: int
    instances: int
    interval_s: float = 60.0
    handler_s: float = 1.0
    heartbeat_s: float = 5.0
    lease_s: float | None = None
    """The lease; ``None``: three heartbeats (the benchmarks' fleets)."""
    design: str = "fleet"
    """``fleet`` (ranked members, membership) or ``every_instance`` (before it)."""
    claims_per_slot: float = 1.0
    """Claims per slot in the fleet design (the ``fleet`` section measures it)."""
    slack_s: float = 0.05
    """The schedulers' ``timer_slack`` (their default, 50 ms; 0: a wake-up per slot)."""

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ValueError(f"Fleet design {self.design!r} is not one of {DESIGNS}")
        if self.jobs < 0 or self.instances < 1:
            raise ValueError(f"a fleet needs jobs >= 0 and instances >= 1, not "
                             f"{self.jobs} and {self.instances}")


@dataclass
class Costs:
    """Per-operation costs, measured (see ``benchmarks/scale.py``).

    ``statements_per_call``: store statements (PostgreSQL) or round trips (Redis) that
    one call of each kind costs. ``cpu_ms``: the store's CPU milliseconds per call of
    each kind (``claim_won``, ``claim_lost``, ``finish``, ``heartbeat``, ``check``,
    ``members``, ``now``), and per renewed lease (``heartbeat_lease``) and per checked run
    (``check_run``) on top. ``idle_cpu``: the store's CPU seconds per second with no
    client. ``rss_mb``: an instance's RSS with no job; ``kb_per_job``: added per
    declared job (its schedule, its job loop task).
    """

    statements_per_call: dict[str, float] = field(default_factory=dict)
    cpu_ms: dict[str, float] = field(default_factory=dict)
    idle_cpu: float = 0.0
    rss_mb: float = 0.0
    kb_per_job: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def predict(costs: Costs, fleet: Fleet) -> dict[str, Any]:
    """Statements (or round trips) per second by call, store CPU and RSS per instance."""
    m, h = fleet.instances, fleet.heartbeat_s
    lease = fleet.lease_s if fleet.lease_s is not None else 3 * h
    slots_s = fleet.jobs / fleet.interval_s
    held = slots_s * fleet.handler_s  # Little's law, whole fleet
    held_each = held / m
    # a backup watches a run from its slot (fleet: pending, then watched from its next
    # check) until the first tick after the run ended
    watched_each = slots_s * (m - 1) / m * (fleet.handler_s + h / 2)
    every = fleet.design == "every_instance"
    # the design before the fleet woke once per slot: it had no timer_slack
    per_wake = 1 if every else _slots_per_wake_up(fleet)
    # the wake-ups of the fleet in which an instance claims (and later finishes) any slot
    busy_wakes = m * slots_s / per_wake * (1 - (1 - 1 / m) ** per_wake)
    # an instance holding (watching) a Poisson number of runs holds none with e^-mean
    calls = {
        "claim": m * slots_s if every else min(m, fleet.claims_per_slot) * busy_wakes,
        "finish": busy_wakes,
        "heartbeat": m / h * (1 - math.exp(-held_each)),
        "check": m / h * (1 - math.exp(-watched_each)),
        "members": 0.0 if every or m < 2 else 2 * m / lease,
        "now": m / h * math.exp(-slots_s * h / 2),
    }
    per_call = costs.statements_per_call
    statements = {k: v * per_call.get(k, 1.0) for k, v in calls.items()}
    cpu = costs.cpu_ms
    won = slots_s
    lost = max(0.0, calls["claim"] - won)
    cpu_s = costs.idle_cpu + (
        won * cpu.get("claim_won", 0.0) + lost * cpu.get("claim_lost", 0.0)
        + calls["finish"] * cpu.get("finish", 0.0)
        + calls["heartbeat"] * cpu.get("heartbeat", 0.0)
        + held / h * cpu.get("heartbeat_lease", 0.0)
        + calls["check"] * cpu.get("check", 0.0)
        + m * watched_each / h * cpu.get("check_run", 0.0)
        + calls["members"] * cpu.get("members", 0.0)
        + calls["now"] * cpu.get("now", 0.0)
    ) / 1000
    return {
        "fleet": asdict(fleet),
        "calls_s": {k: round(v, 2) for k, v in calls.items()},
        "statements_s_by_call": {k: round(v, 2) for k, v in statements.items()},
        "statements_s": round(sum(statements.values()), 1),
        "upkeep_statements_s": round(statements["heartbeat"] + statements["check"], 2),
        "store_cpu_cores": round(cpu_s, 3),
        "held": round(held, 1),
        "watched_per_instance": round(watched_each, 1),
        "rss_mb_per_instance": round(costs.rss_mb + costs.kb_per_job * fleet.jobs / 1024, 1),
    }


def _slots_per_wake_up(fleet: Fleet) -> int:
    """Slots one wake-up of an instance claims: those within its slack of the first."""
    if fleet.jobs == 0:
        return 1
    slack = max(0.0, min(fleet.slack_s, fleet.interval_s / 4, fleet.heartbeat_s / 4))
    spacing = fleet.interval_s / fleet.jobs
    return max(1, min(fleet.jobs, WINDOW_LIMIT, math.floor(slack / spacing + 1e-9) + 1))


def error(predicted: float | None, measured: float | None) -> float | None:
    """Relative error of a prediction, (predicted - measured) / measured."""
    if predicted is None or not measured:
        return None
    return round((predicted - measured) / measured, 3)
