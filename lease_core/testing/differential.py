"""A differential, stateful model test: a store behaves like MemoryBackend.

A hypothesis state machine sends the same random claims, heartbeats, finishes,
failures left to retry (``retry_later``), hand-overs, checkpoint writes and reads, checks,
history and run reads, job registrations, operations (trigger, pause, resume, retry,
cancel) and their reads, history trimming (``prune``), named leases, fleet membership and
clock advances to a real store and to a :class:`MemoryBackend` on an injected clock, and
requires identical observable results (statuses, attempt numbers, reasons, errors,
instances, tokens held, checkpoint values, history outcomes, the order of named leases'
tokens), never exact times. A triggered run's slot is the store's now: each store's is
mapped to the memory store's in what is compared.

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
from lease_core.abc import Attempt, Backend, ClaimRequest, Lease, Outcome, Reason, _implements
from lease_core.operations import Operation, OperationKind
from lease_core.retry import supports_retries

SHORT_MS = 800
LONG_MS = 30_000
#: A step that begins this long after a short lease (re)started first advances the clock.
SAFE_S = 0.3
JOBS = ("a", "b")
SLOTS = (1_000, 2_000, 3_000)
INSTANCES = ("i1", "i2", "i3")
FINAL = (Outcome.COMPLETED, Outcome.FAILED, Outcome.TIMED_OUT)
NAMES = ("n1", "n2")


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


def _attempt_view(a: Attempt, slots: dict[int, int]) -> tuple[Any, ...]:
    return (a.job, slots.get(a.slot, a.slot), a.attempt, a.instance_id, str(a.reason),
            None if a.outcome is None else str(a.outcome), a.finished_at is None, a.error,
            a.requested_by)


def _history_view(attempts: list[Attempt], prefix: str,
                  slots: dict[int, int]) -> list[tuple[Any, ...]]:
    mine = [a for a in attempts if a.job.startswith(prefix)]
    # Newest claim first (ties allowed: a real store's clock may not move between claims).
    assert all(x.claimed_at >= y.claimed_at for x, y in itertools.pairwise(mine)), mine
    return sorted(_attempt_view(a, slots) for a in mine)


def _make_machine(real: Backend, portal: anyio.from_thread.BlockingPortal,
                  counter: Iterator[int]) -> type[RuleBasedStateMachine]:
    class Differential(RuleBasedStateMachine):
        """Each step runs on both backends; their observable results must be equal."""

        def __init__(self) -> None:
            super().__init__()
            self.clock = SteppingClock()
            self.memory = MemoryBackend(clock=self.clock)
            portal.call(self.memory.start)
            # Job names unique to this example: the real store is shared by all examples.
            self.prefix = f"x{next(counter)}-{uuid.uuid4().hex[:6]}-"
            self.leases: list[Lease] = []
            """The leases won, with the memory store's slots (see :meth:`on`)."""
            self.to_real: dict[int, int] = {}
            """A triggered run's slot on the memory store -> its slot on the real one."""
            self.to_mem: dict[int, int] = {}
            self.triggered: list[tuple[str, int]] = []
            """The triggered runs, (job, memory's slot)."""
            self.tokens: dict[tuple[bool, str], list[int]] = {}
            """The named leases' tokens seen, per (real store?, name), in order."""
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

        @staticmethod
        def has(*names: str) -> bool:
            """Whether the real backend implements one of ``names`` (a backend of one's
            own may have no operations, named leases, trimming: those steps are left out)."""
            return any(_implements(type(real), name) for name in names)

        def on(self, backend: Backend, lease: Lease) -> Lease:
            """``lease`` as held on ``backend`` (a triggered run's slot differs)."""
            if backend is self.memory or lease.slot not in self.to_real:
                return lease
            return Lease(lease.job, self.to_real[lease.slot], lease.token, lease.lease_ms)

        def slot_on(self, backend: Backend, slot: int) -> int:
            return slot if backend is self.memory else self.to_real.get(slot, slot)

        def known_runs(self) -> list[tuple[str, int]]:
            """The runs drawn from: those claimed, newest first, then the triggered ones,
            then every fixed slot (memory's slots), so that a draw often finds a run."""
            return list(dict.fromkeys([
                *((x.job, x.slot) for x in reversed(self.leases)), *self.triggered,
                *((self.job(j), s) for j in JOBS for s in SLOTS)]))

        def norm_slot(self, slot: int | None, real_side: bool) -> Any:
            """A slot as compared: a triggered one as memory's; a resume's now as 'now'."""
            if slot is None:
                return None
            if real_side:
                slot = self.to_mem.get(slot, slot)
            return slot if slot in SLOTS or slot in self.to_real else "now"

        def token_rank(self, real_side: bool, name: str, token: int) -> int:
            """A named lease's token as compared: its rank among the name's tokens seen
            on that store (tokens grow with each holder; Redis's start elsewhere)."""
            if token == 0:
                return 0
            seen = self.tokens.setdefault((real_side, name), [])
            if token not in seen:
                seen.append(token)
            assert seen == sorted(seen), f"tokens of {name} did not grow: {seen}"
            return seen.index(token) + 1

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
              overlap_skip=st.booleans(), max_attempts=st.sampled_from([None, 1, 2, 3]),
              catch_up=st.booleans(), scheduled=st.booleans())
        def claim(self, job: str, slot: int, instance: str, short: bool, overlap_skip: bool,
                  max_attempts: int | None, catch_up: bool = False,
                  scheduled: bool = True) -> None:
            self._claim(self.job(job), slot, instance, short, overlap_skip, max_attempts,
                        Reason.CATCH_UP if catch_up else Reason.SCHEDULED, scheduled)

        @rule(index=st.integers(0, 99), instance=st.sampled_from(INSTANCES),
              short=st.booleans(), max_attempts=st.sampled_from([None, 1, 2]))
        def claim_triggered(self, index: int, instance: str, short: bool,
                            max_attempts: int | None) -> None:
            """Claim a triggered run (its slot differs between the stores)."""
            if not self.triggered:
                return
            job, slot = self.triggered[index % len(self.triggered)]
            self._claim(job, slot, instance, short, True, max_attempts, Reason.MANUAL, True)

        def _claim(self, job: str, slot: int, instance: str, short: bool,
                   overlap_skip: bool, max_attempts: int | None, reason: Reason,
                   scheduled: bool) -> None:
            token = f"t{len(self.leases)}-{uuid.uuid4().hex[:8]}"
            lease_ms = SHORT_MS if short else LONG_MS
            request = ClaimRequest(job, slot, instance, token, lease_ms, reason,
                                   overlap_skip=overlap_skip, max_attempts=max_attempts,
                                   scheduled=scheduled)
            mem, got = self.both(lambda b: b.claim(ClaimRequest(
                job, self.slot_on(b, slot), instance, token, lease_ms, reason,
                overlap_skip=overlap_skip, max_attempts=max_attempts, scheduled=scheduled)))
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
            mem, got = self.both(lambda b: b.heartbeat([self.on(b, x) for x in leases]))
            assert got.held == mem.held, f"heartbeat {leases}: real {got}, memory {mem}"
            assert got.cancelled == mem.cancelled, f"heartbeat {leases}: real {got}, memory {mem}"
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
            mem, got = self.both(lambda b: b.finish(self.on(b, lease), outcome, error))
            assert got == mem, f"finish {lease} {outcome}: real {got}, memory {mem}"

        # -- retries within a run (issue 19, part 1)
        @rule(index=st.integers(0, 99), outcome=st.sampled_from(FINAL[1:]),
              delays=st.lists(st.sampled_from([SHORT_MS, LONG_MS]), max_size=2),
              error=st.sampled_from(["again", None, ""]))
        def retry_later(self, index: int, outcome: Outcome, delays: list[int],
                        error: str | None = "again") -> None:
            lease = self.pick(index)
            if lease is None or not supports_retries(real):
                return
            mem, got = self.both(lambda b: b.retry_later([(self.on(b, lease), outcome, error,
                                                            delays)]))
            assert got == mem, f"retry_later {lease} {delays}: real {got}, memory {mem}"
            if mem[0] > 0:
                self._short_restarted(delays[mem[0] - 1])

        @rule(indexes=st.lists(st.integers(0, 99), min_size=1, max_size=3))
        def hand_over(self, indexes: list[int]) -> None:
            leases = self.pick_many(indexes)
            mem, got = self.both(lambda b: b.hand_over([self.on(b, x) for x in leases]))
            assert got == mem, f"hand_over {leases}: real {got}, memory {mem}"

        @rule(index=st.integers(0, 99), value=st.one_of(
                  st.none(), st.integers(0, 9), st.lists(st.text(max_size=3), max_size=2)),
              delete=st.booleans())
        def checkpoint(self, index: int, value: Any, delete: bool) -> None:
            lease = self.pick(index)
            if lease is None:
                return
            if delete:
                mem, got = self.both(lambda b: b.delete_checkpoint(self.on(b, lease)))
            else:
                mem, got = self.both(lambda b: b.set_checkpoint(self.on(b, lease), value))
            assert got == mem, f"checkpoint {lease} {value!r}: real {got}, memory {mem}"

        @rule(job=st.sampled_from(JOBS), slot=st.sampled_from(SLOTS))
        def read_checkpoint(self, job: str, slot: int) -> None:
            mem, got = self.both(lambda b: b.get_checkpoint(self.job(job), slot))
            assert got == mem, f"get_checkpoint {job} {slot}: real {got!r}, memory {mem!r}"

        @rule(runs=st.lists(st.integers(0, 99), min_size=1, max_size=4, unique=True))
        def check(self, runs: list[int]) -> None:
            known = self.known_runs()
            keys = list(dict.fromkeys(known[i % len(known)] for i in runs))
            mem, got = self.both(lambda b: b.check([(j, self.slot_on(b, s)) for j, s in keys]))
            views = [{(k[0], self.to_mem.get(k[1], k[1])):
                      (v.status, v.attempt, v.instance_id, v.claimable(r.now_ms),
                       v.expires_ms is None)
                      for k, v in r.runs.items()} for r in (mem, got)]
            assert views[1] == views[0], f"check {keys}: real {got}, memory {mem}"

        @rule(jobs=st.lists(st.sampled_from(JOBS), min_size=1, max_size=2, unique=True))
        def register(self, jobs: list[str]) -> None:
            names = [self.job(j) for j in jobs]
            mem, got = self.both(lambda b: b.register_jobs(names))
            views = [{k: (self.norm_slot(v.last_slot, real_side),
                          sorted(self.norm_slot(s, real_side) for s in v.open_slots), v.new)
                      for k, v in r.items()}
                     for real_side, r in ((False, mem), (True, got))]
            assert views[1] == views[0], f"register_jobs {names}: real {got}, memory {mem}"

        @rule(job=st.one_of(st.none(), st.sampled_from(JOBS)), open_only=st.booleans())
        def read_runs(self, job: str | None, open_only: bool) -> None:
            name = None if job is None else self.job(job)
            mem, got = self.both(lambda b: b.runs(name, open_only=open_only, limit=10_000))
            views = [sorted((r.job, self.to_mem.get(r.slot, r.slot), str(r.status), r.attempt,
                             r.instance_id, r.expires_ms is None)
                            for r in runs if r.job.startswith(self.prefix))
                     for runs in (mem, got)]
            assert views[1] == views[0], f"runs({name}, {open_only}): real {got}, memory {mem}"

        @rule(job=st.one_of(st.none(), st.sampled_from(JOBS)))
        def history(self, job: str | None) -> None:
            name = None if job is None else self.job(job)
            mem, got = self.both(lambda b: b.history(name, 10_000))
            assert (_history_view(got, self.prefix, self.to_mem)
                    == _history_view(mem, self.prefix, {})), (
                f"history({name}): real {got}, memory {mem}")

        # -- operations (trigger, pause, resume, retry, cancel) and their reads
        @rule(kind=st.sampled_from(list(OperationKind)), job=st.sampled_from(JOBS),
              index=st.integers(0, 99), by=st.sampled_from(INSTANCES),
              grace=st.sampled_from([0, LONG_MS]))
        def operate(self, kind: OperationKind, job: str, index: int, by: str,
                    grace: int) -> None:
            name, slot = self.job(job), None
            if kind in (OperationKind.RETRY, OperationKind.CANCEL):
                known = self.known_runs()
                name, slot = known[index % len(known)]
            op = Operation(kind, name, slot, by, grace if kind is OperationKind.CANCEL else 0)
            if not self.has("operate"):
                return
            mem, got = self.both(lambda b: b.operate(
                op if slot is None else Operation(kind, op.job, self.slot_on(b, slot), by,
                                                  op.grace_ms)))
            views = [(r.refused, r.status, r.slot if slot is not None else r.slot is None)
                     for r in (mem, got)]
            if slot is not None:
                views[1] = (got.refused, got.status, self.to_mem.get(got.slot, got.slot))
            assert views[1] == views[0], f"operate {op}: real {got}, memory {mem}"
            if kind is OperationKind.TRIGGER and mem.refused is None:
                assert mem.slot is not None and got.slot is not None
                self.to_real[mem.slot], self.to_mem[got.slot] = got.slot, mem.slot
                self.triggered.append((op.job, mem.slot))

        @rule()
        def read_operations(self) -> None:
            names = [self.job(j) for j in JOBS]
            if self.has("queued"):
                mem, got = self.both(lambda b: b.queued(names))
                assert [(j, self.to_mem.get(s, s)) for j, s in got] == mem, (
                    f"queued: real {got}, memory {mem}")
            if self.has("paused"):
                mem, got = self.both(lambda b: b.paused())
                mine = [{k: v for k, v in r.items() if k.startswith(self.prefix)}
                        for r in (mem, got)]
                assert mine[1] == mine[0], f"paused: real {got}, memory {mem}"
            if not self.has("heartbeats"):
                return
            keys = self.known_runs()
            mem, got = self.both(lambda b: b.heartbeats(
                [(j, self.slot_on(b, s)) for j, s in keys]))
            views = [{(j, self.to_mem.get(s, s)): at is None for (j, s), at in r.items()}
                     for r in (mem, got)]
            assert views[1] == views[0], f"heartbeats: real {got}, memory {mem}"

        @rule(jobs=st.lists(st.sampled_from(JOBS), min_size=1, max_size=2, unique=True),
              keep=st.sampled_from([None, 0, 1, 2, 4]), batch=st.sampled_from([1, 1000]))
        def prune(self, jobs: list[str], keep: int | None, batch: int) -> None:
            names = [self.job(j) for j in jobs]
            if not self.has("prune", "prune_many"):
                return
            if len(names) == 1:
                mem, got = self.both(lambda b: b.prune(names[0], keep=keep, batch=batch))
            else:
                mem, got = self.both(lambda b: b.prune_many(names, keep=keep, batch=batch))
            assert got == mem, f"prune {names} keep={keep}: real {got}, memory {mem}"

        # -- named leases
        def _lease_view(self, real_side: bool, name: str, answer: Any) -> tuple[Any, ...]:
            return (answer.held, answer.holder, self.token_rank(real_side, name, answer.token),
                    answer.expires_ms > answer.now_ms)

        @rule(name=st.sampled_from(NAMES), holder=st.sampled_from(INSTANCES),
              short=st.booleans())
        def acquire_lease(self, name: str, holder: str, short: bool) -> None:
            ttl = SHORT_MS if short else LONG_MS
            full = self.job(name)
            if not self.has("acquire_lease"):
                return
            mem, got = self.both(lambda b: b.acquire_lease(full, holder, ttl))
            views = [self._lease_view(side, full, r) for side, r in ((False, mem), (True, got))]
            assert views[1] == views[0], f"acquire {full} {holder}: real {got}, memory {mem}"
            if mem.held:
                self._short_restarted(ttl)

        @rule(name=st.sampled_from(NAMES), index=st.integers(0, 9), short=st.booleans(),
              release=st.booleans())
        def renew_or_release_lease(self, name: str, index: int, short: bool,
                                   release: bool) -> None:
            full = self.job(name)
            seen = [self.tokens.get((side, full), []) for side in (False, True)]
            if not seen[0] or len(seen[0]) != len(seen[1]):
                return
            ttl = SHORT_MS if short else LONG_MS

            def token(b: Backend) -> int:
                return seen[b is not self.memory][index % len(seen[0])]
            if release:
                mem, got = self.both(lambda b: b.release_lease(full, token(b)))
                assert got == mem, f"release {full}: real {got}, memory {mem}"
                return
            mem, got = self.both(lambda b: b.renew_lease(full, token(b), ttl))
            assert (got is None) == (mem is None), f"renew {full}: real {got}, memory {mem}"
            if mem is not None:
                self._short_restarted(ttl)

        @rule(name=st.sampled_from(NAMES))
        def read_lease(self, name: str) -> None:
            full = self.job(name)
            if not self.has("read_lease"):
                return
            mem, got = self.both(lambda b: b.read_lease(full))
            views = [self._lease_view(side, full, r) for side, r in ((False, mem), (True, got))]
            assert views[1] == views[0], f"read_lease {full}: real {got}, memory {mem}"

        # -- the fleet's membership
        @rule(instance=st.sampled_from(INSTANCES), short=st.booleans(), leave=st.booleans())
        def members(self, instance: str, short: bool, leave: bool) -> None:
            me, ttl = self.job(instance), SHORT_MS if short else LONG_MS
            if not self.has("members"):
                return
            if leave:
                mem, got = self.both(lambda b: b.leave(me))
                assert got is None and mem is None
                return
            mem, got = self.both(lambda b: b.members(me, ttl))
            mine = [[m for m in r if m.startswith(self.prefix)] for r in (mem, got)]
            assert mine[1] == mine[0], f"members {me}: real {got}, memory {mem}"
            self._short_restarted(ttl)

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
