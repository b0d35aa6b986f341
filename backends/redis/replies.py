"""Reading the Redis backend's replies: claim replies, times, attempt records."""

from __future__ import annotations

import json
from typing import Any

from lease_core._structures import (
    Attempt,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    Outcome,
    Reason,
    RunStatus,
    ms_to_datetime,
)

__all__ = [
    "as_text",
    "attempt_record",
    "claim_fields",
    "claim_result",
    "counted_replies",
    "time_ms",
]


def as_text(value: Any) -> str:
    """A reply's text: bytes decoded as UTF-8, anything else as ``str()``."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def _members(kind: Any) -> dict[Any, Any]:
    """Enum members by value, as text and as the bytes a driver replies with."""
    found: dict[Any, Any] = {"": None, b"": None}
    for member in kind:
        found[member.value] = found[member.value.encode()] = member
    return found


_CLAIM_STATUS = _members(ClaimStatus)
_REASON = _members(Reason)
_RUN_STATUS = _members(RunStatus)


def claim_fields(reply: Any) -> list[Any]:
    """The claim script's reply, ``status|now|attempt|reason|expires|run_status|marker|
    epoch|seq|instance`` (``''`` for none; the instance last, whatever it holds), split."""
    fields: list[Any] = reply.split(b"|" if isinstance(reply, bytes) else "|", 9)
    return fields


def counted_replies(blob: Any, encoding: str = "utf-8",
                     errors: str = "strict") -> list[Any]:
    """Split ``claim_many.lua``'s reply: ``<length>:<reply>`` per claim (length in bytes).

    A client that decodes replies answers text: it is encoded back with the client's own
    ``encoding`` (the lengths count the bytes the server sent), and each reply decoded
    again.
    """
    decoded = not isinstance(blob, bytes)
    data = str(blob).encode(encoding, errors) if decoded else blob
    out: list[Any] = []
    at, size = 0, len(data)
    while at < size:
        colon = data.index(b":", at)
        end = colon + 1 + int(data[at:colon])
        reply = data[colon + 1:end]
        out.append(reply.decode(encoding, errors) if decoded else reply)
        at = end
    return out


def claim_result(request: ClaimRequest, fields: list[Any]) -> ClaimResult:
    """A claim's :func:`claim_fields` as a :class:`ClaimResult`."""
    status, now, attempt, reason, expires, run_status, _marker, epoch, _seq, instance = fields
    return ClaimResult(
        _CLAIM_STATUS[status], request.job, request.slot, int(now), int(attempt),
        _REASON[reason], int(expires) if expires else None, _RUN_STATUS[run_status],
        as_text(instance) or None, epoch=int(epoch) if epoch else 0,
    )


def time_ms(reply: Any) -> int:
    seconds, micros = reply
    return int(as_text(seconds)) * 1000 + int(as_text(micros)) // 1000


def attempt_record(job: str, raw: str) -> Attempt:
    """An attempt's JSON record in the ``{P/E}:att`` hash as an :class:`Attempt`."""
    rec = json.loads(raw)
    finished = rec.get("f")
    outcome = rec.get("o")
    return Attempt(
        job, int(rec["s"]), int(rec["a"]), str(rec["i"]), Reason(rec["r"]),
        ms_to_datetime(int(rec["c"])),
        ms_to_datetime(int(finished)) if finished is not None else None,
        Outcome(outcome) if outcome else None, rec.get("e"), rec.get("b"),
    )
