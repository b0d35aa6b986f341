"""Redis-specific behaviour of RedisBackend, checked against real servers.

The conformance suite checks the contract on every store; these tests check what only
Redis has: server time in Lua, key layout and hash slots, scripts, adapters, errors,
replication acknowledgement and server restarts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import quote

import anyio
import pytest
import redis
import redis.asyncio
from redis.crc import key_slot

from adapters.redis import AsyncClientAdapter
from backends.embedded.redis import EmbeddedRedis, EmbeddedRedisCluster, _free_port, find_server
from backends.memory import MemoryBackend
from backends.redis import STORE_FORMAT, RedisBackend
from lease_core._structures import (
    ClaimRequest,
    ClaimStatus,
    Lease,
    Outcome,
    Reason,
    RunStatus,
)
from lease_core.abc import Backend
from lease_core.errors import (
    BackendUnavailable,
    ConfigurationError,
    StoreFormatError,
)
from tests.helpers import wait_for
from tests.stores.redis import delete_prefix

pytestmark = pytest.mark.anyio

ODD_JOBS = ["plain", "a{b}", "}x{", "with/slash", "col:on", "üñí 空", "%7B", ""]


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _request(job: str, slot: int, token: str, lease_ms: int = 30_000, **kw: Any) -> ClaimRequest:
    return ClaimRequest(job, slot, f"inst-{token}", token, lease_ms, **kw)


def _server_ms(raw: redis.Redis) -> int:
    seconds, micros = raw.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _wait_server_past(raw: redis.Redis, ms: int) -> None:
    """Wait until the server clock is past ``ms`` (a state, with a deadline)."""
    await wait_for(lambda: _server_ms(raw) > ms, interval=0.01, what=f"server time past {ms}")


@pytest.fixture
def url(valkey8_server: EmbeddedRedis) -> str:
    """The URL of the shared Valkey 8 test server."""
    return valkey8_server.url


@pytest.fixture
def raw(url: str) -> Iterator[redis.Redis]:
    """A plain sync client, for looking behind the backend's back."""
    client = redis.Redis.from_url(url)
    yield client
    client.close()


@pytest.fixture
async def backend(url: str) -> AsyncIterator[RedisBackend]:
    """A started backend on a fresh prefix (its keys are deleted afterwards)."""
    made = RedisBackend(url, prefix=_prefix())
    await made.start()
    try:
        yield made
    finally:
        await made.close()
        delete_prefix(url, made.prefix)


def _keys(raw: redis.Redis, prefix: str) -> list[str]:
    found = [*raw.scan_iter(match="{" + prefix + "}*"), *raw.scan_iter(match="{" + prefix + "/*")]
    return sorted(k.decode() for k in found)


# -- start and close --------------------------------------------------------------------


async def test_a_call_before_start_or_after_close_raises_and_opens_nothing(
        url: str, raw: redis.Redis) -> None:
    """As PostgreSQL: a call outside start() ... close() raises ConfigurationError. (It
    opened a client of its own, which stayed open until another close(): a connection
    left behind by every call after the last close.)"""
    app = f"anarchon-closed-{uuid.uuid4().hex[:8]}"
    made = RedisBackend(f"{url}?client_name={app}", prefix=_prefix())

    def connections() -> int:
        return sum(1 for c in raw.client_list() if c.get("name") == app)

    with pytest.raises(ConfigurationError, match="RedisBackend is not started; call await "
                       r"start\(\) first"):
        await made.now_ms()
    assert connections() == 0
    await made.start()
    try:
        assert await made.now_ms() > 0
        assert connections() >= 1
    finally:
        await made.close()
        delete_prefix(url, made.prefix)
    with pytest.raises(ConfigurationError, match="not started"):
        await made.jobs()
    assert connections() == 0
    # A client of the user's is used as it is, started or not (as PostgreSQL's pool),
    # scripts included, on a server of its own that has none loaded yet.
    binary = find_server("redis")
    assert binary is not None, "no redis server installed"
    with EmbeddedRedis(binary, appendonly=False) as fresh:
        client = redis.Redis.from_url(fresh.url)
        given = RedisBackend(client, prefix=_prefix())
        try:
            assert await given.now_ms() > 0
            won = await given.claim(ClaimRequest("j", 1_000, "i", "t", 30_000))
            assert won.status is ClaimStatus.WON
            assert (await given.acquire_lease("x", "h", 30_000)).held
        finally:
            client.close()


# -- time ------------------------------------------------------------------------------


async def test_lease_time_comes_from_the_server(
    backend: RedisBackend, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 946_684_800.0)  # a client clock in 2000
    before = _server_ms(raw)
    result = await backend.claim(_request("job", 1, "a", lease_ms=7_000))
    after = _server_ms(raw)
    assert result.status is ClaimStatus.WON
    assert before <= result.now_ms <= after
    assert result.expires_ms == result.now_ms + 7_000
    assert before <= await backend.now_ms() >= result.now_ms


async def test_renewal_sets_an_absolute_expiry(backend: RedisBackend) -> None:
    won = await backend.claim(_request("job", 1, "a", lease_ms=60_000))
    lease = Lease("job", 1, "a", 1_000)
    beat = await backend.heartbeat([lease])
    assert beat.held == {"a"}
    state = (await backend.check([("job", 1)])).runs[("job", 1)]
    # additive renewal would give about won.expires + 1 s; absolute gives now + 1 s
    assert state.expires_ms == beat.now_ms + 1_000
    assert state.expires_ms is not None and won.expires_ms is not None
    assert state.expires_ms < won.expires_ms


