"""What ``anarchon status`` shows: the jobs a store knows, runs in progress, last outcomes.

Read only, through the backend's public reads (:meth:`~lease_core.abc.Backend.jobs`,
:meth:`~lease_core.abc.Backend.runs`), so it works on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ._structures import RunInfo, ms_to_datetime
from .abc import Backend

__all__ = ["JobStatus", "StoreStatus", "iso", "read_status", "render_status"]

#: How many recent runs of one job are read to find its last finished one.
_RECENT = 20


def iso(moment: datetime | None) -> str | None:
    """ISO-8601 with milliseconds (``2026-11-30T02:00:00.000+00:00``), or ``None``."""
    if moment is None:
        return None
    return moment.isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class JobStatus:
    """One job: its runs in progress and its last finished run."""

    name: str
    open: list[RunInfo]
    last: RunInfo | None


@dataclass(frozen=True)
class StoreStatus:
    """The store's clock and every job it knows."""

    now_ms: int
    jobs: list[JobStatus]

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (times as ISO-8601 UTC, slots also in epoch milliseconds)."""
        return {
            "now": iso(ms_to_datetime(self.now_ms)),
            "jobs": [
                {
                    "name": job.name,
                    "running": [_run_json(r) for r in job.open],
                    "last": None if job.last is None else _run_json(job.last),
                }
                for job in self.jobs
            ],
        }


def _run_json(run: RunInfo) -> dict[str, Any]:
    return {
        "slot": run.slot,
        "scheduled_at": iso(run.scheduled_at),
        "status": str(run.status),
        "attempt": run.attempt,
        "instance_id": run.instance_id,
        "lease_expires_at": iso(run.expires_at),
    }


async def read_status(backend: Backend, job: str | None = None) -> StoreStatus:
    """Read the status of every job (or of ``job``) from a started backend."""
    now = await backend.now_ms()
    names = await backend.jobs() if job is None else [job]
    open_runs = await backend.runs(job, open_only=True, limit=10_000)
    jobs = []
    for name in names:
        recent = await backend.runs(name, limit=_RECENT)
        last = next((r for r in recent if r.status.finished), None)
        jobs.append(JobStatus(name, [r for r in open_runs if r.job == name], last))
    return StoreStatus(now, jobs)


def render_status(status: StoreStatus) -> str:
    """The status as a table for a terminal."""
    now = iso(ms_to_datetime(status.now_ms))
    if not status.jobs:
        return f"store time {now}: no jobs recorded yet\n"
    lines = [f"store time {now}", ""]
    header = ("JOB", "LAST OUTCOME", "LAST SLOT (UTC)", "IN PROGRESS")
    rows = []
    for job in status.jobs:
        last = job.last
        progress = "; ".join(_describe_open(r, status.now_ms) for r in job.open) or "-"
        rows.append((job.name, str(last.status) if last else "-",
                     iso(last.scheduled_at) or "-" if last else "-", progress))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(3)]
    for row in (header, *rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
                     + "  " + row[3])
    return "\n".join(lines).rstrip() + "\n"


def _describe_open(run: RunInfo, now_ms: int) -> str:
    slot = iso(run.scheduled_at)
    if run.expires_ms is None:
        return f"slot {slot} attempt {run.attempt} {run.status} (by {run.instance_id})"
    left = (run.expires_ms - now_ms) / 1000
    state = f"lease {left:.1f}s left" if left > 0 else f"lease expired {-left:.1f}s ago"
    return (f"slot {slot} attempt {run.attempt} held by {run.instance_id}, "
            f"{state} (until {iso(run.expires_at)})")
