"""Holder ids of :class:`~lease_core.Lease` objects, and what a forked copy of one
forgets (private).

A Lease object made before a fork (at import time, say, in an app server that forks its
workers from a preloaded parent) is copied into every child. Its holder id must not be:
the store gives a live hold back to the holder that has it, so children sharing one id
would all hold the name at once, with one token. A child's copy therefore takes a new
id (when the id was made here, not given) and forgets the parent's hold.
"""

from __future__ import annotations

import itertools
import os
import socket
import uuid
from typing import TYPE_CHECKING

from .errors import LeaseLost

if TYPE_CHECKING:
    from .lease import Lease

__all__: list[str] = []  # private: lease.py uses these

_HOLDERS: tuple[int, str, itertools.count[int]] | None = None


def gave_up(name: str) -> LeaseLost:
    """The error of ``async with``/``with`` whose wait another task's release ended."""
    return LeaseLost(f"lease {name!r} was released while this holder waited for it (by "
                     "another task or thread); the body did not run")


def holder_id() -> str:
    """A holder id unique to one Lease object: host, process, a random part made once per
    process, and a counter (cheap: leases may be made per call)."""
    global _HOLDERS
    pid = os.getpid()
    if _HOLDERS is None or _HOLDERS[0] != pid:  # once per process, and after a fork
        _HOLDERS = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:8]}",
                    itertools.count(1))
    return f"{_HOLDERS[1]}:{next(_HOLDERS[2])}"


def forget_parent(lease: Lease) -> None:
    """``lease`` is a forked child's copy (made, or last used, in another process): a new
    holder id unless one was given, and none of the parent's hold, wait or backend start
    (the parent still has them)."""
    lease._pid = os.getpid()
    if lease._own_holder:
        lease.holder = holder_id()
    lease._last = lease._never = lease._body = lease._acquired = lease._pause = None
    lease._opened = lease._acquiring = lease._abort = False
