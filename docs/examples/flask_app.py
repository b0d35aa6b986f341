"""Flask: an app factory that starts a SyncScheduler.

Run it with ``ANARCHON_URL=postgresql://... flask --app flask_app run``. Under gunicorn,
load the app in each worker (no ``--preload``), so that the scheduler starts after the fork.
The scheduler stops with a hand-over at interpreter exit; gunicorn's ``worker_exit`` hook
may stop it explicitly: ``app.extensions["anarchon"].stop()``.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask

from lease_core import RunContext, SyncScheduler, backend_from_url


def refresh_report(ctx: RunContext) -> None:
    """A sync handler: it runs in a worker thread, never in a request."""
    ctx.log.info("refreshing the report due at %s", ctx.scheduled_at)


def create_app(config: dict[str, Any] | None = None) -> Flask:
    """Build the app and start its scheduler."""
    app = Flask(__name__)
    app.config.from_mapping(
        ANARCHON_URL=os.environ.get("ANARCHON_URL", "memory://"),
        REPORT_INTERVAL=os.environ.get("REPORT_INTERVAL", "1m"),
    )
    app.config.update(config or {})

    scheduler = SyncScheduler(backend_from_url(app.config["ANARCHON_URL"]))
    scheduler.every("refresh-report", app.config["REPORT_INTERVAL"], refresh_report)
    scheduler.start()
    app.extensions["anarchon"] = scheduler

    @app.get("/runs")
    def runs() -> list[dict[str, Any]]:
        return [
            {"job": a.job, "slot": a.slot, "instance": a.instance_id, "outcome": a.outcome}
            for a in scheduler.history(limit=20)
        ]

    return app
