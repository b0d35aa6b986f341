"""A differential, stateful model test: a store behaves like MemoryBackend.

A hypothesis state machine sends the same random claims, heartbeats, finishes,
failures left to retry (``retry_later``), hand-overs, checkpoint writes and reads, checks,
history and run reads, job registrations and clock advances to a real store and to a
:class:`MemoryBackend` on an injected clock, and requires identical observable results
(statuses, attempt numbers, reasons, instances, tokens held, checkpoint values, history
outcomes), never exact times.

Time: a claim takes a long lease (30 s, which never expires during an example on the
real store) or a short one (0.8 s). "Advance" waits on the real store until every short
lease has expired, and moves the memory clock on by one second, which expires exactly
the short leases there too. A step that begins more than 0.3 s after a short lease
(re)started advances first, so a slow machine never lets a real lease expire early (the
steps drawn do not depend on time; only where the advances fall does).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anyio.from_thread
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from backends.memory import MemoryBackend
from lease_core.abc import Attempt, Backend, ClaimRequest, Lease, Outcome
from lease_core.retry import supports_retries

SHORT_MS = 800
LONG_MS = 30_000
#: A step that begins this long after a short lease (re)started first advances the clock.
SAFE_S = 0.3
JOBS = ("a", "b")
SLOTS = (1_000, 2_000, 3_000)
INSTANCES = ("i1", "i2", "i3")
FINAL = (Outcome.COMPLETED, Outcome.FAILED, Outcome.TIMED_OUT)


class SteppingClock:
    """The memory store's clock: moves 1 ms per reading (as a real one moves between
    calls), and a whole second on :meth:`advance`."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now

    def advance(self) -> None:
        self.now += 1.0


def _attempt_view(a: Attempt) -> tuple[Any, ...]:
    return (a.job, a.slot, a.attempt, a.instance_id, str(a.reason),
            None if a.outcome is None else str(a.outcome), a.finished_at is None)


def _history_view(attempts: list[Attempt], prefix: str) -> list[tuple[Any, ...]]:
    mine = [a for a in attempts if a.job.startswith(prefix)]
    # Newest claim first (ties allowed: a real store's clock may not move between claims).
    assert all(x.claimed_at >= y.claimed_at for x, y in itertools.pairwise(mine)), mine
    return sorted(_attempt_view(a) for a in mine)