async def test_expired_lease_is_never_revived(backend: RedisBackend, raw: redis.Redis) -> None:
    won = await backend.claim(_request("job", 1, "old", lease_ms=50))
    assert won.expires_ms is not None
    await _wait_server_past(raw, won.expires_ms)
    old = Lease("job", 1, "old", 60_000)
    assert (await backend.heartbeat([old])).held == frozenset()
    taken = await backend.claim(_request("job", 1, "new"))
    assert (taken.status, taken.attempt, taken.reason) == (ClaimStatus.WON, 2, Reason.TAKEOVER)
    assert not await backend.finish(old, Outcome.COMPLETED)
    assert not await backend.set_checkpoint(old, 1)
    assert await backend.hand_over([old]) == frozenset()
    history = await backend.history("job")
    assert [(a.attempt, a.outcome) for a in history] == [(2, None), (1, Outcome.LOST)]


async def test_max_attempts_on_runs_written_before_takeovers_were_kept(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    """A run hash without ``tk`` (the previous claim script) counts its recorded takeovers."""
    for slot, lease_ms in ((1, 50), (2, 60_000)):
        won = await backend.claim(_request("job", slot, f"a{slot}", lease_ms=lease_ms,
                                           overlap_skip=False))
        assert won.status is ClaimStatus.WON
    await _wait_server_past(raw, (await backend.check([("job", 1)])).runs[
        ("job", 1)].expires_ms or 0)
    taken = await backend.claim(_request("job", 1, "b1", lease_ms=50))
    assert (taken.attempt, taken.reason) == (2, Reason.TAKEOVER)
    assert await backend.hand_over([Lease("job", 2, "a2", 60_000)]) == {"a2"}
    handed = await backend.claim(_request("job", 2, "b2", lease_ms=50))
    assert (handed.attempt, handed.reason) == (2, Reason.HAND_OVER)
    for slot in (1, 2):
        assert raw.hdel(backend._run_key("job", slot), "tk") == 1
        state = (await backend.check([("job", slot)])).runs[("job", slot)]
        await _wait_server_past(raw, state.expires_ms or 0)
    escalated = await backend.claim(_request("job", 1, "c1", max_attempts=2))
    assert (escalated.status, escalated.attempt) == (ClaimStatus.ESCALATED, 2)
    again = await backend.claim(_request("job", 2, "c2", max_attempts=2))
    assert (again.status, again.attempt, again.reason) == (ClaimStatus.WON, 3, Reason.TAKEOVER)
    assert raw.hget(backend._run_key("job", 2), "tk") == b"1"


async def test_stale_token_changes_nothing(backend: RedisBackend) -> None:
    await backend.claim(_request("job", 1, "real"))
    good = Lease("job", 1, "real", 30_000)
    stale = Lease("job", 1, "stale", 30_000)
    assert await backend.set_checkpoint(good, {"step": 1})
    assert not await backend.set_checkpoint(stale, {"step": 0})
    assert not await backend.delete_checkpoint(stale)
    assert not await backend.finish(stale, Outcome.FAILED, "boom")
    assert (await backend.heartbeat([stale])).held == frozenset()
    assert await backend.hand_over([stale]) == frozenset()
    assert await backend.get_checkpoint("job", 1) == {"step": 1}
    state = (await backend.check([("job", 1)])).runs[("job", 1)]
    assert (state.status, state.attempt) == (RunStatus.RUNNING, 1)
    assert await backend.finish(good, Outcome.COMPLETED)


# -- key layout ------------------------------------------------------------------------


async def test_every_script_touches_one_slot(backend: RedisBackend, raw: redis.Redis) -> None:
    assert backend._adapter is not None
    adapter = backend._adapter
    sent: list[tuple[Any, ...]] = []
    execute = adapter.execute

    async def spy(commands: Any, **options: Any) -> list[Any]:
        sent.extend(commands)
        return await execute(commands, **options)

    adapter.execute = spy  # type: ignore[method-assign]
    await backend.register_jobs(ODD_JOBS)
    for job in ODD_JOBS:
        await backend.claim(_request(job, 1, f"{job}-1", history_size=2))
        await backend.claim(_request(job, 2, f"{job}-2", history_size=2))  # skipped
        await backend.set_checkpoint(Lease(job, 1, f"{job}-1", 30_000), [job])
        await backend.heartbeat([Lease(job, 1, f"{job}-1", 30_000)])
        await backend.finish(Lease(job, 1, f"{job}-1", 30_000), Outcome.COMPLETED)
        await backend.claim(_request(job, 3, f"{job}-3", history_size=2))
        await backend.prune(job, keep=2)  # trims slot 1
        await backend.hand_over([Lease(job, 3, f"{job}-3", 30_000)])
        await backend.members(f"instance {job}", 30_000)
    await backend.history()
    scripts = [c for c in sent if c[0] == "EVALSHA"]
    assert len(scripts) > 6 * len(ODD_JOBS)
    for command in scripts:
        keys = command[3:3 + int(command[2])]
        assert len({key_slot(k.encode()) for k in keys}) == 1, command
    # every stored key of a job carries that job's tag, so sits in the job's slot
    tags = {"{" + backend.prefix + "/" + quote(j, safe="") + "}": j for j in ODD_JOBS}
    keys = _keys(raw, backend.prefix)
    assert keys
    for key in keys:
        tag = key[: key.index("}") + 1]
        assert tag in tags or tag == "{" + backend.prefix + "}", key
        assert key_slot(key.encode()) == key_slot(tag.encode())
    assert {a.job for a in await backend.history(limit=1000)} == set(ODD_JOBS)


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "a b", "a/b", "x\n", "*", 5])
def test_bad_prefix_is_refused(prefix: Any) -> None:
    with pytest.raises(ConfigurationError, match="prefix=") as info:
        RedisBackend(prefix=prefix)
    assert repr(prefix) in str(info.value)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="wait_replicas=0"):
        RedisBackend(wait_replicas=0)
    with pytest.raises(ConfigurationError, match="wait_timeout"):
        RedisBackend(wait_timeout="soon")


