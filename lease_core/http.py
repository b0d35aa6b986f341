"""The status API: an HTTP view of the jobs, workflows and recovery logs of a store, and
the operations (``POST``, always with the token: see :mod:`lease_core._http_operations`).

:func:`create_app` returns an ASGI application built on Starlette (extra ``http``:
``pip install 'anarchon[http]'``); ``anarchon serve --url URL`` runs it with uvicorn.

=================================  ===========================================================
``GET /jobs``                      every job and workflow the store knows, each with its latest
                                   runs (``?limit=N``, 1 to 100, default 5); a workflow's steps
                                   are shown in its runs, not as jobs
``GET /overview``                  one row per job and workflow: kind, schedule, next slot,
                                   last outcome, when and how long, runs in progress with
                                   holder and lease left (``retry_at`` for one waiting for
                                   its retry); ``?status=`` (all, running, failed, ok,
                                   never), ``?q=`` (part of the name), ``?page=``,
                                   ``?per_page=`` (up to 200); with the count of every
                                   filter
``GET /runs/{name}``               one job's or workflow's latest runs (``?limit=N``, default
                                   20)
``GET /jobs/{id}``                 one run; ``id`` is ``<name>@<slot>``, the slot in epoch
                                   milliseconds or ISO-8601 UTC (``export@2026-11-30T02:00Z``);
                                   ``?log=1`` adds its ``recovery_log``
``GET /jobs/{id}/recovery-log``    the run's recovery log, oldest entry first
``GET /``                          a page showing the same, refreshing itself, with no assets
                                   from elsewhere
=================================  ===========================================================

An unknown id answers 404 and a malformed one 400; every error is JSON ``{"error": ...}``
(503 when the store cannot be read). A run is JSON with ``id``, ``name``, ``kind`` (``job``
or ``workflow``), ``slot``, ``scheduled_at``, ``status`` (``pending``, ``running``,
``completed``, ``failed``, ``skipped``, ``escalated``, ``cancelled``), ``attempts``
(every attempt, oldest first), and for a workflow ``steps``, each with ``name``,
``status``, ``attempt``, ``instance_id`` (the holder, or the last one), ``started_at``,
``finished_at``, ``heartbeat_at``, ``lease_expires_at`` and ``retry_at``. A job's run has
those step fields itself. ``heartbeat_at`` is when the holder last renewed the lease (or
claimed the run), on the stores that record it (memory, PostgreSQL, Redis);
``lease_expires_at`` tells whether it is alive (``None`` unless its ``store_status`` is
``running``: only a running run holds a lease). ``retry_at`` is when a run waiting for its
retry is due (``None`` unless its ``store_status`` is ``retrying``; it holds no lease
meanwhile). ``store_status`` is the run's status as stored (``handed_over``,
``retrying``, ``timed_out``, ...).

With a ``token``, every request needs the header ``Authorization: Bearer <token>`` and
gets 401 without it. The page asked without it answers 401 too, with the page itself,
which then reads the token from the address's fragment (``http://host:8000/#token=...``,
never sent to the server) and sends it as that header.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from string import Template
from typing import Any

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route
    from starlette.types import ASGIApp, Receive, Scope, Send
except ModuleNotFoundError as exc:  # as a missing driver or lease_core.otel's extra says
    if exc.name is None or exc.name.partition(".")[0] != "starlette":
        raise
    raise ModuleNotFoundError(
        "lease_core.http needs 'starlette'; install it with: pip install 'anarchon[http]'",
        name=exc.name) from exc

from ._checks import check_lookup_name
from ._http_operations import operation_routes
from ._overview import check_query, read_overview
from ._redact import redact
from ._status import (
    list_jobs,
    parse_run_id,
    read_recovery_log,
    read_run,
    read_runs,
)
from .abc import Backend
from .errors import AnarchonError, ConfigurationError

__all__ = ["LoopbackHostOnly", "create_app"]

#: Most runs per job ``GET /jobs?limit=`` accepts.
MAX_RUNS = 100


def create_app(backend: Backend, *, token: str | None = None) -> Starlette:
    """Return the status API and page over ``backend`` as a Starlette (ASGI) application.

    The application holds ``backend`` while it runs: its lifespan calls
    :meth:`~lease_core.abc.Backend.start` at startup and :meth:`~lease_core.abc.Backend.close`
    at shutdown. Both are counted, so a backend the caller started stays open, and only
    what the application opened is closed. Resources passed to the backend are never
    closed.

    .. note:: Starlette and FastAPI do not run the lifespan of a mounted application
       (``app.mount("/status", create_app(backend))``): start the backend in the host
       application's lifespan, since a backend must be started to be read.

    With ``token``, every request must carry ``Authorization: Bearer <token>`` (compared in
    constant time) or gets 401. Spaces and newlines around the token are ignored, on both
    sides (a secret read from a file or an environment variable with its newline).
    """
    if token is not None and not token.strip():
        raise ConfigurationError("the status API token is empty: give a non-empty token, or "
                                 "None to serve without one (only on 127.0.0.1)")
    if token is not None:
        _check_token(token.strip())

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Open already (anarchon serve's reader): joined as it is, an older store not
        # upgraded (its operations do that); else opened, the store made if missing.
        await backend.start(create=not backend._users)
        try:
            yield
        finally:
            await backend.close()

    async def jobs(request: Request) -> Response:
        text = request.query_params.get("limit", "5")
        limit = _whole(text)
        if limit is None or not 1 <= limit <= MAX_RUNS:
            return _error(400, f"limit={text!r} is not a whole number from 1 to {MAX_RUNS}")
        return _json(await list_jobs(backend, limit))

    async def run(request: Request) -> Response:
        name, slot = _run_key(request)
        found = await read_run(backend, name, slot)
        if found is None:
            return await _unknown(backend, name, slot)
        if request.query_params.get("log") in ("1", "true"):
            found["recovery_log"] = await read_recovery_log(backend, name, slot) or []
        return _json(found)

    async def overview(request: Request) -> Response:
        params = request.query_params
        numbers = {}
        for key, default in (("page", "1"), ("per_page", "50")):
            text = params.get(key, default)
            number = _whole(text)
            if number is None:
                return _error(400, f"{key}={text!r} is not a whole number of at most "
                                   f"{MAX_DIGITS} digits")
            numbers[key] = number
        status = params.get("status", "all")
        try:
            check_query(status, numbers["page"], numbers["per_page"])
        except ConfigurationError as exc:
            return _error(400, str(exc))
        # Outside the try: a statement the store refuses is a ConfigurationError too, and
        # answers 503 (a store that cannot be read), as on every route, not 400.
        return _json(await read_overview(backend, status=status, query=params.get("q", ""),
                                         **numbers))

    async def runs_of(request: Request) -> Response:
        text = request.query_params.get("limit", "20")
        limit = _whole(text)
        if limit is None or not 1 <= limit <= MAX_RUNS:
            return _error(400, f"limit={text!r} is not a whole number from 1 to {MAX_RUNS}")
        name = request.path_params["name"]
        try:
            check_lookup_name(name)
        except ConfigurationError as exc:
            return _error(400, str(exc))
        found = await read_runs(backend, name, limit)
        if found is None:
            return _error(404, f"no job or workflow {name!r} in the store")
        return _json(found)

    async def log(request: Request) -> Response:
        name, slot = _run_key(request)
        found = await read_recovery_log(backend, name, slot)
        return _json(found) if found is not None else await _unknown(backend, name, slot)

    page = _Page()

    async def index(request: Request) -> Response:
        return page.response(200)

    middleware = [] if token is None else [Middleware(_BearerAuth, token=token, page=page)]
    return Starlette(
        routes=[
            *operation_routes(backend, token=token),
            Route("/", index, methods=["GET"]),
            Route("/jobs", jobs, methods=["GET"]),
            Route("/overview", overview, methods=["GET"]),
            Route("/runs/{name:path}", runs_of, methods=["GET"]),
            # Names may hold "/" (a workflow step's job is <workflow>/<step>).
            Route("/jobs/{id:path}/recovery-log", log, methods=["GET"]),
            Route("/jobs/{id:path}", run, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, AnarchonError: _store_error},
        lifespan=lifespan,
    )


#: The most digits (leading zeros aside) a number of a query may have: a longer one is
#: refused before ``int()``, which raises ValueError beyond 4300 digits (it answered 500).
MAX_DIGITS = 18


def _whole(text: str) -> int | None:
    """``text`` as a whole number of ASCII digits, at most :data:`MAX_DIGITS` of them
    (leading zeros aside); else ``None``."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= MAX_DIGITS else None


