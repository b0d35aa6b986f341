"""lease_core.testing holds a third-party backend to the contract: a toy backend installed
through the ``anarchon.backends`` entry point passes the shipped suite, a broken one fails it.

Each run is a pytest of its own in a subprocess, from a folder outside this project (so
none of this suite's fixtures or settings help), on a test module written as a backend's
author would write it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

import lease_core
from tests.helpers import install_toy_backend

if TYPE_CHECKING:
    from lease_core import abc, testing

TOY_BACKEND = """
    import dataclasses

    from backends.memory import MemoryBackend
    from lease_core.abc import ClaimStatus

    STORES = {}


    class ToyBackend(MemoryBackend):
        \"\"\"One shared in-memory store per URL, as a server would be.\"\"\"

        schemes = ("toy",)

        @classmethod
        def from_url(cls, url, **options):
            return STORES.setdefault(url, cls())


    class BrokenToyBackend(ToyBackend):
        \"\"\"Lets a second instance win a run that is already running.\"\"\"

        schemes = ("brokentoy",)

        async def claim(self, request):
            result = await super().claim(request)
            if result.status is ClaimStatus.RUNNING:
                return dataclasses.replace(result, status=ClaimStatus.WON,
                                           instance_id=request.instance_id)
            return result
"""

TEST_MODULE = """
    import pytest

    import toy_backend
    from lease_core import backend_from_url
    from lease_core.testing import BackendConformance


    class TestToyBackend(BackendConformance):
        differential_examples = 8
        differential_steps = 15

        @pytest.fixture(params=["asyncio", "trio"])
        def anyio_backend(self, request):
            return request.param

        def url(self):
            return "{scheme}://" + self.namespace

        def make_backend(self):
            return backend_from_url(self.url())

        async def cleanup(self):
            toy_backend.STORES.pop(self.url(), None)
"""

#: Hypothesis reports the first failing program it finds, unshrunk: shrinking replays
#: programs whose steps wait out real leases, for minutes. Derandomized: the same programs
#: every run, so that whether the differential test meets the broken claim is not luck.
NO_SHRINK = """
    from hypothesis import Phase, settings

    settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.generate],
                              derandomize=True)
    settings.load_profile("no-shrink")
"""

INI = """
    [pytest]
    addopts = -ra -p no:cacheprovider
    filterwarnings = error
    timeout = 60
"""


def run_suite(tmp_path: Path, scheme: str, conftest: str = "") -> subprocess.CompletedProcess[str]:
    """Install the toy backends, then run the shipped suite on ``scheme`` in a new pytest."""
    site = tmp_path / "site"
    site.mkdir()
    install_toy_backend(site, TOY_BACKEND, {"toy": "ToyBackend", "brokentoy": "BrokenToyBackend"})
    project = tmp_path / "project"
    project.mkdir()
    (project / "pytest.ini").write_text(textwrap.dedent(INI))
    (project / "conftest.py").write_text(textwrap.dedent(conftest))
    (project / "test_toy.py").write_text(textwrap.dedent(TEST_MODULE).replace("{scheme}", scheme))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "test_toy.py"],
        cwd=project, capture_output=True, text=True, timeout=110,
        # The toy, then the lease_core this test imported (not whichever checkout the
        # interpreter has installed, which a clone sharing a venv would test instead).
        env={"PYTHONPATH": os.pathsep.join([str(site), str(Path(lease_core.__file__).parents[1])]),
             "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
             "COLUMNS": "1000"},  # the short summary's reasons, not cut
    )


def summary(out: str) -> dict[str, int]:
    """The counts of pytest's closing line: ``{"passed": 45, "failed": 2}``."""
    last = out.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|error)", last)}


@pytest.mark.timeout(115)
def test_a_third_party_backend_passes_the_shipped_suite(tmp_path: Path) -> None:
    from lease_core.testing import conformance, lease_checks

    checks = [name for module in (conformance, lease_checks) for name in vars(module)
              if name.startswith("test_")]
    out = run_suite(tmp_path, "toy")
    assert out.returncode == 0, out.stdout + out.stderr
    # Every check on both loops, and the differential test once.
    assert summary(out.stdout) == {"passed": 2 * len(checks) + 1}, out.stdout


