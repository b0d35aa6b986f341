"""The backend contract as tests (see lease_core/abc.py), on a :class:`Store` per test.

Every backend must pass this module unchanged. Lease expiry is real store time, so the
leases here are short and every wait has a deadline.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from lease_core import ConfigurationError, Outcome, Reason, RunStatus
from lease_core._structures import Attempt, ClaimRequest, ClaimResult, ClaimStatus, Lease
from lease_core.abc import Backend
from lease_core.errors import BackendUnavailable
from lease_core.retry import supports_retries

from ._tools import Store, wait_for

pytestmark = pytest.mark.anyio

SLOT = 1_700_000_000_000
SHORT = 300  # ms: a lease we wait out


def req(job: str, slot: int = SLOT, instance: str = "a", lease_ms: int = 10_000,
        **kw: object) -> ClaimRequest:
    """A claim of ``job``'s run at ``slot`` by ``instance``, with a fresh token."""
    return ClaimRequest(job, slot, instance, uuid.uuid4().hex, lease_ms, **kw)  # type: ignore[arg-type]


def lease_of(r: ClaimRequest) -> Lease:
    """The lease that claim ``r`` holds once it has won."""
    return Lease(r.job, r.slot, r.token, r.lease_ms)


def _both_claims(backend: Backend) -> list[tuple[str, Callable[[ClaimRequest],
                                                               Awaitable[ClaimResult]]]]:
    """``claim`` and a batch of one of ``claim_many``, each with its name: a backend
    implementing both twins is held to each rule by both."""
    async def alone(r: ClaimRequest) -> ClaimResult:
        (result,) = await backend.claim_many([r])
        return result

    return [("claim", backend.claim), ("claim_many", alone)]


async def started(store: Store) -> Backend:
    """A new backend on ``store``, started: one simulated instance (the test closes it)."""
    backend = store.backend()
    await backend.start()
    return backend


async def wait_expired(backend: Backend, job: str, slot: int = SLOT) -> None:
    """Wait until the run's lease has expired by the store's clock (5 s deadline)."""

    async def expired() -> bool:
        result = await backend.check([(job, slot)])
        state = result.runs.get((job, slot))
        return state is not None and state.claimable(result.now_ms)

    await wait_for(expired, timeout=5, what="lease expiry")


