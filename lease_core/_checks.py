"""Argument checks of the backend contract's calls, a limit they share, the
checkpoints' JSON (a value that is not JSON is refused as a bad argument is), and the
run statuses an attempt or a finish implies.

Re-exported by :mod:`lease_core.abc`, where a backend imports them from.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ._redact import redact
from ._structures import Attempt, Outcome, RunStatus
from .errors import ConfigurationError

__all__ = [
    "FINISH_OUTCOMES",
    "MEMBER_RETENTION_MS",
    "check_every",
    "check_history_query",
    "check_leave",
    "check_limit",
    "check_lookup_name",
    "check_members",
    "check_prune",
    "check_storable",
    "decode_checkpoint",
    "encode_checkpoint",
    "finish_status",
    "run_status",
]


def check_prune(keep: int | None, older_than_ms: int | None, batch: int) -> None:
    """Validate the arguments of :meth:`Backend.prune` (``ConfigurationError`` naming them)."""
    for name, value in (("keep", keep), ("older_than_ms", older_than_ms)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ConfigurationError(f"{name}={value!r} must be a whole number, 0 or more")
    if not isinstance(batch, int) or batch < 1:
        raise ConfigurationError(f"batch={batch!r} must be a whole number, 1 or more")


def check_limit(limit: int) -> None:
    """Validate the ``limit`` of :meth:`Backend.history` and :meth:`Backend.runs`: 0 or
    more (``ConfigurationError`` naming it; a negative one is no count of anything)."""
    if limit < 0:
        raise ConfigurationError(f"limit={limit!r} must be 0 or more")


def check_every(every_ms: int) -> None:
    """Validate the period of :meth:`Backend.maintenance_due` (``ConfigurationError``)."""
    if isinstance(every_ms, bool) or not isinstance(every_ms, int) or every_ms < 1:
        raise ConfigurationError(f"every_ms={every_ms!r} must be a whole number, 1 or more")


#: How long after its expiry a member's record is kept at most: :meth:`Backend.members`
#: deletes older ones (a cheap, bounded sweep of the records it reads anyway).
MEMBER_RETENTION_MS = 3_600_000


def check_leave(instance_id: str) -> None:
    """Validate the argument of :meth:`Backend.leave` (``ConfigurationError`` naming it)."""
    if not isinstance(instance_id, str) or not instance_id:
        raise ConfigurationError(f"instance_id={instance_id!r} must be a non-empty string")


def check_members(instance_id: str, ttl_ms: int) -> None:
    """Validate the arguments of :meth:`Backend.members` (``ConfigurationError`` naming them)."""
    check_leave(instance_id)
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 1:
        raise ConfigurationError(f"ttl_ms={ttl_ms!r} must be a whole number, 1 or more")


#: The longest name (UTF-8 bytes) :func:`check_storable` lets through: PostgreSQL keeps
#: lease names and instance ids in a btree index, whose entries hold at most 2704 bytes
#: (a longer one failed as "cannot reach PostgreSQL", retried as an outage).
MAX_NAME_BYTES = 1000


def check_storable(what: str, text: str) -> None:
    """Refuse a name no store can hold: a NUL character (PostgreSQL's text refuses it), a
    lone surrogate (``os.fsdecode`` of bytes that are not UTF-8; no store encodes it), or
    more than :data:`MAX_NAME_BYTES` bytes. Raises a :class:`ConfigurationError` naming
    ``what`` and the value (its start only, for a long one)."""
    if "\x00" in text:
        raise ConfigurationError(f"{what}={text[:200]!r} holds a NUL character, which no "
                                 "store can keep; remove it")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigurationError(f"{what}={text[:200]!r} is not valid Unicode text (a lone "
                                 "surrogate, as os.fsdecode() makes of bytes that are not "
                                 "UTF-8); no store can keep it") from None
    if size > MAX_NAME_BYTES:
        raise ConfigurationError(f"{what}={text[:40]!r}... is {size} bytes long (UTF-8); "
                                 f"no store keeps one of more than {MAX_NAME_BYTES}")


def check_lookup_name(name: str) -> str:
    """Refuse a job or workflow name that no store can hold (a NUL character: PostgreSQL
    cannot store one), so that a lookup answers a clear error, not the driver's."""
    if "\x00" in name:
        raise ConfigurationError(
            f"name {name!r} holds a NUL character, which no job or workflow name can; "
            "check the name")
    check_storable("name", name)
    return name


def check_history_query(job: object, limit: object) -> None:
    """Refuse the arguments of ``Scheduler.history`` alike on every store (not each
    driver's own error): ``limit`` a whole number, at least 1; ``job`` a name or None."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"limit={limit!r} must be an integer >= 1")
    if job is not None:
        if not isinstance(job, str):
            raise ConfigurationError(
                f"job={job!r} must be a job name (a string), or None for every job")
        check_lookup_name(job)


def encode_checkpoint(value: object) -> str:
    """Serialise a checkpoint value to JSON text, or raise :class:`ConfigurationError`."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except RecursionError:  # (its repr would recurse as deep)
        raise ConfigurationError(
            "checkpoint value nests too deeply to be stored as JSON (lists or dicts "
            "thousands of levels deep); store a flatter value") from None
    except (TypeError, ValueError) as exc:
        # A short repr is shown whole, its passwords masked; a long one by its type: cut
        # before the masking, a URL's password could show in part.
        shown = repr(value)
        if len(shown) > 80:
            shown = f"of type {type(value).__name__}"
        raise ConfigurationError(
            f"checkpoint value {redact(shown)} is not JSON-serialisable ({redact(str(exc))}); "
            "store dicts, lists, strings, numbers, booleans or None"
        ) from None


def decode_checkpoint(text: str | None) -> Any:
    """Parse checkpoint JSON text; ``None`` (no checkpoint) stays ``None``."""
    return None if text is None else json.loads(text)


def run_status(attempt: Attempt) -> RunStatus:
    """The run's status implied by its latest attempt (``lost``: not yet taken over)."""
    if attempt.outcome is None:
        return RunStatus.RUNNING
    try:
        return RunStatus(attempt.outcome.value)
    except ValueError:
        return RunStatus.RUNNING


#: The outcomes :meth:`Backend.finish` ends a run with.
FINISH_OUTCOMES = (Outcome.COMPLETED, Outcome.FAILED, Outcome.TIMED_OUT)


def finish_status(outcome: object) -> RunStatus:
    """The run status :meth:`Backend.finish` writes for ``outcome`` (member or value).

    Raises :class:`~lease_core.errors.ConfigurationError`, naming it, for any other
    outcome: the others are the store's own (lost, handed over, escalated, skipped).
    """
    for member in FINISH_OUTCOMES:
        if outcome is member or outcome == member.value:
            return RunStatus(member.value)
    raise ConfigurationError(
        f"outcome={outcome!r} cannot end a run; use completed, failed or timed_out"
    )


def check_not_forked(backend: Any, opened_in: int) -> None:
    """Refuse, in a forked child, a backend its parent has open (``opened_in``: the pid
    that opened it): its connections are the parent's. A memory store (a MemoryBackend,
    or any backend whose class sets ``in_process``) has none."""
    if opened_in != os.getpid() and not getattr(backend, "in_process", False):
        raise RuntimeError(f"{type(backend).__name__}: this process is a fork of the one "
                           "that opened it (its connections are the parent's): make one here")
