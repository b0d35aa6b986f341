"""The single/batch twins of the Backend contract (claim/claim_many, finish/finish_many,
prune/prune_many): a backend implements one of each pair and inherits the other.

The backends here are the memory store with one twin of a pair put back to the one
:class:`~lease_core.abc.Backend` derives, so each implements the pair as a backend written
against the contract would: only the single call (as before the twins), only the batch
(as the built-in backends now do), or neither.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest

from backends.memory import MemoryBackend
from lease_core import ConfigurationError, Outcome
from lease_core.abc import (
    TWINS,
    Backend,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    Lease,
)

pytestmark = pytest.mark.anyio


def _request(job: str, token: str = "t", slot: int = 1) -> ClaimRequest:
    return ClaimRequest(job, slot, "i", token, 60_000)


class OnlySingles(MemoryBackend):
    """A backend of the contract before the twins: claim(), finish() and prune() only."""

    claim_many = Backend.claim_many
    finish_many = Backend.finish_many
    prune_many = Backend.prune_many

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def claim(self, request: ClaimRequest) -> ClaimResult:
        self.calls.append(f"claim {request.job}")
        (result,) = await MemoryBackend.claim_many(self, [request])
        return result

    async def finish(self, lease: Lease, outcome: Outcome, error: str | None = None) -> bool:
        self.calls.append(f"finish {lease.job}")
        (done,) = await MemoryBackend.finish_many(self, [(lease, outcome, error)])
        return done

    async def prune(self, job: str, *, keep: int | None = None,
                    older_than_ms: int | None = None, batch: int = 1000) -> int:
        self.calls.append(f"prune {job}")
        counts = await MemoryBackend.prune_many(self, [job], keep=keep,
                                                older_than_ms=older_than_ms, batch=batch)
        return counts[job]


class OnlyBatches(MemoryBackend):
    """A backend implementing the batches only (as the built-in ones do), counted."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int]] = []

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        self.batches.append(("claim_many", len(requests)))
        return await super().claim_many(requests)

    async def finish_many(self, items: Sequence[tuple[Lease, Outcome, str | None]]
                          ) -> list[bool]:
        self.batches.append(("finish_many", len(items)))
        return await super().finish_many(items)

    async def prune_many(self, jobs: Sequence[str], **options: Any) -> dict[str, int]:
        self.batches.append(("prune_many", len(jobs)))
        return await super().prune_many(jobs, **options)


#: Single calls a built-in backend implements beside its batch, as a measured fast path:
#: Redis sends a lone claim or finish as one script call without the batch's bookkeeping
#: (client CPU per claim + finish, benchmarks/RESULTS.md). Each shares its reply handling
#: with the batch; the conformance suite runs both.
FAST_PATHS = {("RedisBackend", "claim"), ("RedisBackend", "finish")}


def test_the_built_in_backends_implement_only_the_batches() -> None:
    from backends.postgres import PostgresBackend
    from backends.redis import RedisBackend

    for backend in (MemoryBackend, PostgresBackend, RedisBackend):
        for single, batch in TWINS:
            assert batch in _defined(backend), f"{backend.__name__}.{batch}"
            if (backend.__name__, single) in FAST_PATHS:
                assert single in _defined(backend), f"{backend.__name__}.{single} is listed"
                continue
            assert single not in _defined(backend), f"{backend.__name__}.{single}"
            assert getattr(backend, single) is getattr(Backend, single)


def _defined(cls: type) -> set[str]:
    """Names defined by ``cls`` or a base of it below Backend (its mixins, say)."""
    return {name for klass in cls.__mro__[:cls.__mro__.index(Backend)] for name in vars(klass)}


async def test_a_backend_with_the_single_calls_only_gets_batches_that_loop_over_them() -> None:
    backend = OnlySingles()
    await backend.start()
    results = await backend.claim_many([_request("a", "ta"), _request("b", "tb"),
                                        _request("a", "other")])
    assert [r.status for r in results] == [ClaimStatus.WON, ClaimStatus.WON,
                                           ClaimStatus.RUNNING]
    assert await backend.claim_many([]) == []
    done = await backend.finish_many([(Lease("a", 1, "ta", 60_000), Outcome.COMPLETED, None),
                                      (Lease("a", 1, "ta", 60_000), Outcome.FAILED, None),
                                      (Lease("b", 1, "tb", 60_000), Outcome.FAILED, "x")])
    assert done == [True, False, True]
    # An outcome finish() refuses fails the batch before any finish() is called.
    with pytest.raises(ConfigurationError, match="outcome="):
        await backend.finish_many([(Lease("b", 1, "tb", 60_000), Outcome.COMPLETED, None),
                                   (Lease("b", 1, "tb", 60_000), Outcome.LOST, None)])
    assert await backend.prune_many(["a", "b", "a"], keep=0) == {"a": 1, "b": 1}
    assert backend.calls == ["claim a", "claim b", "claim a", "finish a", "finish a",
                             "finish b", "prune a", "prune b"]