def _run_key(request: Request) -> tuple[str, int]:
    try:
        return parse_run_id(request.path_params["id"])
    except ConfigurationError as exc:
        raise HTTPException(400, str(exc)) from None


async def _unknown(backend: Backend, name: str, slot: int) -> Response:
    known = name in await backend.jobs() or name in await backend.workflows()
    if not known:
        return _error(404, f"no job or workflow {name!r} in the store")
    return _error(404, f"no run of {name!r} at slot {slot} in the store")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(body, status, {"Cache-Control": "no-store", **(headers or {})})


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json({"error": message}, status, headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, exc.detail, dict(exc.headers or {}))


async def _store_error(request: Request, exc: Exception) -> Response:
    what = "read the store" if request.method in ("GET", "HEAD") else "act on the store"
    return _error(503, f"cannot {what}: {redact(str(exc))}")


class _Page:
    """The page: one HTML file with its script and style inlined, all package data."""

    def __init__(self) -> None:
        folder = resources.files(__package__ or "lease_core") / "_page"
        script = (folder / "status.js").read_text("utf-8")
        style = (folder / "status.css").read_text("utf-8")
        html = Template((folder / "index.html").read_text("utf-8"))
        self.body = html.substitute(script=script, style=style)
        # Only this script and style may run, and the page may talk to its own server only.
        self.headers = {
            "Content-Security-Policy": (
                f"default-src 'none'; script-src '{_sha256(script)}'; "
                f"style-src '{_sha256(style)}'; connect-src 'self'; img-src data:; "
                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        }

    def response(self, status: int, headers: dict[str, str] | None = None) -> Response:
        """The page with this HTTP status."""
        return HTMLResponse(self.body, status, {**self.headers, **(headers or {})})


def _check_token(token: str) -> None:
    """Refuse a token a browser cannot send: the page's ``fetch`` throws on a header value
    outside ISO-8859-1, and a blank or control character splits or ends the header.
    The message says where, never the token (a secret)."""
    for at, char in enumerate(token):
        if not 33 <= ord(char) <= 126:
            raise ConfigurationError(
                f"the status API token has a character a browser cannot send in a header "
                f"(U+{ord(char):04X} at position {at + 1}): use printable ASCII without "
                "blanks, e.g. python -c 'import secrets; print(secrets.token_urlsafe())'")


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


class _BearerAuth:
    """Answers 401 to every request without ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, *, token: str, page: _Page) -> None:
        self.app = app
        # Stripped as the header's value is: a secret read with its newline still matches.
        self.token = token.strip().encode()
        self.page = page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        challenge = {"WWW-Authenticate": 'Bearer realm="anarchon"'}
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in ("", "/") and scope["method"] in ("GET", "HEAD"):
            # The page holds no data: served with the 401, it asks for #token=...
            response = self.page.response(401, challenge)
        else:
            response = _error(401, "this server needs a bearer token: send the header "
                                   "'Authorization: Bearer <token>'", challenge)
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    given.strip(), self.token)
        return False


#: The Host names of this machine: what a browser sends to a server on 127.0.0.1 it
#: reached through its own name (a port may follow).
_LOCAL_HOSTS = (b"127.0.0.1", b"localhost", b"[::1]")


class LoopbackHostOnly:
    """Answers 400 to a request whose ``Host`` is not this machine's (127.0.0.1,
    localhost, [::1]): ``anarchon serve`` without a token wraps its application in it, so
    that a page elsewhere whose name was rebound to 127.0.0.1 (DNS rebinding) cannot
    read the status through the user's browser."""

    def __init__(self, app: ASGIApp, *, hosts: Sequence[str] = ()) -> None:
        """``hosts``: more names or addresses of this machine to answer (the loopback
        address the server listens on, such as ``127.0.0.2``)."""
        self.app = app
        self.hosts = {*_LOCAL_HOSTS, *(_host_name(h) for h in hosts)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._local(scope):
            await self.app(scope, receive, send)
            return
        response = _error(400, "this server answers only requests to 127.0.0.1 or "
                               "localhost: it serves without a token")
        await response(scope, receive, send)

    def _local(self, scope: Scope) -> bool:
        host = next((value for name, value in scope["headers"] if name == b"host"), b"")
        text = host.decode("latin-1")
        name = (text.partition("]")[0] + "]" if text.startswith("[")
                else text.partition(":")[0])
        return _host_name(name) in self.hosts


def _host_name(host: str) -> bytes:
    """``host`` as a ``Host`` header names it, without a port (an IPv6 address in [])."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower().encode()
    if address.version == 6:
        return f"[{address.compressed}]".encode()
    return str(address).encode()

