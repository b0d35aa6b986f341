"""The status API's operations: ``POST`` routes acting through :class:`~lease_core.Admin`.

=====================================  ==================================================
``POST /jobs/{name}/trigger``          one extra run now; answers its ``id`` and ``slot``
``POST /jobs/{name}/pause``            no instance claims new slots of the job
``POST /jobs/{name}/resume``           the fleet claims them again
``POST /jobs/{id}/retry``              a failed, timed-out or escalated run runs again
``POST /jobs/{id}/cancel``             the run ends ``cancelled`` (``?grace=10s``)
=====================================  ==================================================

Every POST needs the bearer token, even on 127.0.0.1: a server started without one
answers 403 naming ``ANARCHON_TOKEN``. Operations are recorded as made by ``http``. An
unknown job or a slot with no run answers 404, a run whose status does not allow the
operation 409, a malformed id or grace 400; each changes nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ._status import iso, parse_run_id
from ._structures import ms_to_datetime
from .abc import Backend
from .errors import ConfigurationError, OperationRefused, StoreRefused
from .operations import Admin

__all__ = ["operation_routes"]

#: The environment variable ``anarchon serve`` reads its token from (named in the 403).
TOKEN_ENV = "ANARCHON_TOKEN"


def _answer(body: dict[str, object], status: int = 200) -> Response:
    return JSONResponse(body, status, {"Cache-Control": "no-store"})


def operation_routes(backend: Backend, *, token: str | None) -> list[Route]:
    """The POST routes of the operations over ``backend`` (placed before the GET routes)."""
    admin = Admin(backend, by="http")

    def route(path: str, kind: str) -> Route:
        async def endpoint(request: Request) -> Response:
            if token is None:
                return _answer({"error": "operations need a bearer token: start the server "
                                         f"with ${TOKEN_ENV} (or --token) and send it"}, 403)
            try:
                return _answer(await act(request))
            except OperationRefused as exc:
                return _answer({"error": str(exc)}, 409 if exc.kind == "conflict" else 404)
            except StoreRefused:
                raise  # the store's setup, not the request: 503, as a store unreachable
            except ConfigurationError as exc:
                return _answer({"error": str(exc)}, 400)

        async def act(request: Request) -> dict[str, object]:
            if kind in ("trigger", "pause", "resume"):
                name = request.path_params["name"]
                if kind == "trigger":
                    slot = await admin.trigger(name)
                    return {"operation": kind, "id": f"{name}@{slot}", "name": name,
                            "slot": slot, "scheduled_at": iso(ms_to_datetime(slot)), "by": admin.by}
                await (admin.pause if kind == "pause" else admin.resume)(name)
                return {"operation": kind, "name": name, "paused": kind == "pause",
                        "by": admin.by}
            name, slot = parse_run_id(request.path_params["id"])
            if kind == "retry":
                await admin.retry(name, slot)
            else:
                await admin.cancel(name, slot, grace=request.query_params.get("grace", "10s"))
            return {"operation": kind, "id": f"{name}@{slot}", "name": name, "slot": slot,
                    "by": admin.by}

        handler: Callable[[Request], Awaitable[Response]] = endpoint
        return Route(path, handler, methods=["POST"])

    return [route("/jobs/{name:path}/trigger", "trigger"),
            route("/jobs/{name:path}/pause", "pause"),
            route("/jobs/{name:path}/resume", "resume"),
            route("/jobs/{id:path}/retry", "retry"),
            route("/jobs/{id:path}/cancel", "cancel")]
