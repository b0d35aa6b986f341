"""The exceptions raised by anarchon.

Every exception derives from :class:`AnarchonError`, so one ``except`` clause catches them
all. Driver exceptions are translated at the backend edge into these types.
"""

from __future__ import annotations

__all__ = [
    "AnarchonError",
    "AuthenticationFailed",
    "BackendUnavailable",
    "ConfigurationError",
    "LeaseLost",
    "OperationRefused",
    "StopRequested",
    "StoreFormatError",
    "StoreNotFound",
    "StoreRefused",
]


class AnarchonError(Exception):
    """Raised for every error of anarchon's own; the root of its exception tree."""


class ConfigurationError(AnarchonError, ValueError):
    """Raised when a value given to anarchon is invalid; the message names the value."""


class StoreRefused(ConfigurationError):
    """Raised when the store refuses a statement or command for want of a privilege or of
    an object it needs (the store user's grants, a table or schema missing), whatever
    the values given: the setup is wrong, not the call's input.

    A :class:`ConfigurationError`, so code that catches those still catches it; the
    status API answers 503 to an operation it refuses, not 400.
    """


class LeaseLost(AnarchonError):
    """Raised when a fenced operation finds that its token no longer holds the run."""


class StoreFormatError(AnarchonError):
    """Raised when the store was written by a newer format than this anarchon understands."""


class StoreNotFound(AnarchonError):
    """Raised by ``start(create=False)`` when there is no anarchon store where it looked.

    The message names the place (the table or key prefix) and how to create the store.
    Read-only tools raise it instead of creating anything.
    """


class BackendUnavailable(AnarchonError):
    """Raised when the store cannot be reached or refuses the connection."""

    #: True when the failed call surely changed nothing in the store (PostgreSQL aborted
    #: its transaction); False when it may have taken effect before its answer was lost.
    changed_nothing: bool = False


class AuthenticationFailed(BackendUnavailable):
    """Raised when the store refuses the login: a wrong user name or password.

    A :class:`BackendUnavailable`, so code that retries an unreachable store still
    catches it; the message says the login was refused, never the password.
    """


class StopRequested(AnarchonError):
    """Raised by :meth:`RunContext.raise_if_stopping` when the run should end now.

    The scheduler treats it as a request to stop: when the scheduler is stopping, the run
    is handed over to a backup and not recorded as failed; after a lost lease or an
    operator's cancel the attempt ends ``lost`` or ``cancelled``. Raised when none of
    these applies (by the handler itself), it fails the attempt like any exception.
    """


class OperationRefused(AnarchonError):
    """Raised when an operation (:class:`~lease_core.Admin`) does not apply; nothing changed.

    ``kind`` says why: ``unknown_job`` (the store has never seen the job), ``no_run`` (the
    slot has no run) or ``conflict`` (the run's status does not allow the operation, such as
    a retry of a completed run or a cancel of a finished one). The CLI exits with 2 and the
    HTTP API answers 404 (the first two) or 409 (a conflict).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
