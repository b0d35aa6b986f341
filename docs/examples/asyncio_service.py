"""A plain asyncio service: run the scheduler until SIGTERM or Ctrl-C, then hand over.

Run it with ``ANARCHON_URL=postgresql://... python asyncio_service.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal

from lease_core import RunContext, Scheduler, backend_from_url


async def refresh_report(ctx: RunContext) -> None:
    """Refresh a report; a long job would call ``ctx.raise_if_stopping()`` between items."""
    ctx.log.info("refreshing the report due at %s", ctx.scheduled_at)


async def main() -> None:
    """Run one instance until it is asked to stop."""
    scheduler = Scheduler(backend_from_url(os.environ["ANARCHON_URL"]))
    scheduler.every("refresh-report", os.environ.get("REPORT_INTERVAL", "1m"), refresh_report)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async with scheduler:
        print(f"instance {scheduler.instance_id} started", flush=True)
        await stop.wait()
        # Handlers see ctx.stopping; those still running after 10s are handed over.
        await scheduler.stop(grace="10s")
    print("stopped", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