@pytest.mark.timeout(115)
def test_the_shipped_suite_fails_a_backend_that_lets_two_instances_win(tmp_path: Path) -> None:
    out = run_suite(tmp_path, "brokentoy", NO_SHRINK)
    assert out.returncode == 1, out.stdout + out.stderr
    failed = re.findall(r"^FAILED test_toy\.py::TestToyBackend::(\w+)(\[\w+\])? - (.*)$",
                        out.stdout, re.MULTILINE)
    reasons = {name: reason for name, _, reason in failed}
    # The check of the property itself, with the values (assertions are rewritten).
    assert "test_first_claim_wins_and_second_stands_by" in reasons, out.stdout
    assert "ClaimStatus.RUNNING" in reasons["test_first_claim_wins_and_second_stands_by"]
    # The differential test finds the difference and names the call.
    assert reasons["test_behaves_like_the_memory_backend"].startswith("AssertionError: claim")
    assert summary(out.stdout)["passed"] > 0  # the properties the toy keeps still pass


@pytest.mark.anyio
async def test_membership_checks_skip_a_backend_that_keeps_no_membership() -> None:
    from backends.memory import MemoryBackend
    from lease_core.abc import Backend
    from lease_core.errors import ConfigurationError
    from lease_core.testing import Store, conformance

    class NoMembership(MemoryBackend):
        """The memory backend with the contract's default members(): no membership."""

        async def members(self, instance_id: str, ttl_ms: int) -> list[str] | None:
            return await Backend.members(self, instance_id, ttl_ms)

    class Shared(Store):
        def __init__(self) -> None:
            self.shared = NoMembership()

        def backend(self) -> Backend:
            return self.shared

    assert await NoMembership().members("i", 1_000) is None
    with pytest.raises(ConfigurationError, match="ttl_ms=0"):  # the default validates too
        await NoMembership().members("i", 0)
    checks = [check for name, check in vars(conformance).items()
              if name.startswith("test_members")]
    assert len(checks) == 4
    for check in checks:
        with pytest.raises(pytest.skip.Exception, match="keeps no membership"):
            await check(Shared())


@pytest.mark.anyio
async def test_lease_checks_skip_a_backend_without_named_leases() -> None:
    from backends.memory import MemoryBackend
    from lease_core._named_leases import LeaseAnswer, NamedLeaseStore
    from lease_core.abc import Backend
    from lease_core.errors import ConfigurationError
    from lease_core.testing import Store, lease_checks

    class NoLeases(MemoryBackend):
        """The memory backend with the contract's default named leases: none."""

        async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
            return await NamedLeaseStore.acquire_lease(self, name, holder, ttl_ms)

    class Shared(Store):
        def __init__(self) -> None:
            self.shared = NoLeases()

        def backend(self) -> Backend:
            return self.shared

    with pytest.raises(ConfigurationError, match="NoLeases has no named leases"):
        await NoLeases().acquire_lease("n", "h", 1_000)
    checks = [check for name, check in vars(lease_checks).items() if name.startswith("test_")]
    assert len(checks) == 8
    for check in checks:
        with pytest.raises(pytest.skip.Exception, match="has no named leases"):
            await check(Shared())