async def test_a_backend_with_the_batches_only_answers_lone_calls_as_batches_of_one() -> None:
    backend = OnlyBatches()
    await backend.start()
    won = await backend.claim(_request("a", "ta"))
    assert (won.status, won.job, won.attempt) == (ClaimStatus.WON, "a", 1)
    assert (await backend.claim(_request("a", "other"))).status is ClaimStatus.RUNNING
    assert await backend.finish(Lease("a", 1, "ta", 60_000), Outcome.COMPLETED)
    assert not await backend.finish(Lease("a", 1, "ta", 60_000), Outcome.COMPLETED)
    with pytest.raises(ConfigurationError, match="outcome="):
        await backend.finish(Lease("a", 1, "ta", 60_000), Outcome.ESCALATED)
    assert await backend.prune("a", keep=0) == 1
    assert await backend.prune("nobody", keep=0) == 0
    with pytest.raises(ValueError, match="keep=-1"):
        await backend.prune("a", keep=-1)
    assert backend.batches == [("claim_many", 1), ("claim_many", 1), ("finish_many", 1),
                               ("finish_many", 1), ("finish_many", 1), ("prune_many", 1),
                               ("prune_many", 1)]


@pytest.mark.parametrize(("pair", "named"), [
    (("claim", "claim_many"), "claim() or claim_many()"),
    (("finish", "finish_many"), "finish() or finish_many()"),
])
def test_a_backend_with_neither_twin_is_refused_at_instantiation(
    pair: tuple[str, str], named: str
) -> None:
    neither = type("Neither", (MemoryBackend,), {name: getattr(Backend, name) for name in pair})
    with pytest.raises(TypeError, match="Neither without an implementation of " + re.escape(named)):
        neither()
    both = type("Both", (MemoryBackend,), {
        name: getattr(Backend, name) for pair in TWINS[:2] for name in pair})
    with pytest.raises(TypeError, match=r"claim\(\) or claim_many\(\) and of finish\(\)"):
        both()


def test_an_abstract_method_left_gets_abc_s_own_error_first() -> None:
    class Unfinished(Backend):
        pass

    with pytest.raises(TypeError, match="abstract method"):
        Unfinished()  # type: ignore[abstract]


async def test_a_backend_with_neither_prune_twin_keeps_its_history() -> None:
    class KeepsAll(MemoryBackend):
        prune = Backend.prune
        prune_many = Backend.prune_many

    backend = KeepsAll()
    await backend.start()
    r = _request("a", "ta")
    await backend.claim(r)
    await backend.finish(Lease("a", 1, "ta", 60_000), Outcome.COMPLETED)
    assert await backend.prune("a", keep=0) == 0
    assert await backend.prune_many(["a", "b", "a"], keep=0) == {"a": 0, "b": 0}
    with pytest.raises(ValueError, match="batch=0"):
        await backend.prune_many(["a"], batch=0)
    with pytest.raises(ValueError, match="keep=-1"):
        await backend.prune("a", keep=-1)
    assert len(await backend.history("a")) == 1


async def test_a_single_call_reaching_its_derived_twin_through_super_is_refused() -> None:
    class Loops(MemoryBackend):
        """Implements claim() alone, but defers to super(): nothing to derive it from."""

        claim_many = Backend.claim_many

        async def claim(self, request: ClaimRequest) -> ClaimResult:
            return await super().claim(request)

    with pytest.raises(NotImplementedError, match=r"Loops.claim\(\) reached Backend.claim"):
        await Loops().claim(_request("a"))
    with pytest.raises(NotImplementedError, match=r"does not implement claim_many"):
        await Loops().claim_many([_request("a")])


async def test_an_override_of_a_built_in_backend_s_single_call_still_works() -> None:
    """As the toy backends of the tests do: claim() overridden on top of MemoryBackend."""

    class Tagged(MemoryBackend):
        async def claim(self, request: ClaimRequest) -> ClaimResult:
            result = await super().claim(request)
            return ClaimResult(result.status, result.job, result.slot, result.now_ms,
                               result.attempt, result.reason, result.expires_ms,
                               result.run_status, "tagged")

    backend = Tagged()
    await backend.start()
    assert (await backend.claim(_request("a"))).instance_id == "tagged"
    # Its batches are still the memory store's own (they never went through claim()).
    (batched,) = await backend.claim_many([_request("b")])
    assert batched.instance_id == "i"