def test_bad_connection_object_is_refused() -> None:
    """At construction, as PostgresBackend refuses one (it was found only at start())."""
    with pytest.raises(ConfigurationError, match="connection=42"):
        RedisBackend(42)


# -- history and trimming ------------------------------------------------------------


async def test_history_is_capped_and_finished_runs_deleted(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    for slot in range(1, 11):
        await backend.claim(_request("job", slot, f"t{slot}", history_size=3))
        assert await backend.finish(Lease("job", slot, f"t{slot}", 30_000), Outcome.COMPLETED)
    assert await backend.prune("job", keep=3) == 7  # the ticker's trimming, not the claims
    history = await backend.history("job")
    assert [a.slot for a in history] == [10, 9, 8]
    runs = [k for k in _keys(raw, backend.prefix) if ":run:" in k]
    assert len(runs) == 3
    assert (await backend.check([("job", 1)])).runs == {}


async def test_history_ttl_drops_old_finished_attempts(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    await backend.claim(_request("job", 1, "a"))
    await backend.finish(Lease("job", 1, "a", 30_000), Outcome.FAILED, "boom")
    finished = (await backend.history("job"))[0].finished_at
    assert finished is not None and (await backend.history("job"))[0].error == "boom"
    await _wait_server_past(raw, int(finished.timestamp() * 1000) + 20)
    await backend.claim(_request("job", 2, "b", history_ttl_ms=10))
    await backend.prune("job", older_than_ms=10)
    assert [a.slot for a in await backend.history("job")] == [2]
    assert (await backend.check([("job", 1)])).runs == {}


# -- scripts and round trips ---------------------------------------------------------


async def test_scripts_reload_after_script_flush(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    raw.script_flush()
    won = await backend.claim(_request("job", 1, "a"))
    assert won.status is ClaimStatus.WON
    raw.script_flush()
    beat = await backend.heartbeat([Lease("job", 1, "a", 30_000), Lease("job", 2, "x", 1)])
    assert beat.held == {"a"}
    raw.script_flush()
    assert await backend.finish(Lease("job", 1, "a", 30_000), Outcome.COMPLETED)


async def test_heartbeat_is_one_script_call_and_claims_batch(
    backend: RedisBackend,
) -> None:
    leases = [Lease(f"job{i % 3}", slot, f"t{i}", 30_000)
              for i, slot in enumerate(range(1, 10))]
    assert backend._adapter is not None
    adapter = backend._adapter
    batches: list[list[Any]] = []
    execute = adapter.execute

    async def spy(commands: Any, **options: Any) -> list[Any]:
        batches.append(list(commands))
        return await execute(commands, **options)

    adapter.execute = spy  # type: ignore[method-assign]
    won = await backend.claim_many([_request(x.job, x.slot, x.token, overlap_skip=False)
                                    for x in leases])
    assert [r.status for r in won] == [ClaimStatus.WON] * 9
    assert len(batches) == 1
    beat = await backend.heartbeat([*leases, Lease("job0", 99, "gone", 30_000)])
    assert beat.held == {x.token for x in leases}
    assert len(batches) == 2
    # one script call for every job's leases (on a Cluster, one per job)
    assert [c[0] for c in batches[1]] == ["EVALSHA"]
    # a claim of a job this process has listed is the claim script alone
    assert (await backend.claim(_request("job0", 1, "other"))).status is ClaimStatus.RUNNING
    assert [c[0] for c in batches[2]] == ["EVALSHA"]


async def test_batched_calls_take_one_round_trip(backend: RedisBackend) -> None:
    leases = [Lease(f"job{i}", 1, f"t{i}", 30_000) for i in range(5)]
    for lease in leases:
        await backend.claim(_request(lease.job, 1, lease.token))
    assert backend._adapter is not None
    adapter = backend._adapter
    calls = 0
    execute = adapter.execute

    async def counting(commands: Any, **options: Any) -> list[Any]:
        nonlocal calls
        calls += 1
        return await execute(commands, **options)

    adapter.execute = counting  # type: ignore[method-assign]
    assert (await backend.heartbeat(leases)).held == {lease.token for lease in leases}
    assert calls == 1
    assert len((await backend.check([(lease.job, 1) for lease in leases])).runs) == 5
    assert calls == 2
    assert (await backend.claim(_request("job0", 1, "other"))).status is ClaimStatus.RUNNING
    assert calls == 3
    assert await backend.hand_over(leases) == {lease.token for lease in leases}
    assert calls == 4
    assert await backend.members("i-1", 30_000) == ["i-1"]  # one members.lua call
    assert calls == 5


async def test_members_live_on_the_server_clock_and_long_ended_ones_go(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    key = "{" + backend.prefix + "}:members"
    before = _server_ms(raw)
    raw.zadd(key, {"ancient": before - 3_600_000 - 60_000, "recent": before - 1_000,
                   "live": before + 60_000})
    assert await backend.members("me", 30_000) == ["live", "me"]
    after = _server_ms(raw)
    assert raw.zscore(key, "ancient") is None  # ended more than an hour ago: deleted
    assert raw.zscore(key, "recent") == before - 1_000  # ended lately: kept, not listed
    score = raw.zscore(key, "me")
    assert score is not None and before + 30_000 <= score <= after + 30_000


# -- store format ----------------------------------------------------------------------


async def test_store_format_is_recorded_and_a_newer_one_refused(
    url: str, raw: redis.Redis
) -> None:
    prefix = _prefix()
    backend = RedisBackend(url, prefix=prefix)
    await backend.start()
    await backend.close()
    assert raw.hget("{" + prefix + "}:meta", "format") == str(STORE_FORMAT).encode()

    newer = _prefix()
    raw.hset("{" + newer + "}:meta", "format", STORE_FORMAT + 1)
    refused = RedisBackend(url, prefix=newer)
    try:
        with pytest.raises(StoreFormatError, match=f"format {STORE_FORMAT + 1}"):
            await refused.start()
        assert _keys(raw, newer) == ["{" + newer + "}:meta"]
        assert raw.hgetall("{" + newer + "}:meta") == {b"format": str(STORE_FORMAT + 1).encode()}
        assert refused._adapter is None
    finally:
        delete_prefix(url, prefix)
        delete_prefix(url, newer)


async def test_a_meta_key_that_is_not_an_anarchon_stores_is_refused_and_kept(
    url: str, raw: redis.Redis
) -> None:
    """Another application's ``{P}:meta`` under anarchon's prefix: a hash whose format is
    no number, or a key of another type. Start and the read-only tools refuse it with a
    StoreFormatError naming the key (before: "attempt to compare number with nil", an
    int() ValueError, or WRONGTYPE), and write nothing."""
    cases = {"hash": lambda key: raw.hset(key, "format", "abc"),
             "string": lambda key: raw.set(key, "someone else's")}
    prefixes = []
    try:
        for kind, write in cases.items():
            prefix = _prefix()
            prefixes.append(prefix)
            key = "{" + prefix + "}:meta"
            write(key)
            before = raw.dump(key)
            expected = ("a hash whose format is 'abc', not a number" if kind == "hash"
                        else "a string, not a hash")
            for create in (True, False):
                backend = RedisBackend(url, prefix=prefix)
                with pytest.raises(StoreFormatError, match=expected) as caught:
                    await backend.start(create=create)
                assert key in str(caught.value) and "prefix of its own" in str(caught.value)
            assert _keys(raw, prefix) == [key] and raw.dump(key) == before
    finally:
        for prefix in prefixes:
            delete_prefix(url, prefix)


# -- adapters --------------------------------------------------------------------------


async def test_passed_sync_client_is_never_closed(url: str) -> None:
    client = redis.Redis.from_url(url)
    backend = RedisBackend(client, prefix=_prefix())
    await backend.start()
    assert (await backend.claim(_request("job", 1, "a"))).status is ClaimStatus.WON
    await backend.close()
    try:
        assert client.ping()
    finally:
        delete_prefix(url, backend.prefix)
        client.close()


@pytest.mark.asyncio_only
async def test_passed_asyncio_client_is_never_closed(url: str) -> None:
    client = redis.asyncio.Redis.from_url(url)
    backend = RedisBackend(client, prefix=_prefix())
    await backend.start()
    assert (await backend.claim(_request("job", 1, "a"))).status is ClaimStatus.WON
    await backend.close()
    try:
        assert await client.ping()
    finally:
        delete_prefix(url, backend.prefix)
        await client.aclose()


@pytest.mark.asyncio_only
async def test_an_asyncio_client_that_decodes_replies_works_alike(url: str) -> None:
    await _decoded_replies(url, sync=False)


async def test_a_sync_client_that_decodes_replies_works_alike(url: str) -> None:
    await _decoded_replies(url, sync=True)


async def _decoded_replies(url: str, *, sync: bool) -> None:
    # decode_responses=True: every reply is text, not bytes (the claim's one-string reply,
    # the markers, the history's JSON).
    client: Any = (redis.Redis.from_url(url, decode_responses=True) if sync
                   else redis.asyncio.Redis.from_url(url, decode_responses=True))
    backend = RedisBackend(client, prefix=_prefix())
    await backend.start()
    try:
        first = _request("j", 1, "a")
        won = await backend.claim(first)
        assert (won.status, won.attempt, won.instance_id) == (ClaimStatus.WON, 1, "inst-a")
        batch = await backend.claim_many([ClaimRequest(f"j{i}", 1, "b", f"t{i}", 30_000)
                                          for i in range(3)] + [_request("j", 1, "b")])
        assert [r.status for r in batch] == [ClaimStatus.WON] * 3 + [ClaimStatus.RUNNING]
        assert batch[-1].instance_id == "inst-a"
        lease = Lease("j", 1, "a", 30_000)
        assert (await backend.heartbeat([lease])).held == {"a"}
        assert await backend.finish_many([(lease, Outcome.COMPLETED, None)]) == [True]
        [attempt] = await backend.history("j")
        assert (attempt.outcome, attempt.instance_id) == (Outcome.COMPLETED, "inst-a")
    finally:
        await backend.close()
        delete_prefix(url, backend.prefix)
        await anyio.to_thread.run_sync(client.close) if sync else await client.aclose()


@pytest.mark.asyncio_only
@pytest.mark.parametrize(("decode", "encoding"),
                         [(False, "utf-8"), (True, "utf-8"), (True, "latin-1")])
async def test_a_batch_answers_any_holder_and_token_as_single_claims_do(
    url: str, decode: bool, encoding: str,
) -> None:
    # One claim_many.lua call answers its claims as one string of replies counted in
    # bytes: a holder whose instance id has the separators, a newline and non-ASCII text
    # comes back whole (from a client decoding with its own encoding too), and a claim
    # whose token holds the field separator goes through claim.lua instead, with the
    # same answers.
    client: Any = redis.asyncio.Redis.from_url(url, decode_responses=decode,
                                               encoding=encoding)
    backend = RedisBackend(client, prefix=_prefix())
    await backend.start()
    holder = "h|1:2\nπ:é|" if encoding == "utf-8" else "h|1:2\né:ü|"
    try:
        for i in range(3):
            won = await backend.claim(ClaimRequest(f"j{i}", 1, holder, f"h{i}", 30_000))
            assert won.status is ClaimStatus.WON
        batch = [ClaimRequest(f"j{i}", 1, "b", f"b{i}", 30_000) for i in range(5)]
        results = await backend.claim_many(batch)
        assert [(r.job, r.status, r.instance_id) for r in results] == [
            (f"j{i}", ClaimStatus.RUNNING, holder) for i in range(3)
        ] + [(f"j{i}", ClaimStatus.WON, "b") for i in range(3, 5)]
        piped = await backend.claim_many([ClaimRequest("j5", 1, "b", "t|5", 30_000),
                                          ClaimRequest("j0", 1, "b", "t6", 30_000)])
        assert [(r.status, r.instance_id) for r in piped] == [
            (ClaimStatus.WON, "b"), (ClaimStatus.RUNNING, holder)]
        lease = Lease("j5", 1, "t|5", 30_000)
        assert (await backend.heartbeat([lease])).held == {"t|5"}
    finally:
        await backend.close()
        delete_prefix(url, backend.prefix)
        await client.aclose()


@pytest.mark.asyncio_only
@pytest.mark.parametrize(("decode", "encoding"),
                         [(False, "utf-8"), (True, "utf-8"), (True, "latin-1")])
async def test_a_batch_of_finishes_ends_each_attempt_as_single_finishes_do(
    url: str, raw: redis.Redis, decode: bool, encoding: str,
) -> None:
    # One finish_many.lua call per SCRIPT_BATCH finishes (one argument each, answered
    # as one string of flags): any error text (the field separator, a newline, an empty
    # text, non-ASCII) is recorded whole, a stale token or a second finish of a run
    # changes nothing, and a token holding the separator sends the batch through
    # finish.lua instead. Each side is checked against the same finishes made one at a
    # time.
    client: Any = redis.asyncio.Redis.from_url(url, decode_responses=decode,
                                               encoding=encoding)
    backend = RedisBackend(client, prefix=_prefix())
    await backend.start()
    errors = [None, "a|b|c", "line\nbreak", "", "Eé ü" if encoding == "latin-1" else "Eπ 空|"]

    def script_calls() -> int:  # the server's count since the last reset
        stats: dict[str, Any] = raw.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

    async def finishes(side: str, count: int, token: str) -> list[Any]:
        claims = [ClaimRequest(f"{side}{i % 7}", i, "b", f"{token}{i}", 30_000,
                               overlap_skip=False) for i in range(count)]
        assert {r.status for r in await backend.claim_many(claims)} == {ClaimStatus.WON}
        items: list[Any] = [(Lease(c.job, c.slot, c.token, 30_000),
                             Outcome.FAILED if i % 2 else Outcome.COMPLETED,
                             errors[i % len(errors)]) for i, c in enumerate(claims)]
        stale = claims[0]
        return [*items, items[1], (Lease(stale.job, stale.slot, "x", 30_000),
                                   Outcome.COMPLETED, None)]

    def trail(attempts: list[Any], side: str) -> list[tuple[Any, ...]]:
        return sorted((a.job[len(side):], a.slot, a.outcome, a.error)
                      for a in attempts if a.job.startswith(side))

    try:
        one, many = await finishes("one", 205, "t"), await finishes("many", 205, "t")
        expected = [await backend.finish(*item) for item in one]
        assert expected == [True] * 205 + [False, False]
        raw.config_resetstat()
        assert await backend.finish_many(many) == expected
        assert script_calls() == 3  # 207 finishes, at most SCRIPT_BATCH per call
        history = await backend.history(limit=1000)
        assert trail(history, "many") == trail(history, "one")
        recorded = {a.error for a in history if a.job.startswith("many")}
        assert set(errors) - {None} <= recorded

        piped = await finishes("pipe", 3, "t|")
        raw.config_resetstat()
        assert await backend.finish_many(piped) == [True] * 3 + [False, False]
        assert script_calls() == 5  # one finish.lua call each
        history = await backend.history(limit=1000)
        assert trail(history, "pipe") == [(str(i), i, item[1], item[2])
                                          for i, item in enumerate(piped[:3])]
    finally:
        await backend.close()
        delete_prefix(url, backend.prefix)
        await client.aclose()


async def test_from_url_and_unix_socket() -> None:
    binary = find_server("valkey")
    assert binary is not None
    with EmbeddedRedis(binary, unix_socket=True) as server:
        assert server.url.startswith("unix://")
        backend = RedisBackend.from_url(server.url, prefix="unix_test")
        assert "unix" in RedisBackend.schemes
        await backend.start()
        try:
            assert (await backend.claim(_request("job", 1, "a"))).status is ClaimStatus.WON
            assert "unix socket" in repr(backend)
        finally:
            await backend.close()
        assert backend._adapter is None


async def test_a_unix_socket_url_takes_the_backends_options_in_its_query() -> None:
    # ?prefix= taken out of the query left 'unix:/path' (no '//'), which redis-py refused:
    # "connection URL is not a Redis URL"
    binary = find_server("valkey")
    assert binary is not None
    with EmbeddedRedis(binary, unix_socket=True) as server:
        backend = RedisBackend.from_url(f"{server.url}?db=3&prefix=unix_q")
        await backend.start()
        try:
            assert backend.prefix == "unix_q"
            assert (await backend.claim(_request("job", 1, "a"))).status is ClaimStatus.WON
        finally:
            await backend.close()
        path = server.url.removeprefix("unix://").partition("?")[0]
        with redis.Redis(unix_socket_path=path, db=3) as raw:
            assert raw.exists("{unix_q/job}:run:1")


# -- errors ----------------------------------------------------------------------------


async def test_unreachable_server_names_the_address() -> None:
    port = _free_port()
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(BackendUnavailable, match=f"127.0.0.1:{port}"):
        await backend.start()
    assert backend._adapter is None


async def test_a_database_the_server_does_not_have_is_a_configuration_error(
        valkey8_server: EmbeddedRedis) -> None:
    """``redis://host:port/99`` on a server of 16 databases read as the server's fault:
    "Redis at ... failed a command: DB index is out of range" (``BackendUnavailable``,
    exit 1). The URL is wrong: a ``ConfigurationError`` (exit 2) naming the database."""
    from lease_core.cli import main

    url = f"redis://127.0.0.1:{valkey8_server.port}/99"
    backend = RedisBackend(url, prefix=_prefix())
    with pytest.raises(ConfigurationError) as info:
        await backend.start()
    message = str(info.value)
    assert message.startswith(f"Redis at 127.0.0.1:{valkey8_server.port} has no database 99 "
                              "(DB index is out of range): the path of the URL"), message
    await backend.close()
    assert await anyio.to_thread.run_sync(main, ["status", "--url", url]) == 2


@pytest.fixture(scope="module")
def password_server() -> Iterator[EmbeddedRedis]:
    """A Valkey server that requires the password ``right-pw-77``."""
    binary = find_server("valkey")
    assert binary is not None
    with EmbeddedRedis(binary, password="right-pw-77") as server:
        yield server


@pytest.mark.parametrize("password", ["wrong-pw-123", None])
async def test_bad_password_is_refused_without_showing_it(
    password_server: EmbeddedRedis, password: str | None
) -> None:
    auth = f":{password}@" if password else ""
    backend = RedisBackend(f"redis://{auth}127.0.0.1:{password_server.port}/0")
    with pytest.raises(BackendUnavailable) as info:
        await backend.start()
    message = str(info.value)
    assert f"127.0.0.1:{password_server.port}" in message
    assert "wrong-pw-123" not in message and "right-pw-77" not in message
    good = RedisBackend(password_server.url, prefix=_prefix())
    await good.start()
    try:
        assert (await good.claim(_request("job", 1, "a"))).status is ClaimStatus.WON
    finally:
        await good.close()


@pytest.mark.parametrize("appendonly", [True, False])
async def test_server_restart_mid_lease(appendonly: bool) -> None:
    binary = find_server("valkey")
    assert binary is not None
    extra = ("--appendfsync", "always") if appendonly else ()
    with EmbeddedRedis(binary, appendonly=appendonly, extra_args=extra) as server:
        backend = RedisBackend(server.url, prefix="restart")
        await backend.start()
        try:
            lease = Lease("job", 1, "a", 30_000)
            assert (await backend.claim(_request("job", 1, "a"))).status is ClaimStatus.WON
            assert await backend.set_checkpoint(lease, {"done": 3})
            server.stop()
            with pytest.raises(BackendUnavailable, match=f"127.0.0.1:{server.port}"):
                await backend.heartbeat([lease])
            server.start()
            beat = await backend.heartbeat([lease])
            if appendonly:
                # persisted: the lease and checkpoint survive, the holder carries on
                assert beat.held == {"a"}
                assert await backend.get_checkpoint("job", 1) == {"done": 3}
                assert await backend.finish(lease, Outcome.COMPLETED)
            else:
                # lost: the holder learns it holds nothing; no attempt starts before
                # every lease that may have been live has expired
                assert beat.held == frozenset()
                again = await backend.claim(_request("job", 1, "b"))
                assert (again.status, again.run_status) == (ClaimStatus.RUNNING, None)
                assert again.expires_ms == again.now_ms + 30_000
        finally:
            await backend.close()


def _client(kind: str, url: str) -> Any:
    if kind == "url":
        return url
    if kind == "asyncio-client":
        return redis.asyncio.Redis.from_url(url)
    return redis.Redis.from_url(url)


@pytest.mark.parametrize("kind", ["url", "asyncio-client", "sync-client"])
async def test_calls_after_a_restart_do_not_fail_on_stale_connections(
    kind: str, anyio_backend: str
) -> None:
    if kind == "asyncio-client" and anyio_backend != "asyncio":
        pytest.skip("redis-py's asyncio client runs on asyncio only")
    binary = find_server("valkey")
    assert binary is not None
    with EmbeddedRedis(binary, appendonly=True, extra_args=("--appendfsync", "always")) as server:
        connection = _client(kind, server.url)
        backend = RedisBackend(connection, prefix="stale")
        await backend.start()
        try:
            lease = Lease("job", 1, "a", 30_000)
            assert (await backend.claim(_request("job", 1, "a"))).status is ClaimStatus.WON
            # several connections in the pool, all idle when the server goes away
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(backend.now_ms)
            server.stop()
            server.start()
            # every call's first try after the restart succeeds
            assert (await backend.heartbeat([lease])).held == {"a"}
            assert await backend.set_checkpoint(lease, {"step": 1})
            assert (await backend.claim(_request("job", 2, "b", overlap_skip=False))).status \
                is ClaimStatus.WON
            assert await backend.finish(lease, Outcome.COMPLETED)
        finally:
            await backend.close()
            if not isinstance(connection, str):
                close = getattr(connection, "aclose", None)
                await close() if close is not None else connection.close()



class _LosingReplies(redis.Redis):
    """A client whose next ``lose`` script calls run on the server and then fail as a
    connection closed before the reply (the one failure a resend cannot tell apart)."""

    lose = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)
        if self.lose and args[0] == "EVALSHA":
            self.lose -= 1
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return reply


async def test_calls_sent_again_after_a_lost_reply_answer_as_the_first_did(
        url: str) -> None:
    """A batch whose connection failed is sent once more, as the batch of a connection
    closed while idle never ran. An operation ran the first time too: sent again it
    answers as it did and changes nothing (a trigger sent twice made two runs). A retry's
    end of an attempt is not sent again."""
    from lease_core.operations import Operation, OperationKind

    client = _LosingReplies.from_url(url)
    backend = RedisBackend(client, prefix=_prefix())
    await backend.start()
    try:
        won = await backend.claim(_request("job", 1, "a"))
        assert won.status is ClaimStatus.WON
        client.lose = 1
        result = await backend.operate(Operation(OperationKind.TRIGGER, "job", None, "test", 0))
        assert result.refused is None and result.slot is not None
        assert await backend.queued(["job"]) == [("job", result.slot)]  # one run, not two
        # A retry's end of an attempt is not sent again: the contract answers -1 to a
        # second end with the same token (lease_core.testing's conformance checks).
        client.lose = 1
        with pytest.raises(BackendUnavailable):
            await backend.retry_later([(Lease("job", 1, "a", 30_000), Outcome.FAILED, "boom",
                                        [60_000])])
        state = (await backend.check([("job", 1)])).runs[("job", 1)]
        assert state.status is RunStatus.RETRYING
        client.lose = 1  # a fenced call is safe twice: sent again, it succeeds
        assert (await backend.claim(_request("job", 2, "b", overlap_skip=False))).status \
            is ClaimStatus.WON
    finally:
        await backend.close()
        client.close()
        delete_prefix(url, backend.prefix)


# -- replication acknowledgement -------------------------------------------------------


async def test_wait_replicas_without_replicas_fails_the_claim(
    url: str, raw: redis.Redis
) -> None:
    backend = RedisBackend(url, prefix=_prefix(), wait_replicas=1, wait_timeout="50ms")
    await backend.start()
    try:
        with pytest.raises(BackendUnavailable, match="0 of wait_replicas=1"):
            await backend.claim(_request("job", 1, "a"))
        # not won: the run is handed over at once (see tests/test_redis_replicas.py), so
        # the token renews nothing (and a heartbeat that wrote nothing does not wait)
        assert (await backend.heartbeat([Lease("job", 1, "a", 30_000)])).held == set()
        state = (await backend.check([("job", 1)])).runs[("job", 1)]
        assert state.status is RunStatus.HANDED_OVER
    finally:
        await backend.close()
        delete_prefix(url, backend.prefix)


async def test_wait_replicas_with_a_replica_wins() -> None:
    binary = find_server("valkey")
    assert binary is not None
    # no diskless-sync delay: the replica is in sync in milliseconds, not 5 s
    with EmbeddedRedis(binary, extra_args=("--repl-diskless-sync-delay", "0")) as primary:
        replica_args = ("--replicaof", "127.0.0.1", str(primary.port))
        with EmbeddedRedis(binary, extra_args=replica_args):
            probe = redis.Redis.from_url(primary.url)
            try:
                await wait_for(
                    lambda: probe.info("replication").get("slave0", {}).get("state") == "online",
                    timeout=15, what="the replica to be in sync",
                )
            finally:
                probe.close()
            backend = RedisBackend(primary.url, prefix="wait", wait_replicas=1)
            await backend.start()
            try:
                won = await backend.claim(_request("job", 1, "a"))
                assert won.status is ClaimStatus.WON
                assert (await backend.heartbeat([Lease("job", 1, "a", 30_000)])).held == {"a"}
            finally:
                await backend.close()


# -- same story as the reference backend -----------------------------------------------


#: The story's lease: long enough that no step meant to see it live can outlast it on a
#: loaded machine (the story waits it out where it means it to expire).
STORY_LEASE_MS = 1_000


async def _story(backend: Backend, expire: Any) -> list[tuple[Any, ...]]:
    """Drive a backend through skip, hand-over, takeover and escalation; record results."""
    out: list[tuple[Any, ...]] = []

    async def claim(slot: int, token: str, **kw: Any) -> None:
        r = await backend.claim(_request("job", slot, token, lease_ms=STORY_LEASE_MS, **kw))
        out.append(("claim", slot, r.status, r.attempt, r.reason, r.run_status))

    await backend.register_jobs(["job"])
    await claim(10, "a")
    await claim(10, "b")
    await claim(20, "c")  # skipped: slot 10 is live
    out.append(("handover", await backend.hand_over([Lease("job", 10, "a", STORY_LEASE_MS)])))
    await claim(10, "d", max_attempts=3)  # hand-over, not counted
    await expire()
    await claim(10, "e", max_attempts=3)  # takeover: attempt 3
    await expire()
    await claim(10, "f", max_attempts=3)  # escalated
    await claim(30, "g", overlap_skip=False)
    out.append(("finish", await backend.finish(Lease("job", 30, "g", STORY_LEASE_MS),
                                               Outcome.TIMED_OUT)))
    info = (await backend.register_jobs(["job"]))["job"]
    out.append(("job", info.last_slot, info.open_slots, info.new))
    # Attempts claimed in the same millisecond have no defined order: compare them sorted.
    out.extend(sorted(
        (("attempt", a.slot, a.attempt, a.reason, a.outcome, a.error)
         for a in await backend.history("job")),
        key=lambda t: (t[1], t[2]),
    ))
    return out


async def test_behaves_like_the_memory_backend(backend: RedisBackend, raw: redis.Redis) -> None:
    clock = [1_000_000.0]

    def ticking() -> float:  # store time moves on between calls, as Redis's does
        clock[0] += 0.001
        return clock[0]

    memory = MemoryBackend(clock=ticking)
    await memory.start()

    async def memory_expire() -> None:
        clock[0] += STORY_LEASE_MS / 1000 + 0.05

    async def redis_expire() -> None:
        await _wait_server_past(raw, _server_ms(raw) + STORY_LEASE_MS + 50)

    expected = await _story(memory, memory_expire)
    assert await _story(backend, redis_expire) == expected


# -- Cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_node() -> Iterator[EmbeddedRedisCluster]:
    """A 3-node Valkey Cluster: each script must keep to one slot, and the jobs' slots
    fall on different nodes, so one pipeline is split between the nodes."""
    binary = find_server("valkey")
    assert binary is not None
    with EmbeddedRedisCluster(binary, nodes=3) as cluster:
        yield cluster


@pytest.mark.asyncio_only
async def test_works_on_a_cluster(cluster_node: EmbeddedRedisCluster) -> None:
    from redis.asyncio.cluster import RedisCluster

    client = RedisCluster.from_url(cluster_node.url)
    backend = RedisBackend(client, prefix="cluster")
    await backend.start()
    try:
        nodes = {client.get_node_from_key(backend._run_key(job, 1)).name for job in ODD_JOBS}
        assert len(nodes) > 1, "the jobs' slots should fall on more than one node"
        await backend.register_jobs(ODD_JOBS)
        leases = []
        for job in ODD_JOBS:
            won = await backend.claim(_request(job, 1, f"{job}-1", history_size=1))
            skipped = await backend.claim(_request(job, 2, f"{job}-2", history_size=1))
            assert (won.status, skipped.status) == (ClaimStatus.WON, ClaimStatus.SKIPPED)
            leases.append(Lease(job, 1, f"{job}-1", 30_000))
        tokens = {lease.token for lease in leases}
        assert (await backend.heartbeat(leases)).held == tokens
        assert len((await backend.check([(j, 1) for j in ODD_JOBS])).runs) == len(ODD_JOBS)
        assert await backend.hand_over(leases) == tokens
        for job in ODD_JOBS:  # the skipped slot 2 trimmed; the open run 1's attempt kept
            assert await backend.prune(job, keep=0) == 1
        assert sorted(a.slot for a in await backend.history()) == [1] * len(ODD_JOBS)
        assert await backend.members("node a", 30_000) == ["node a"]
        assert await backend.members("node b", 30_000) == ["node a", "node b"]
        held = await backend.acquire_lease("leader", "h", 30_000)  # a named lease too
        seen = await backend.read_lease("leader")
        assert seen.held and (seen.token, seen.holder) == (held.token, "h")
    finally:
        await backend.close()
        await client.aclose()


class _TrimRounds(AsyncClientAdapter):
    """Records, while ``recording``, the attempts each round trip's scripts deleted."""

    recording = False

    def __init__(self, client: Any) -> None:
        super().__init__(client, owned=False)
        self.rounds: list[int] = []

    async def execute(self, commands: Any, *, resend: bool = True) -> list[Any]:
        replies = await super().execute(commands, resend=resend)
        if self.recording:
            self.rounds.append(sum(r for c, r in zip(commands, replies, strict=True)
                                   if c[0] == "EVALSHA" and isinstance(r, int)))
        return replies


async def _completed_runs(backend: RedisBackend, jobs: list[str], runs: int) -> None:
    """Record ``runs`` completed runs of each of ``jobs`` (slots 1 to ``runs``)."""
    requests = [_request(job, slot, f"{job}-{slot}", overlap_skip=False)
                for job in jobs for slot in range(1, runs + 1)]
    assert all(r.status is ClaimStatus.WON for r in await backend.claim_many(requests))
    assert all(await backend.finish_many([
        (Lease(r.job, r.slot, r.token, 30_000), Outcome.COMPLETED, None)
        for r in requests]))


@pytest.mark.asyncio_only
async def test_a_trimming_backlog_is_deleted_in_round_trips_of_bounded_size(url: str) -> None:
    """Redis runs a pipeline's scripts back to back, every other client waiting: a
    backlog deleted in one round trip held the server for about a second per 50,000
    attempts. One round trip deletes about trim_round_trip attempts at most; trimming
    with nothing beyond each job's share is one round trip still."""
    client = redis.asyncio.Redis.from_url(url)
    adapter = _TrimRounds(client)
    backend = RedisBackend(adapter, prefix=_prefix())
    backend.trim_round_trip = 100
    jobs = [f"j{i}" for i in range(8)]
    await backend.start()
    try:
        await _completed_runs(backend, jobs, 100)
        adapter.recording = True
        assert await backend.prune_many(jobs, keep=95, batch=500) == dict.fromkeys(jobs, 5)
        assert len(adapter.rounds) == 1  # 5 each: within its share (6) of the 100
        adapter.rounds.clear()
        assert await backend.prune_many(jobs, keep=0, batch=500) == dict.fromkeys(jobs, 95)
        assert sum(adapter.rounds) == 8 * 95 and max(adapter.rounds) <= 100, adapter.rounds
        assert await backend.history("j0") == []
        adapter.rounds.clear()
        assert await backend.prune_many(jobs, keep=0, batch=500) == dict.fromkeys(jobs, 0)
        assert adapter.rounds == [0]
        # A workflow's steps: their listed attempts are deleted in bounded round trips too.
        steps = [f"wf/{step}" for step in "abcd"]
        await backend.register_workflows({"wf": list("abcd")})
        await _completed_runs(backend, steps, 30)
        adapter.rounds.clear()
        assert await backend.prune_many(steps, keep=0, batch=500) == dict.fromkeys(steps, 30)
        deleting = [n for n in adapter.rounds if n]
        assert sum(deleting) == 120 and max(deleting) <= 100, adapter.rounds
    finally:
        await backend.close()
        await client.aclose()
        delete_prefix(url, backend.prefix)


def test_an_embedded_server_whose_port_was_taken_before_its_first_start_takes_another() -> None:
    """Its port is chosen free, then bound by the server: another process can take it in
    between (the suite's workers start servers side by side), and the server exited with
    "Address already in use". A restart keeps its port: a store's URL does not change."""
    import socket

    binary = find_server("redis")
    if binary is None:
        pytest.skip("no redis-server")
    server = EmbeddedRedis(binary)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server.port = taken.getsockname()[1]
        try:
            server.start()
            assert server.port != taken.getsockname()[1]
            assert redis.Redis.from_url(server.url).ping()
            port = server.port
            server.stop()
            server.start()
            assert server.port == port
        finally:
            server.close()
