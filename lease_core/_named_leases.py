"""The named-lease part of the backend contract (:class:`~lease_core.Lease` builds on it).

A *named lease* is a hold on a name, such as ``"leader"``, by one holder at a time,
for a TTL measured on **the store's clock**. It keeps no history: one record per name,
holding the current token, the expiry and the holder.

*Acquire* (:meth:`NamedLeaseStore.acquire_lease`), atomically:

- when the name is free (never held, released, or its expiry ``<= now``), the caller
  takes it with a ``token`` above every token the name had before (memory and
  PostgreSQL: the previous token + 1, 1 for a new name; Redis starts a name new to the
  server at ``fence_of(now_ms, 1)``, and PostgreSQL after a detected failover jumps to
  its epoch's first fence: see :func:`~lease_core.fence_of`), ``expires =
  now + ttl_ms``, ``held`` is true;
- when ``holder`` already holds it live (the same call sent again after its reply was
  lost), the hold is renewed with the **same** token;
- otherwise nothing changes and the answer describes the current hold (``held`` false).

So the token grows strictly with every new holder of a name, across releases and
expiries, and a holder can pass it to other systems as a fencing token.

*Renew* (:meth:`~NamedLeaseStore.renew_lease`) sets ``expires = now + ttl_ms`` (an
absolute expiry, never an addition to the remaining time), only where ``token`` still
holds the name live. *Release* (:meth:`~NamedLeaseStore.release_lease`) frees the name
at once, only where ``token`` still holds it live, keeping the token for the next holder
to grow from.

*Read* (:meth:`~NamedLeaseStore.read_lease`) tells who holds a name, on the store's
clock, changing nothing: ``held`` true only for a live hold (expiry ``> now``), whose
``holder``, ``token`` and ``expires_ms`` it gives; a free name answers ``held`` false,
``holder`` ``None``, and the last token it had (0 when never held), with an
``expires_ms`` not after ``now_ms`` unless the store lets nobody take the name before
then (PostgreSQL's quarantine after a failover: its end, as an acquire answers).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_storable
from .errors import ConfigurationError

__all__ = ["LeaseAnswer", "NamedLeaseStore", "check_lease"]


@dataclass(frozen=True, slots=True)
class LeaseAnswer:
    """A store's answer to :meth:`NamedLeaseStore.acquire_lease`.

    ``held``: whether the caller holds the name now. ``token``, ``expires_ms`` and
    ``holder`` describe the current hold (the caller's when ``held``; ``token`` 0 and
    ``holder`` ``None`` for a name never held). ``now_ms`` is the store's clock when it
    answered. Every time is in epoch milliseconds on the store's clock.
    """

    held: bool
    token: int
    expires_ms: int
    now_ms: int
    holder: str | None


#: The longest lease: 365 days (a longer one is surely a mistake, and would overflow the
#: stores' expiry arithmetic).
MAX_LEASE_TTL_MS = 365 * 86_400_000


def check_lease(name: object, *, holder: object = "-", ttl_ms: object = 1,
                token: object = 1, ttl: object = None) -> None:
    """Validate the arguments of the named-lease calls (``ConfigurationError`` naming them;
    ``ttl``: the duration ``ttl_ms`` was made from, named instead where given)."""
    for what, text in (("lease name", name), ("holder", holder)):
        if not isinstance(text, str) or not text:
            raise ConfigurationError(f"{what}={text!r} must be a non-empty string")
        check_storable(what, text)
    for what, value in (("ttl_ms", ttl_ms), ("token", token)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{what}={value!r} must be a whole number, 1 or more")
    assert isinstance(ttl_ms, int)
    if ttl_ms > MAX_LEASE_TTL_MS:
        named = f"ttl_ms={ttl_ms!r}" if ttl is None else f"ttl={ttl!r}"
        raise ConfigurationError(f"{named} is longer than 365 days; a lease is renewed "
                                 "while held, so give it a ttl of seconds or minutes")


class NamedLeaseStore:
    """The named-lease calls of :class:`~lease_core.abc.Backend` (see the module docs).

    The built-in backends implement all three in one store call each (one statement on
    PostgreSQL, one script on Redis, one lock on memory). The defaults here raise
    :class:`~lease_core.errors.ConfigurationError`: a backend of your own that does not
    implement them has no named leases, and the conformance suite skips their checks.
    """

    def _no_leases(self) -> ConfigurationError:
        return ConfigurationError(
            f"{type(self).__name__} has no named leases; implement acquire_lease(), "
            "renew_lease() and release_lease() (see lease_core._named_leases) or use a "
            "built-in backend"
        )

    async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
        """Take ``name`` for ``holder`` for ``ttl_ms`` when it is free (see module docs)."""
        raise self._no_leases()

    async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
        """Set the hold of ``token`` on ``name`` to end at ``now + ttl_ms``; return that
        expiry (ms, store clock), or ``None`` when ``token`` no longer holds it live."""
        raise self._no_leases()

    async def read_lease(self, name: str) -> LeaseAnswer:
        """Who holds ``name`` now, read on the store's clock without taking it (see the
        module docs); ``held`` here means held live by anyone.

        The default raises :class:`~lease_core.errors.ConfigurationError`: a backend of
        your own written before this call existed keeps its leases, without
        :meth:`~lease_core.Lease.current_holder` (the conformance suite skips its check).
        """
        check_lease(name)
        raise ConfigurationError(
            f"{type(self).__name__} cannot read a lease without taking it; implement "
            "read_lease() (see lease_core._named_leases) or use a built-in backend")

    async def release_lease(self, name: str, token: int) -> bool:
        """Free ``name`` now if ``token`` holds it live; return whether it did."""
        raise self._no_leases()
