"""Retries within a run: the policy a job, workflow or step declares with ``retry=``.

A run whose handler raises (or times out) is tried again within the same run (same job
and slot) when its policy has retries left: the failing attempt ends ``failed`` (or
``timed_out``) and the store marks the run ``retrying`` until the backoff has passed, on
the store's clock, with no lease held. The first instance to claim it after that makes the
next attempt, with reason ``retry``. ``max_attempts`` still counts takeovers only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ._durations import Duration, parse_duration, to_ms
from .abc import Backend
from .errors import ConfigurationError

__all__ = ["Retry", "RetryOption", "supports_retries", "to_retry"]

#: The longest ``backoff`` or ``max_backoff``: 30 days (a longer one is surely a
#: mistake, and would overflow the stores' expiry arithmetic).
MAX_BACKOFF_S = 30 * 86400
#: The most retries of one run: each retry's delay is sent to the store with the failure.
MAX_RETRIES = 1000
#: ``max_backoff`` when none is given.
_DEFAULT_MAX_BACKOFF = "5m"


@dataclass(frozen=True)
class Retry:
    """How many times, and how long after, a failed run is tried again within its run.

    ``retries``: the most retries of one run (``Retry(retries=3)`` runs it 4 times at
    most; 1,000 at most).
    The ``n``-th retry waits ``backoff * factor ** (n - 1)``, spread by ``jitter`` (0.1:
    up to 10 % shorter or longer), never more than ``max_backoff``, on the store's clock
    (a ``max_backoff`` shorter than the ``backoff`` is refused: the backoff would never
    apply).
    Exceptions that are instances of a type in ``no_retry`` are never retried, also
    when they come out of a task group (an exception group holding one): the run ends
    ``failed`` at once. A timeout counts as a failure.
    """

    retries: int = 3
    backoff: Duration = "1s"
    factor: float = 2.0
    max_backoff: Duration = _DEFAULT_MAX_BACKOFF
    jitter: float = 0.1
    no_retry: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        retries = self.retries
        if (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0
                or retries > MAX_RETRIES):
            raise ConfigurationError(
                f"retries={retries!r} must be a whole number from 0 to {MAX_RETRIES}")
        for what, value in (("backoff", self.backoff), ("max_backoff", self.max_backoff)):
            if parse_duration(value, what=what, allow_zero=True) > MAX_BACKOFF_S:
                raise ConfigurationError(
                    f"{what}={value!r} is longer than {MAX_BACKOFF_S // 86400} days; a retry "
                    "waits at most that long")
        cap = parse_duration(self.max_backoff, what="max_backoff", allow_zero=True)
        base = parse_duration(self.backoff, what="backoff", allow_zero=True)
        if cap == 0 < base:
            raise ConfigurationError(
                f"max_backoff={self.max_backoff!r} caps every wait at 0, so "
                f"backoff={self.backoff!r} would never apply; for retries at once give "
                "backoff=0, else a max_backoff of at least the backoff")
        if cap < base:  # every wait, the first too, would be the cap: backoff ignored
            default = " (the default)" if self.max_backoff == _DEFAULT_MAX_BACKOFF else ""
            raise ConfigurationError(
                f"backoff={self.backoff!r} is longer than max_backoff={self.max_backoff!r}"
                f"{default}, which caps every wait, so no retry would wait the backoff; "
                "give a max_backoff of at least the backoff")
        factor = self.factor
        if (isinstance(factor, bool) or not isinstance(factor, int | float)
                or not 1 <= factor < math.inf):
            raise ConfigurationError(f"factor={factor!r} must be a finite number, 1 or more")
        jitter = self.jitter
        if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not (
                0 <= jitter <= 1):
            raise ConfigurationError(f"jitter={jitter!r} must be a number from 0 to 1")
        no_retry = self.no_retry
        if isinstance(no_retry, type):
            object.__setattr__(self, "no_retry", no_retry := (no_retry,))
        if not isinstance(no_retry, tuple) or not all(
                isinstance(t, type) and issubclass(t, BaseException) for t in no_retry):
            raise ConfigurationError(
                f"no_retry={no_retry!r} must be an exception type or a tuple of them")

    def retries_error(self, exc: BaseException | None) -> bool:
        """True when a failure with ``exc`` (``None``: a timeout) may be retried."""
        if self.retries <= 0:
            return False
        if exc is None or not self.no_retry:
            return True
        if isinstance(exc, BaseExceptionGroup):  # from a task group: any of its errors
            return exc.split(self.no_retry)[0] is None
        return not isinstance(exc, self.no_retry)

    def delay_ms(self, retry: int) -> int:
        """The wait before retry number ``retry`` (1 for the first), jitter applied."""
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 1:
            raise ConfigurationError(
                f"delay_ms({retry!r}): a retry's number is 1 for the first, 2 for the "
                "second...")
        base = parse_duration(self.backoff, what="backoff", allow_zero=True)
        cap = parse_duration(self.max_backoff, what="max_backoff", allow_zero=True)
        if base == 0:
            return 0
        try:
            grown = base * self.factor ** (retry - 1)
        except OverflowError:  # past any cap long before (factor ** 1000)
            grown = math.inf
        seconds = min(cap, grown)
        if self.jitter:
            seconds = min(cap, seconds * (1 + self.jitter * (2 * random.random() - 1)))
        return max(0, to_ms(seconds))

    def delays_ms(self) -> tuple[int, ...]:
        """The waits before each retry, in order (what the store is given at a failure)."""
        return tuple(self.delay_ms(n) for n in range(1, self.retries + 1))


#: What ``retry=`` accepts: ``None`` (no retry), a number of retries, or a :class:`Retry`.
RetryOption = int | Retry | None


def to_retry(value: object) -> Retry | None:
    """``retry=`` as a :class:`Retry` (``None``: no retry), or a clear error naming it."""
    if value is None or isinstance(value, Retry):
        return value if value is None or value.retries else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"retry={value!r} must be a number of retries (0 or more), a "
            "lease_core.Retry(...) or None")
    if value > MAX_RETRIES:  # named as given (Retry would name its own retries=)
        raise ConfigurationError(
            f"retry={value!r} must be a number of retries from 0 to {MAX_RETRIES}")
    return Retry(retries=value) if value else None


def supports_retries(backend: Backend) -> bool:
    """True when ``backend`` implements :meth:`~lease_core.abc.Backend.retry_later`, which
    ``retry=`` needs (every built-in backend does)."""
    return type(backend).retry_later is not Backend.retry_later
