"""How an attempt ended, decided in one pure function from what happened to its handler."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from enum import StrEnum

from ._redact import redact
from ._structures import Outcome
from .errors import LeaseLost, StopRequested

__all__ = ["MAX_ERROR_BYTES", "Ending", "Interruption", "capped", "classify",
           "decide_outcome", "error_text", "storable"]

#: The most an attempt's error text takes in the store, in bytes of UTF-8 (8 KiB), marker
#: included. Bytes, not characters: it bounds what each failed attempt costs in every
#: store, on the wire and in a page of history (100 attempts: 800 KiB at most), whatever
#: the script (4,000 characters could be 16 KB). An exception's type and message
#: (``format_exception_only``) rarely reach 1 KiB; one that embeds a whole response body
#: or a large ``repr`` is cut, keeping its start and its end.
MAX_ERROR_BYTES = 8192


class Interruption(StrEnum):
    """Why the scheduler cancelled a running handler."""

    STOPPED = "stopped"
    """The grace period of :meth:`Scheduler.stop` ended."""
    LEASE_LOST = "lease lost"
    """A heartbeat found that another attempt holds the run."""
    DEADLINE = "lease not renewed in time"
    """The lease could not be renewed before it would expire in the store."""
    CANCELLED = "cancelled"
    """An operator cancelled the run and its grace ended (:meth:`Admin.cancel`)."""


@dataclass(frozen=True, slots=True)
class Ending:
    """The decision for one attempt: its outcome and error text.

    ``outcome`` is ``None`` when nothing may be recorded (the scheduler crashed or was
    aborted: a backup takes the run over once its lease expires). ``LOST`` means another
    attempt holds, or may soon hold, the run: the instance only watches it. ``HANDED_OVER``
    means the run goes to a backup at once. Any other outcome is recorded with ``finish``.
    """

    outcome: Outcome | None
    error: str | None = None


def classify(exc: BaseException) -> type[Exception] | None:
    """StopRequested or LeaseLost when ``exc`` is one, or a group of only those.

    A group holding both is LeaseLost: the run is no longer this attempt's to hand over.
    """
    for kind in (StopRequested, LeaseLost):
        if isinstance(exc, kind):
            return kind
    if isinstance(exc, BaseExceptionGroup):
        lost, rest = exc.split(LeaseLost)
        if rest is not None:
            _stop, rest = rest.split(StopRequested)
            if rest is not None:
                return None
            return LeaseLost if lost is not None else StopRequested
        return LeaseLost
    return None


def storable(text: str) -> str:
    """``text`` as every store can keep it: a NUL character (PostgreSQL's text refuses it)
    and a lone surrogate (``os.fsdecode`` of a name that is not UTF-8, which no store can
    encode) are written as backslash escapes. An error message the store refused would
    leave its attempt unfinished, and the run taken over and run again at every lease."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def capped(text: str) -> str:
    """``text`` if its UTF-8 takes at most :data:`MAX_ERROR_BYTES` bytes; else its first
    three quarters and its last quarter with ``… [N characters cut] …`` between them,
    :data:`MAX_ERROR_BYTES` bytes at most in all. ``text`` must encode (:func:`storable`);
    a cut falls between characters (one cut in two is dropped whole): valid text."""
    data = text.encode("utf-8")
    if len(data) <= MAX_ERROR_BYTES:
        return text
    # The marker with as many digits as the text has characters: never shorter than the
    # one written, so the whole fits.
    room = MAX_ERROR_BYTES - len(f" … [{len(text)} characters cut] … ".encode())
    head_bytes = room * 3 // 4
    head = data[:head_bytes].decode("utf-8", "ignore")
    tail = data[len(data) - (room - head_bytes):].decode("utf-8", "ignore")
    return f"{head} … [{len(text) - len(head) - len(tail)} characters cut] … {tail}"


def error_text(text: str) -> str:
    """An error text as the engine stores it (history, recovery log, status API), the same
    for every backend: passwords masked (:func:`~lease_core._redact.redact`), then made
    storable (:func:`storable`), then cut to :data:`MAX_ERROR_BYTES` (:func:`capped`).
    Masked before the cut, so a cut never leaves part of a password unmasked."""
    return capped(storable(redact(text)))


def decide_outcome(
    *,
    raised: BaseException | None = None,
    timed_out: bool = False,
    timeout: float | None = None,
    interrupted: Interruption | None = None,
    lost: bool = False,
    stopping: bool = False,
    crashed: bool = False,
    cancelled: bool = False,
) -> Ending:
    """Decide how an attempt ended.

    ``raised`` is the exception the handler raised, if any; ``timed_out`` is true when the
    job's ``timeout`` cancelled it; ``interrupted`` says why the scheduler cancelled it;
    ``lost`` is true when a heartbeat already found the lease lost; ``stopping`` when the
    scheduler is stopping gracefully; ``crashed`` when it was cancelled from outside or
    aborted; ``cancelled`` when an operator cancelled the run (whatever the handler did
    then, within its grace or not, the run ended ``cancelled``: the store recorded it).
    The checks run in that order of precedence: crash, cancel, lost lease, hand-over,
    failure, time-out, completion.
    """
    if crashed:
        return Ending(None)
    if cancelled:
        return Ending(Outcome.CANCELLED, "cancelled")
    kind = None if raised is None else classify(raised)
    if interrupted in (Interruption.LEASE_LOST, Interruption.DEADLINE):
        return Ending(Outcome.LOST, str(interrupted))
    if lost or kind is LeaseLost:
        return Ending(Outcome.LOST, storable(str(raised)) if kind is LeaseLost
                      else "lease lost")
    if interrupted is Interruption.STOPPED or (kind is StopRequested and stopping):
        return Ending(Outcome.HANDED_OVER)
    if raised is not None:
        # Kept in the store and shown by history, the status API and the recovery log: a
        # password in a driver's message (a DSN) is masked, and a huge text cut, before
        # it is written.
        return Ending(Outcome.FAILED, error_text(
            "".join(traceback.format_exception_only(raised)).strip()))
    if timed_out:
        return Ending(Outcome.TIMED_OUT, f"timed out after {timeout or 0:g}s")
    return Ending(Outcome.COMPLETED)
