"""The ``anarchon`` command line: ``demo``, ``migrate``, ``history``, ``status``, ``prune``,
``serve``, the operations ``trigger``, ``pause``, ``resume``, ``retry`` and ``cancel``, and
``lease`` (who holds a named lease).

A mistake of the user's (a bad flag, URL, option or password, a missing extra) is reported
in one line on stderr, never as a traceback. Exit codes, the same for every subcommand:

- 0: success (also when the reader of the output went away: ``anarchon history | head``);
- 1: the command failed at run time (store unreachable, login refused, unexpected error, a
  failed demo verdict, ``serve``'s port already in use);
- 2: the command line or the configuration is wrong, or an operation does not apply (an
  unknown job, a slot with no run, a retry of a completed run, a cancel of a finished one:
  nothing changed);
- 3: no anarchon store at the URL (``status``, ``history``, ``prune``, ``serve`` and the
  operations never create one; ``status`` and ``history`` only read, and work with
  SELECT-only rights; ``prune`` deletes old history; ``serve`` reads, and its operations
  write as the operations do);
- 130: interrupted (Ctrl-C); ``serve`` stopped by SIGTERM stops gracefully and exits 143,
  and so does the demo, once it has stopped its workers and removed its namespace.

``--url`` defaults to ``$ANARCHON_URL`` for every subcommand, and ``serve``'s ``--token``
to ``$ANARCHON_TOKEN``: neither then shows in ``ps``. An empty ``$ANARCHON_TOKEN`` is a
usage error (exit 2), not "no token"; an empty ``--url`` (or a blank ``$ANARCHON_URL``)
too, not libpq's default server. ``--debug`` (before or after the subcommand, or
``ANARCHON_DEBUG=1``) adds the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import anyio

from . import __version__
from ._cli_help import EXIT_CODES, add_command
from ._cli_operations import COMMANDS as OPERATIONS
from ._cli_operations import MEMORY_NOTE, run_operation
from ._cli_operations import add_parsers as add_operation_parsers
from ._platform import asyncio_options
from ._redact import redact
from ._serve import Limits, add_limit_options, check_port, limits_from, loopback
from ._status import iso as _iso
from ._status import one_line
from .errors import AnarchonError, ConfigurationError, OperationRefused, StoreNotFound

__all__ = ["main"]

#: Exit codes of :func:`main`.
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_STORE = 3
EXIT_INTERRUPTED = 130
#: The exit code of a command stopped by SIGTERM after cleaning up (serve, the demo).
EXIT_TERMINATED = 128 + signal.SIGTERM

#: The environment variable every subcommand reads the store's URL from, without --url.
URL_ENV = "ANARCHON_URL"

#: The environment variable ``anarchon serve`` reads its bearer token from.
TOKEN_ENV = "ANARCHON_TOKEN"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the command and its ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {redact(message)} (see {self.prog} --help)\n")


#: The largest count or duration (in ms) a command takes: 2**53, far beyond any store's
#: history, and within every store's integers.
_LARGEST = 2**53


def _whole(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _LARGEST:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number from 0 to {_LARGEST:,}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _LARGEST:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number from 1 to {_LARGEST:,}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anarchon", description="Lease coordination for scheduled jobs.",
                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"anarchon {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an unexpected error (also ANARCHON_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    url_help = ("the store: a URL (postgresql://, redis://, memory://, ...) or a PostgreSQL "
                f"key/value DSN ('host=db dbname=app'); default: ${URL_ENV}")
    demo = add_command(sub, "demo", "run the fleet demo (embedded PostgreSQL by default)")
    demo.add_argument("--backend", choices=("postgres", "redis", "memory"), default=None,
                      help="which embedded store to start (default: postgres); with --url, "
                           "the kind of store it names")
    demo.add_argument("--url", "--dsn", dest="url", default=None,
                      help=url_help + "; runs against it instead of an embedded server "
                           "(make demo ignores the variable)")
    demo.add_argument("--workflow", choices=("bank-close",), default=None,
                      help="run a workflow demo instead of the fleet demo: bank-close "
                           "(PostgreSQL only)")
    demo.add_argument("--serve", action="store_true",
                      help="serve the status page on 127.0.0.1 during the demo and print its "
                           "URL (with --workflow; extra 'http')")
    demo.add_argument("--namespace", default=None, metavar="NAME",
                      help="name the demo's tables or keys under NAME instead of a new "
                           "anarchon_demo_<random>; refused if anything by that name exists")
    demo.add_argument("--keep", action="store_true",
                      help="keep the demo's tables or keys at the end (with --url) and print "
                           "how to look at them and remove them; by default they are removed")
    demo.add_argument("--remove", default=None, metavar="NAME",
                      help="remove a namespace a demo kept (with --url), and nothing else: "
                           "refused unless it carries a demo's marker")
    migrate = add_command(
        sub, "migrate", "create or upgrade the PostgreSQL store (privileged user)")
    migrate.add_argument("--url", "--dsn", dest="url", default=None,
                         help=f"PostgreSQL URL or key/value DSN (default: ${URL_ENV}); "
                              "--url postgresql:// takes the rest from the PG* variables")
    migrate.add_argument("--table", "--namespace", dest="table", default=None,
                         help="table name, may be schema.name (default anarchon_runs); "
                              "--namespace, as the other commands take it, is the same")
    history = add_command(sub, "history", "print the recorded attempts, newest first")
    history.add_argument("--url", "--dsn", dest="url", default=None, help=url_help)
    history.add_argument("--job", default=None,
                     help="only this job, or a workflow's steps (default: every job)")
    history.add_argument("--limit", type=_positive, default=20,
                         help="at most this many attempts (default 20)")
    _namespace_options(history)
    history.add_argument("--json", action="store_true", help="print a JSON array")
    status = add_command(
        sub, "status", "the jobs the store knows, runs in progress, each job's last outcome")
    status.add_argument("--url", "--dsn", dest="url", default=None, help=url_help)
    status.add_argument("--job", default=None,
                     help="only this job, or a workflow's steps (default: every job)")
    _namespace_options(status)
    status.add_argument("--json", action="store_true", help="print a JSON object")
    prune = add_command(
        sub, "prune", "delete old history (finished attempts, and the finished runs left "
                      "without any): by age, --older-than, and by count, --keep")
    prune.add_argument("--url", "--dsn", dest="url", default=None, help=url_help)
    prune.add_argument("--older-than", default=None,
                       help="delete attempts that finished longer ago than this ('30d', '12h')")
    prune.add_argument("--keep", type=_whole, default=None, metavar="N",
                       help="delete each job's finished attempts beyond its newest N, as a "
                            "scheduler's history_size does (give --older-than, --keep or both)")
    prune.add_argument("--job", default=None,
                     help="only this job, or a workflow's steps (default: every job)")
    _namespace_options(prune)
    serve = add_command(
        sub, "serve", "serve the status API and page over HTTP (extra 'http'); operations "
                      "(POST) need the token")
    serve.add_argument("--url", "--dsn", dest="url", default=None, help=url_help)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; any other needs a token)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    serve.add_argument("--token", default=None,
                       help=f"bearer token every request must send (default: ${TOKEN_ENV}, "
                            "which unlike this flag does not show in ps)")
    add_limit_options(serve)
    _namespace_options(serve)
    add_operation_parsers(sub, url_help, _namespace_options)
    for command in sub.choices.values():  # also after it, where an error's hint leads
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an unexpected error")
    return parser


def _port(text: str) -> int:
    # Its length bounded before int(), whose ValueError beyond 4300 digits argparse
    # reported as "invalid _port value".
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > 5 \
            or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number from 1 to 65535")
    return int(text)


def _namespace_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--table", default=None, help="PostgreSQL table (default anarchon_runs)")
    command.add_argument("--prefix", default=None, help="Redis key prefix (default anarchon_runs)")
    command.add_argument("--namespace", default=None,
                         help="the table or key prefix, whatever the store")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anarchon`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    _terminated.clear()
    debug = args.debug or os.environ.get("ANARCHON_DEBUG", "") not in ("", "0")
    prog = f"anarchon {args.command}"
    args.url_source = "--url"
    if args.url is None:
        args.url = os.environ.get(URL_ENV) or None
        args.url_source = f"${URL_ENV}"
    try:
        try:
            return _run(args)
        except BaseExceptionGroup as group:
            raise _single(group) from None
    except BrokenPipeError:
        # The reader went away (``| head``): what it read was all it wanted. Python would
        # complain again when flushing stdout at exit, so stdout goes nowhere from here.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except StoreNotFound as exc:
        print(f"{prog}: {_line(exc)}", file=sys.stderr)
        return EXIT_NO_STORE
    except (ConfigurationError, OperationRefused) as exc:
        print(f"{prog}: {_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except AnarchonError as exc:
        print(f"{prog}: {_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        if _terminated:  # cleaned up: now die of the signal, as serve does (143)
            print(f"{prog}: terminated (SIGTERM)", file=sys.stderr)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
            return EXIT_TERMINATED  # pragma: no cover - not reached
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            sys.stderr.write(redact("".join(traceback.format_exception(exc))))
        text = _line(exc, first_only=True)
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"{prog}: unexpected error: {type(exc).__name__}: {text}{hint}", file=sys.stderr)
        return EXIT_FAILED


#: Set when SIGTERM stopped the demo (its exit is then 143, not Ctrl-C's 130).
_terminated: list[int] = []


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM stops the block as Ctrl-C does: a demo killed by ``kill`` or a supervisor
    ended without a cleanup, its worker processes left running on the user's store and
    its namespace left behind."""
    def stop(signum: int, frame: Any) -> None:
        _terminated.append(signum)
        ctrl_c = signal.getsignal(signal.SIGINT)  # asyncio's while it runs: it cancels
        if callable(ctrl_c):
            ctrl_c(signal.SIGINT, frame)
        else:  # SIGINT ignored (a background job) or the default action
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # (main() in a thread)
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _line(exc: BaseException, *, first_only: bool = False) -> str:
    """The error's text on one line, passwords masked."""
    text = str(exc).strip()
    if first_only:
        text = text.splitlines()[0] if text else ""
    return " ".join(redact(text).split())


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error inside nested groups of one, else the group itself."""
    inner: BaseException = group
    while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
        inner = inner.exceptions[0]
    return inner


def _run(args: argparse.Namespace) -> int:
    if args.url is not None and not args.url.strip():
        # A script's `--url "$URL"` with URL unset: libpq read it as its default server,
        # so migrate created tables and the demo ran (or removed) on whatever that was.
        raise ConfigurationError(
            f"{args.url_source} is empty: give the store's URL (postgresql://..., "
            "redis://...)" + (f", or leave out --url to use ${URL_ENV}"
                              if args.url_source == "--url" else f", or unset {URL_ENV}"))
    if args.command == "demo":
        from .demo.command import run_command

        with _sigterm_as_ctrl_c():  # the demo then removes its namespace, as on Ctrl-C
            return run_command(args)
    if args.url is None and args.command in ("migrate", "history", "status", "prune",
                                             "serve", *OPERATIONS):  # not libpq's default
        pg = ("; --url postgresql:// takes host, user and database from the PG* variables"
              if args.command == "migrate" else "")
        raise ConfigurationError(f"which store? give --url, or set ${URL_ENV}{pg}")
    if args.command == "migrate":
        from backends.postgres import CODE_VERSION
        from backends.postgres.upgrade import migrate_to

        table, code = anyio.run(lambda: migrate_to(args.url, table=args.table),
                                backend_options=asyncio_options())
        newer = (f"; v{code} is a newer release's, used as it is (this release's is "
                 f"v{CODE_VERSION})") if code > CODE_VERSION else ""
        print(f"anarchon migrate: the tables for {table!r} are ready "
              f"(store code v{code}{newer})")
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command in OPERATIONS:
        return int(anyio.run(run_operation, args, _backend(args),
                              backend_options=asyncio_options()))
    command = {"status": _status, "prune": _prune}.get(args.command, _history)
    result: int = anyio.run(command, args, backend_options=asyncio_options())
    return result


async def _prune(args: argparse.Namespace) -> int:
    from ._durations import parse_typed_duration, to_ms

    if args.older_than is None and args.keep is None:
        raise ConfigurationError("what to delete? give --older-than DURATION (by age), "
                                 "--keep N (by count) or both")
    older_than = None
    if args.older_than is not None:
        older_than = to_ms(parse_typed_duration(args.older_than, what="--older-than"))
        if older_than > _LARGEST:
            raise ConfigurationError(
                f"--older-than {args.older_than!r} is longer than any history can be; give "
                f"at most {_LARGEST // 86_400_000:,}d")
    backend = _backend(args)
    await backend.start(create=False)
    try:
        jobs = await _jobs_named(backend, args.job) or await backend.jobs()
        total = 0
        for job in jobs:
            deleted = batch = 1000
            while deleted >= batch:  # up to a batch of each kind per call
                deleted = await backend.prune(job, keep=args.keep, older_than_ms=older_than,
                                              batch=batch)
                total += deleted
    finally:
        await backend.close()
    which = [f"beyond the newest {args.keep} of each job"] if args.keep is not None else []
    if args.older_than is not None:
        bare = args.older_than.strip().replace(".", "", 1).isdigit()  # a number: seconds
        which.append(f"that finished more than {args.older_than.strip()}{'s' if bare else ''}"
                     " ago")
    print(f"anarchon prune: deleted {_count(total, 'attempt')} {' or '.join(which)}, from "
          f"{_count(len(jobs), 'job')}" + ("" if jobs or "memory" not in getattr(
              backend, "schemes", ()) else f" {MEMORY_NOTE}"))
    return 0


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _serve(args: argparse.Namespace) -> int:
    if args.token is not None and not args.token.strip():
        raise ConfigurationError(
            f"--token is empty: give the token clients must send, or leave --token out "
            f"(and ${TOKEN_ENV} unset) to serve without one on 127.0.0.1")
    if args.token is None and TOKEN_ENV in os.environ and not os.environ[TOKEN_ENV].strip():
        # A secret that did not arrive: serving without a token would be a surprise.
        raise ConfigurationError(
            f"${TOKEN_ENV} is set but empty: give it the token clients must send, or unset "
            "it to serve without one on 127.0.0.1")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if token is None and not loopback(args.host):
        raise ConfigurationError(
            f"--host {args.host!r} is not a loopback address: give a bearer token "
            f"(${TOKEN_ENV} or --token), or listen on 127.0.0.1")
    if any(importlib.util.find_spec(name) is None for name in ("starlette", "uvicorn")):
        raise ConfigurationError("the status API and page need the extra 'http': "
                                 "pip install 'anarchon[http]'")
    limits = limits_from(args)
    check_port(args.host, args.port)
    result: int = anyio.run(_serve_app, args, token, limits,
                            backend_options=asyncio_options())
    return result


async def _serve_app(args: argparse.Namespace, token: str | None, limits: Limits) -> int:
    import uvicorn

    from .http import LoopbackHostOnly, create_app

    backend = _backend(args)
    app: Any = create_app(backend, token=token)
    if token is None:
        # Without a token only this machine may read: a page elsewhere that rebinds its
        # own name to 127.0.0.1 (DNS rebinding) sends its name as Host, and is refused.
        app = LoopbackHostOnly(app, hosts=[args.host])
    # Started here, so a store that cannot be reached is one line on stderr; the
    # application's lifespan holds it too, and the last close closes it. Read-only: a
    # store that is not there is an error, never created.
    await backend.start(create=False)
    interrupted: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn shuts down on SIGINT as on SIGTERM; SIGINT's documented exit is 130.
            interrupted.append(sig)
            super().handle_exit(sig, frame)

    try:
        server = Server(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                       lifespan="on", **limits.uvicorn_options()))
        try:
            await server.serve()
        except SystemExit:  # uvicorn's own exit when it could not start after all
            return EXIT_FAILED
    finally:
        await backend.close()
    if signal.SIGINT in interrupted:
        return EXIT_INTERRUPTED
    return 0 if server.started else EXIT_FAILED


_COLUMNS = ("job", "scheduled_at", "attempt", "instance_id", "reason", "outcome",
            "claimed_at", "finished_at", "requested_by", "error")


def _backend(args: argparse.Namespace) -> Any:
    from ._registry import backend_from_url

    # An empty value is passed on, and refused by the backend: dropped, it would name the
    # default store (a script's `--table "$T"` with T unset pruning the default store).
    options = {k: v for k in ("table", "prefix", "namespace")
               if (v := getattr(args, k, None)) is not None}
    scheme = args.url.split("://", 1)[0].lower().split("+")[0] if "://" in args.url \
        else "postgresql"  # a key/value DSN
    kind = _KINDS.get(scheme)
    for flag, (store, what) in _FLAG_STORES.items():  # the backend named its keyword
        if flag in options and kind is not None and kind != store:
            raise ConfigurationError(
                f"--{flag} names {what}, and {redact(args.url)!r} is a {kind} store: give "
                "--namespace, the table or key prefix whatever the store"
                + (", or --prefix" if kind == "Redis" else ", or --table"
                   if kind == "PostgreSQL" else ""))
    return backend_from_url(args.url, **options)


#: The built-in stores by URL scheme (without a driver: postgresql+pg8000 is postgresql).
_KINDS = {"postgresql": "PostgreSQL", "postgres": "PostgreSQL", "redis": "Redis",
          "rediss": "Redis", "unix": "Redis", "memory": "memory"}
#: The store each store-specific flag is for, and what it names there.
_FLAG_STORES = {"table": ("PostgreSQL", "a PostgreSQL table"),
                "prefix": ("Redis", "a Redis key prefix")}


async def _jobs_named(backend: Any, job: str | None, *,
                      strict: bool = True) -> list[str] | None:
    """The jobs a ``--job`` names: the job itself, or a workflow's step jobs (in step
    order); ``None`` without ``--job`` (every job). ``strict``: refuses a name the store
    has never seen (a typo read as "nothing to show"); else that name alone."""
    if job is None:
        return None
    if not job:  # a script's `--job "$JOB"` with JOB unset: not "every job", nor "no history"
        raise ConfigurationError("--job is empty: give a job's name, or leave --job out for "
                                 "every job")
    known = await backend.jobs()
    if job in known:
        return [job]
    workflows = await backend.workflows()
    named: list[str] = []
    if job in workflows:
        named = [name for name in (f"{job}/{step}" for step in workflows[job])
                 if name in known]
        named += sorted(name for name in known if name.startswith(job + "/")
                        and name not in named)  # a step no longer declared: its history
    if not named and not strict:
        return [job]
    if not named:
        raise ConfigurationError(
            f"the store has never seen job {job!r}; check the name (`anarchon status` "
            "lists them)")
    return named


async def _status(args: argparse.Namespace) -> int:
    from ._status import read_status, render_status

    backend = _backend(args)
    await backend.start(create=False)
    try:
        status = await read_status(backend, await _jobs_named(backend, args.job))
    finally:
        await backend.close()
    if args.json:
        print(json.dumps(status.as_json(), indent=2))
    else:
        sys.stdout.write(render_status(status))
        if not status.jobs and "memory" in getattr(backend, "schemes", ()):
            print(MEMORY_NOTE)
    return 0


async def _history(args: argparse.Namespace) -> int:
    backend = _backend(args)
    await backend.start(create=False)
    try:
        jobs = await _jobs_named(backend, args.job, strict=False)
        if jobs is None or len(jobs) == 1:
            attempts = await backend.history(None if jobs is None else jobs[0], args.limit)
        else:  # a workflow's steps, newest first together
            attempts = sorted([a for job in jobs for a in await backend.history(job, args.limit)],
                              key=lambda a: a.claimed_at, reverse=True)[:args.limit]
    finally:
        await backend.close()
    rows: list[dict[str, Any]] = [
        {"job": a.job, "scheduled_at": _iso(a.scheduled_at), "attempt": a.attempt,
         "instance_id": a.instance_id, "reason": str(a.reason),
         "outcome": str(a.outcome) if a.outcome is not None else None,
         "claimed_at": _iso(a.claimed_at), "finished_at": _iso(a.finished_at),
         "error": None if a.error is None else redact(a.error),
         "requested_by": a.requested_by}
        for a in attempts
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        where = f"job {args.job!r}" if args.job else "any job"
        named = "".join(f" (--{flag} {value})" for flag in ("table", "prefix", "namespace")
                        if (value := getattr(args, flag)) is not None)  # not the default's
        print(f"no history for {where} in {redact(args.url)}{named}")
        return 0
    table = [[c.upper() for c in _COLUMNS]] + [  # one line a row: a traceback's \n escaped
        [("running" if r[c] is None and c == "outcome" else one_line(str(r[c] or "")))
         for c in _COLUMNS]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS) - 1)]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