@pytest.mark.anyio
async def test_lease_checks_fail_a_racy_acquire_and_a_release_renewal_revives() -> None:
    """A named lease taken in two steps (read the name, then write it: a GET and a SET, a
    SELECT and an UPDATE) is given to every holder that asked at once. Each check made
    one call at a time, so such a backend passed them all; the race check fails it. And
    a released hold that a renewal of its token revives fails the token check."""
    import anyio.lowlevel

    from backends.memory import MemoryBackend
    from lease_core._named_leases import LeaseAnswer, check_lease
    from lease_core.abc import Backend
    from lease_core.testing import Store, lease_checks

    class ReadThenWrite(MemoryBackend):
        """Named leases kept in a dict of its own, each acquire a read, then a write."""

        def __init__(self) -> None:
            super().__init__()
            self.named: dict[str, tuple[int, int, str | None]] = {}

        async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
            check_lease(name, holder=holder, ttl_ms=ttl_ms)
            now = await self.now_ms()
            token, expires, current = self.named.get(name, (0, 0, None))
            await anyio.lowlevel.checkpoint()  # the round trip between the read and write
            if expires > now and current != holder:
                return LeaseAnswer(False, token, expires, now, current)
            token += 0 if expires > now else 1
            self.named[name] = (token, now + ttl_ms, holder)
            return LeaseAnswer(True, token, now + ttl_ms, now, holder)

        async def renew_lease(self, name: str, token: int, ttl_ms: int) -> int | None:
            check_lease(name, ttl_ms=ttl_ms, token=token)
            now = await self.now_ms()
            held, expires, holder = self.named.get(name, (0, 0, None))
            if held != token or expires <= now:
                return None
            self.named[name] = (token, now + ttl_ms, holder)
            return now + ttl_ms

        async def release_lease(self, name: str, token: int) -> bool:
            check_lease(name, token=token)
            held, expires, _ = self.named.get(name, (0, 0, None))
            if held != token or expires <= await self.now_ms():
                return False
            self.named[name] = (token, 0, None)
            return True

        async def read_lease(self, name: str) -> LeaseAnswer:
            check_lease(name)
            now = await self.now_ms()
            token, expires, holder = self.named.get(name, (0, 0, None))
            live = expires > now and holder is not None
            return LeaseAnswer(live, token, expires, now, holder if live else None)

    class Shared(Store):
        def __init__(self, shared: Backend | None = None) -> None:
            self.shared = ReadThenWrite() if shared is None else shared

        def backend(self) -> Backend:
            return self.shared

    class RevivedByRenewal(ReadThenWrite):
        """A release that marks the name free (no holder) but keeps its expiry, which
        the renewal alone reads: a renewal sent just before a release (as the Lease's
        renewal task may) held the freed name again, for nobody, for a ttl."""

        async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
            token, expires, current = self.named.get(name, (0, 0, None))
            if current is None and expires:  # released: free, as if it had lapsed
                self.named[name] = (token, 0, None)
            return await super().acquire_lease(name, holder, ttl_ms)

        async def release_lease(self, name: str, token: int) -> bool:
            _, expires, current = self.named.get(name, (0, 0, None))
            if current is None or not await super().release_lease(name, token):
                return False
            self.named[name] = (token, expires, None)
            return True

    with pytest.raises(AssertionError, match=r"assert \d+ is None"):  # the revived expiry
        await lease_checks.test_lease_is_exclusive_and_its_token_grows_with_each_holder(
            Shared(RevivedByRenewal()))

    checks = {name: check for name, check in vars(lease_checks).items()
              if name.startswith("test_")}
    race = checks.pop("test_lease_acquires_at_once_give_the_name_to_one_holder")
    for check in checks.values():  # one call at a time: the two steps do not show
        await check(Shared())
    with pytest.raises(AssertionError, match="5 holders of one name at once"):
        await race(Shared())
    await race(Shared(MemoryBackend()))  # the built-in memory backend takes a name in one step