async def test_first_claim_wins_and_second_stands_by(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        ra, rb = req("j", instance="a"), req("j", instance="b")
        won = await a.claim(ra)
        assert won.status is ClaimStatus.WON
        assert won.attempt == 1 and won.reason is Reason.SCHEDULED
        assert won.expires_ms is not None and won.expires_ms - won.now_ms == ra.lease_ms
        other = await b.claim(rb)
        assert other.status is ClaimStatus.RUNNING
        assert other.attempt == 1 and other.instance_id == "a"
        history = await b.history("j")
        assert [(h.attempt, h.instance_id, h.reason, h.outcome) for h in history] == [
            (1, "a", Reason.SCHEDULED, None)
        ]
    finally:
        await a.close()
        await b.close()


async def test_claims_at_once_give_a_run_to_one_instance(store: Store) -> None:
    """Instances claiming one run at the same time (each on a backend object of its own):
    one wins it, the others stand by, told who holds it; so again once its lease has
    expired (one takes it over). A claim that reads the run, then writes it in a second
    step (a GET then a SET, a SELECT then an INSERT), lets several win: each found it
    free. The other checks claim one call at a time, where that does not show. A claim
    that gives up having changed nothing (``BackendUnavailable.changed_nothing``: a lock
    wait the server bounds, on a busy machine) is made again, as a scheduler does."""
    backends = [await started(store) for _ in range(5)]
    try:
        async def race(lease_ms: int, round_: int) -> ClaimResult:
            answers: list[ClaimResult] = []

            async def claim(backend: Backend, instance: str) -> None:
                request = req("race", instance=instance, lease_ms=lease_ms)
                for _ in range(20):  # a claim that gave up having written nothing
                    try:         # (a lock wait bounded on a busy server) is made again
                        answers.append(await backend.claim(request))
                        return
                    except BackendUnavailable as exc:
                        if not exc.changed_nothing:
                            raise
                answers.append(await backend.claim(request))

            async with anyio.create_task_group() as tg:
                for i, backend in enumerate(backends):
                    tg.start_soon(claim, backend, f"r{round_}-i{i}")
            won = [r for r in answers if r.status is ClaimStatus.WON]
            assert len(won) == 1, (
                f"round {round_}: {len(won)} instances won one run at once: {won}")
            for r in answers:
                if r is not won[0]:
                    assert (r.status, r.instance_id) == (
                        ClaimStatus.RUNNING, won[0].instance_id), (round_, r)
            return won[0]

        first = await race(SHORT, 0)
        assert (first.attempt, first.reason) == (1, Reason.SCHEDULED)
        await wait_expired(backends[0], "race")
        second = await race(60_000, 1)  # a takeover of the lapsed lease
        assert (second.attempt, second.reason) == (2, Reason.TAKEOVER)
        history = await backends[0].history("race")
        assert [(h.attempt, h.instance_id, h.outcome) for h in history] == [
            (2, second.instance_id, None), (1, first.instance_id, Outcome.LOST)]
    finally:
        for backend in backends:
            await backend.close()


async def test_finish_records_outcome_and_later_claims_see_finished(store: Store) -> None:
    a = await started(store)
    try:
        r = req("j")
        await a.claim(r)
        assert await a.finish(lease_of(r), Outcome.FAILED, "boom")
        again = await a.claim(req("j", instance="b"))
        assert again.status is ClaimStatus.FINISHED
        assert again.run_status is RunStatus.FAILED
        (attempt,) = await a.history("j")
        assert attempt.outcome == "failed" and attempt.error == "boom"
        assert attempt.finished_at is not None and attempt.finished_at >= attempt.claimed_at
    finally:
        await a.close()


async def test_stale_token_is_refused_everywhere(store: Store) -> None:
    a = await started(store)
    try:
        r = req("j")
        await a.claim(r)
        old = lease_of(r)
        assert await a.set_checkpoint(old, {"done": 1})
        # The holder's last renewal asks for a short lease (renewals set an absolute
        # expiry), then it stalls past it: the lease is live for as long as the test
        # needs it, however slow the machine, and expires when the test means it to.
        renewal = Lease(r.job, r.slot, r.token, SHORT)
        assert r.token in (await a.heartbeat([renewal])).held
        await wait_expired(a, "j")
        r2 = req("j", instance="b")
        took = await a.claim(r2)
        assert took.status is ClaimStatus.WON and took.attempt == 2
        assert took.reason is Reason.TAKEOVER
        beat = await a.heartbeat([old])
        assert old.token not in beat.held
        assert not await a.finish(old, Outcome.COMPLETED)
        assert not await a.set_checkpoint(old, {"done": 0})
        assert not await a.delete_checkpoint(old)
        assert await a.hand_over([old]) == frozenset()
        assert await a.get_checkpoint("j", SLOT) == {"done": 1}
        assert await a.set_checkpoint(lease_of(r2), {"done": 2})
        assert await a.get_checkpoint("j", SLOT) == {"done": 2}
        history = await a.history("j")
        assert [(h.attempt, h.reason, h.outcome) for h in history] == [
            (2, Reason.TAKEOVER, None),
            (1, Reason.SCHEDULED, Outcome.LOST),
        ]
    finally:
        await a.close()


async def test_heartbeat_renews_many_leases_to_an_absolute_expiry(store: Store) -> None:
    a = await started(store)
    try:
        reqs = [req(f"job{i}", lease_ms=5_000) for i in range(5)]
        for r in reqs:
            assert (await a.claim(r)).status is ClaimStatus.WON
        for _ in range(3):
            beat = await a.heartbeat([lease_of(r) for r in reqs])
            assert beat.held == {r.token for r in reqs}
        result = await a.check([(r.job, r.slot) for r in reqs])
        for r in reqs:
            state = result.runs[(r.job, r.slot)]
            assert state.status is RunStatus.RUNNING
            assert state.expires_ms is not None
            # Renewal sets now + lease; adding to the remaining time would exceed it.
            assert state.expires_ms - result.now_ms <= 5_000
        assert (await a.heartbeat([])).held == frozenset()
    finally:
        await a.close()


async def test_expired_lease_is_not_revived_by_heartbeat(store: Store) -> None:
    a = await started(store)
    try:
        r = req("j", lease_ms=SHORT)
        await a.claim(r)
        await wait_expired(a, "j")
        assert r.token not in (await a.heartbeat([lease_of(r)])).held
    finally:
        await a.close()


async def test_a_run_that_ended_or_was_handed_over_fences_its_last_holder(
        store: Store) -> None:
    """Once its attempt has ended (finished, handed over, failed and left waiting for a
    retry, or cancelled by an operator with a grace, which keeps its holder's token), the
    last holder's token holds nothing, although no other attempt has taken the run yet: a
    heartbeat does not renew it, a checkpoint write or delete, a hand-over, a finish (one,
    or a batch of them), a ``retry_later`` and its claim sent again (with its token)
    change nothing. A backend that fences by
    token alone (keeping the token on the run once it ended) or by token and expiry (not
    the run's status) fails here."""
    from lease_core.operations import Operation, OperationKind

    a = await started(store)
    try:
        ended = {RunStatus.COMPLETED: req("ended"), RunStatus.HANDED_OVER: req("handed"),
                 RunStatus.CANCELLED: req("cancelled")}
        if supports_retries(a):
            ended[RunStatus.RETRYING] = req("retrying")
        for r in ended.values():
            assert (await a.claim(r)).status is ClaimStatus.WON
            assert await a.set_checkpoint(lease_of(r), {"at": "start"})
        try:
            cancelled = await a.operate(Operation(OperationKind.CANCEL, "cancelled", SLOT,
                                                  "ops", grace_ms=60_000))
            assert cancelled.refused is None, cancelled
        except ConfigurationError as exc:  # a backend without operations
            if "has no operations" not in str(exc):
                raise
            del ended[RunStatus.CANCELLED]
        assert await a.finish(lease_of(ended[RunStatus.COMPLETED]), Outcome.COMPLETED)
        handed = ended[RunStatus.HANDED_OVER]
        assert await a.hand_over([lease_of(handed)]) == {handed.token}
        if RunStatus.RETRYING in ended:
            retrying = ended[RunStatus.RETRYING]
            assert await a.retry_later(
                [(lease_of(retrying), Outcome.FAILED, "boom", [60_000])]) == [1]
        for status, r in ended.items():
            old, who = lease_of(r), f"the last holder of a run now {status.value}"
            assert r.token not in (await a.heartbeat([old])).held, (
                f"heartbeat() renewed {who}: it must hold only a running run")
            stranger = Lease(r.job, SLOT, "not-its-token", r.lease_ms)
            beat = await a.heartbeat([stranger])
            assert not beat.held and not beat.cancelled, (
                f"heartbeat() answered a token that never held the run now {status}: {beat}")
            assert not await a.set_checkpoint(old, {"at": "late"}), (
                f"set_checkpoint() wrote for {who}")
            assert not await a.delete_checkpoint(old), f"delete_checkpoint() deleted for {who}"
            assert await a.hand_over([old]) == frozenset(), f"hand_over() released {who}"
            assert not await a.finish(old, Outcome.FAILED, "late"), f"finish() ended {who}"
            assert await a.get_checkpoint(r.job, SLOT) == {"at": "start"}, (
                f"the checkpoint of {who} changed")
            if status is not RunStatus.HANDED_OVER:  # (which any claim may take)
                for how, claim in _both_claims(a):  # its claim sent again, as after a
                    again = await claim(r)           # lost reply: not won again
                    assert again.status is not ClaimStatus.WON, (
                        f"{how}() sent again by {who} won it: {again}")
            state = (await a.check([(r.job, SLOT)])).runs[(r.job, SLOT)]
            assert (state.status, state.attempt) == (status, 1), (
                f"{who} changed the run: {state}")
        olds = [lease_of(r) for r in ended.values()]
        assert await a.finish_many([(old, Outcome.COMPLETED, None) for old in olds]) == [
            False] * len(olds), "finish_many() ended a run its token no longer holds"
        if supports_retries(a):
            assert await a.retry_later([(old, Outcome.FAILED, "late", [60_000])
                                        for old in olds]) == [-1] * len(olds), (
                "retry_later() ended a run its token no longer holds")
        state_of = (await a.check([(r.job, SLOT) for r in ended.values()])).runs
        assert {status: state_of[(r.job, SLOT)].status for status, r in ended.items()} == {
            status: status for status in ended}, "a late batch changed a run"
        took = await a.claim(req("handed", instance="b"))  # the run is as it was left
        assert (took.status, took.attempt, took.reason) == (
            ClaimStatus.WON, 2, Reason.HAND_OVER)
    finally:
        await a.close()


async def test_hand_over_lets_a_backup_claim_at_once(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        r = req("j", lease_ms=60_000)
        await a.claim(r)
        assert await a.set_checkpoint(lease_of(r), [1, 2])
        assert await a.hand_over([lease_of(r)]) == {r.token}
        state = (await b.check([("j", SLOT)])).runs[("j", SLOT)]
        assert state.status is RunStatus.HANDED_OVER
        took = await b.claim(req("j", instance="b"))
        assert took.status is ClaimStatus.WON
        assert (took.attempt, took.reason) == (2, Reason.HAND_OVER)
        assert await b.get_checkpoint("j", SLOT) == [1, 2]
        history = await b.history("j")
        assert [(h.attempt, h.instance_id, h.reason, h.outcome) for h in history] == [
            (2, "b", Reason.HAND_OVER, None),
            (1, "a", Reason.SCHEDULED, Outcome.HANDED_OVER),
        ]
    finally:
        await a.close()
        await b.close()


async def test_escalation_after_max_attempts(store: Store) -> None:
    a = await started(store)
    try:
        for attempt in (1, 2):
            r = req("j", lease_ms=SHORT, max_attempts=2)
            got = await a.claim(r)
            assert got.status is ClaimStatus.WON and got.attempt == attempt
            await wait_expired(a, "j")
        last = await a.claim(req("j", max_attempts=2))
        assert last.status is ClaimStatus.ESCALATED
        assert (await a.claim(req("j", max_attempts=2))).status is ClaimStatus.FINISHED
        state = (await a.check([("j", SLOT)])).runs[("j", SLOT)]
        assert state.status is RunStatus.ESCALATED
        outcomes = [(h.attempt, h.outcome) for h in await a.history("j")]
        assert outcomes == [(2, Outcome.ESCALATED), (1, Outcome.LOST)]
    finally:
        await a.close()


async def test_max_attempts_counts_takeovers_not_hand_overs(store: Store) -> None:
    """A run handed over on a deploy and then crashed is taken over, not escalated."""
    a = await started(store)
    try:
        first = req("j", max_attempts=2)
        assert (await a.claim(first)).attempt == 1
        assert await a.hand_over([lease_of(first)]) == {first.token}
        handed = await a.claim(req("j", instance="b", lease_ms=SHORT, max_attempts=2))
        assert (handed.status, handed.attempt, handed.reason) == (
            ClaimStatus.WON, 2, Reason.HAND_OVER)
        await wait_expired(a, "j")  # the attempt that started by hand-over crashed
        taken = await a.claim(req("j", instance="c", lease_ms=SHORT, max_attempts=2))
        assert (taken.status, taken.attempt, taken.reason) == (
            ClaimStatus.WON, 3, Reason.TAKEOVER)
        await wait_expired(a, "j")  # the first attempt and one takeover: max_attempts=2
        last = await a.claim(req("j", instance="d", max_attempts=2))
        assert (last.status, last.attempt) == (ClaimStatus.ESCALATED, 3)
        outcomes = [(h.attempt, h.reason, h.outcome) for h in await a.history("j")]
        assert outcomes == [(3, Reason.TAKEOVER, Outcome.ESCALATED),
                            (2, Reason.HAND_OVER, Outcome.LOST),
                            (1, Reason.SCHEDULED, Outcome.HANDED_OVER)]
    finally:
        await a.close()


async def test_overlap_skip_is_recorded_and_allow_runs_both(store: Store) -> None:
    a = await started(store)
    try:
        await a.claim(req("j", slot=SLOT))
        skipped = await a.claim(req("j", slot=SLOT + 1000))
        assert skipped.status is ClaimStatus.SKIPPED
        assert (await a.claim(req("j", slot=SLOT + 1000))).run_status is RunStatus.SKIPPED
        newest = (await a.history("j"))[0]
        assert (newest.slot, newest.outcome) == (SLOT + 1000, Outcome.SKIPPED)
        allowed = await a.claim(req("j", slot=SLOT + 2000, overlap_skip=False))
        assert allowed.status is ClaimStatus.WON
        # A finished earlier run does not cause a skip.
        await a.claim(req("k", slot=SLOT))
        r = req("k", slot=SLOT)
        assert (await a.claim(r)).status is ClaimStatus.RUNNING
    finally:
        await a.close()


async def test_overlap_skip_looks_only_at_earlier_runs_holding_a_live_lease(
        store: Store) -> None:
    """``overlap_skip`` skips a new slot only behind an earlier run of the job that holds
    a live lease (or waits for its retry): not behind one whose lease expired (its
    holder is gone), nor one handed over, nor a later slot's run. Asked of both claim
    twins."""
    a = await started(store)
    try:
        twins = _both_claims(a)
        for how, _ in twins:
            lapsed = req(f"lapsed-{how}", lease_ms=SHORT)
            assert (await a.claim(lapsed)).status is ClaimStatus.WON
            handed = req(f"handed-{how}")
            assert (await a.claim(handed)).status is ClaimStatus.WON
            assert await a.hand_over([lease_of(handed)]) == {handed.token}
            later = req(f"later-{how}", slot=SLOT + 1000)
            assert (await a.claim(later)).status is ClaimStatus.WON
        for how, _ in twins:
            await wait_expired(a, f"lapsed-{how}")
        for how, claim in twins:
            for job, slot, behind in (
                    ("lapsed", SLOT + 1000, "an earlier run whose lease expired"),
                    ("handed", SLOT + 1000, "an earlier run handed over"),
                    ("later", SLOT, "a later slot's run")):
                got = await claim(req(f"{job}-{how}", slot=slot))
                assert got.status is ClaimStatus.WON, (
                    f"overlap_skip skipped {job!r} at slot {slot} behind {behind} ({how}); "
                    f"only an earlier run holding a live lease or waiting for its retry "
                    f"skips: {got}")
    finally:
        await a.close()


async def test_a_paused_job_s_new_slots_are_skipped_until_it_resumes(store: Store) -> None:
    """With operations (:meth:`~lease_core.abc.Backend.operate`): a scheduled or catch-up
    claim of a paused job's new slot is skipped, recorded with who paused it, while the
    run that was running goes on; once resumed, new slots are won again. Skipped for a
    backend without operations (the default ``operate`` raises)."""
    from lease_core.operations import Operation, OperationKind

    a = await started(store)
    try:
        held = req("p")
        assert (await a.claim(held)).status is ClaimStatus.WON
        try:
            paused = await a.operate(Operation(OperationKind.PAUSE, "p", None, "ops"))
        except ConfigurationError as exc:
            if "has no operations" in str(exc):
                pytest.skip(str(exc))
            raise
        assert paused.refused is None, paused
        for slot, reason in ((SLOT + 1000, Reason.SCHEDULED), (SLOT + 2000, Reason.CATCH_UP)):
            for offset, (how, claim) in enumerate(_both_claims(a)):
                got = await claim(req("p", slot=slot + offset, reason=reason,
                                      overlap_skip=False))
                assert got.status is ClaimStatus.SKIPPED, (
                    f"a {reason.value} claim of a new slot of a paused job must be skipped "
                    f"({how}): {got}")
        assert (await a.claim(req("p", instance="b"))).status is ClaimStatus.RUNNING
        assert await a.finish(lease_of(held), Outcome.COMPLETED)  # the run that was running
        skipped = {h.slot: (h.outcome, h.error) for h in await a.history("p") if h.slot != SLOT}
        assert skipped == dict.fromkeys((SLOT + 1000, SLOT + 1001, SLOT + 2000, SLOT + 2001),
                                        (Outcome.SKIPPED, "job paused by ops")), skipped
        resumed = await a.operate(Operation(OperationKind.RESUME, "p", None, "ops"))
        assert resumed.refused is None, resumed
        got = await a.claim(req("p", slot=SLOT + 3000))
        assert got.status is ClaimStatus.WON, f"a resumed job's new slot must be won: {got}"
    finally:
        await a.close()


async def test_a_run_operation_the_run_s_status_forbids_is_refused_by_the_store(
        store: Store) -> None:
    """With operations: the store refuses, changing nothing, a retry of a run that is not
    over (running, handed over, waiting for its retry) and a cancel of a run that is.
    ``Admin`` reads the status first, but only the store's check is atomic: a retry of a
    running run made the run claimable while its holder ran on (the run ran twice at
    once). Skipped for a backend without operations."""
    from lease_core.operations import Operation, OperationKind

    a = await started(store)
    try:
        runs = {RunStatus.RUNNING: req("op-running"), RunStatus.HANDED_OVER: req("op-handed"),
                RunStatus.COMPLETED: req("op-done")}
        if supports_retries(a):
            runs[RunStatus.RETRYING] = req("op-retrying")
        for r in runs.values():
            assert (await a.claim(r)).status is ClaimStatus.WON
        try:  # (a slot with no run: refused, whatever the backend)
            await a.operate(Operation(OperationKind.RETRY, "op-running", SLOT + 1, "ops"))
        except ConfigurationError as exc:
            if "has no operations" in str(exc):
                pytest.skip(str(exc))
            raise
        assert await a.hand_over([lease_of(runs[RunStatus.HANDED_OVER])])
        assert await a.finish(lease_of(runs[RunStatus.COMPLETED]), Outcome.COMPLETED)
        if RunStatus.RETRYING in runs:
            assert await a.retry_later([(lease_of(runs[RunStatus.RETRYING]), Outcome.FAILED,
                                         "boom", [60_000])]) == [1]
        for status, r in runs.items():
            kind = OperationKind.CANCEL if status.finished else OperationKind.RETRY
            got = await a.operate(Operation(kind, r.job, SLOT, "ops"))
            assert (got.refused, got.status) == ("conflict", status), (
                f"a {kind.value} of a run {status.value} must be refused: {got}")
            state = (await a.check([(r.job, SLOT)])).runs[(r.job, SLOT)]
            assert (state.status, state.attempt) == (status, 1), (kind, state)
        running = lease_of(runs[RunStatus.RUNNING])
        assert (await a.heartbeat([running])).held == {running.token}
        assert await a.queued([r.job for r in runs.values()]) == []
    finally:
        await a.close()


async def test_register_jobs_reports_first_seen_last_slot_and_open_runs(store: Store) -> None:
    a = await started(store)
    try:
        first = await a.register_jobs(["x", "y"])
        assert first["x"].new and first["x"].last_slot is None
        twice = await a.register_jobs(["z", "z"])  # a name listed twice: one new job
        assert list(twice) == ["z"] and twice["z"].new, twice
        now = await a.now_ms()
        assert abs(first["x"].first_seen_ms - now) < 5_000
        await a.claim(req("x", slot=SLOT))
        r = req("x", slot=SLOT + 5)
        await a.claim(req("x", slot=SLOT + 5, overlap_skip=False))
        del r
        done = req("y", slot=SLOT)
        await a.claim(done)
        await a.finish(lease_of(done), Outcome.COMPLETED)
        handed = req("w", slot=SLOT)
        await a.claim(handed)
        assert await a.hand_over([lease_of(handed)]) == {handed.token}
        again = await a.register_jobs(["x", "y", "w"])
        assert not again["x"].new
        assert again["x"].first_seen_ms == first["x"].first_seen_ms
        assert again["x"].last_slot == SLOT + 5
        assert again["x"].open_slots == (SLOT, SLOT + 5)
        assert again["y"].open_slots == ()
        assert again["w"].open_slots == (SLOT,), (
            "register_jobs() must list a handed-over run's slot in open_slots (a starting "
            f"scheduler watches it, to claim it): {again['w']}")
    finally:
        await a.close()


async def test_check_reads_many_runs_and_omits_missing(store: Store) -> None:
    a = await started(store)
    try:
        await a.claim(req("p", instance="i1"))
        await a.claim(req("q", instance="i2"))
        result = await a.check([("p", SLOT), ("q", SLOT), ("nope", SLOT)])
        assert set(result.runs) == {("p", SLOT), ("q", SLOT)}
        assert result.runs[("q", SLOT)].instance_id == "i2"
        assert abs(result.now_ms - await a.now_ms()) < 5_000
    finally:
        await a.close()


async def test_history_is_trimmed_by_size(store: Store) -> None:
    a = await started(store)
    try:
        for i in range(8):
            r = req("h", slot=SLOT + i, history_size=3)
            await a.claim(r)
            await a.finish(lease_of(r), Outcome.COMPLETED)
        r = req("h", slot=SLOT + 8, history_size=3)
        await a.claim(r)
        await a.prune("h", keep=3)  # what the scheduler's ticker does
        history = await a.history("h")
        assert len(history) <= 4
        assert history[0].slot == SLOT + 8
        assert {h.slot for h in history} >= {SLOT + 8, SLOT + 7}
        # Trimmed runs are gone from the store too.
        result = await a.check([("h", SLOT), ("h", SLOT + 8)])
        assert ("h", SLOT) not in result.runs and ("h", SLOT + 8) in result.runs
        assert len(await a.history(None, limit=2)) == 2
    finally:
        await a.close()


async def test_history_of_every_job_is_newest_claim_first(store: Store) -> None:
    """``history(None, limit)`` is the newest ``limit`` attempts of the whole store,
    newest claim first, whatever their jobs' names (not job by job)."""
    a = await started(store)
    try:
        for job in ("h-b", "h-a", "h-c"):  # claimed in this order, each a tick later
            now = await a.now_ms()
            await wait_for(_later_than(a, now), timeout=5, what="the store clock to move")
            assert (await a.claim(req(job))).status is ClaimStatus.WON
        newest = [h.job for h in await a.history(None, 2)]
        assert newest == ["h-c", "h-a"], (
            f"history(None, 2) must be the two newest claims, newest first: {newest}")
        assert [h.job for h in await a.history(None)] == ["h-c", "h-a", "h-b"]
    finally:
        await a.close()


async def test_history_is_trimmed_by_ttl(store: Store) -> None:
    a = await started(store)
    try:
        old = req("t", slot=SLOT, history_ttl_ms=200)
        await a.claim(old)
        await a.finish(lease_of(old), Outcome.COMPLETED)
        slow = req("t-slow", history_ttl_ms=200)  # claimed now, finished after the ttl
        await a.claim(slow)
        now = await a.now_ms()
        await wait_for(lambda: a.now_ms(), what="clock")  # one round trip
        await wait_for(_later_than(a, now + 400), timeout=5, what="ttl to pass")
        new = req("t", slot=SLOT + 1000, history_ttl_ms=200)
        await a.claim(new)
        assert await a.finish(lease_of(slow), Outcome.COMPLETED)
        # The age of an attempt is that of its end, not its claim.
        assert await a.prune("t-slow", older_than_ms=200) == 0, (
            "prune(older_than_ms=) deleted an attempt that finished just now (claimed "
            "longer ago): an attempt's age runs from its end")
        await a.prune("t", older_than_ms=200)  # what the scheduler's ticker does
        slots = [h.slot for h in await a.history("t")]
        assert slots == [SLOT + 1000]
    finally:
        await a.close()


def _later_than(backend: Backend, ms: int):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return await backend.now_ms() > ms

    return check


async def test_checkpoint_round_trips_json_and_rejects_other_values(store: Store) -> None:
    from lease_core import ConfigurationError

    a = await started(store)
    try:
        r = req("c")
        await a.claim(r)
        assert await a.get_checkpoint("c", SLOT) is None
        value = {"cursor": 41, "names": ["α", "b"], "ok": True, "none": None}
        assert await a.set_checkpoint(lease_of(r), value)
        assert await a.get_checkpoint("c", SLOT) == value
        not_json: list[Any] = [{"bad": object()}, float("nan"), [float("inf")], {1j: 1}]
        for bad in not_json:  # NaN and Infinity too: JSON has no such numbers
            with pytest.raises(ConfigurationError, match="JSON"):
                await a.set_checkpoint(lease_of(r), bad)
        nested: list[Any] = []
        for _ in range(100_000):  # deeper than JSON encoders recurse (3.13: ~10,000)
            nested = [nested]
        with pytest.raises(ConfigurationError, match="nests too deeply"):
            await a.set_checkpoint(lease_of(r), nested)
        assert await a.get_checkpoint("c", SLOT) == value
        assert await a.delete_checkpoint(lease_of(r))
        assert await a.get_checkpoint("c", SLOT) is None
    finally:
        await a.close()


async def test_job_names_and_many_claims_are_isolated(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        names = ["a.b", "a/b", "a:b", "a@b", "a-b", "A_b"]
        for name in names:
            assert (await a.claim(req(name, instance="a"))).status is ClaimStatus.WON
        for name in names:
            assert (await b.claim(req(name, instance="b"))).status is ClaimStatus.RUNNING
        assert {h.job for h in await a.history(None, 100)} == set(names)
    finally:
        await a.close()
        await b.close()


async def test_jobs_and_runs_describe_the_store_now(store: Store) -> None:
    a = await started(store)
    try:
        done, handed = req("alpha", SLOT), req("beta", SLOT)
        held = req("alpha", SLOT + 1000, overlap_skip=False)
        for r in (done, held, handed):
            assert (await a.claim(r)).status is ClaimStatus.WON
        assert await a.finish(lease_of(done), Outcome.COMPLETED)
        assert await a.hand_over([lease_of(handed)]) == {handed.token}
        now = await a.now_ms()

        assert await a.jobs() == ["alpha", "beta"]
        runs = await a.runs()
        assert [(r.job, r.slot, r.status) for r in runs] == [
            ("alpha", SLOT + 1000, RunStatus.RUNNING),
            ("alpha", SLOT, RunStatus.COMPLETED),
            ("beta", SLOT, RunStatus.HANDED_OVER),
        ]
        running = runs[0]
        assert running.instance_id == "a" and running.attempt == 1
        assert running.expires_ms is not None and running.expires_ms > now
        assert running.expires_at is not None and running.scheduled_at.year == 2023
        assert runs[1].expires_ms is None and runs[2].expires_ms is None

        open_runs = await a.runs(open_only=True)
        assert {(r.job, r.slot) for r in open_runs} == {("alpha", SLOT + 1000), ("beta", SLOT)}
        assert [r.slot for r in await a.runs("alpha")] == [SLOT + 1000, SLOT]
        assert [r.slot for r in await a.runs("alpha", limit=1)] == [SLOT + 1000]
        # The newest slots, not the runs of the newest attempts: an older slot claimed
        # last is not among the newest two.
        older = req("alpha", SLOT - 1000, overlap_skip=False)
        assert (await a.claim(older)).status is ClaimStatus.WON
        assert [r.slot for r in await a.runs("alpha", limit=2)] == [SLOT + 1000, SLOT]
        assert await a.runs("nobody") == []
        with pytest.raises(ValueError, match="limit=-1"):
            await a.runs(limit=-1)
        assert await a.history("alpha", 0) == []
        with pytest.raises(ValueError, match="limit=-1"):  # not "all but the oldest"
            await a.history("alpha", -1)
    finally:
        await a.close()


async def test_a_claim_sent_again_with_its_token_answers_won(store: Store) -> None:
    a = await started(store)
    try:
        r = req("j")
        first = await a.claim(r)
        again = await a.claim(r)
        assert (again.status, again.attempt, again.reason) == (
            ClaimStatus.WON, 1, Reason.SCHEDULED)
        assert again.expires_ms == first.expires_ms
        assert len(await a.history("j")) == 1
        assert (await a.claim(req("j", instance="b"))).status is ClaimStatus.RUNNING
    finally:
        await a.close()


async def test_workflow_steps_are_recorded_in_the_store(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        assert await b.workflows() == {}
        await a.register_workflows({"close": ["snapshot", "interest", "publish"],
                                    "sync": ["pull"]})
        await a.register_workflows({"sync": ["pull", "push"]})  # a newer declaration wins
        assert await b.workflows() == {"close": ["snapshot", "interest", "publish"],
                                       "sync": ["pull", "push"]}
        await a.register_workflows({})
        assert len(await b.workflows()) == 2
        await a.register_workflows({"sync": [], "export": []})  # no steps: not a workflow
        assert await b.workflows() == {"close": ["snapshot", "interest", "publish"]}
        await b.register_workflows({"sync": ["pull"], "close": []})
        assert await a.workflows() == {"sync": ["pull"]}
    finally:
        await a.close()
        await b.close()


async def test_job_schedules_are_recorded_in_the_store(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        assert await b.schedules() == {}
        every = '{"every_ms": 60000, "offset_ms": 0}'
        await a.register_schedules({"report": every, "close": '{"cron": "0 2 * * *"}'})
        await a.register_schedules({"close": '{"cron": "0 3 * * *", "tz": "UTC"}'})
        assert await b.schedules() == {"report": every,
                                       "close": '{"cron": "0 3 * * *", "tz": "UTC"}'}
        await a.register_schedules({})
        assert len(await b.schedules()) == 2
        assert await b.workflows() == {}  # a schedule is not a workflow
    finally:
        await a.close()
        await b.close()


async def test_prune_trims_a_job_without_claiming(store: Store) -> None:
    a = await started(store)
    try:
        for slot in range(5):  # five finished runs, then one open
            r = req("old", slot=SLOT + slot, overlap_skip=False)
            await a.claim(r)
            assert await a.finish(lease_of(r), Outcome.COMPLETED)
        held = req("old", slot=SLOT + 10, overlap_skip=False)
        await a.claim(held)
        bad: list[dict[str, Any]] = [{"keep": -1}, {"older_than_ms": -1}, {"batch": 0},
                                     {"keep": 1.5}]
        for kwargs in bad:  # refused, naming the value, by both twins: nothing trimmed
            ((name, value),) = kwargs.items()
            with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
                await a.prune("old", **kwargs)
            with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
                await a.prune_many(["old"], **kwargs)
        assert await a.prune("old", keep=10) == 0
        assert await a.prune("old", keep=4, batch=1) == 1  # bounded work per call
        assert [h.slot for h in await a.history("old")][-1] == SLOT + 1  # oldest first
        assert await a.prune("old", keep=3) == 2
        left = await a.history("old")
        assert [h.slot for h in left] == [SLOT + 10, SLOT + 4, SLOT + 3]
        # runs with no attempt left are deleted, the open run stays
        assert {r.slot for r in await a.runs("old")} == {SLOT + 10, SLOT + 4, SLOT + 3}
        assert await a.get_checkpoint("old", SLOT) is None
        # by age: every finished attempt is older than 0 ms once the clock moved on
        now = await a.now_ms()
        await wait_for(lambda: _later(a, now), timeout=5, what="the store clock to move")
        assert await a.prune("old", older_than_ms=0) == 2
        assert [h.slot for h in await a.history("old")] == [SLOT + 10]
        assert (await a.check([("old", SLOT + 10)])).runs[("old", SLOT + 10)].status is \
            RunStatus.RUNNING
    finally:
        await a.close()


async def test_prune_many_trims_each_job_as_prune_does(store: Store) -> None:
    """prune_many() of several jobs: per job, what prune() of that job alone does."""
    a = await started(store)
    try:
        async def fill(p: str) -> None:
            for job, finished in ((f"{p}-five", 5), (f"{p}-two", 2), (f"{p}-many", 7)):
                for slot in range(finished):
                    r = req(job, slot=SLOT + slot, overlap_skip=False)
                    await a.claim(r)
                    assert await a.finish(lease_of(r), Outcome.COMPLETED)
            await a.claim(req(f"{p}-five", slot=SLOT + 10, overlap_skip=False))  # open

        await fill("one")
        await fill("all")
        names = ("five", "two", "many", "none")
        alone = {n: await a.prune(f"one-{n}", keep=3, batch=2) for n in names}
        many = await a.prune_many([f"all-{n}" for n in (*names, "five")], keep=3, batch=2)
        assert many == {f"all-{n}": alone[n] for n in names} == {
            "all-five": 2, "all-two": 0, "all-many": 2, "all-none": 0}
        assert await a.prune_many([], keep=3) == {}
        with pytest.raises(ValueError, match="batch=0"):
            await a.prune_many(["all-five"], keep=3, batch=0)

        def kept(h: list[Attempt]) -> list[tuple[int, Outcome | None]]:
            return [(x.slot - SLOT, x.outcome) for x in h]

        for n in names:
            one, both = await a.history(f"one-{n}"), await a.history(f"all-{n}")
            assert kept(both) == kept(one), n
            assert {r.slot for r in await a.runs(f"all-{n}")} == {
                r.slot for r in await a.runs(f"one-{n}")}
        # a second call goes on where the batch stopped; the open run of all-five stays
        assert await a.prune_many(["all-five", "all-many"], keep=3, batch=2) == {
            "all-five": 1, "all-many": 2}
        assert [x.slot - SLOT for x in await a.history("all-many")] == [6, 5, 4]
        assert (SLOT + 10) in {r.slot for r in await a.runs("all-five")}
    finally:
        await a.close()


async def test_prune_and_maintenance_take_limits_beyond_any_history(store: Store) -> None:
    """Any whole number is a limit (``keep``, ``older_than_ms``, ``batch``, ``every_ms``,
    and ``limit`` of ``history`` and ``runs``):
    one far beyond any history (a ttl of a million years, 2**64) keeps everything, or
    wins the period for good, instead of failing in the store (a bigint out of range on
    PostgreSQL, a date before year 1 in memory), which made every trimming of a
    scheduler with such a ``history_ttl`` or ``history_size`` fail."""
    a = await started(store)
    try:
        r = req("far", overlap_skip=False)
        await a.claim(r)
        assert await a.finish(lease_of(r), Outcome.COMPLETED)
        # So are history's and runs' (a bigint out of range, the driver's own error).
        for limit in (2**63, 2**64):
            assert len(await a.history("far", limit)) == len(await a.history(None, limit)) == 1
            assert len(await a.runs("far", limit=limit)) == len(await a.runs(limit=limit)) == 1
        million_years = 1_000_000 * 365 * 86_400_000
        for kwargs in ({"older_than_ms": million_years}, {"older_than_ms": 2**64},
                       {"keep": 2**64}, {"keep": 2**64, "older_than_ms": 2**64},
                       {"keep": 0, "batch": 2**64}):
            deleted = 1 if kwargs.get("keep") == 0 else 0
            assert await a.prune("far", **kwargs) == deleted, kwargs
            assert await a.prune_many(["far", "none"], **kwargs) == {"far": 0, "none": 0}
        assert await a.history("far") == []
        assert await a.maintenance_due("forever", 2**64)
        assert not await a.maintenance_due("other", 1)
    finally:
        await a.close()


async def _later(backend: Backend, ms: int) -> bool:
    return await backend.now_ms() > ms


async def test_a_workflow_step_s_run_keeps_its_result_and_fences_a_zombie(store: Store) -> None:
    # Steps run as jobs "<workflow>/<step>"; their checkpoint holds progress, then result.
    a, b = await started(store), await started(store)
    try:
        job = "bank-close/interest"
        first = req(job, lease_ms=300)
        assert (await a.claim(first)).status is ClaimStatus.WON
        assert await a.set_checkpoint(lease_of(first), {"progress": {"after": 100}})
        await wait_expired(b, job)
        second = req(job, instance="b")
        won = await b.claim(second)
        assert (won.status, won.attempt, won.reason) == (ClaimStatus.WON, 2, Reason.TAKEOVER)
        assert await b.get_checkpoint(job, SLOT) == {"progress": {"after": 100}}
        # The zombie can neither store its result nor complete the step.
        assert not await a.set_checkpoint(lease_of(first), {"result": "zombie"})
        assert not await a.finish(lease_of(first), Outcome.COMPLETED)
        assert await b.set_checkpoint(lease_of(second), {"result": {"credited": 7}})
        assert await b.finish(lease_of(second), Outcome.COMPLETED)
        assert await a.get_checkpoint(job, SLOT) == {"result": {"credited": 7}}
        assert not await b.set_checkpoint(lease_of(second), {"result": "late"})
        result = await a.check([(job, SLOT), ("bank-close/publish", SLOT)])
        assert result.runs[(job, SLOT)].status is RunStatus.COMPLETED
        assert ("bank-close/publish", SLOT) not in result.runs
    finally:
        await a.close()
        await b.close()


async def test_claim_many_answers_as_sequential_claims(store: Store) -> None:
    """A batch of claims gives, request by request, what claim() one at a time gives.

    Checked twice: a batch whose claims come from two instances, and one from a single
    instance (as a scheduler sends them; a backend may take another path for it).
    """
    a = await started(store)
    try:
        async def prepare(p: str, other: str = "b") -> list[ClaimRequest]:
            await a.claim(req(f"{p}-running", instance="x"))
            await a.claim(req(f"{p}-skip", instance="x"))
            await a.claim(req(f"{p}-esc", instance="x", lease_ms=SHORT, max_attempts=1))
            await a.claim(req(f"{p}-take", instance="x", lease_ms=SHORT))
            done = req(f"{p}-fin", instance="x")
            await a.claim(done)
            await a.finish(lease_of(done), Outcome.COMPLETED)
            handed = req(f"{p}-hand", instance="x")
            await a.claim(handed)
            await a.hand_over([lease_of(handed)])
            again = req(f"{p}-again")
            return [
                req(f"{p}-new"),
                req(f"{p}-running"),
                req(f"{p}-skip", slot=SLOT + 1000),
                req(f"{p}-esc", max_attempts=1),
                req(f"{p}-take", max_attempts=3),
                req(f"{p}-fin"),
                req(f"{p}-hand"),
                req(f"{p}-dup"), req(f"{p}-dup", instance=other),  # one run twice
                again, again,  # the same claim sent twice
                req(f"{p}-two"), req(f"{p}-two", slot=SLOT + 1000),  # skipped by the first
                req(f"{p}-both"), req(f"{p}-both", slot=SLOT + 1000, overlap_skip=False),
            ]

        seq, bat = await prepare("seq"), await prepare("bat")
        one = await prepare("one", other=bat[0].instance_id)
        for p in ("seq", "bat", "one"):
            await wait_expired(a, f"{p}-esc")
            await wait_expired(a, f"{p}-take")
        one_by_one = [await a.claim(r) for r in seq]
        batched = await a.claim_many(bat)
        single = await a.claim_many(one)
        assert await a.claim_many([]) == []

        def shape(results: list[ClaimResult], p: str) -> list[tuple[object, ...]]:
            return [(r.status, r.job.removeprefix(p), r.slot, r.attempt, r.reason, r.run_status,
                     r.instance_id, r.expires_ms is None)
                    for r in results]

        assert shape(batched, "bat") == shape(one_by_one, "seq")
        assert shape(single, "one") == shape(one_by_one, "seq")
        assert [r.status for r in batched] == [
            ClaimStatus.WON, ClaimStatus.RUNNING, ClaimStatus.SKIPPED, ClaimStatus.ESCALATED,
            ClaimStatus.WON, ClaimStatus.FINISHED, ClaimStatus.WON,
            ClaimStatus.WON, ClaimStatus.RUNNING, ClaimStatus.WON, ClaimStatus.WON,
            ClaimStatus.WON, ClaimStatus.SKIPPED, ClaimStatus.WON, ClaimStatus.WON,
        ]
        assert [r.reason for r in batched[4:7]] == [Reason.TAKEOVER, None, Reason.HAND_OVER]

        def trail(attempts: list[Attempt], p: str) -> list[tuple[object, ...]]:
            return sorted((h.job.removeprefix(p), h.slot, h.attempt, h.instance_id, h.reason,
                           h.outcome) for h in attempts if h.job.startswith(p))

        history = await a.history(None, 1000)
        assert trail(history, "bat") == trail(history, "seq")
        assert trail(history, "one") == trail(history, "seq")
        for p in ("bat", "one"):
            state = await a.check([(f"{p}-take", SLOT), (f"{p}-esc", SLOT)])
            assert state.runs[(f"{p}-take", SLOT)].attempt == 2
            assert state.runs[(f"{p}-esc", SLOT)].status is RunStatus.ESCALATED
    finally:
        await a.close()


async def test_finish_many_answers_as_sequential_finishes(store: Store) -> None:
    """A batch of finishes gives, item by item, what finish() one at a time gives."""
    a = await started(store)
    try:
        async def prepare(p: str) -> list[tuple[Lease, Outcome, str | None]]:
            names = ("ok", "failed", "timed", "twice", "stale", "done", "handed")
            claims = {name: req(f"{p}-{name}") for name in names}
            for r in claims.values():
                assert (await a.claim(r)).status is ClaimStatus.WON
            assert await a.finish(lease_of(claims["done"]), Outcome.COMPLETED)
            assert await a.hand_over([lease_of(claims["handed"])])
            stale = claims["stale"]
            return [
                (lease_of(claims["ok"]), Outcome.COMPLETED, None),
                (lease_of(claims["failed"]), Outcome.FAILED, "boom"),
                (lease_of(claims["timed"]), Outcome.TIMED_OUT, None),
                (lease_of(claims["twice"]), Outcome.COMPLETED, None),
                (lease_of(claims["twice"]), Outcome.FAILED, "again"),  # already ended
                (Lease(stale.job, stale.slot, "not-its-token", stale.lease_ms),
                 Outcome.COMPLETED, None),
                (lease_of(claims["done"]), Outcome.FAILED, "late"),
                (lease_of(claims["handed"]), Outcome.COMPLETED, None),
            ]

        seq, bat = await prepare("seq"), await prepare("bat")
        one_by_one = [await a.finish(*item) for item in seq]
        batched = await a.finish_many(bat)
        assert batched == one_by_one == [True] * 4 + [False] * 4
        assert await a.finish_many([]) == []

        def trail(attempts: list[Attempt], p: str) -> list[tuple[object, ...]]:
            return sorted((h.job.removeprefix(p), h.slot, h.attempt, h.outcome, h.error)
                          for h in attempts if h.job.startswith(p))

        history = await a.history(None, 1000)
        assert trail(history, "bat") == trail(history, "seq")
        ended = {h.job: h.outcome for h in history if h.job.startswith("bat")}
        assert ended["bat-failed"] is Outcome.FAILED and ended["bat-stale"] is None
        state = await a.check([("bat-twice", SLOT), ("bat-stale", SLOT)])
        assert state.runs[("bat-twice", SLOT)].status is RunStatus.COMPLETED
        assert state.runs[("bat-stale", SLOT)].status is RunStatus.RUNNING

        # An outcome finish() refuses fails the whole batch, and nothing is written.
        x, y = req("refused-x"), req("refused-y")
        for r in (x, y):
            await a.claim(r)
        with pytest.raises(ConfigurationError, match="outcome="):
            await a.finish_many([(lease_of(x), Outcome.COMPLETED, None),
                                 (lease_of(y), Outcome.LOST, None)])
        state = await a.check([("refused-x", SLOT), ("refused-y", SLOT)])
        assert {r.status for r in state.runs.values()} == {RunStatus.RUNNING}
        with pytest.raises(ConfigurationError, match="outcome="):
            await a.finish(lease_of(x), Outcome.ESCALATED)
    finally:
        await a.close()


async def test_single_calls_and_batches_of_one_agree(store: Store) -> None:
    """claim() and claim_many([r]), finish() and finish_many([x]), prune() and
    prune_many([job]) answer alike (a backend implements one of each pair, or both)."""
    a = await started(store)
    try:
        async def prepare(p: str) -> dict[str, ClaimRequest]:
            claims = {name: req(f"{p}-{name}", instance="x")
                      for name in ("held", "done", "ended", "stale")}
            for r in claims.values():
                assert (await a.claim(r)).status is ClaimStatus.WON
            assert await a.finish(lease_of(claims["done"]), Outcome.COMPLETED)
            for slot in range(1, 5):  # finished runs to trim
                r = req(f"{p}-trim", slot=SLOT + slot, overlap_skip=False)
                await a.claim(r)
                assert await a.finish(lease_of(r), Outcome.COMPLETED)
            return claims

        lone, batch = await prepare("lone"), await prepare("batch")

        async def claims(p: str, made: dict[str, ClaimRequest],
                         claim: Callable[[ClaimRequest], Awaitable[ClaimResult]],
                         ) -> list[tuple[object, ...]]:
            got = [await claim(r) for r in (req(f"{p}-new"), req(f"{p}-held", instance="b"),
                                            req(f"{p}-done"), made["held"])]
            return [(r.status, r.job.removeprefix(p), r.attempt, r.reason, r.run_status,
                     r.instance_id) for r in got]

        async def claim_alone(r: ClaimRequest) -> ClaimResult:
            (result,) = await a.claim_many([r])
            return result

        assert await claims("batch", batch, claim_alone) == await claims("lone", lone, a.claim)

        async def finishes(made: dict[str, ClaimRequest],
                           finish: Callable[[Lease, Outcome, str | None], Awaitable[bool]],
                           ) -> list[bool]:
            stale = made["stale"]
            return [await finish(lease_of(made["ended"]), Outcome.FAILED, "boom"),
                    await finish(lease_of(made["ended"]), Outcome.COMPLETED, None),  # ended
                    await finish(Lease(stale.job, stale.slot, "not-its-token", stale.lease_ms),
                                 Outcome.COMPLETED, None)]

        async def finish_alone(lease: Lease, outcome: Outcome, error: str | None) -> bool:
            (done,) = await a.finish_many([(lease, outcome, error)])
            return done

        assert await finishes(batch, finish_alone) == await finishes(lone, a.finish) == [
            True, False, False]
        with pytest.raises(ConfigurationError, match="outcome="):
            await a.finish_many([(lease_of(batch["stale"]), Outcome.LOST, None)])
        with pytest.raises(ConfigurationError, match="outcome="):
            await a.finish(lease_of(lone["stale"]), Outcome.LOST)

        assert await a.prune("lone-trim", keep=1, batch=2) == 2
        assert await a.prune_many(["batch-trim"], keep=1, batch=2) == {"batch-trim": 2}
        assert await a.prune("lone-nothing", keep=1) == 0
        assert await a.prune_many(["batch-nothing"], keep=1) == {"batch-nothing": 0}
        with pytest.raises(ValueError, match="keep=-1"):
            await a.prune_many(["batch-trim"], keep=-1)

        def trail(attempts: list[Attempt], p: str) -> list[tuple[object, ...]]:
            return sorted((h.job.removeprefix(p), h.slot, h.attempt, h.instance_id, h.reason,
                           h.outcome, h.error) for h in attempts if h.job.startswith(p))

        history = await a.history(None, 1000)
        assert trail(history, "batch-") == trail(history, "lone-")
        assert len(await a.history("batch-trim")) == 2
    finally:
        await a.close()


async def test_maintenance_due_has_one_winner_per_period(store: Store) -> None:
    backends = [store.backend() for _ in range(4)]
    for b in backends:
        await b.start()
    try:
        with pytest.raises(ConfigurationError, match="every_ms=0"):
            await backends[0].maintenance_due("a", 0)
        wins: list[bool] = []

        async def ask(b: Backend, who: str) -> None:
            wins.append(await b.maintenance_due(who, 600))

        async with anyio.create_task_group() as tg:
            for i, b in enumerate(backends):
                tg.start_soon(ask, b, f"i{i}")
        assert sorted(wins) == [False, False, False, True]
        assert not await backends[1].maintenance_due("again", 600)

        # once the period is over, exactly one caller wins the next one
        async def next_period() -> bool:
            return await backends[2].maintenance_due("later", 600)

        await wait_for(next_period, what="the next period")
        assert not await backends[3].maintenance_due("other", 600)
    finally:
        for b in backends:
            await b.close()


async def test_a_claim_leaves_trimming_to_prune(store: Store) -> None:
    a = await started(store)
    try:
        for i in range(6):
            r = req("k", slot=SLOT + i, history_size=2, history_ttl_ms=1)
            assert (await a.claim(r)).status is ClaimStatus.WON
            await a.finish(lease_of(r), Outcome.COMPLETED)
        assert len(await a.history("k")) == 6  # the claims trimmed nothing
        assert len(await a.history("k", limit=4)) == 4  # never more than asked for
        assert await a.prune("k", keep=2) == 4
        assert [h.slot for h in await a.history("k")] == [SLOT + 5, SLOT + 4]
    finally:
        await a.close()


async def test_a_trimmed_slot_is_never_won_again(store: Store) -> None:
    """A scheduled claim of a slot whose run finished and was trimmed away finds it
    finished (attempt 0, no run status) instead of winning it a second time; so does one
    of an older slot never claimed (its turn passed while newer runs ran and were
    trimmed). A later workflow step's claim (``scheduled=False``) and a newer slot still
    win, and so does a trigger's or a retry's claim of a run that exists."""
    a = await started(store)
    try:
        for i in (1, 2, 3, 4):
            r = req("tr", slot=SLOT + i, overlap_skip=False)
            assert (await a.claim(r)).status is ClaimStatus.WON
            await a.finish(lease_of(r), Outcome.COMPLETED)
        assert await a.prune("tr", keep=2) == 2  # the runs of SLOT+1 and SLOT+2 go
        assert ("tr", SLOT + 1) not in (await a.check([("tr", SLOT + 1)])).runs
        for slot, reason in ((SLOT + 1, Reason.SCHEDULED), (SLOT + 2, Reason.CATCH_UP),
                             (SLOT, Reason.SCHEDULED)):  # SLOT: never claimed, older
            for how, claim in _both_claims(a):  # the scheduler sends claim_many()
                again = await claim(req("tr", slot=slot, reason=reason, instance="b"))
                assert (again.status, again.attempt, again.run_status) == (
                    ClaimStatus.FINISHED, 0, None), (
                    f"{how}() of a trimmed slot must answer finished, attempt 0: {again}")
        assert [h.slot for h in await a.history("tr")] == [SLOT + 4, SLOT + 3]
        # A later workflow step's run is started by the step before it, not by a
        # schedule: its store may have trimmed newer slots of the step already.
        step = await a.claim(req("tr", slot=SLOT + 2, scheduled=False, overlap_skip=False))
        assert step.status is ClaimStatus.WON and step.attempt == 1
        newer = await a.claim(req("tr", slot=SLOT + 5, overlap_skip=False))
        assert newer.status is ClaimStatus.WON
        # Nothing trimmed yet: an older slot never claimed is still won (a late member
        # covering a slot nobody claimed on time).
        for i in (3, 1):
            late = await a.claim(req("fresh", slot=SLOT + i, overlap_skip=False))
            assert late.status is ClaimStatus.WON, late
    finally:
        await a.close()


async def test_trimming_keeps_an_open_run_s_attempt_and_deletes_the_run_once_over(
        store: Store) -> None:
    """By size, trimming never deletes the attempt of a run still open (it would leave
    the run with no history while it runs, and with nothing to trim once it ends): it
    keeps it beyond the newest ``keep``, and deletes it, and the run, once the run has
    finished."""
    a = await started(store)
    try:
        long = req("orph", slot=SLOT, overlap_skip=False, lease_ms=60_000)
        assert (await a.claim(long)).status is ClaimStatus.WON
        for i in (1, 2, 3):
            r = req("orph", slot=SLOT + i, overlap_skip=False)
            await a.claim(r)
            await a.finish(lease_of(r), Outcome.COMPLETED)
        assert await a.prune("orph", keep=1) == 2  # SLOT+1 and SLOT+2, not the open one
        assert [h.slot for h in await a.history("orph")] == [SLOT + 3, SLOT]
        assert await a.finish(lease_of(long), Outcome.COMPLETED)
        assert await a.prune("orph", keep=1) == 1
        assert [h.slot for h in await a.history("orph")] == [SLOT + 3]
        assert set((await a.check([("orph", SLOT), ("orph", SLOT + 3)])).runs) == {
            ("orph", SLOT + 3)}
    finally:
        await a.close()


async def test_trimming_keeps_a_handed_over_or_retrying_run_s_attempts(store: Store) -> None:
    """A run handed over, or waiting for its retry, is open though its last attempt has
    ended: trimming, by size or by age, keeps its attempts (the failure a retry follows,
    the log of its recovery) and the run, as it keeps a running one's."""
    a = await started(store)
    try:
        handed = req("open", slot=SLOT, overlap_skip=False)
        assert (await a.claim(handed)).status is ClaimStatus.WON
        assert await a.hand_over([lease_of(handed)]) == {handed.token}
        kept = {SLOT: RunStatus.HANDED_OVER}
        if supports_retries(a):
            failed = req("open", slot=SLOT + 1, overlap_skip=False)
            assert (await a.claim(failed)).status is ClaimStatus.WON
            assert await a.retry_later(
                [(lease_of(failed), Outcome.FAILED, "boom", [60_000])]) == [1]
            kept[SLOT + 1] = RunStatus.RETRYING
        for i in (2, 3, 4):
            r = req("open", slot=SLOT + i, overlap_skip=False)
            await a.claim(r)
            assert await a.finish(lease_of(r), Outcome.COMPLETED)
        open_slots = sorted(kept, reverse=True)

        async def left(after: str) -> list[int]:
            slots = sorted((h.slot for h in await a.history("open")), reverse=True)
            state = (await a.check([("open", s) for s in kept])).runs
            gone = sorted(set(open_slots) - set(slots) - {k[1] for k in state})
            assert not gone and all(
                state[("open", s)].status is status for s, status in kept.items()), (
                f"{after} deleted the attempts of open runs (handed over or retrying): "
                f"history {slots}, runs {state}")
            return slots

        deleted = await a.prune("open", keep=1)
        assert await left("prune(keep=1)") == [SLOT + 4, *open_slots], deleted
        assert deleted == 2  # the finished SLOT+2 and SLOT+3
        now = await a.now_ms()
        await wait_for(lambda: _later(a, now), timeout=5, what="the store clock to move")
        assert await a.prune("open", older_than_ms=0) == 1  # the finished SLOT+4
        assert await left("prune(older_than_ms=0)") == open_slots
        took = await a.claim(req("open", slot=SLOT, instance="b"))
        assert (took.status, took.attempt, took.reason) == (
            ClaimStatus.WON, 2, Reason.HAND_OVER)
    finally:
        await a.close()


async def _members_or_skip(backend: Backend, instance_id: str, ttl_ms: int) -> list[str]:
    """``backend.members(...)``, or skip the check: a backend answering None keeps no
    membership (the contract's default), and has nothing else to check."""
    found = await backend.members(instance_id, ttl_ms)
    if found is None:
        pytest.skip(f"{type(backend).__name__}.members() returns None: it keeps no membership")
    assert isinstance(found, list), f"members() must return a list or None, not {found!r}"
    return found


async def test_members_lists_every_live_member_sorted(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        assert await _members_or_skip(a, "m-b", 60_000) == ["m-b"]  # includes the caller
        assert await b.members("m-a", 60_000) == ["m-a", "m-b"]
        assert await a.members("m-b", 60_000) == ["m-a", "m-b"]  # renewing keeps it
        assert await b.members("m-c", 60_000) == ["m-a", "m-b", "m-c"]
        assert await a.members("m-a", 60_000) == ["m-a", "m-b", "m-c"]
    finally:
        await a.close()
        await b.close()


async def test_members_drops_a_member_whose_ttl_lapsed(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        await _members_or_skip(a, "keeper", 60_000)
        assert await b.members("leaver", 60_000) == ["keeper", "leaver"]
        # A renewal sets an absolute expiry: the short ttl is again the whole of it, also
        # after a longer one (neither added to what was left, nor the later of the two).
        assert await b.members("leaver", SHORT) == ["keeper", "leaver"]
        assert await b.members("leaver", SHORT) == ["keeper", "leaver"]

        async def gone() -> bool:
            return await a.members("keeper", 60_000) == ["keeper"]

        await wait_for(gone, timeout=5, what="the lapsed member to disappear (a renewal "
                       "sets now + ttl_ms, shortening a longer membership)")
        # it comes back as soon as it renews
        assert await b.members("leaver", 60_000) == ["keeper", "leaver"]
        assert await a.members("keeper", 60_000) == ["keeper", "leaver"]
    finally:
        await a.close()
        await b.close()


async def test_leave_ends_a_membership_at_once(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        await _members_or_skip(a, "stays", 60_000)
        if getattr(type(b), "leave", None) is Backend.leave:
            pytest.skip(f"{type(b).__name__} inherits Backend.leave(): its members "
                        "lapse with their ttl")
        assert await b.members("goes", 60_000) == ["goes", "stays"]
        await b.leave("goes")
        assert await a.members("stays", 60_000) == ["stays"]  # gone before its ttl
        await b.leave("goes")  # leaving again, or when never a member, does nothing
        await b.leave("never-joined")
        assert await a.members("stays", 60_000) == ["stays"]
        assert await b.members("goes", 60_000) == ["goes", "stays"]  # it may join again
        bad_ids: list[object] = ["", None, 7, b"bytes"]
        for instance_id in bad_ids:
            with pytest.raises(ConfigurationError, match="instance_id="):
                await b.leave(instance_id)  # type: ignore[arg-type]
        assert await a.members("stays", 60_000) == ["goes", "stays"]
    finally:
        await a.close()
        await b.close()


async def test_members_refuses_bad_arguments_and_writes_nothing(store: Store) -> None:
    a = await started(store)
    try:
        await _members_or_skip(a, "good", 60_000)
        bad_ttls: list[object] = [0, -1, 1.5, "100", True, None]
        for ttl in bad_ttls:
            with pytest.raises(ConfigurationError, match=f"ttl_ms={ttl!r}"):
                await a.members("bad-ttl", ttl)  # type: ignore[arg-type]
        bad_ids: list[object] = ["", None, 7, b"bytes"]
        for instance_id in bad_ids:
            with pytest.raises(ConfigurationError, match="instance_id="):
                await a.members(instance_id, 60_000)  # type: ignore[arg-type]
        assert await a.members("good", 60_000) == ["good"]
    finally:
        await a.close()


async def test_members_round_trip_odd_instance_ids(store: Store) -> None:
    a = await started(store)
    try:
        odd = ["host 1 pid 2", "zürich-β-東京", "a:b:c", "x|y|z", "member:x", "%s", "'; --",
               "{tag}"]
        await _members_or_skip(a, odd[0], 60_000)
        for name in odd[1:]:
            assert name in await _members_or_skip(a, name, 60_000)
        assert await a.members(odd[0], 60_000) == sorted(odd)
    finally:
        await a.close()


# -- retries within a run (issue 19, part 1)
async def test_retry_later_leaves_the_run_retrying_until_due(store: Store) -> None:
    a, b = await started(store), await started(store)
    try:
        if not supports_retries(a):
            pytest.skip(f"{type(a).__name__} implements no retry_later()")
        first = req("j", instance="a", max_attempts=1)
        assert (await a.claim(first)).status is ClaimStatus.WON
        stale = Lease("j", SLOT, "not-the-token", first.lease_ms)
        delays = [SHORT, SHORT]
        assert await a.retry_later([(stale, Outcome.FAILED, "x", delays)]) == [-1]
        assert await a.retry_later([(lease_of(first), Outcome.FAILED, "boom", delays)]) == [1]
        assert await a.retry_later([(lease_of(first), Outcome.FAILED, "boom", delays)]) == [-1]
        waiting = await b.claim(req("j", instance="b", max_attempts=1))
        assert (waiting.status, waiting.run_status) == (ClaimStatus.RUNNING, RunStatus.RETRYING)
        assert SLOT in (await a.register_jobs(["j"]))["j"].open_slots
        assert [r.slot for r in await a.runs("j", open_only=True)] == [SLOT]
        await wait_expired(b, "j")
        second = req("j", instance="b", max_attempts=1)  # a retry is never escalated
        won = await b.claim(second)
        assert (won.status, won.attempt, won.reason) == (ClaimStatus.WON, 2, Reason.RETRY)
        # No error and an empty one are recorded as given (Redis recorded None as '')
        assert await b.retry_later([(lease_of(second), Outcome.TIMED_OUT, None, delays)]) == [2]
        await wait_expired(a, "j")
        third = req("j", instance="a")
        assert (await a.claim(third)).reason is Reason.RETRY
        assert await a.retry_later([(lease_of(third), Outcome.FAILED, "", delays)]) == [0]
        done = await b.claim(req("j", instance="b"))
        assert (done.status, done.run_status) == (ClaimStatus.FINISHED, RunStatus.FAILED)
        history = sorted(await a.history("j"), key=lambda h: h.attempt)
        assert [(h.attempt, h.instance_id, h.reason, h.outcome, h.error) for h in history] == [
            (1, "a", Reason.SCHEDULED, Outcome.FAILED, "boom"),
            (2, "b", Reason.RETRY, Outcome.TIMED_OUT, None),
            (3, "a", Reason.RETRY, Outcome.FAILED, "")]
        with pytest.raises(ConfigurationError, match="skipped"):
            await a.retry_later([(lease_of(third), Outcome.SKIPPED, None, delays)])
    finally:
        await a.close()
        await b.close()


async def test_a_slot_is_skipped_while_an_earlier_run_waits_for_its_retry(
        store: Store) -> None:
    """``overlap_skip``: a new slot is skipped while an earlier run of the job waits for
    its retry (the run goes on, holding no lease), as while one holds a live lease, and
    the skip's error says which; a claim that allows overlap still wins."""
    a = await started(store)
    try:
        if not supports_retries(a):
            pytest.skip(f"{type(a).__name__} implements no retry_later()")
        first = req("o")
        assert (await a.claim(first)).status is ClaimStatus.WON
        assert await a.retry_later([(lease_of(first), Outcome.FAILED, "boom", [60_000])]) == [1]
        assert (await a.claim(req("o", slot=SLOT + 1))).status is ClaimStatus.SKIPPED
        allowed = req("o", slot=SLOT + 2, overlap_skip=False)
        assert (await a.claim(allowed)).status is ClaimStatus.WON
        assert (await a.claim(req("o", slot=SLOT + 3))).status is ClaimStatus.SKIPPED
        skipped = {h.slot: h.error for h in await a.history("o") if h.outcome is Outcome.SKIPPED}
        assert skipped == {SLOT + 1: "an earlier run of the job waits for its retry",
                           SLOT + 3: "an earlier run of the job still holds its lease"}
    finally:
        await a.close()
