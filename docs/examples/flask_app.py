"""Flask: an app factory that starts a SyncScheduler.

Run it with ``ANARCHON_URL=postgresql://... flask --app flask_app run`` (``--debug`` too:
under the debug reloader only the serving process starts a scheduler, not the watcher
that restarts it; without the reloader the one process does). ``app.run(debug=True)``
starts the reloader after the app is built, so pass it ``use_reloader=False`` (or use
``flask run``). Under gunicorn, load the app in each worker (no ``--preload``), so that
the scheduler starts after the fork. The scheduler stops with a hand-over at interpreter
exit; gunicorn's ``worker_exit`` hook may stop it explicitly:
``app.extensions["anarchon"].stop()``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flask import Flask

from lease_core import RunContext, SyncScheduler, backend_from_url


def refresh_report(ctx: RunContext) -> None:
    """A sync handler: it runs in a worker thread, never in a request."""
    ctx.log.info("refreshing the report due at %s", ctx.scheduled_at.isoformat())


def serving_process(app: Flask) -> bool:
    """Whether this process serves requests: false only in the debug reloader's watcher.

    ``flask run`` with the reloader (``--debug`` turns it on) loads the app twice: in a
    watcher process, which restarts the server when a file changes and serves nothing,
    and in the server it starts with ``WERKZEUG_RUN_MAIN=true``. A scheduler started in
    both would be two instances. Without the reloader (``--no-reload``,
    ``FLASK_RUN_RELOAD=false``, ``app.run(debug=True, use_reloader=False)``, gunicorn with
    ``FLASK_DEBUG=1``) there is one process, and it serves.
    """
    if os.environ.get("WERKZEUG_RUN_MAIN") == "true":
        return True  # the server the reloader started
    return not _reloader_watcher(app)


def _reloader_watcher(app: Flask) -> bool:
    """True while ``flask run`` loads the app in a process that will run the reloader."""
    import click

    context = click.get_current_context(silent=True)
    if context is None or context.info_name != "run" or "reload" not in context.params:
        return False  # not under `flask run`: app.run(), gunicorn, a test client
    reload = context.params["reload"]  # --reload/--no-reload or $FLASK_RUN_RELOAD, if given
    return bool(app.debug if reload is None else reload)  # flask run's own default


def create_app(config: dict[str, Any] | None = None) -> Flask:
    """Build the app and start its scheduler (in the serving process only)."""
    # anarchon logs to the 'anarchon' logger, silent until the application configures
    # logging: show it on the console.
    logging.getLogger("anarchon").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = Flask(__name__)
    app.config.from_mapping(
        ANARCHON_URL=os.environ.get("ANARCHON_URL", "memory://"),
        REPORT_INTERVAL=os.environ.get("REPORT_INTERVAL", "1m"),
    )
    app.config.update(config or {})

    scheduler = SyncScheduler(backend_from_url(app.config["ANARCHON_URL"]))
    scheduler.every("refresh-report", app.config["REPORT_INTERVAL"], refresh_report)
    if serving_process(app):
        scheduler.start()
    app.extensions["anarchon"] = scheduler

    @app.get("/runs")
    def runs() -> list[dict[str, Any]]:
        return [
            {"job": a.job, "scheduled_at": a.scheduled_at.isoformat(), "slot": a.slot,
             "instance": a.instance_id, "outcome": a.outcome,
             "claimed_at": a.claimed_at.isoformat(),
             "finished_at": a.finished_at.isoformat() if a.finished_at else None}
            for a in scheduler.history(limit=20)
        ]

    return app
