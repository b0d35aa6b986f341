"""A view of the scheduler's recent runs, read from the store."""

from django.http import HttpRequest, JsonResponse

from jobs.scheduler import scheduler


def runs(request: HttpRequest) -> JsonResponse:
    """The latest attempts of every job, newest first."""
    attempts = scheduler.history(limit=20)
    return JsonResponse({"runs": [
        {"job": a.job, "scheduled_at": a.scheduled_at.isoformat(), "slot": a.slot,
         "instance": a.instance_id, "outcome": a.outcome}
        for a in attempts
    ]})
