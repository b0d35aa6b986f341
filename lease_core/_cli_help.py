"""The ``anarchon`` command's help texts: each subcommand's ``--help`` opens with what it
does (the line ``anarchon --help`` lists) and ends with examples; the exit codes end
``anarchon --help``."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["EXIT_CODES", "add_command"]

#: The exit codes, as ``anarchon --help`` lists them (the module ``cli``'s docstring
#: explains them).
EXIT_CODES = """exit codes (the same for every subcommand):
  0    success (also when the reader of the output went away: anarchon history | head)
  1    failed at run time: store unreachable, login refused, unexpected error, a failed
       demo verdict, serve's port already in use
  2    usage or configuration error, or an operation that does not apply (nothing changed)
  3    no anarchon store at the URL (status, history, prune, serve and the operations
       never create one)
  130  interrupted (Ctrl-C)
  143  serve or the demo stopped by SIGTERM, after a graceful shutdown"""

_URL = "postgresql://app:pw@db/app"

#: Each subcommand's examples, after its options in its ``--help``.
_EXAMPLES = {
    "demo": ["anarchon demo                      # on an embedded PostgreSQL",
             "anarchon demo --backend redis      # extras redis,embedded",
             "anarchon demo --workflow bank-close",
             f"anarchon demo --url {_URL} --keep"],
    "migrate": ["anarchon migrate --url postgresql://admin:pw@db/app",
                "anarchon migrate --url postgresql://admin:pw@db/app --table jobs.anarchon_runs"],
    "history": [f"anarchon history --url {_URL} --job export --limit 50",
                "ANARCHON_URL=redis://cache:6379/0 anarchon history --json"],
    "status": [f"anarchon status --url {_URL}",
               "ANARCHON_URL=redis://cache:6379/0 anarchon status --job export --json"],
    "prune": [f"anarchon prune --url {_URL} --older-than 30d",
              f"anarchon prune --url {_URL} --keep 100 --job export"],
    "serve": [f"anarchon serve --url {_URL}     # http://127.0.0.1:8000/",
              f"ANARCHON_TOKEN=$(cat token.txt) anarchon serve --url {_URL} --host 0.0.0.0"],
    "trigger": [f"anarchon trigger export --url {_URL}"],
    "pause": [f"anarchon pause export --url {_URL}"],
    "resume": [f"anarchon resume export --url {_URL}"],
    "retry": [f"anarchon retry export@2026-01-31T02:00:00Z --url {_URL}",
              "  (the slot as history's SCHEDULED_AT column shows it, or in epoch ms)"],
    "cancel": [f"anarchon cancel export@2026-01-31T02:00:00Z --grace 30s --url {_URL}"],
    "lease": [f"anarchon lease leader --url {_URL} --json"],
}


def add_command(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    """Add the subcommand ``name`` to the subparsers ``sub``: ``help`` is its line in
    ``anarchon --help`` and opens its own ``--help``, which ends with its examples."""
    examples = "\n".join("  " + line for line in _EXAMPLES.get(name, []))
    command: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=help[:1].upper() + help[1:] + ".",
        epilog=f"examples:\n{examples}" if examples else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return command