def _make_machine(real: Backend, portal: anyio.from_thread.BlockingPortal,
                  counter: Iterator[int]) -> type[RuleBasedStateMachine]:
    class Differential(RuleBasedStateMachine):
        """Each step runs on both backends; their observable results must be equal."""

        def __init__(self) -> None:
            super().__init__()
            self.clock = SteppingClock()
            self.memory = MemoryBackend(clock=self.clock)
            # Job names unique to this example: the real store is shared by all examples.
            self.prefix = f"x{next(counter)}-{uuid.uuid4().hex[:6]}-"
            self.leases: list[Lease] = []
            self.short_started: float | None = None
            """When the first live short lease since the last advance (re)started."""
            self.short_latest = 0.0

        def both(self, call: Callable[[Backend], Any]) -> tuple[Any, Any]:
            self.settle()

            async def on(backend: Backend) -> Any:
                return await call(backend)
            memory = anyio.run(on, self.memory)
            return memory, portal.call(on, real)

        def job(self, name: str) -> str:
            return self.prefix + name

        def _short_restarted(self, lease_ms: int) -> None:
            if lease_ms == SHORT_MS:
                now = time.monotonic()
                if self.short_started is None:
                    self.short_started = now
                self.short_latest = now

        def settle(self) -> None:
            """Advance first when a live short lease is too old to stay live reliably."""
            if (self.short_started is not None
                    and time.monotonic() - self.short_started >= SAFE_S):
                self.advance()

        def pick(self, index: int) -> Lease | None:
            # An index, not sampled_from(self.leases): which claims won may depend on
            # where the advances fell, and the draws must not.
            return self.leases[index % len(self.leases)] if self.leases else None

        def pick_many(self, indexes: list[int]) -> list[Lease]:
            if not self.leases:
                return []
            return list({id(x): x for x in (self.leases[i % len(self.leases)]
                                             for i in indexes)}.values())

        @initialize()
        def start(self) -> None:
            anyio.run(self.memory.start)

        @rule(job=st.sampled_from(JOBS), slot=st.sampled_from(SLOTS),
              instance=st.sampled_from(INSTANCES), short=st.booleans(),
              overlap_skip=st.booleans(), max_attempts=st.sampled_from([None, 1, 2, 3]))
        def claim(self, job: str, slot: int, instance: str, short: bool, overlap_skip: bool,
                  max_attempts: int | None) -> None:
            token = f"t{len(self.leases)}-{uuid.uuid4().hex[:8]}"
            lease_ms = SHORT_MS if short else LONG_MS
            request = ClaimRequest(self.job(job), slot, instance, token, lease_ms,
                                   overlap_skip=overlap_skip, max_attempts=max_attempts)
            mem, got = self.both(lambda b: b.claim(request))
            view = [(r.status, r.attempt, r.reason, r.run_status, r.instance_id,
                     r.expires_ms is None) for r in (mem, got)]
            assert view[1] == view[0], f"claim {request}: real {got}, memory {mem}"
            if str(mem.status) == "won":
                lease = Lease(request.job, slot, token, lease_ms)
                self.leases.append(lease)
                self._short_restarted(lease_ms)

        @rule(indexes=st.lists(st.integers(0, 99), max_size=4))
        def heartbeat(self, indexes: list[int]) -> None:
            leases = self.pick_many(indexes)
            mem, got = self.both(lambda b: b.heartbeat(leases))
            assert got.held == mem.held, f"heartbeat {leases}: real {got}, memory {mem}"
            real_renewed = got.held if got.renewed is None else got.renewed
            mem_renewed = mem.held if mem.renewed is None else mem.renewed
            assert real_renewed == mem_renewed
            for lease in leases:
                if lease.token in mem_renewed:
                    self._short_restarted(lease.lease_ms)

        @rule(index=st.integers(0, 99), outcome=st.sampled_from(FINAL))
        def finish(self, index: int, outcome: Outcome) -> None:
            lease = self.pick(index)
            if lease is None:
                return
            error = None if outcome is Outcome.COMPLETED else f"{outcome} on purpose"
            mem, got = self.both(lambda b: b.finish(lease, outcome, error))
            assert got == mem, f"finish {lease} {outcome}: real {got}, memory {mem}"

        # -- retries within a run (issue 19, part 1)
        @rule(index=st.integers(0, 99), outcome=st.sampled_from(FINAL[1:]),
              delays=st.lists(st.sampled_from([SHORT_MS, LONG_MS]), max_size=2))
        def retry_later(self, index: int, outcome: Outcome, delays: list[int]) -> None:
            lease = self.pick(index)
            if lease is None or not supports_retries(real):
                return
            mem, got = self.both(lambda b: b.retry_later([(lease, outcome, "again", delays)]))
            assert got == mem, f"retry_later {lease} {delays}: real {got}, memory {mem}"
            if mem[0] > 0:
                self._short_restarted(delays[mem[0] - 1])

        @rule(indexes=st.lists(st.integers(0, 99), min_size=1, max_size=3))
        def hand_over(self, indexes: list[int]) -> None:
            leases = self.pick_many(indexes)
            mem, got = self.both(lambda b: b.hand_over(leases))
            assert got == mem, f"hand_over {leases}: real {got}, memory {mem}"

        @rule(index=st.integers(0, 99), value=st.one_of(
                  st.none(), st.integers(0, 9), st.lists(st.text(max_size=3), max_size=2)),
              delete=st.booleans())
        def checkpoint(self, index: int, value: Any, delete: bool) -> None:
            lease = self.pick(index)
            if lease is None:
                return
            if delete:
                mem, got = self.both(lambda b: b.delete_checkpoint(lease))
            else:
                mem, got = self.both(lambda b: b.set_checkpoint(lease, value))
            assert got == mem, f"checkpoint {lease} {value!r}: real {got}, memory {mem}"

        @rule(job=st.sampled_from(JOBS), slot=st.sampled_from(SLOTS))
        def read_checkpoint(self, job: str, slot: int) -> None:
            mem, got = self.both(lambda b: b.get_checkpoint(self.job(job), slot))
            assert got == mem, f"get_checkpoint {job} {slot}: real {got!r}, memory {mem!r}"

        @rule(runs=st.lists(st.tuples(st.sampled_from(JOBS), st.sampled_from(SLOTS)),
                            min_size=1, max_size=4, unique=True))
        def check(self, runs: list[tuple[str, int]]) -> None:
            keys = [(self.job(j), s) for j, s in runs]
            mem, got = self.both(lambda b: b.check(keys))
            views = [{k: (v.status, v.attempt, v.instance_id, v.claimable(r.now_ms))
                      for k, v in r.runs.items()} for r in (mem, got)]
            assert views[1] == views[0], f"check {keys}: real {got}, memory {mem}"

        @rule(jobs=st.lists(st.sampled_from(JOBS), min_size=1, max_size=2, unique=True))
        def register(self, jobs: list[str]) -> None:
            names = [self.job(j) for j in jobs]
            mem, got = self.both(lambda b: b.register_jobs(names))
            views = [{k: (v.last_slot, sorted(v.open_slots), v.new) for k, v in r.items()}
                     for r in (mem, got)]
            assert views[1] == views[0], f"register_jobs {names}: real {got}, memory {mem}"

        @rule(job=st.one_of(st.none(), st.sampled_from(JOBS)), open_only=st.booleans())
        def read_runs(self, job: str | None, open_only: bool) -> None:
            name = None if job is None else self.job(job)
            mem, got = self.both(lambda b: b.runs(name, open_only=open_only, limit=10_000))
            views = [sorted((r.job, r.slot, str(r.status), r.attempt, r.instance_id)
                            for r in runs if r.job.startswith(self.prefix))
                     for runs in (mem, got)]
            assert views[1] == views[0], f"runs({name}, {open_only}): real {got}, memory {mem}"

        @rule(job=st.one_of(st.none(), st.sampled_from(JOBS)))
        def history(self, job: str | None) -> None:
            name = None if job is None else self.job(job)
            mem, got = self.both(lambda b: b.history(name, 10_000))
            assert _history_view(got, self.prefix) == _history_view(mem, self.prefix), (
                f"history({name}): real {got}, memory {mem}")

        @rule()
        def advance(self) -> None:
            """Let every short lease expire, on both stores."""
            if self.short_started is not None:
                wait = self.short_latest + SHORT_MS / 1000 + 0.05 - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            self.clock.advance()
            self.short_started = None

        @invariant()
        def same_jobs(self) -> None:
            mem, got = self.both(lambda b: b.jobs())
            mine = [[j for j in jobs if j.startswith(self.prefix)] for jobs in (mem, got)]
            assert mine[1] == mine[0]

        def teardown(self) -> None:
            anyio.run(self.memory.close)

    return Differential


def run_differential(real: Backend, *, max_examples: int = 40, step_count: int = 30) -> None:
    """Run random programs of backend calls on ``real`` and on a memory model; fail on a
    difference.

    ``real`` is a backend object that is not started: it is started on an asyncio loop in a
    thread of its own, shared by every example (each example's jobs have a prefix of their
    own, so the store need not be empty), and closed at the end. Up to ``max_examples``
    programs of up to ``step_count`` steps run; a difference raises ``AssertionError``
    naming the call and both answers, after hypothesis has shrunk the program. Call it
    from synchronous code (a plain test function), not from a running event loop.
    """
    with anyio.from_thread.start_blocking_portal() as portal:
        portal.call(real.start)
        try:
            machine = _make_machine(real, portal, itertools.count())
            run_state_machine_as_test(machine, settings=settings(
                max_examples=max_examples, stateful_step_count=step_count, deadline=None,
                suppress_health_check=list(HealthCheck),
            ))
        finally:
            portal.call(real.close)