@pytest.mark.anyio
async def test_the_lease_read_check_skips_a_backend_without_reads_and_fails_one_that_takes(
) -> None:
    """A backend written before ``read_lease`` existed keeps its leases and skips the read
    check; one whose read takes a free name (an acquire in disguise) fails it."""
    from backends.memory import MemoryBackend
    from lease_core._named_leases import LeaseAnswer, NamedLeaseStore
    from lease_core.testing import lease_checks

    check = lease_checks.test_lease_read_tells_who_holds_it_and_takes_nothing

    class NoReads(MemoryBackend):
        async def read_lease(self, name: str) -> LeaseAnswer:
            return await NamedLeaseStore.read_lease(self, name)

    class ReadsByTaking(MemoryBackend):
        async def read_lease(self, name: str) -> LeaseAnswer:
            answer = await self.acquire_lease(name, "reader", 60_000)
            return LeaseAnswer(True, answer.token, answer.expires_ms, answer.now_ms,
                               answer.holder)

    with pytest.raises(pytest.skip.Exception, match="implement read_lease"):
        await check(_store_of(NoReads()))
    with pytest.raises(AssertionError):
        await check(_store_of(ReadsByTaking()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_lease_read_check_passes_a_correct_store_far_away() -> None:
    """A correct store 200 ms away (a managed database in another zone) passes the read
    check: it asserted a 300 ms hold still live three round trips after taking it, so it
    failed every correct backend whose calls take over 100 ms (and any, on a loaded CI
    machine)."""
    from backends.memory import MemoryBackend
    from lease_core._named_leases import LeaseAnswer
    from lease_core.testing import lease_checks

    class FarAway(MemoryBackend):
        async def acquire_lease(self, name: str, holder: str, ttl_ms: int) -> LeaseAnswer:
            await anyio.sleep(0.2)  # the request's way there: the store acts after it
            return await super().acquire_lease(name, holder, ttl_ms)

        async def read_lease(self, name: str) -> LeaseAnswer:
            await anyio.sleep(0.2)
            return await super().read_lease(name)

        async def release_lease(self, name: str, token: int) -> bool:
            await anyio.sleep(0.2)
            return await super().release_lease(name, token)

    await lease_checks.test_lease_read_tells_who_holds_it_and_takes_nothing(
        _store_of(FarAway()))


# -- Mutants of the memory backend, each breaking one guarantee the kit missed before.
def _store_of(backend: abc.Backend) -> testing.Store:
    """A store whose every backend is ``backend`` (one object, one store)."""
    from lease_core.testing import Store

    class Shared(Store):
        def backend(self) -> abc.Backend:
            return backend

    return Shared()


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_that_fences_an_ended_run_by_token_alone() -> None:
    """A heartbeat that renews a run its holder already finished (fenced by token and
    expiry, not the run's status), and a checkpoint written by a holder that handed its
    run over (the token kept on the run, the write fenced by token alone), passed every
    check; the ended-run check fails both, and passes the memory backend."""
    from backends.memory import MemoryBackend, _Run
    from lease_core._structures import Lease, RunStatus
    from lease_core.abc import encode_checkpoint
    from lease_core.testing import conformance

    class RenewsAFinishedRun(MemoryBackend):
        """finish() keeps the token and expiry; heartbeat() checks only those."""

        def _finish(self, lease: Lease, status: RunStatus, error: str | None) -> bool:
            run = self._held(lease, self._now())
            if run is None:
                return False
            token, expires = run.token, run.expires_ms
            super()._finish(lease, status, error)
            run.token, run.expires_ms = token, expires
            return True

        def _held(self, lease: Lease, now: int, *, live: bool = False) -> _Run | None:
            run = self._runs.get((lease.job, lease.slot))
            if run is None or run.token != lease.token:
                return None
            if live:  # the heartbeat: a live lease, whatever the run's status
                return run if run.expires_ms is not None and run.expires_ms > now else None
            return run if run.status is RunStatus.RUNNING else None

    class CheckpointsAfterHandOver(MemoryBackend):
        """hand_over() keeps the token on the run; set_checkpoint() checks only it."""

        async def hand_over(self, leases: Sequence[Lease]) -> frozenset[str]:
            tokens = {(x.job, x.slot): x.token for x in leases
                      if self._held(x, self._now()) is not None}
            done = await super().hand_over(leases)
            for key, token in tokens.items():
                self._runs[key].token = token
            return done

        async def set_checkpoint(self, lease: Lease, value: object) -> bool:
            run = self._runs.get((lease.job, lease.slot))
            if run is None or run.token != lease.token:
                return False
            run.checkpoint = encode_checkpoint(value)
            return True

    check = conformance.test_a_run_that_ended_or_was_handed_over_fences_its_last_holder
    with pytest.raises(AssertionError, match=r"heartbeat\(\) renewed the last holder of a "
                                             "run now completed"):
        await check(_store_of(RenewsAFinishedRun()))
    with pytest.raises(AssertionError, match=r"set_checkpoint\(\) wrote for the last holder "
                                             "of a run now handed_over"):
        await check(_store_of(CheckpointsAfterHandOver()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_whose_trimming_deletes_a_run_waiting_to_go_on() -> None:
    """Trimming that looks at each attempt's own end, not at its run, deletes the
    attempts (and the record) of a run handed over or waiting for its retry: it passed
    every check (they trimmed around a running run only); the new check fails it."""
    from backends.memory import MemoryBackend
    from lease_core._structures import RunStatus
    from lease_core.testing import conformance

    class TrimsOpenRunsThatEnded(MemoryBackend):
        """prune_many() takes a run whose last attempt ended for a finished one."""

        async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                             older_than_ms: int | None = None,
                             batch: int = 1000) -> dict[str, int]:
            for run in self._runs.values():
                if run.status in (RunStatus.HANDED_OVER, RunStatus.RETRYING):
                    run.status = RunStatus.FAILED
            return await super().prune_many(jobs, keep=keep, older_than_ms=older_than_ms,
                                            batch=batch)

    check = conformance.test_trimming_keeps_a_handed_over_or_retrying_run_s_attempts
    with pytest.raises(AssertionError, match=r"prune\(keep=1\) deleted the attempts of open "
                                             "runs"):
        await check(_store_of(TrimsOpenRunsThatEnded()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.parametrize("skips_behind", ["expired", "handed_over", "later"])
@pytest.mark.anyio
async def test_the_kit_fails_a_backend_that_skips_behind_a_run_holding_no_live_lease(
        skips_behind: str) -> None:
    """overlap_skip behind an earlier run whose lease expired, one handed over, or a later
    slot's run: each passed every check (the differential test met the last by chance
    only); the new check fails each, naming what it skipped behind."""
    from backends.memory import MemoryBackend
    from lease_core._structures import RunStatus
    from lease_core.testing import conformance

    class SkipsTooOften(MemoryBackend):
        def _earlier_open(self, job: str, slot: int, now: int) -> str | None:
            for (j, s), run in self._runs.items():
                if j != job or s == slot:
                    continue
                if ((skips_behind == "expired" and run.status is RunStatus.RUNNING)
                        or (skips_behind == "handed_over"
                            and run.status is RunStatus.HANDED_OVER)
                        or (skips_behind == "later" and s > slot
                            and run.status is RunStatus.RUNNING)) and (
                        s < slot or skips_behind == "later"):
                    return "an earlier run of the job still holds its lease"
            return super()._earlier_open(job, slot, now)

    behind = {"expired": "an earlier run whose lease expired",
              "handed_over": "an earlier run handed over", "later": "a later slot's run"}
    check = conformance.test_overlap_skip_looks_only_at_earlier_runs_holding_a_live_lease
    with pytest.raises(AssertionError, match=f"overlap_skip skipped .* behind "
                                             rf"{behind[skips_behind]} \(claim\);"):
        await check(_store_of(SkipsTooOften()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_that_leaves_a_handed_over_run_out_of_open_slots() -> None:
    """register_jobs() listing running and retrying runs but not handed-over ones (so a
    scheduler starting after a deploy does not watch them) passed every check but the
    differential test, by chance; the register_jobs check now fails it."""
    import dataclasses

    from backends.memory import MemoryBackend
    from lease_core._structures import JobInfo, RunStatus
    from lease_core.testing import conformance

    class MissesHandedOver(MemoryBackend):
        async def register_jobs(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
            found = await super().register_jobs(jobs)
            return {name: dataclasses.replace(info, open_slots=tuple(
                        s for s in info.open_slots
                        if self._runs[(name, s)].status is not RunStatus.HANDED_OVER))
                    for name, info in found.items()}

    check = conformance.test_register_jobs_reports_first_seen_last_slot_and_open_runs
    with pytest.raises(AssertionError, match="must list a handed-over run's slot"):
        await check(_store_of(MissesHandedOver()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_whose_prune_many_takes_a_negative_age() -> None:
    """A prune_many() of its own taking older_than_ms=-1 as 0 (trimming every finished
    attempt) passed every check: they asked only keep=-1 and batch=0 of it, and
    Backend.prune() validates before it reaches prune_many(). The prune check now asks
    both twins each bad argument."""
    from backends.memory import MemoryBackend
    from lease_core.testing import conformance

    class NegativeAgeIsZero(MemoryBackend):
        async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                             older_than_ms: int | None = None,
                             batch: int = 1000) -> dict[str, int]:
            older_than_ms = None if older_than_ms is None else max(older_than_ms, 0)
            return await super().prune_many(jobs, keep=keep, older_than_ms=older_than_ms,
                                            batch=batch)

    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        await conformance.test_prune_trims_a_job_without_claiming(
            _store_of(NegativeAgeIsZero()))
    await conformance.test_prune_trims_a_job_without_claiming(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_whose_claim_reads_then_writes() -> None:
    """A claim made in two steps (read the run, a round trip, then write it) gives one run
    to every instance that claimed it at once. Every check claimed one call at a time, so
    such a backend passed them all (the differential test too: it makes one call at a
    time); the race check fails it, and passes the memory backend, whose claim is one
    step under its lock."""
    import anyio.lowlevel

    from backends.memory import MemoryBackend
    from lease_core._structures import ClaimRequest, ClaimResult
    from lease_core.testing import conformance

    class ReadThenWriteClaim(MemoryBackend):
        async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
            results = []
            for request in requests:
                with self._lock:
                    found = (request.job, request.slot) in self._runs  # the read
                await anyio.lowlevel.checkpoint()  # the round trip between the two steps
                with self._lock:
                    if not found:  # the write, as decided from the read
                        self._runs.pop((request.job, request.slot), None)
                    results.append(self._claim(request))
            return results

    check = conformance.test_claims_at_once_give_a_run_to_one_instance
    with pytest.raises(AssertionError, match="round 0: 5 instances won one run at once"):
        await check(_store_of(ReadThenWriteClaim()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.asyncio_only  # it waits out the check's 5 s deadline
@pytest.mark.anyio
async def test_the_kit_fails_a_backend_whose_membership_renewal_never_shortens() -> None:
    """A membership renewal that keeps the later of its expiry and now + ttl_ms (or adds
    to what was left) passed: the lapse check renewed with the short ttl only. It now
    renews a long membership with a short ttl first, and fails such a backend (after its
    5 s wait)."""
    from backends.memory import MemoryBackend
    from lease_core.abc import check_members
    from lease_core.testing import conformance

    class NeverShortens(MemoryBackend):
        async def members(self, instance_id: str, ttl_ms: int) -> list[str]:
            check_members(instance_id, ttl_ms)
            with self._lock:
                now = self._now()
                until = max(self._members.get(instance_id, 0), now + ttl_ms)
                self._members[instance_id] = until
                self._members = {m: u for m, u in self._members.items() if u > now}
                return sorted(self._members)

    check = conformance.test_members_drops_a_member_whose_ttl_lapsed
    with pytest.raises(AssertionError, match="shortening a longer membership"):
        await check(_store_of(NeverShortens()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_that_stores_nan_in_a_checkpoint() -> None:
    """A checkpoint encoded with json.dumps' defaults stores NaN and Infinity, which are
    not JSON (PostgreSQL's jsonb and other readers refuse them): it passed, the check
    asking only for an object() to be refused; it now asks NaN and Infinity too."""
    import json

    from backends.memory import MemoryBackend
    from lease_core._structures import Lease
    from lease_core.errors import ConfigurationError
    from lease_core.testing import conformance

    class StoresNaN(MemoryBackend):
        async def set_checkpoint(self, lease: Lease, value: object) -> bool:
            try:
                text = json.dumps(value)  # allow_nan=True, the default
            except (TypeError, RecursionError):
                raise ConfigurationError("checkpoint value is not JSON") from None
            run = self._held(lease, self._now())
            if run is None:
                return False
            run.checkpoint = text
            return True

    check = conformance.test_checkpoint_round_trips_json_and_rejects_other_values
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        await check(_store_of(StoresNaN()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_whose_claim_ignores_a_pause() -> None:
    """The kit checked no operation: a backend with operate() whose claim ignored a paused
    job passed. The pause check fails it, and skips a backend without operations."""
    from backends.memory import MemoryBackend
    from lease_core._structures import ClaimRequest, ClaimResult
    from lease_core.abc import Backend
    from lease_core.operations import Operation, OperationResult
    from lease_core.testing import conformance

    class IgnoresPause(MemoryBackend):
        def _claim(self, req: ClaimRequest) -> ClaimResult:
            job = self._jobs.get(req.job)
            paused_by = None if job is None else job.paused_by
            if job is not None:
                job.paused_by = None
            try:
                return super()._claim(req)
            finally:
                if job is not None:
                    job.paused_by = paused_by

    class NoOperations(MemoryBackend):
        async def operate(self, op: Operation) -> OperationResult:
            return await Backend.operate(self, op)

    check = conformance.test_a_paused_job_s_new_slots_are_skipped_until_it_resumes
    with pytest.raises(AssertionError, match="a scheduled claim of a new slot of a paused "
                                             "job must be skipped"):
        await check(_store_of(IgnoresPause()))
    with pytest.raises(pytest.skip.Exception, match="has no operations"):
        await check(_store_of(NoOperations()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_that_ages_an_attempt_from_its_claim() -> None:
    """Trimming by age that measures an attempt from its claim, not its end, deletes a
    long run's attempt the moment it finishes: it passed (the ttl check's attempts ended
    as they began); the ttl check now finishes one after the ttl and fails it."""
    import dataclasses

    from backends.memory import MemoryBackend
    from lease_core.testing import conformance

    class AgedFromClaim(MemoryBackend):
        async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                             older_than_ms: int | None = None,
                             batch: int = 1000) -> dict[str, int]:
            ended = {job: list(self._attempts.get(job, [])) for job in jobs}
            for job, attempts in ended.items():  # each finished as it was claimed
                self._attempts[job] = [
                    a if a.finished_at is None else dataclasses.replace(
                        a, finished_at=a.claimed_at) for a in attempts]
            counts = await super().prune_many(jobs, keep=keep, older_than_ms=older_than_ms,
                                               batch=batch)
            for job, attempts in ended.items():
                left = {(a.slot, a.attempt) for a in self._attempts.get(job, [])}
                self._attempts[job] = [a for a in attempts if (a.slot, a.attempt) in left]
            return counts

    check = conformance.test_history_is_trimmed_by_ttl
    with pytest.raises(AssertionError, match="an attempt's age runs from its end"):
        await check(_store_of(AgedFromClaim()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.anyio
async def test_the_kit_fails_a_backend_that_lists_the_store_s_history_job_by_job() -> None:
    """history(None, limit) read job by job (each newest first) answers old attempts of
    one job before new ones of another: it passed every check (only the differential
    test, by chance, meets it); the new check fails it."""
    from backends.memory import MemoryBackend
    from lease_core._structures import Attempt
    from lease_core.abc import check_limit
    from lease_core.testing import conformance

    class JobByJob(MemoryBackend):
        async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
            if job is not None:
                return await super().history(job, limit)
            check_limit(limit)
            found = [a for name in sorted(self._attempts)
                     for a in sorted(self._attempts[name], key=lambda a: a.claimed_at,
                                     reverse=True)]
            return found[:limit]

    check = conformance.test_history_of_every_job_is_newest_claim_first
    with pytest.raises(AssertionError, match=r"history\(None, 2\) must be the two newest"):
        await check(_store_of(JobByJob()))
    await check(_store_of(MemoryBackend()))


@pytest.mark.parametrize("rule", ["trimmed", "paused"])
@pytest.mark.anyio
async def test_the_kit_fails_a_claim_many_that_drops_a_rule_claim_keeps(rule: str) -> None:
    """A backend implementing both claim twins is held to the same answers only where a
    check asks both: a claim_many() (what the scheduler sends) that won a trimmed slot
    again, or ignored a pause, while claim() kept the rule, passed. The trimmed-slot and
    pause checks now ask both twins."""
    from backends.memory import MemoryBackend
    from lease_core._structures import ClaimRequest, ClaimResult
    from lease_core.testing import conformance

    field = {"trimmed": "trimmed_slot", "paused": "paused_by"}[rule]

    class BatchDropsARule(MemoryBackend):
        async def claim(self, request: ClaimRequest) -> ClaimResult:
            (result,) = await super().claim_many([request])
            return result

        async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
            kept = {name: getattr(job, field) for name, job in self._jobs.items()}
            for job in self._jobs.values():
                setattr(job, field, None)
            try:
                return await super().claim_many(requests)
            finally:
                for name, value in kept.items():
                    setattr(self._jobs[name], field, value)

    check = {"trimmed": conformance.test_a_trimmed_slot_is_never_won_again,
             "paused": conformance.test_a_paused_job_s_new_slots_are_skipped_until_it_resumes,
             }[rule]
    with pytest.raises(AssertionError, match=r"claim_many"):
        await check(_store_of(BatchDropsARule()))
    await check(_store_of(MemoryBackend()))
