"""FastAPI (or Starlette): the scheduler lives in the app's lifespan.

Run it with ``ANARCHON_URL=postgresql://... uvicorn fastapi_app:app``. Every worker
process is an instance; for each slot one of them runs the job and the others back it up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from lease_core import RunContext, Scheduler, backend_from_url

# anarchon logs to the 'anarchon' logger, silent until the application configures
# logging; uvicorn configures only its own loggers, so show anarchon's on the console.
logging.getLogger("anarchon").setLevel(logging.INFO)
if not logging.getLogger().handlers:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s %(message)s")

scheduler = Scheduler(backend_from_url(os.environ["ANARCHON_URL"]))


@scheduler.every("refresh-report", os.environ.get("REPORT_INTERVAL", "1m"))
async def refresh_report(ctx: RunContext) -> None:
    ctx.log.info("refreshing the report due at %s", ctx.scheduled_at.isoformat())


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Start and stop in the lifespan's one task; leaving the block stops the scheduler
    # and hands every run it still holds over to another instance.
    async with scheduler:
        yield


app = FastAPI(lifespan=lifespan)


@app.get("/runs")
async def runs() -> list[dict[str, Any]]:
    """The latest attempts of every job, newest first."""
    return [
        {"job": a.job, "scheduled_at": a.scheduled_at.isoformat(), "slot": a.slot,
         "instance": a.instance_id, "outcome": a.outcome}
        for a in await scheduler.history(limit=20)
    ]
