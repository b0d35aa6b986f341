"""anarchon: lease coordination for scheduled jobs.

Many instances of a service run the same scheduled jobs; for every scheduled run exactly
one instance wins and executes it, and the others stand by as backups. The public API is
imported from here; backends are loaded lazily, so a missing optional driver fails only
when its backend is used, with a message naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._structures import Attempt, Outcome, Reason, RunInfo, RunStatus, fence_of
from .errors import (
    AnarchonError,
    AuthenticationFailed,
    BackendUnavailable,
    ConfigurationError,
    LeaseLost,
    OperationRefused,
    StopRequested,
    StoreFormatError,
    StoreNotFound,
    StoreRefused,
)
from .events import (
    AttemptEnded,
    Cancelled,
    Claimed,
    Completed,
    Escalated,
    Event,
    Failed,
    HandedOver,
    HistoryTrimmed,
    Lost,
    Retried,
    RunEvent,
    Skipped,
    StandingBy,
    StoreBack,
    StoreUnreachable,
    TakenOver,
    TimedOut,
)
from .retry import Retry

if TYPE_CHECKING:
    from backends.memory import MemoryBackend
    from backends.postgres import PostgresBackend
    from backends.redis import RedisBackend

    from ._registry import backend_from_url
    from ._sync_lease import SyncLease
    from .abc import Backend
    from .context import Checkpoint, RunContext
    from .lease import Lease, LeaseHolder
    from .operations import Admin
    from .scheduler import Health, Scheduler, SchedulerState
    from .sync import SyncAdmin, SyncScheduler
    from .workflows import Workflow

__all__ = [
    "Admin",
    "AnarchonError",
    "Attempt",
    "AttemptEnded",
    "AuthenticationFailed",
    "Backend",
    "BackendUnavailable",
    "Cancelled",
    "Checkpoint",
    "Claimed",
    "Completed",
    "ConfigurationError",
    "Escalated",
    "Event",
    "Failed",
    "HandedOver",
    "Health",
    "HistoryTrimmed",
    "Lease",
    "LeaseHolder",
    "LeaseLost",
    "Lost",
    "MemoryBackend",
    "OperationRefused",
    "Outcome",
    "PostgresBackend",
    "Reason",
    "RedisBackend",
    "Retried",
    "Retry",
    "RunContext",
    "RunEvent",
    "RunInfo",
    "RunStatus",
    "Scheduler",
    "SchedulerState",
    "Skipped",
    "StandingBy",
    "StopRequested",
    "StoreBack",
    "StoreFormatError",
    "StoreNotFound",
    "StoreRefused",
    "StoreUnreachable",
    "SyncAdmin",
    "SyncLease",
    "SyncScheduler",
    "TakenOver",
    "TimedOut",
    "Workflow",
    "backend_from_url",
    "fence_of",
]

__version__ = "0.1.0"

# The library logs to "anarchon"; the application decides where that goes. No handler of
# its own (not even a NullHandler): with no logging configured, Python's last-resort
# handler prints the warnings and errors (a failed handler's traceback) on stderr.

_LAZY: dict[str, tuple[str, str]] = {
    "Admin": ("lease_core.operations", ""),
    "Scheduler": ("lease_core.scheduler", ""),
    "SchedulerState": ("lease_core.scheduler", ""),
    "Health": ("lease_core.scheduler", ""),
    "SyncScheduler": ("lease_core.sync", ""),
    "SyncAdmin": ("lease_core.sync", ""),
    "Workflow": ("lease_core.workflows", ""),
    "Lease": ("lease_core.lease", ""),
    "LeaseHolder": ("lease_core.lease", ""),
    "SyncLease": ("lease_core._sync_lease", ""),
    "RunContext": ("lease_core.context", ""),
    "Checkpoint": ("lease_core.context", ""),
    "Backend": ("lease_core.abc", ""),
    "backend_from_url": ("lease_core._registry", ""),
    "MemoryBackend": ("backends.memory", ""),
    "PostgresBackend": ("backends.postgres", "postgres"),
    "RedisBackend": ("backends.redis", "redis"),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, extra = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'lease_core' has no attribute {name!r}") from None
    if module_name.startswith("backends."):
        from ._packages import require_own

        require_own("backends")
        if extra:
            require_own("adapters")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if extra and not (exc.name or "").startswith(("backends", "lease_core", "adapters")):
            raise ConfigurationError(
                f"{name} needs the driver {exc.name!r}; install it with: "
                f"pip install 'anarchon[{extra}]'"
            ) from None
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
