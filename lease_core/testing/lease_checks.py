"""The named-lease part of the backend contract as checks (see lease_core/_named_leases.py).

Collected with :mod:`lease_core.testing.conformance` by
:class:`~lease_core.testing.BackendConformance`; a backend that keeps the contract's
default (no named leases: :class:`~lease_core.errors.ConfigurationError`) skips them.
"""

from __future__ import annotations

import anyio
import pytest

from lease_core import ConfigurationError
from lease_core._named_leases import LeaseAnswer
from lease_core.abc import Backend

from ._tools import Store, wait_for

pytestmark = pytest.mark.anyio

SHORT = 300  # ms: a lease we wait out
LONG = 60_000


async def _started(store: Store) -> Backend:
    backend = store.backend()
    await backend.start()
    return backend


async def _acquire_or_skip(backend: Backend, name: str, holder: str,
                           ttl_ms: int = LONG) -> LeaseAnswer:
    """``backend.acquire_lease(...)``, or skip the check for a backend without leases."""
    try:
        return await backend.acquire_lease(name, holder, ttl_ms)
    except ConfigurationError as exc:
        if "has no named leases" in str(exc):
            pytest.skip(str(exc))
        raise


async def test_lease_is_exclusive_and_its_token_grows_with_each_holder(store: Store) -> None:
    a, b = await _started(store), await _started(store)
    try:
        first = await _acquire_or_skip(a, "L", "h1")
        assert first.held and first.token >= 1 and first.holder == "h1"
        assert first.expires_ms - first.now_ms == LONG  # the store's clock, both ends
        other = await b.acquire_lease("L", "h2", LONG)
        assert not other.held
        assert (other.token, other.holder, other.expires_ms) == (first.token, "h1",
                                                                  first.expires_ms)
        again = await a.acquire_lease("L", "h1", LONG)  # sent again: same hold, renewed
        assert again.held and again.token == first.token
        assert await b.release_lease("L", first.token + 1) is False  # not its token
        assert await a.release_lease("L", first.token) is True
        assert await a.release_lease("L", first.token) is False  # released already
        assert await a.renew_lease("L", first.token, LONG) is None  # nor revived
        second = await b.acquire_lease("L", "h2", LONG)
        assert second.held and second.token > first.token
        assert await a.renew_lease("L", first.token, LONG) is None  # stale token
        assert not (await a.acquire_lease("L", "h1", LONG)).held
        # the old holder again, after a release: a new holder, so a new token
        assert await b.release_lease("L", second.token) is True
        third = await b.acquire_lease("L", "h2", LONG)
        assert third.held and third.token > second.token
    finally:
        await a.close()
        await b.close()


async def test_lease_expiry_frees_the_name_and_fences_the_old_holder(store: Store) -> None:
    a, b = await _started(store), await _started(store)
    try:
        first = await _acquire_or_skip(a, "E", "old", SHORT)
        assert first.held

        async def taken() -> LeaseAnswer | None:
            answer = await b.acquire_lease("E", "new", LONG)
            return answer if answer.held else None

        second = await wait_for(taken, timeout=5, what="the lapsed lease to be free")
        assert second.token > first.token
        assert await a.renew_lease("E", first.token, LONG) is None
        assert await a.release_lease("E", first.token) is False
        assert not (await a.acquire_lease("E", "old", LONG)).held
        assert await b.renew_lease("E", second.token, LONG) is not None
    finally:
        await a.close()
        await b.close()


async def _race(backends: list[Backend], name: str, ttl_ms: int,
                round_: int) -> LeaseAnswer:
    """Every backend asks for ``name`` at once, as a holder of its own; the one winner."""
    answers: dict[str, LeaseAnswer] = {}

    async def take(backend: Backend, holder: str) -> None:
        answers[holder] = await backend.acquire_lease(name, holder, ttl_ms)

    async with anyio.create_task_group() as tg:
        for i, backend in enumerate(backends):
            tg.start_soon(take, backend, f"h{round_}-{i}")
    held = [answer for answer in answers.values() if answer.held]
    assert len(held) == 1, f"round {round_}: {len(held)} holders of one name at once: {held}"
    (winner,) = held
    for holder, answer in answers.items():
        if not answer.held:
            assert (answer.token, answer.holder) == (winner.token, winner.holder), holder
    return winner


async def test_lease_acquires_at_once_give_the_name_to_one_holder(store: Store) -> None:
    """Holders that ask for a free name at the same time (each on a backend of its own):
    one takes it, the others are told its hold; so again once that hold has lapsed (a
    takeover), with a larger token. An acquire that reads the name, then writes it in a
    second step (a GET, then a SET), gives it to several at once: each found it free."""
    backends = [await _started(store) for _ in range(5)]
    try:
        await _acquire_or_skip(backends[0], "C-probe", "p")
        first = await _race(backends, "C", SHORT, 0)

        async def lapsed() -> bool:
            return await backends[0].now_ms() > first.expires_ms

        await wait_for(lapsed, timeout=5, what="the lease to lapse")
        second = await _race(backends, "C", LONG, 1)  # a takeover of the lapsed hold
        assert second.token > first.token
    finally:
        for backend in backends:
            await backend.close()


