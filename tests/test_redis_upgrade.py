"""A Redis store written by store format 1 keeps working under today's scripts.

Format 1 (anarchon before the attempt records moved into the run hashes) kept every
attempt record as JSON in ``{P/E}:att``. Its scripts are kept, unchanged, under
``tests/fixtures/redis_v1``: these tests write a store with them, through a plain client,
then run today's backend over it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from backends.embedded.redis import EmbeddedRedis
from backends.redis import STORE_FORMAT, RedisBackend
from lease_core._structures import ClaimRequest, ClaimStatus, Lease, Outcome, Reason, RunStatus
from tests.helpers import wait_for
from tests.stores.redis import delete_prefix

pytestmark = pytest.mark.anyio

_V1 = Path(__file__).parent / "fixtures" / "redis_v1"


def _v1_source(*parts: str) -> str:
    return "\n".join((_V1 / f"{part}.lua").read_text(encoding="utf-8")
                     for part in ("_prelude", *parts))


class V1Store:
    """Today's predecessor, format 1, driven through a plain client."""

    def __init__(self, raw: redis.Redis, prefix: str) -> None:
        self.raw, self.prefix = raw, prefix
        self.claim_script = raw.register_script(_v1_source("_claim", "claim"))
        self.finish_script = raw.register_script(_v1_source("finish"))
        self.hand_over_script = raw.register_script(_v1_source("hand_over"))
        raw.hset("{" + prefix + "}:meta", mapping={"format": 1, "created": 1})
        self.marker = ""

    def tag(self, job: str) -> str:
        return "{" + self.prefix + "/" + job + "}"

    def claim(self, job: str, slot: int, token: str, lease_ms: int = 60_000) -> list[str]:
        tag = self.tag(job)
        keys = [f"{tag}:job", f"{tag}:run:{slot}", f"{tag}:open", f"{tag}:hist",
                f"{tag}:att", f"{tag}:done", f"{tag}:orphan"]
        args: list[Any] = [slot, f"old-{token}", token, lease_ms, "scheduled", 0, "", 100,
                           "", f"{tag}:run:", self.marker, lease_ms]
        fields = self.claim_script(keys, args).decode().split("|")
        self.marker = fields[6]
        return fields

    def finish(self, job: str, slot: int, token: str, status: str, error: str = "") -> int:
        tag = self.tag(job)
        keys = [f"{tag}:run:{slot}", f"{tag}:open", f"{tag}:att", f"{tag}:done"]
        return int(self.finish_script(keys, [token, slot, status, 1 if error else 0, error]))

    def hand_over(self, job: str, slot: int, token: str) -> int:
        tag = self.tag(job)
        keys = [f"{tag}:run:{slot}", f"{tag}:att", f"{tag}:done"]
        return int(self.hand_over_script(keys, [token, slot]))


@pytest.fixture
def url(valkey8_server: EmbeddedRedis) -> str:
    """The URL of the shared Valkey 8 test server."""
    return valkey8_server.url


@pytest.fixture
def raw(url: str) -> Iterator[redis.Redis]:
    """A plain sync client, for writing the old layout."""
    client = redis.Redis.from_url(url)
    yield client
    client.close()


@pytest.fixture
def old(raw: redis.Redis, url: str) -> Iterator[V1Store]:
    """A store of format 1 under a prefix of its own, deleted afterwards."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    yield V1Store(raw, prefix)
    delete_prefix(url, prefix)


@pytest.fixture
async def backend(url: str, old: V1Store) -> AsyncIterator[RedisBackend]:
    """Today's backend over the old store (opened by the test itself)."""
    found = RedisBackend(url, prefix=old.prefix)
    yield found
    await found.close()


def _server_ms(raw: redis.Redis) -> int:
    seconds, micros = raw.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _request(job: str, slot: int, token: str, **kw: Any) -> ClaimRequest:
    return ClaimRequest(job, slot, f"new-{token}", token, 60_000, **kw)


