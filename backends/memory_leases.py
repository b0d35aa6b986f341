"""Named leases (:class:`~lease_core.Lease`) on the in-memory store.

The memory backend's half of the named-lease calls, kept apart from
:mod:`backends.memory`; each call runs under the backend's lock, on its clock, after a
checkpoint of the event loop, as every call of the backend makes: a call in a cancelled
scope raises there (a real store's raises at its round trip), so a test on this store
meets the cancellations a real one's does.
"""

from __future__ import annotations

import threading

import anyio.lowlevel

from lease_core._named_leases import LeaseAnswer, check_lease

__all__ = ["MemoryNamedLeases"]


class MemoryNamedLeases:
    """The named leases of :class:`~backends.memory.MemoryBackend` (see
    :mod:`lease_core._named_leases`)."""

    _lock: threading.Lock
    #: name -> (token, expiry in ms on the backend's clock, holder or None).
    _named: dict[str, tuple[int, int, str | None]]

    def _now(self) -> int:
        raise NotImplementedError  # pragma: no cover - MemoryBackend's own

    async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
        """Take ``name`` for ``holder`` when it is free, under the lock."""
        check_lease(name, holder=holder, ttl_ms=ttl_ms)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            token, expires, current = self._named.get(name, (0, 0, None))
            live = expires > now
            if live and current != holder:
                return LeaseAnswer(False, token, expires, now, current)
            token += 0 if live else 1
            self._named[name] = (token, now + ttl_ms, holder)
            return LeaseAnswer(True, token, now + ttl_ms, now, holder)

    async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
        """Extend the live hold of ``token`` to ``now + ttl_ms``, under the lock."""
        check_lease(name, ttl_ms=ttl_ms, token=token)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            held, expires, holder = self._named.get(name, (0, 0, None))
            if held != token or expires <= now:
                return None
            self._named[name] = (token, now + ttl_ms, holder)
            return now + ttl_ms

    async def read_lease(self, name: str) -> LeaseAnswer:
        """Who holds ``name`` now, under the lock; nothing changes."""
        check_lease(name)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            now = self._now()
            token, expires, holder = self._named.get(name, (0, 0, None))
        if expires > now and holder is not None:
            return LeaseAnswer(True, token, expires, now, holder)
        return LeaseAnswer(False, token, expires, now, None)

    async def release_lease(self, name: str, token: int) -> bool:
        """Free ``name`` if ``token`` holds it live, keeping the token, under the lock."""
        check_lease(name, token=token)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            held, expires, _ = self._named.get(name, (0, 0, None))
            if held != token or expires <= self._now():
                return False
            self._named[name] = (token, 0, None)
            return True
