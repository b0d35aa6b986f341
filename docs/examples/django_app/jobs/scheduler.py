"""The jobs, declared once; ``manage.py run_scheduler`` starts them."""

from django.conf import settings

from lease_core import RunContext, SyncScheduler, backend_from_url

scheduler = SyncScheduler(backend_from_url(settings.ANARCHON_URL))


@scheduler.every("refresh-report", settings.REPORT_INTERVAL)
def refresh_report(ctx: RunContext) -> None:
    """A sync handler, free to use the ORM: it runs in a worker thread."""
    ctx.log.info("refreshing the report due at %s", ctx.scheduled_at)