async def test_a_format_1_store_is_read_and_marked_format_2(
    old: V1Store, backend: RedisBackend, raw: redis.Redis
) -> None:
    assert old.claim("j", 1, "t1")[0] == "won"
    assert old.finish("j", 1, "t1", "failed", "boom") == 1
    assert old.claim("j", 2, "t2")[0] == "won"  # still running at the upgrade
    assert old.claim("j", 3, "t3", lease_ms=50)[0] == "won"  # expires: taken over
    assert old.claim("j", 4, "t4")[0] == "won"
    assert old.hand_over("j", 4, "t4") == 1
    marker = old.marker

    await backend.start()
    assert raw.hget("{" + old.prefix + "}:meta", "format") == str(STORE_FORMAT).encode()
    assert STORE_FORMAT == 2
    info = (await backend.register_jobs(["j"]))["j"]
    assert (info.last_slot, info.open_slots, info.new) == (4, (2, 3, 4), False)
    history = await backend.history("j")
    assert [(a.slot, a.attempt, a.reason, a.outcome, a.error) for a in history] == [
        (4, 1, Reason.SCHEDULED, Outcome.HANDED_OVER, None),
        (3, 1, Reason.SCHEDULED, None, None),
        (2, 1, Reason.SCHEDULED, None, None),
        (1, 1, Reason.SCHEDULED, Outcome.FAILED, "boom"),
    ]

    # the old holder's claim sent again answers as its first try; the marker is kept
    again = await backend.claim(ClaimRequest("j", 2, "old-t2", "t2", 60_000))
    assert (again.status, again.attempt, again.reason) == (ClaimStatus.WON, 1,
                                                           Reason.SCHEDULED)
    assert raw.hget(old.tag("j") + ":job", "sid") == marker.encode()
    # the old holder finishes under today's script; a stranger cannot
    assert not await backend.finish(Lease("j", 2, "stranger", 60_000), Outcome.COMPLETED)
    assert await backend.finish(Lease("j", 2, "t2", 60_000), Outcome.COMPLETED)

    await wait_for(lambda: _server_ms(raw) > int(raw.hget(old.tag("j") + ":run:3", "exp")),
                   interval=0.01, what="the old lease of slot 3 expired")
    taken = await backend.claim(_request("j", 3, "n3"))
    assert (taken.status, taken.attempt, taken.reason) == (ClaimStatus.WON, 2,
                                                           Reason.TAKEOVER)
    handed = await backend.claim(_request("j", 4, "n4"))
    assert (handed.status, handed.attempt, handed.reason) == (ClaimStatus.WON, 2,
                                                              Reason.HAND_OVER)
    assert await backend.finish(Lease("j", 3, "n3", 60_000), Outcome.COMPLETED)
    assert await backend.hand_over([Lease("j", 4, "n4", 60_000)]) == {"n4"}
    history = await backend.history("j")
    assert [(a.slot, a.attempt, a.reason, a.outcome) for a in history] == [
        (4, 2, Reason.HAND_OVER, Outcome.HANDED_OVER),
        (3, 2, Reason.TAKEOVER, Outcome.COMPLETED),
        (4, 1, Reason.SCHEDULED, Outcome.HANDED_OVER),
        (3, 1, Reason.SCHEDULED, Outcome.LOST),
        (2, 1, Reason.SCHEDULED, Outcome.COMPLETED),
        (1, 1, Reason.SCHEDULED, Outcome.FAILED),
    ]
    # a new slot after the old ones: new layout, same history order
    assert (await backend.claim(_request("j", 5, "n5"))).status is ClaimStatus.WON
    assert (await backend.history("j", limit=1))[0].slot == 5

    # trimming deletes old and new records alike, and the runs left without attempts;
    # the open run 4 keeps its attempts (the one handed over too) until it ends
    assert await backend.prune("j", keep=2) == 4
    assert [(a.slot, a.attempt) for a in await backend.history("j")] == [(5, 1), (4, 2),
                                                                          (4, 1)]
    runs = (await backend.check([("j", s) for s in (1, 2, 3, 4, 5)])).runs
    assert sorted(runs) == [("j", 4), ("j", 5)]
    assert runs[("j", 4)].status is RunStatus.HANDED_OVER
    assert raw.hlen(old.tag("j") + ":att") == 1  # run 4's first attempt, format 1's
    assert (await backend.register_jobs(["j"]))["j"].open_slots == (4, 5)
    assert [r.slot for r in await backend.runs("j", open_only=True)] == [5, 4]


async def test_old_runs_keep_their_max_attempts_count(
    old: V1Store, backend: RedisBackend, raw: redis.Redis
) -> None:
    """An old run taken over by the old script, then by today's, escalates on time."""
    assert old.claim("k", 1, "a", lease_ms=50)[0] == "won"
    await wait_for(lambda: _server_ms(raw) > int(raw.hget(old.tag("k") + ":run:1", "exp")),
                   interval=0.01, what="the first lease expired")
    assert old.claim("k", 1, "b", lease_ms=50)[:3][2] == "2"
    await backend.start()
    await wait_for(lambda: _server_ms(raw) > int(raw.hget(old.tag("k") + ":run:1", "exp")),
                   interval=0.01, what="the second lease expired")
    escalated = await backend.claim(_request("k", 1, "c", max_attempts=2))
    assert (escalated.status, escalated.attempt) == (ClaimStatus.ESCALATED, 2)
    history = await backend.history("k")
    assert [(a.attempt, a.reason, a.outcome) for a in history] == [
        (2, Reason.TAKEOVER, Outcome.ESCALATED), (1, Reason.SCHEDULED, Outcome.LOST)]
