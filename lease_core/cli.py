"""The ``anarchon`` command line: ``demo``, ``migrate`` and ``history``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import anyio

from .errors import AnarchonError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anarchon", description="Lease coordination for scheduled jobs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the fleet demo (embedded PostgreSQL by default)")
    demo.add_argument("--backend", choices=("postgres", "redis", "memory"), default="postgres",
                      help="which embedded store to start (default: postgres)")
    demo.add_argument("--dsn", "--url", dest="url", default=None,
                      help="run against this existing server instead of an embedded one")
    migrate = sub.add_parser(
        "migrate", help="create or upgrade the PostgreSQL store (privileged user)")
    migrate.add_argument("--dsn", "--url", dest="dsn", default=None,
                         help="PostgreSQL URL or DSN (default: PG* variables)")
    migrate.add_argument("--table", default="anarchon_runs", help="table name, may be schema.name")
    history = sub.add_parser("history", help="print the recorded attempts")
    history.add_argument("--url", required=True, help="backend URL, e.g. postgresql://...")
    history.add_argument("--job", default=None)
    history.add_argument("--limit", type=int, default=20)
    history.add_argument("--table", default=None, help="PostgreSQL table (default anarchon_runs)")
    history.add_argument("--prefix", default=None, help="Redis key prefix (default anarchon_runs)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anarchon`` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            return 0 if run_demo(args.backend, args.url) else 1
        if args.command == "migrate":
            from backends.postgres import CODE_VERSION, migrate

            anyio.run(lambda: migrate(args.dsn, table=args.table))
            print(f"anarchon: tables for {args.table!r} are ready (store code v{CODE_VERSION})")
            return 0
        if args.command == "history":
            return anyio.run(_history, args)
    except AnarchonError as exc:
        print(f"anarchon: {exc}", file=sys.stderr)
        return 2
    return 2


async def _history(args: argparse.Namespace) -> int:
    from ._registry import backend_from_url

    options = {k: v for k, v in (("table", args.table), ("prefix", args.prefix)) if v}
    backend = backend_from_url(args.url, **options)
    await backend.start()
    try:
        attempts = await backend.history(args.job, args.limit)
    finally:
        await backend.close()
    for a in attempts:
        print(f"{a.job}\t{a.scheduled_at.isoformat()}\t{a.attempt}\t{a.instance_id}\t"
              f"{a.reason}\t{a.outcome or 'running'}\t{a.error or ''}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