async def test_lease_renewal_sets_an_absolute_expiry(store: Store) -> None:
    a = await _started(store)
    try:
        held = await _acquire_or_skip(a, "R", "h", LONG)
        before = await a.now_ms()
        expires = await a.renew_lease("R", held.token, 5_000)
        after = await a.now_ms()
        assert expires is not None
        assert before + 5_000 <= expires <= after + 5_000  # now + ttl, not added to the rest
        answer = await a.acquire_lease("R", "other", LONG)
        assert not answer.held and answer.expires_ms == expires
    finally:
        await a.close()


async def test_lease_expired_is_not_revived_by_renewal(store: Store) -> None:
    a = await _started(store)
    try:
        held = await _acquire_or_skip(a, "X", "h", SHORT)

        async def lapsed() -> bool:
            return await a.now_ms() > held.expires_ms  # by the store's clock

        await wait_for(lapsed, timeout=5, what="the lease to lapse")
        assert await a.renew_lease("X", held.token, LONG) is None
        assert await a.release_lease("X", held.token) is False
        again = await a.acquire_lease("X", "h", LONG)  # the same holder, after expiry
        assert again.held and again.token > held.token
    finally:
        await a.close()


async def test_lease_names_are_isolated_and_round_trip(store: Store) -> None:
    a = await _started(store)
    try:
        names = ["n", "host 1 pid 2", "zürich-β-東京", "a:b", "{tag}", "x/y", "%s", "'; --",
                 "lease:n", "member:n"]
        tokens = {}
        for name in names:
            answer = await _acquire_or_skip(a, name, f"holder of {name}")
            assert answer.held, name
            tokens[name] = answer.token
        for name in names:
            other = await a.acquire_lease(name, "someone else", LONG)
            assert not other.held and other.holder == f"holder of {name}", name
        assert await a.release_lease("n", tokens["n"]) is True
        assert not (await a.acquire_lease("lease:n", "someone else", LONG)).held
        assert (await a.acquire_lease("n", "someone else", LONG)).held
        # a lease does not touch a job or a member of the same name
        assert await a.members("n", LONG) in (None, ["n"])
        assert await a.jobs() == []
    finally:
        await a.close()


async def test_lease_calls_refuse_bad_arguments(store: Store) -> None:
    a = await _started(store)
    try:
        await _acquire_or_skip(a, "ok", "h")
        for name in ["", None, 7]:
            with pytest.raises(ConfigurationError, match="name="):
                await a.acquire_lease(name, "h", LONG)  # type: ignore[arg-type]
        for holder in ["", None]:
            with pytest.raises(ConfigurationError, match="holder="):
                await a.acquire_lease("ok", holder, LONG)  # type: ignore[arg-type]
        for ttl in [0, -1, 1.5, True, "100"]:
            with pytest.raises(ConfigurationError, match=f"ttl_ms={ttl!r}"):
                await a.acquire_lease("ok", "h", ttl)  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError, match=f"ttl_ms={ttl!r}"):
                await a.renew_lease("ok", 1, ttl)  # type: ignore[arg-type]
        for token in [0, -3, "1", None]:
            with pytest.raises(ConfigurationError, match=f"token={token!r}"):
                await a.release_lease("ok", token)  # type: ignore[arg-type]
        assert not (await a.acquire_lease("ok", "other", LONG)).held  # still held by "h"
    finally:
        await a.close()


async def test_lease_read_tells_who_holds_it_and_takes_nothing(store: Store) -> None:
    """``read_lease`` answers on the store's clock and writes nothing: a name never held
    is free (token 0), a live hold is named with its token and expiry, a released or
    lapsed one is free again, and reading never takes the name nor raises its token. A
    backend that keeps the default (no ``read_lease``) skips this check."""
    a, b = await _started(store), await _started(store)
    try:
        await _acquire_or_skip(a, "W-probe", "p")
        try:
            never = await b.read_lease("W")
        except ConfigurationError as exc:
            if "read_lease()" in str(exc):
                pytest.skip(str(exc))
            raise
        assert (never.held, never.token, never.holder) == (False, 0, None)
        # Held live for LONG: the checks of a live hold take no time limit of their own
        # (a 300 ms hold lapsed within three round trips to a distant store).
        first = await a.acquire_lease("W", "h1", LONG)
        seen = await b.read_lease("W")
        assert (seen.held, seen.token, seen.holder) == (True, first.token, "h1")
        assert seen.expires_ms == first.expires_ms and seen.now_ms < seen.expires_ms
        assert not (await b.acquire_lease("W", "h2", LONG)).held  # the read took nothing
        assert await a.release_lease("W", first.token) is True
        released = await b.read_lease("W")
        assert (released.held, released.holder, released.token) == (False, None,
                                                                     first.token)
        second = await b.acquire_lease("W", "h2", SHORT)  # a hold that lapses
        assert second.held and second.token > first.token

        async def lapsed() -> LeaseAnswer | None:
            answer = await a.read_lease("W")
            return None if answer.held else answer

        free = await wait_for(lapsed, timeout=5, what="the read to find the hold lapsed")
        assert free.holder is None and free.token == second.token
        assert free.now_ms >= second.expires_ms  # by the store's clock
        third = await a.acquire_lease("W", "h1", LONG)  # reads raised no token
        assert third.held and third.token > second.token
        assert (await b.read_lease("W")).token == third.token
        for name in ["", None, 7]:
            with pytest.raises(ConfigurationError, match="name="):
                await a.read_lease(name)  # type: ignore[arg-type]
    finally:
        await a.close()
        await b.close()
