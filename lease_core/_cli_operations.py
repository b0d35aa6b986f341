"""The CLI's operations: ``anarchon trigger|pause|resume JOB`` and ``retry|cancel JOB@SLOT``;
and ``anarchon lease NAME``, which only reads who holds a named lease.

Each acts through the store (:class:`~lease_core.Admin`, recorded as made by ``cli``), so
the whole fleet sees it. Every operation needs a job the store knows, so the store is
opened with ``start(create=False)``: a mistyped namespace exits 3 (no store there) and
creates none. A refusal (an unknown job, a slot with no run, a retry of a completed run,
a cancel of a finished one) exits 2 and changes nothing. ``lease`` opens the store the
same way and changes nothing (it reads as :meth:`~lease_core.Lease.current_holder` does).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._cli_help import add_command
from ._status import parse_run_id
from ._structures import format_slot
from .errors import OperationRefused

__all__ = ["COMMANDS", "add_parsers", "run_operation"]

#: The operation subcommands (and ``lease``, a read).
COMMANDS = ("trigger", "pause", "resume", "retry", "cancel", "lease")

_HELP = {
    "trigger": "run JOB once more now, on an instance that declares it (reason manual)",
    "pause": "no instance claims new slots of JOB until resume (runs in progress go on)",
    "resume": "let the fleet claim the slots of JOB again",
    "retry": "run a failed, timed-out or escalated run JOB@SLOT again (reason retry)",
    "cancel": "end the run JOB@SLOT cancelled; its holder's handler is cancelled",
    "lease": "who holds the named lease NAME (a Lease's), read without taking it",
}


def add_parsers(sub: Any, url_help: str, namespace_options: Any) -> None:
    """Add the operation subcommands to the ``anarchon`` parser's subparsers ``sub``."""
    for name in COMMANDS:
        command = add_command(sub, name, _HELP[name])
        if name == "lease":
            command.add_argument("name", metavar="NAME", help="the lease's name")
            command.add_argument("--json", action="store_true", help="print a JSON object")
        elif name in ("retry", "cancel"):
            command.add_argument("run", metavar="JOB@SLOT",
                                 help="the run: job name, '@', slot in epoch ms or ISO-8601")
        else:
            command.add_argument("job", metavar="JOB", help="the job's name")
        if name == "cancel":
            command.add_argument("--grace", default="10s",
                                 help="how long the handler may take to stop (default 10s)")
        command.add_argument("--url", "--dsn", dest="url", default=None, help=url_help)
        namespace_options(command)


async def run_operation(args: argparse.Namespace, backend: Any) -> int:
    """Make the operation ``args.command`` on ``backend``; print what was done."""
    from .operations import Admin

    if args.command == "lease":
        return await _show_lease(args, backend)
    try:
        return await _operate(args, Admin(backend, by="cli"))
    except OperationRefused as refused:
        if refused.kind != "unknown_job" or not _in_memory(backend):
            raise
        # Not "check the name": this command has a new store of its own, always empty.
        raise OperationRefused(refused.kind, f"{refused} {MEMORY_NOTE}") from None


#: What a command on ``memory://`` says: its store is its own, not the services'.
MEMORY_NOTE = ("(memory:// is a store inside one process: this command has an empty one "
               "of its own, not your services'; give the URL of the store they use)")


def _in_memory(backend: Any) -> bool:
    return "memory" in getattr(backend, "schemes", ())


async def _operate(args: argparse.Namespace, admin: Any) -> int:
    # One call, no ``async with``: the store is upgraded only if the operation is made.
    if args.command == "trigger":
        slot = await admin.trigger(args.job)
        print(f"anarchon trigger: {args.job}@{slot} ({format_slot(slot)}) queued; an "
              "instance declaring the job runs it within one heartbeat")
    elif args.command in ("pause", "resume"):
        await (admin.pause if args.command == "pause" else admin.resume)(args.job)
        print(f"anarchon {args.command}: job {args.job!r} "
              f"{'paused' if args.command == 'pause' else 'resumed'}")
    else:
        job, slot = parse_run_id(args.run)
        if args.command == "retry":
            await admin.retry(job, slot)
            print(f"anarchon retry: {job}@{slot} queued again (reason retry)")
        else:
            await admin.cancel(job, slot, grace=args.grace)
            print(f"anarchon cancel: {job}@{slot} cancelled")
    return 0


async def _show_lease(args: argparse.Namespace, backend: Any) -> int:
    """``anarchon lease NAME``: one read of who holds it (the store is not created)."""
    from ._named_leases import check_lease

    check_lease(args.name)
    await backend.start(create=False)
    try:
        answer = await backend.read_lease(args.name)
    finally:
        await backend.close()
    held = answer.held and answer.holder is not None
    expires_in = max(answer.expires_ms - answer.now_ms, 0) / 1000 if held else None
    # nobody holds it and nobody may take it yet: the store's quarantine after a failover
    quarantine = (None if held or answer.expires_ms <= answer.now_ms
                  else (answer.expires_ms - answer.now_ms) / 1000)
    if args.json:
        print(json.dumps({"name": args.name, "holder": answer.holder if held else None,
                          "token": answer.token if held else None,
                          "expires_in": expires_in, "quarantine": quarantine}))
    elif held:
        print(f"lease {args.name!r}: held by {answer.holder!r}, token {answer.token}, "
              f"expires in {expires_in:.1f} s unless renewed")
    elif quarantine is not None:
        print(f"lease {args.name!r}: free, but not to be taken for at least "
              f"{quarantine:.1f} s more (the store's quarantine after a failover)")
    else:
        print(f"lease {args.name!r}: free")
        if _in_memory(backend):  # as ``anarchon status`` says
            print(MEMORY_NOTE)
    return 0
