"""The chaos coordinator: starts a store, proxies and worker processes, injects faults,
then audits the store and the workers' records.

One :func:`run_chaos` call covers one store kind. Faults are drawn from a seeded RNG, one
at a time, for ``seconds``; then the faults stop, the fleet runs ``settle_leases`` more
leases, every worker stops gracefully, and :func:`audit` checks the invariants.

The fleet churns: a fault on a worker hits the member ranked first for a job drawn at
random (the coordinator ranks the live instances as the workers do), and workers join
(a new process, a new proxy) and leave (a graceful stop, not replaced) between
``min_workers`` and ``max_workers``.

An operator acts too, beside the faults, from its own thread and RNG (so the faults'
draws are the same with or without it): ``cancels`` times, evenly over the faults'
window, it cancels a running run drawn at random through the store
(:class:`~lease_core.Admin`, as ``chaos``; recorded as a fault ``cancel``). Every other
cancel (the first, the third, ...) is made earlier, as soon as a worker is stopped
(SIGSTOP) or partitioned after the cancel before it, of a run that worker holds: its
holder cannot hear the cancel, and its lease lapses before it can (with no such run
by the cancel's time, it cancels any run then). The audit checks that no attempt of a
cancelled run starts after the cancel, none completes it, and it stays ``cancelled``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from lease_core import Admin, Attempt, OperationRefused, Outcome, backend_from_url
from lease_core.abc import Backend, RunInfo, RunStatus
from lease_core.engine.fleet import rendezvous_rank

from .proxy import Proxy
from .stores import ChaosStore, PostgresChaosStore, make_store

__all__ = ["FAULTS", "ChaosConfig", "Fault", "Observed", "Report", "audit", "judge", "run_chaos"]

#: The faults a run draws from.
FAULTS = ("kill", "stop", "partition", "restart", "skew", "join", "leave", "zombie")
#: The faults that hit one worker: each hits the first-ranked member of a random job.
ON_OWNER = ("kill", "stop", "partition", "skew", "leave", "zombie")
#: Seconds a ``zombie`` fault waits for its worker to reach the fenced write it asked for.
ZOMBIE_WAIT_S = 2.0
SKEW_S = 3600.0
#: Seconds a restarted store may take to answer again before the run goes on regardless.
RESTART_RECOVERY_S = 30.0
_FINAL = (Outcome.COMPLETED, Outcome.FAILED, Outcome.TIMED_OUT)
#: The job that fails transiently and is retried within its run (see tests/chaos/worker.py).
FLAKY_JOB = "flaky"


@dataclass
class ChaosConfig:
    """One chaos run on one store."""

    store: str
    seconds: float = 30.0
    """How long faults are injected."""
    workers: int = 4
    jobs: int = 10
    interval_ms: int = 600
    lease: float = 1.5
    heartbeat: float = 0.3
    steps: int = 4
    """Checkpointed steps of each handler; with ``step_s``, a handler lasts about 0.5 s,
    so a faulted worker usually holds a run or two."""
    step_s: float = 0.1
    seed: int = 1
    settle_leases: int = 4
    """Leases to wait after the faults stop; runs older than that must have ended."""
    drain_s: float = 30.0
    """How much longer to wait, at most, for those runs on a slow machine."""
    faults: tuple[str, ...] = FAULTS
    first: tuple[str, ...] = ()
    """Fault kinds injected first, in this order, before the random draws (so a short
    run is sure to include them)."""
    min_workers: int = 2
    """``leave`` is not drawn when only this many workers run."""
    max_workers: int = 6
    """``join`` is not drawn when this many workers run."""
    gap: tuple[float, float] = (0.4, 1.2)
    """Seconds between the end of one fault and the start of the next."""
    proxy: bool = True
    """Workers connect through their proxy; without it, partitions are not injected."""
    verbose: bool = False
    """Workers log the library's INFO records (claims, retries, leases lost) to their
    ``.stderr`` file in the run's directory."""

    flaky: bool = True
    """Workers also run :data:`FLAKY_JOB`, whose every other run fails transiently and is
    retried within its run (``retry=``)."""
    cancels: int = 2
    """How many running runs the operator cancels during the faults (evenly spread)."""

    spread: bool = False
    """Spread the jobs' slots evenly over the interval (offsets) instead of all together."""

    def offset_ms(self, n: int) -> int:
        """The slot offset of job ``n`` (0 unless :attr:`spread`)."""
        return n * self.interval_ms // self.jobs if self.spread else 0

    @property
    def slots_per_second(self) -> float:
        """How many slots the jobs schedule per second, together."""
        return self.jobs * 1000 / self.interval_ms


@dataclass
class Fault:
    """One injected fault: what, on which instance (or the store), and when (wall time)."""

    kind: str
    target: str
    start: float
    end: float = 0.0
    jobs: tuple[str, ...] = ()
    """The jobs the target ranked first for among the live instances, when it was hit."""
    run: tuple[str, int] | None = None
    """A ``cancel``'s run, when the store made the cancel (``None``: refused, or no run
    was running)."""
    holder: str = ""
    """A ``cancel``'s: the instance holding the run, when it was stopped or partitioned
    (``""`` otherwise)."""


@dataclass
class Report:
    """What a run measured; ``violations`` lists every broken invariant with its runs."""

    store: str
    version: str = ""
    seconds: float = 0.0
    wall_s: float = 0.0
    slots: int = 0
    attempts: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    double_completions: list[tuple[str, int]] = field(default_factory=list)
    double_fenced: list[tuple[str, int]] = field(default_factory=list)
    stale_finish: list[tuple[str, int, int]] = field(default_factory=list)
    stale_checkpoint: list[tuple[str, int, int]] = field(default_factory=list)
    stale_transaction: list[tuple[str, int, int]] = field(default_factory=list)
    checkpoint_backwards: list[tuple[str, int, int]] = field(default_factory=list)
    left_running: list[tuple[str, int, str]] = field(default_factory=list)
    handed_over_at_shutdown: int = 0
    fenced_effects: int = 0
    unfenced_started_twice: int = 0
    unfenced_done_twice: int = 0
    runs_with_handler: int = 0
    takeovers: int = 0
    takeover_latency: list[float] = field(default_factory=list)
    late_takeovers: list[tuple[str, int, int, float]] = field(default_factory=list)
    retries: int = 0
    """Attempts made by retry (reason ``retry``)."""
    fences_repeated: list[tuple[str, int, int]] = field(default_factory=list)
    """Runs where an attempt that ran got a fence (``ctx.fence``) not above the fence of
    every attempt that started before it: (job, slot, fence) (an invariant: none)."""
    lost_claims: list[tuple[str, int, int, str]] = field(default_factory=list)
    """Claims the store acknowledged as won but lost: no such attempt (attempt, instance)
    in its history after the run: (job, slot, attempt, instance)."""
    lost_finishes: list[tuple[str, int, int, str]] = field(default_factory=list)
    """Finishes the store acknowledged but lost: the attempt's record shows no outcome, or
    another one."""
    lost_checkpoints: list[tuple[str, int, int]] = field(default_factory=list)
    """Checkpoints that went backwards because a checkpoint acknowledged in a failover's
    window was lost with it (moved out of :attr:`checkpoint_backwards`)."""
    lost_effects: list[tuple[str, int, int, str]] = field(default_factory=list)
    """Fenced transactions (PostgreSQL) committed in a failover's window whose effect row
    the store no longer has, because the failover lost it with the run's finish (moved out
    of :attr:`double_fenced` and :attr:`stale_transaction`; pglossy)."""
    lost_cancels: list[tuple[str, int]] = field(default_factory=list)
    """Cancels the store acknowledged in a failover's window and lost with it: no attempt
    of the run is ``cancelled`` (not judged as cancelled runs; pglossy)."""
    lost_unexplained: list[tuple[str, int, int, str]] = field(default_factory=list)
    """Of the lost commits, those acknowledged outside every failover's window (from
    :data:`LOSS_WINDOW_S` before the primary was killed to the promotion): an invariant,
    none."""
    lease_overlaps: list[tuple[str, int, int]] = field(default_factory=list)
    """Attempts won while another attempt of the run surely held a live lease: the store
    acknowledged a claim or renewal whose expiry (store clock) was still ahead, and that
    attempt had not ended by itself (completed, failed, timed out, handed over) before
    this claim: (job, slot, attempt won) (an invariant: none)."""
    retry_overlaps: list[tuple[str, int, int]] = field(default_factory=list)
    """Retries that began before the attempt they retry had ended: claimed before its
    failure was recorded, after an attempt that did not fail, or whose handler started
    before the failed handler's last record (an invariant: none)."""
    handover_latency: list[float] = field(default_factory=list)
    missed_slots: int = 0
    missed_lost_commit: int = 0
    """Of :attr:`missed_slots`, those whose claim or skip the store acknowledged in a
    failover's window (a lost commit, explained by it; sentinelfix)."""
    missed_store_unreachable: int = 0
    """Of :attr:`missed_slots`, those from which the store answered no request until the
    job's next slot was due (see :class:`StoreProbe`)."""
    cancels: int = 0
    """Runs cancelled through the store while the fleet ran them."""
    cancels_of_frozen: int = 0
    """Of :attr:`cancels`, runs whose holder was stopped or partitioned at the cancel."""
    cancelled_taken_over: list[tuple[str, int, int]] = field(default_factory=list)
    """Attempts of a cancelled run claimed after the cancel (an invariant: none)."""
    cancelled_completed: list[tuple[str, int, str]] = field(default_factory=list)
    """Cancelled runs that some attempt completed, or whose status is not ``cancelled``
    (an invariant: none)."""
    missed_while_answered: list[tuple[str, int]] = field(default_factory=list)
    """The other missed slots: the store answered the probe before the job's next slot
    was due, and nobody claimed the slot (an invariant: none)."""
    zombie_writes: int = 0
    """Fenced writes (``zombie`` faults) sent as their process resumed after another
    attempt of the run had been claimed: a superseded attempt's writes, which the store
    must refuse (the invariant rows count any it accepted)."""
    owner_faults: int = 0
    """Faults that hit the member ranked first for at least one job, as the store's history
    shows it: the member that claimed the job's latest slot before the fault first."""
    claim_delay: list[float] = field(default_factory=list)
    """Seconds from each run's slot to its first attempt's claim (store clock)."""
    worker_exits: list[str] = field(default_factory=list)
    start_retries: int = 0
    skewed_completions: int = 0
    open_at_shutdown: int = 0
    """Runs still ``running`` (lease lapsed) after every worker stopped, newer than the
    horizon: a later start takes them over."""
    recovery_s: float = 0.0
    """From the end of the faults until no run older than the horizon was open."""
    """Runs completed by a worker whose clock was an hour off."""

    @property
    def injected(self) -> int:
        """How many faults the coordinator injected (the operator's cancels, the failovers
        a replicated store made by itself, and ``zombie`` faults that found no write to
        stop before, aside)."""
        return sum(n for kind, n in self.faults.items()
                   if kind not in ("cancel", "failover-own", "zombie-idle"))

    @property
    def violations(self) -> dict[str, list[Any]]:
        """Each invariant that broke, with the (job, slot[, attempt]) of its runs."""
        found = {
            "double completions": self.double_completions,
            "two attempts holding a live lease at once": self.lease_overlaps,
            "double fenced effects": self.double_fenced,
            "finish from a superseded attempt": self.stale_finish,
            "checkpoint from a superseded attempt": self.stale_checkpoint,
            "transaction from a superseded attempt": self.stale_transaction,
            "checkpoint went backwards": self.checkpoint_backwards,
            "runs left running": self.left_running,
            "slots never claimed while the store answered": self.missed_while_answered,
            "retry overlapping the attempt it retries": self.retry_overlaps,
            "cancelled runs taken over": self.cancelled_taken_over,
            "cancelled runs completed": self.cancelled_completed,
            "fence numbers issued twice": self.fences_repeated,
            "lost commits not explained by a failover": self.lost_unexplained,
        }
        return {k: v for k, v in found.items() if v}

    def percentile(self, values: list[float], q: float) -> float | None:
        """The ``q`` quantile (0..1) of ``values``, nearest rank; ``None`` when empty."""
        if not values:
            return None
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    def summary(self) -> dict[str, Any]:
        """The figures as plain data (for RESULTS.md and the CLI)."""
        def ms(v: float | None) -> int | None:
            return None if v is None else round(v * 1000)
        return {
            "store": self.store, "version": self.version,
            "fault_seconds": round(self.seconds, 1),
            "wall_seconds": round(self.wall_s, 1), "slots": self.slots,
            "attempts": self.attempts, "faults": self.faults, "outcomes": self.outcomes,
            "violations": {k: len(v) for k, v in self.violations.items()},
            "violation_examples": {k: [list(x) for x in v[:5]]
                                   for k, v in self.violations.items()},
            "double_completions": len(self.double_completions),
            "lease_overlaps": len(self.lease_overlaps),
            "double_fenced_effects": len(self.double_fenced),
            "stale_finish": len(self.stale_finish),
            "stale_checkpoint": len(self.stale_checkpoint),
            "stale_transaction": len(self.stale_transaction),
            "checkpoint_backwards": len(self.checkpoint_backwards),
            "left_running": len(self.left_running),
            "handed_over_at_shutdown": self.handed_over_at_shutdown,
            "fenced_effects": self.fenced_effects,
            "runs_with_handler": self.runs_with_handler,
            "unfenced_started_twice": self.unfenced_started_twice,
            "unfenced_done_twice": self.unfenced_done_twice,
            "takeovers": self.takeovers,
            "takeovers_measured": len(self.takeover_latency),
            "takeover_p50_ms": ms(self.percentile(self.takeover_latency, 0.5)),
            "takeover_p99_ms": ms(self.percentile(self.takeover_latency, 0.99)),
            "takeover_max_ms": ms(max(self.takeover_latency, default=None)),
            "late_takeovers": len(self.late_takeovers),
            "retries": self.retries,
            "retry_overlaps": len(self.retry_overlaps),
            "handover_p50_ms": ms(self.percentile(self.handover_latency, 0.5)),
            "handover_p99_ms": ms(self.percentile(self.handover_latency, 0.99)),
            "missed_slots": self.missed_slots,
            "missed_store_unreachable": self.missed_store_unreachable,
            "missed_lost_commit": self.missed_lost_commit,
            "missed_while_answered": len(self.missed_while_answered),
            "owner_faults": self.owner_faults,
            "zombie_writes": self.zombie_writes,
            "claim_delay_p50_ms": ms(self.percentile(self.claim_delay, 0.5)),
            "claim_delay_p99_ms": ms(self.percentile(self.claim_delay, 0.99)),
            "claim_delay_max_ms": ms(max(self.claim_delay, default=None)),
            "start_retries": self.start_retries,
            "skewed_completions": self.skewed_completions,
            "open_at_shutdown": self.open_at_shutdown,
            "recovery_s": round(self.recovery_s, 1),
            "cancels": self.cancels,
            "cancels_of_frozen": self.cancels_of_frozen,
            "cancelled_taken_over": len(self.cancelled_taken_over),
            "cancelled_completed": len(self.cancelled_completed),
            "fences_repeated": len(self.fences_repeated),
            "lost_claims": len(self.lost_claims),
            "lost_finishes": len(self.lost_finishes),
            "lost_checkpoints": len(self.lost_checkpoints),
            "lost_effects": len(self.lost_effects),
            "lost_cancels": len(self.lost_cancels),
            "lost_unexplained": len(self.lost_unexplained),
        }


# --------------------------------------------------------------------------- workers


def stopped(pid: int) -> bool:
    """True while the process ``pid`` is stopped (SIGSTOP, by itself or not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def freeze_before(pid: int, request: Path, write: str, timeout: float) -> bool:
    """Ask the worker ``pid`` to stop itself just before its next fenced ``write`` (``cp``,
    ``tx``, ``fin``), through the file ``request`` it watches
    (:class:`tests.chaos.worker.Freezer`); True once it did, False when it made no such
    write within ``timeout`` seconds (the request is withdrawn)."""
    staged = request.with_suffix(".staged")
    staged.write_text(write)
    staged.rename(request)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopped(pid):
            return True
        time.sleep(0.01)
    try:
        request.unlink()  # withdrawn: not taken
    except FileNotFoundError:
        # taken just now: the process stops itself at once
        deadline = time.monotonic() + 2.0
        while not stopped(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        return stopped(pid)
    return False


def _read_line(stream: Any, into: list[bytes]) -> None:
    into.append(stream.readline())


class Worker:
    """One worker slot: a proxy that lives for the whole run, and its current process."""

    def __init__(self, index: int, store: ChaosStore, config: ChaosConfig, logdir: Path) -> None:
        self.index = index
        self.store = store
        self.config = config
        self.logdir = logdir
        self.proxy = Proxy(store.port)
        self.proxy.start()
        self.generation = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.instance = ""
        self.skew = 0.0
        self.exits: list[str] = []
        self.restarts = 0
        self.skews: dict[str, float] = {}
        """The clock skew of each instance this slot ran."""
        """Starts that failed (store unreachable at start-up) and were retried."""

    def launch(self, skew: float = 0.0) -> None:
        """Start a new process (a new instance id) without waiting for it."""
        self.generation += 1
        self.skew = skew
        self.instance = f"w{self.index}.{self.generation}"
        self.skews[self.instance] = skew
        c = self.config
        payload = {
            "url": self.store.url(self.proxy.port if c.proxy else self.store.port),
            "options": self.store.options(),
            "instance": self.instance, "lease": f"{c.lease}s", "heartbeat": f"{c.heartbeat}s",
            "steps": c.steps, "step_s": c.step_s, "fenced": self.store.fenced_transactions,
            "jobs": [[f"job{n}", c.interval_ms, "skip" if n % 2 else "allow",
                      c.offset_ms(n)] for n in range(c.jobs)],
            "log": str(self.logdir / f"{self.instance}.jsonl"), "skew": skew,
            "freeze": str(self.freeze_path),
            "grace": "5s", "verbose": c.verbose, "flaky": c.flaky,
        }
        self.stderr = open(self.logdir / f"{self.instance}.stderr", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.worker", json.dumps(payload)],
            stdout=subprocess.PIPE, stderr=self.stderr, cwd=Path(__file__).parents[2],
        )

    def wait_started(self, timeout: float = 60.0) -> None:
        """Block until the process printed ``started``.

        A worker whose store is unreachable when it starts (just after a store restart)
        exits; like a process manager would, start it again until ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            proc = self.proc
            assert proc is not None and proc.stdout is not None
            stdout = proc.stdout
            line: list[bytes] = []
            reader = threading.Thread(target=_read_line, args=(stdout, line), daemon=True)
            reader.start()
            reader.join(max(0.1, deadline - time.monotonic()))
            if line and line[0].strip() == b"started":
                return
            err = (self.logdir / f"{self.instance}.stderr").read_text(errors="replace")[-3000:]
            if time.monotonic() >= deadline:
                # Reported, not raised: the run goes on (the process may start later).
                self.exits.append(f"{self.instance}: did not start within {timeout:g}s "
                                  f"{err[-500:]}")
                return
            self.reap(10, note=False)
            self.restarts += 1
            time.sleep(0.2)
            self.launch(self.skew)

    @property
    def freeze_path(self) -> Path:
        """Where a ``zombie`` fault asks the current process to stop before a fenced write
        (see :class:`tests.chaos.worker.Freezer`)."""
        return self.logdir / f"{self.instance}.freeze"

    def freeze_before(self, write: str, timeout: float) -> bool:
        """Ask the current process to stop itself just before its next fenced ``write``
        (see :func:`freeze_before`)."""
        assert self.proc is not None
        return freeze_before(self.proc.pid, self.freeze_path, write, timeout)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the current process."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def reap(self, timeout: float, note: bool = True) -> None:
        """Wait for the process to end (SIGKILL after ``timeout``), noting how it ended."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            self.exits.append(f"{self.instance}: did not stop within {timeout:g}s")
        else:
            if note and code not in (0, -signal.SIGKILL):
                self.exits.append(f"{self.instance}: exit code {code}")
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()
        self.proc = None

    def close(self) -> None:
        """Kill the process if still running, and close the proxy."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.reap(10)
        self.proxy.close()


class StoreProbe:
    """A thread that sends the store a trivial request every ``period`` seconds, through the
    endpoint the workers use (PgBouncer for ``pgbouncer``), and records when it answered.

    Tells the audit when the store itself was unreachable (a restart, and behind PgBouncer
    its ``server_login_retry`` after a failed reconnect), whatever the workers did.
    """

    def __init__(self, store: ChaosStore, period: float = 0.05) -> None:
        self.store = store
        self.period = period
        self.answers: list[tuple[float, float]] = []
        """(sent, answered) wall times of the requests the store answered."""
        self.failures = 0
        self._answered = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="store-probe")

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.time()
            try:
                self.store.ping()
            except Exception:
                self.failures += 1
            else:
                with self._answered:
                    self.answers.append((sent, time.time()))
                    self._answered.notify_all()
            self._stop.wait(self.period)

    def wait_answer(self, sent_after: float, timeout: float) -> float | None:
        """Wait until the store answers a request sent after ``sent_after`` (wall time);
        return when it answered, or ``None`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._answered:
            while True:
                if self.answers and self.answers[-1][0] > sent_after:
                    return next(done for sent, done in self.answers if sent > sent_after)
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return None
                self._answered.wait(min(left, 0.5))

    def start(self) -> None:
        """Start probing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop probing (waits for the request in flight)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


# --------------------------------------------------------------------------- the run


def _read_store(store: ChaosStore, fn: Any) -> Any:
    """Run ``await fn(backend)`` on a direct (unproxied) backend of ``store``."""
    async def go() -> Any:
        backend = backend_from_url(store.url(store.port), **store.options())
        await backend.start()
        try:
            return await fn(backend)
        finally:
            await backend.close()
    return anyio.run(go)


def _owner(rng: random.Random, workers: list[Worker], config: ChaosConfig,
           kind: str = "") -> tuple[Worker, tuple[str, ...]]:
    """The worker ranked first for a random job among the live ones, and its jobs.

    A ``leave`` never takes the worker whose clock is skewed from the start (worker 0,
    while another is left to rank first): the check that a skewed clock changes nothing
    needs it to go on running.
    """
    members = tuple(sorted(w.instance for w in workers))
    jobs = [f"job{n}" for n in range(config.jobs)]

    def owner_of(job: str) -> Worker:
        return next(w for w in workers if rendezvous_rank(job, w.instance, members) == 0)

    if kind == "leave":
        kept = [j for j in jobs if not (owner_of(j).index == 0 and owner_of(j).skew)]
        jobs = kept or jobs
    job = rng.choice(jobs)
    worker = owner_of(job)
    owned = tuple(j for j in jobs if rendezvous_rank(j, worker.instance, members) == 0)
    return worker, owned


def _kinds(config: ChaosConfig, workers: list[Worker]) -> list[str]:
    """The fault kinds that can be drawn now (joins and leaves keep the fleet's bounds)."""
    proxied = not workers or workers[0].store.proxied
    return [k for k in config.faults
            if ((config.proxy and proxied) or k != "partition")
            and (k != "join" or len(workers) < config.max_workers)
            and (k != "leave" or len(workers) > config.min_workers)]


class Frozen:
    """The instances stopped (SIGSTOP) or partitioned now, shared by the coordinator, which
    injects those faults, and the :class:`Operator`, which cancels their runs."""

    def __init__(self) -> None:
        self._instances: set[str] = set()
        self._reserved: set[str] = set()
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def during(self, instance: str, reserved: bool = False) -> Any:
        """``instance`` is frozen for the ``with`` block; ``reserved``: its runs are the
        coordinator's own (a zombie fault's), which the operator neither waits for nor
        cancels."""
        into = self._reserved if reserved else self._instances
        with self._changed:
            into.add(instance)
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                into.discard(instance)

    def reserved(self) -> frozenset[str]:
        """The instances whose runs the operator leaves alone now."""
        with self._changed:
            return frozenset(self._reserved)

    def wait(self, timeout: float) -> frozenset[str]:
        """The instances frozen now, waiting up to ``timeout`` seconds for one."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._instances), max(0.0, timeout))
            return frozenset(self._instances)


def _inject(rng: random.Random, kind: str, workers: list[Worker], store: ChaosStore,
            config: ChaosConfig, skew_sign: list[float], probe: StoreProbe,
            retired: list[Worker], frozen: Frozen | None = None,
            cancels: list[Fault] | None = None) -> Fault:
    frozen = frozen or Frozen()
    long = config.lease * rng.uniform(1.5, 2.5)
    if kind == "restart":
        # (a replicated store's restart is a failover: the primary killed, a replica promoted)
        fault = Fault("failover" if store.replicated else kind, store.kind, time.time())
        store.restart()
        restarted = time.time()
        # The fault lasts until the store answers again where the workers connect: behind
        # PgBouncer, about server_login_retry after the restart (its first reconnect
        # reaches a server still shutting down). The next fault comes after the gap, so
        # restarts do not pile up into one long outage.
        answered = probe.wait_answer(restarted, RESTART_RECOVERY_S)
        fault.end = answered if answered is not None else time.time()
        return fault
    if kind == "join":
        worker = Worker(max(w.index for w in workers) + 1, store, config, workers[0].logdir)
        fault = Fault(kind, "", time.time())
        worker.launch()
        workers.append(worker)
        worker.wait_started()
        fault.target, fault.end = worker.instance, time.time()
        return fault
    worker, owned = _owner(rng, workers, config, kind)
    fault = Fault(kind, worker.instance, time.time(), jobs=owned)
    if kind == "kill":
        worker.signal(signal.SIGKILL)
        worker.reap(10)
        time.sleep(rng.uniform(0.2, 1.0))
        worker.launch(worker.skew)
        worker.wait_started()
    elif kind == "stop":
        worker.signal(signal.SIGSTOP)
        with frozen.during(worker.instance):
            time.sleep(long)
        worker.signal(signal.SIGCONT)
    elif kind == "partition":
        worker.proxy.pause()
        with frozen.during(worker.instance):
            time.sleep(long)
        worker.proxy.resume()
    elif kind.startswith("zombie"):
        # Stopped just before a fenced write, past its lease: the write goes out as it
        # resumes, from an attempt a backup has taken over meanwhile. ``zombie-end`` (in
        # ``first``) asks for the write that ends the run (the fenced transaction, the
        # finish), ``zombie-cp`` for a checkpoint; ``zombie`` draws one.
        # ``zombie-cancel``: stopped before the write that ends the run, whose run an
        # operator cancels meanwhile (recorded in ``cancels``); resumed at once, within the
        # cancel's grace (its token still on the run), the write must be refused: a
        # cancelled run is never completed.
        writes = ("cp", "tx") if store.fenced_transactions else ("cp", "fin")
        write = rng.choice(writes)
        if kind != "zombie":
            write = writes[0] if kind == "zombie-cp" else writes[1]
        if worker.freeze_before(write, ZOMBIE_WAIT_S):
            fault.kind, fault.start = f"zombie-{write}", time.time()
            # (the operator's cancels leave these two alone: a cancel would take the
            # takeover that zombie-end waits for)
            with frozen.during(worker.instance,
                               reserved=kind in ("zombie-end", "zombie-cancel")):
                if kind == "zombie-cancel":
                    # (a cancel the store refused or failed is not recorded: the short
                    # runs' check that a zombie's run was cancelled says so)
                    with contextlib.suppress(Exception):
                        cancel = _cancel(rng, store, frozenset({worker.instance}),
                                         _last_freeze(worker.logdir, worker.instance))
                        if cancel.run is not None and cancels is not None:
                            cancel.holder = worker.instance
                            cancels.append(cancel)
                # Resumed once another attempt claimed the run (or after `long`), within
                # that attempt's run: the write lands while the run is running again.
                elif wait_for_takeover(worker.logdir, worker.instance, long):
                    time.sleep(rng.uniform(0.0, 0.1))
            worker.signal(signal.SIGCONT)
        else:
            fault.kind, fault.jobs = "zombie-idle", ()  # no such write came: nothing stopped
    elif kind == "skew":
        # A graceful stop (hand-over), then the same worker with its clock off by an hour.
        worker.signal(signal.SIGTERM)
        worker.reap(30)
        skew_sign[0] = -skew_sign[0]
        worker.launch(SKEW_S * skew_sign[0])
        worker.wait_started()
    elif kind == "leave":
        # A graceful stop for good: the others re-rank its jobs (it left the fleet).
        worker.signal(signal.SIGTERM)
        worker.reap(30)
        workers.remove(worker)
        retired.append(worker)
    else:
        raise ValueError(f"fault {kind!r} is unknown; use one of {FAULTS}")
    fault.end = time.time()
    return fault


def wait_for_takeover(logdir: Path, instance: str, timeout: float) -> bool:
    """Wait until a worker's records (in ``logdir``) show a claim of the run ``instance``
    froze in (its last ``freeze`` record), made after the freeze by another token; False
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    frozen = _freezes(logdir, instance)
    if not frozen:
        time.sleep(timeout)
        return False
    job, slot, token = frozen[-1]["j"], frozen[-1]["s"], frozen[-1]["k"]
    since = float(frozen[-1]["t"]) * 1000
    marker = f'"e":"claim","j":{json.dumps(job)},"s":{slot},'
    read: dict[Path, int] = {}
    while time.monotonic() < deadline:
        for path in logdir.glob("*.jsonl"):
            with open(path, "rb") as records:
                records.seek(read.get(path, 0))
                chunk = records.read()
            # (only whole lines: a line being written is read at the next turn)
            complete = chunk[:chunk.rfind(b"\n") + 1]
            read[path] = read.get(path, 0) + len(complete)
            for line in complete.decode().splitlines():
                if marker in line:
                    claim = json.loads(line)
                    if claim["k"] != token and int(claim["n"]) > since:
                        return True
        time.sleep(0.05)
    return False


def _freezes(logdir: Path, instance: str) -> list[dict[str, Any]]:
    """The ``freeze`` records of ``instance`` (:class:`tests.chaos.worker.Freezer`)."""
    mine = logdir / f"{instance}.jsonl"
    return [json.loads(line) for line in mine.read_text().splitlines()
            if '"e":"freeze"' in line]


def _last_freeze(logdir: Path, instance: str) -> tuple[str, int] | None:
    """The run (job, slot) ``instance`` last stopped itself in, if any."""
    frozen = _freezes(logdir, instance)
    return (str(frozen[-1]["j"]), int(frozen[-1]["s"])) if frozen else None


def _cancel(rng: random.Random, store: ChaosStore,
            holders: frozenset[str] | None = None,
            only: tuple[str, int] | None = None,
            spare: frozenset[str] = frozenset()) -> Fault:
    """Cancel a running run drawn at random, through the store, as an operator would; one
    held by one of ``holders`` when given; the run ``only`` when given; none held by one
    of ``spare``."""
    fault = Fault("cancel", "", time.time())

    async def cancel(backend: Backend) -> tuple[str, int] | None:
        running = [r for r in await backend.runs(open_only=True, limit=1_000_000)
                   if r.status is RunStatus.RUNNING
                   and (holders is None or r.instance_id in holders)
                   and (only is None or (r.job, r.slot) == only)
                   and r.instance_id not in spare]
        if not running:
            return None
        run = rng.choice(sorted(running, key=lambda r: (r.job, r.slot)))
        if holders is not None:
            fault.holder = str(run.instance_id)
        try:
            await Admin(backend, by="chaos").cancel(run.job, run.slot, grace="1s")
        except OperationRefused:
            return None  # it finished in between
        return run.job, run.slot

    fault.run = _read_store(store, cancel)
    fault.target = "" if fault.run is None else f"{fault.run[0]}@{fault.run[1]}"
    fault.end = time.time()
    return fault


class Operator:
    """Cancels ``config.cancels`` running runs through the store, evenly over the faults'
    window, from its own thread and RNG; :attr:`faults` records each try. Every other
    cancel is of a run held by a frozen instance (see :class:`Frozen`), made as soon as
    there is one, when there is one before that cancel is due."""

    def __init__(self, store: ChaosStore, config: ChaosConfig,
                 frozen: Frozen | None = None) -> None:
        self.store, self.config = store, config
        self.frozen = frozen or Frozen()
        self.rng = random.Random(config.seed * 7919 + 1)
        self.faults: list[Fault] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-operator", daemon=True)

    def _run(self) -> None:
        n = self.config.cancels
        began = time.monotonic()
        spacing = self.config.seconds / (n + 1)
        for k in range(n):
            at = began + spacing * (k + 1)
            # (the first, third, ... cancel: of a frozen holder's run, from the one before)
            if k % 2 == 0 and self._cancel_frozen(at):
                continue
            if self._stop.wait(max(0.0, at - time.monotonic())):
                return
            # A try may find no run running, see its run finish first, or meet the store
            # down (a fault's doing): it tries again, a few times, before giving up.
            for _ in range(20):
                fault: Fault | None = None
                with contextlib.suppress(Exception):
                    fault = _cancel(self.rng, self.store, spare=self.frozen.reserved())
                if fault is not None and fault.run is not None:
                    self.faults.append(fault)
                    break
                if self._stop.wait(0.1):
                    return

    def _cancel_frozen(self, until: float) -> bool:
        """Cancel a run held by a frozen instance, waiting for one until ``until``
        (monotonic); True once made."""
        while not self._stop.is_set() and time.monotonic() < until:
            holders = self.frozen.wait(min(0.5, until - time.monotonic()))
            if not holders:
                continue
            fault: Fault | None = None
            with contextlib.suppress(Exception):
                fault = _cancel(self.rng, self.store, holders)
            if fault is not None and fault.run is not None:
                self.faults.append(fault)
                return True
            if self._stop.wait(0.1):
                return False
        return False

    def start(self) -> None:
        """Start the operator's thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the operator (a cancel in flight completes) and wait for its thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)


def run_chaos(config: ChaosConfig, workdir: Path | None = None,
              progress: Any = None) -> Report:
    """Run one chaos run end to end and return its audited report."""
    say = progress or (lambda _msg: None)
    rng = random.Random(config.seed)
    t0 = time.monotonic()
    logdir = Path(workdir or tempfile.mkdtemp(prefix=f"anarchon-chaos-{config.store}-"))
    logdir.mkdir(parents=True, exist_ok=True)
    if any(logdir.glob("*.jsonl")):
        # The audit reads every worker record there: an earlier run's would be judged as
        # this one's (its claims missing from this store: lost commits).
        raise ValueError(f"{logdir} holds an earlier chaos run's records; give a new or "
                         "empty directory")
    say(f"{config.store}: records and logs in {logdir}")
    store = make_store(config.store)
    workers: list[Worker] = []
    retired: list[Worker] = []
    """Workers that left the fleet (their records still count)."""
    faults: list[Fault] = []
    probe = StoreProbe(store)
    frozen = Frozen()
    operator = Operator(store, config, frozen)
    try:
        workers = [Worker(i, store, config, logdir) for i in range(config.workers)]
        for w in workers:
            # The first worker runs an hour ahead from the start.
            w.launch(SKEW_S if w.index == 0 else 0.0)
        for w in workers:
            w.wait_started()
        probe.start()
        operator.start()
        started = time.time()
        say(f"{config.store}: {config.workers} workers started; faults for {config.seconds:g}s")
        skew_sign = [1.0]
        first = list(config.first)
        end = time.monotonic() + config.seconds
        while time.monotonic() < end:
            time.sleep(rng.uniform(*config.gap))
            if time.monotonic() >= end:
                break
            kinds = _kinds(config, workers)
            kind = first.pop(0) if first else rng.choice(kinds)
            faults.append(_inject(rng, kind, workers, store, config, skew_sign, probe,
                                  retired, frozen, operator.faults))
        operator.stop()
        faults = sorted(faults + operator.faults, key=lambda f: f.start)
        faults_over = time.time()
        time.sleep(config.settle_leases * config.lease)
        # On a starved machine the fleet may need longer to take every run over: wait
        # (up to drain_s) until no run older than the horizon is open.
        deadline = time.monotonic() + config.drain_s
        while True:
            audit_at = time.time()
            open_before = _read_store(store, lambda b: b.runs(open_only=True, limit=1_000_000))
            horizon = (audit_at - config.settle_leases * config.lease) * 1000
            if time.monotonic() > deadline or all(r.slot >= horizon for r in open_before):
                break
            time.sleep(0.5)
        probe.stop()
        for w in workers:
            w.signal(signal.SIGTERM)
        for w in workers:
            w.reap(30)
        say(f"{config.store}: workers stopped; auditing")
        every = workers + retired
        skewed = frozenset(i for w in every for i, skew in w.skews.items() if skew)
        faults = _own_failovers(store, faults)
        report = audit(store, config, logdir, faults, started, faults_over, audit_at,
                       open_before, skewed, probe.answers)
        report.recovery_s = audit_at - faults_over
        report.worker_exits = [e for w in every for e in w.exits]
        report.start_retries = sum(w.restarts for w in every)
        report.wall_s = time.monotonic() - t0
        return report
    finally:
        operator.stop()
        probe.stop()
        for w in workers + retired:
            w.close()
        store.close()


# --------------------------------------------------------------------------- the audit


def _events(logdir: Path) -> dict[tuple[str, int], list[dict[str, Any]]]:
    runs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(logdir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by SIGKILL
            runs[(record["j"], int(record["s"]))].append(record)
    return runs


@dataclass
class Observed:
    """Everything the audit reads: the store's records and the workers' own."""

    history: list[Attempt]
    open_before: list[RunInfo]
    """Open runs a few leases after the faults stopped, with every worker still alive."""
    open_after: list[RunInfo]
    """Open runs after every worker stopped gracefully."""
    checkpoints: dict[tuple[str, int], Any]
    effects: list[tuple[str, int, int, str]]
    """Fenced effect rows (job, slot, attempt, instance); PostgreSQL only."""
    events: dict[tuple[str, int], list[dict[str, Any]]]
    """The handlers' append-only records, by run."""
    faults: list[Fault]
    started: float
    faults_over: float
    audit_at: float
    skewed: frozenset[str] = frozenset()
    """Instances whose clocks were skewed."""
    answers: list[tuple[float, float]] | None = None
    """(sent, answered) wall times of the store probe's requests (:class:`StoreProbe`);
    ``None`` when the store was not probed."""
    statuses: dict[tuple[str, int], RunStatus] | None = None
    """Every run's status after every worker stopped (``None``: not read)."""


def audit(store: ChaosStore, config: ChaosConfig, logdir: Path, faults: list[Fault],
          started: float, faults_over: float, audit_at: float,
          open_before: list[RunInfo], skewed: frozenset[str] = frozenset(),
          answers: list[tuple[float, float]] | None = None) -> Report:
    """Read the store and the workers' records, then :func:`judge` them."""
    async def read(backend: Backend) -> tuple[list[Attempt], list[RunInfo], dict[Any, Any],
                                              list[RunInfo]]:
        history = await backend.history(None, 10_000_000)
        open_runs = await backend.runs(open_only=True, limit=1_000_000)
        every = await backend.runs(limit=10_000_000)
        keys = {(a.job, a.slot) for a in history}
        checkpoints = {k: await backend.get_checkpoint(*k) for k in keys}
        return history, open_runs, checkpoints, every

    history, open_after, checkpoints, every = _read_store(store, read)
    if config.verbose:
        with open(logdir / "history.ndjson", "w") as out:
            for a in history:
                out.write(json.dumps({
                    "j": a.job, "s": a.slot, "a": a.attempt, "i": a.instance_id,
                    "r": str(a.reason), "c": a.claimed_at.timestamp(),
                    "f": a.finished_at.timestamp() if a.finished_at else None,
                    "o": str(a.outcome) if a.outcome else None, "err": a.error}) + "\n")
        with open(logdir / "faults.ndjson", "w") as out:
            for f in faults:
                out.write(json.dumps(vars(f)) + "\n")
        with open(logdir / "probe.ndjson", "w") as out:
            for answer in answers or ():
                out.write(json.dumps(answer) + "\n")
    effects = store.effects() if isinstance(store, PostgresChaosStore) else []
    observed = Observed(history, open_before, open_after, checkpoints, effects,
                        _events(logdir), faults, started, faults_over, audit_at, skewed,
                        answers, {(r.job, r.slot): r.status for r in every})
    report = judge(config, observed)
    report.version = store.version
    return report


#: Seconds by which a worker's record may precede its attempt's claim time in the store
#: (the workers' and the store's clocks are this machine's; a margin for rounding).
CLOCK_SLACK_S = 0.05


def _audit_retries(report: Report, key: tuple[str, int], attempts: list[Attempt],
                   evs: list[dict[str, Any]]) -> None:
    """A retried run never runs twice at once: each retry begins after the failed attempt
    it retries ended, in the store's records and in the handlers' own."""
    # An attempt's own records: its number, its instance, from its claim in the store on
    # (a failover may number an attempt again: the lost one's records are not its own).
    def own(attempt: Attempt) -> list[dict[str, Any]]:
        since = attempt.claimed_at.timestamp() - CLOCK_SLACK_S
        return [e for e in evs if e["e"] in ("rstart", "rfail", "rdone")
                and e["a"] == attempt.attempt and e["i"] == attempt.instance_id
                and float(e["t"]) >= since]

    for prev, nxt in itertools.pairwise(attempts):
        if nxt.reason != "retry":
            continue
        report.retries += 1
        if (prev.outcome not in (Outcome.FAILED, Outcome.TIMED_OUT)
                or prev.finished_at is None or prev.finished_at > nxt.claimed_at):
            report.retry_overlaps.append((*key, nxt.attempt))
            continue
        starts = [float(e["t"]) for e in own(nxt) if e["e"] == "rstart"]
        ended = [float(e["t"]) for e in own(prev)]
        if starts and ended and min(starts) < max(ended):
            report.retry_overlaps.append((*key, nxt.attempt))


def judge(config: ChaosConfig, seen: Observed) -> Report:
    """Count every broken invariant, and the figures, in what a run left behind."""
    report = Report(config.store, "", config.seconds)
    faults, history, events = seen.faults, seen.history, seen.events
    open_before, open_after, checkpoints = seen.open_before, seen.open_after, seen.checkpoints
    started, faults_over, audit_at, effects = (seen.started, seen.faults_over, seen.audit_at,
                                               seen.effects)
    for f in faults:
        report.faults[f.kind] = report.faults.get(f.kind, 0) + 1
    runs: dict[tuple[str, int], list[Attempt]] = defaultdict(list)
    for a in history:
        runs[(a.job, a.slot)].append(a)
    report.slots = len(runs)
    report.attempts = len(history)
    report.owner_faults = _owner_faults(faults, history)
    report.zombie_writes = _zombie_writes(faults, history, events)
    report.fenced_effects = len(effects)
    effect_of = {(job, slot): attempt for job, slot, attempt, _ in effects}

    # Runs still open a few leases after the faults stopped, while the fleet was alive.
    horizon = (audit_at - config.settle_leases * config.lease) * 1000
    report.left_running = [(r.job, r.slot, str(r.status)) for r in open_before
                           if r.slot < horizon]
    report.left_running += [(r.job, r.slot, "running after shutdown") for r in open_after
                            if r.status is RunStatus.RUNNING and r.slot < horizon]
    report.open_at_shutdown = sum(1 for r in open_after
                                  if r.status is RunStatus.RUNNING and r.slot >= horizon)
    report.handed_over_at_shutdown = sum(1 for r in open_after
                                         if r.status is RunStatus.HANDED_OVER)
    by_instance: dict[str, list[Fault]] = defaultdict(list)
    for f in faults:
        by_instance[f.target].append(f)
    bound = config.lease + config.heartbeat

    for key, attempts in runs.items():
        attempts.sort(key=lambda a: a.attempt)
        top = attempts[-1].attempt
        for a in attempts:
            name = str(a.outcome) if a.outcome is not None else "open"
            report.outcomes[name] = report.outcomes.get(name, 0) + 1
        report.skewed_completions += sum(1 for a in attempts if a.outcome is Outcome.COMPLETED
                                         and a.instance_id in seen.skewed)
        report.claim_delay.append(attempts[0].claimed_at.timestamp() - key[1] / 1000)
        if sum(1 for a in attempts if a.outcome is Outcome.COMPLETED) > 1:
            report.double_completions.append(key)
        retried = {a.attempt - 1 for a in attempts if a.reason == "retry"}
        for a in attempts:
            # A failure followed by its retry is no superseded finish.
            if a.attempt < top and a.outcome in _FINAL and not (
                    a.attempt in retried and a.outcome is not Outcome.COMPLETED):
                report.stale_finish.append((*key, a.attempt))
        _audit_retries(report, key, attempts, events.get(key, []))
        # Takeover latency: from the fault of the previous holder to the new claim.
        for prev, nxt in itertools.pairwise(attempts):
            if nxt.reason == "takeover":
                report.takeovers += 1
                claimed = nxt.claimed_at.timestamp()
                cause = [f for f in by_instance.get(prev.instance_id, [])
                         if f.kind in ("kill", "stop", "partition", "zombie-cp",
                                       "zombie-tx", "zombie-fin")
                         and prev.claimed_at.timestamp() <= f.start <= claimed]
                if cause:
                    latency = claimed - cause[-1].start
                    report.takeover_latency.append(latency)
                    if latency > bound + 0.25:
                        report.late_takeovers.append((*key, nxt.attempt, round(latency, 3)))
            elif nxt.reason == "hand-over" and prev.finished_at is not None:
                report.handover_latency.append(
                    (nxt.claimed_at - prev.finished_at).total_seconds())
        # Fenced effects (PostgreSQL): one row, written by the attempt that completed.
        if key in effect_of:
            a_eff = effect_of[key]
            final = [a for a in attempts if a.attempt == a_eff]
            if a_eff != top or not final or final[0].outcome is not Outcome.COMPLETED:
                report.stale_transaction.append((*key, a_eff))
        evs = events.get(key, [])
        tx_attempts = {e["a"] for e in evs if e["e"] == "tx"}
        if any(e["e"] == "tx_dup" for e in evs) or len(tx_attempts) > 1:
            report.double_fenced.append(key)
        for e in evs:
            if e["e"] == "tx" and e["a"] != top:
                report.stale_transaction.append((*key, e["a"]))
        # Checkpoints: only the holder writes; a new attempt never reads less than what
        # earlier attempts were told they wrote; the stored value is the newest writer's.
        held_until = _held_until(evs)
        for e in evs:
            # A read after the attempt's lease ran out (a process frozen past it, whose
            # handler read once more before the loss's cancellation reached it) sees the
            # next holder's writes, as it should: only a read while it held the run counts.
            if e["e"] == "cp_foreign" and float(e["t"]) * 1000 < held_until.get(
                    int(e["a"]), float("inf")):
                report.stale_checkpoint.append((*key, e["a"]))
        written: dict[int, int] = defaultdict(int)
        for e in evs:
            if e["e"] == "cp":
                written[e["a"]] = max(written[e["a"]], int(e["step"]))
        for e in evs:
            if e["e"] == "start":
                read_step = int(e["cp"]["step"]) if e["cp"] else 0
                earlier = max((s for a, s in written.items() if a < e["a"]), default=0)
                if read_step < earlier:
                    report.checkpoint_backwards.append((*key, e["a"]))
        stored = checkpoints.get(key)
        if written and stored is not None:
            if int(stored["a"]) < max(written):
                report.stale_checkpoint.append((*key, int(stored["a"])))
            if int(stored["step"]) < max(written.values()):
                report.checkpoint_backwards.append((*key, int(stored["a"])))
        # Un-fenced effects: the handler's own record, outside any fencing.
        starts = {e["a"] for e in evs if e["e"] == "start"}
        dones = {e["a"] for e in evs if e["e"] == "done"}
        if starts:
            report.runs_with_handler += 1
        report.unfenced_started_twice += len(starts) > 1
        report.unfenced_done_twice += len(dones) > 1

    # Slots nobody claimed while at least one worker was alive; and of those, the slots
    # the store answered no request from until the job's next slot was due: when the
    # store returns, only the newest slot missed while it was unreachable is claimed.
    first = min((k[1] for k in runs), default=0)
    step = config.interval_ms
    windows = [(f.start - LOSS_WINDOW_S, f.end + LOSS_WINDOW_S) for f in faults
               if f.kind in ("failover", "failover-own")]
    answered = sorted(done * 1000 for _, done in seen.answers or ())
    # (the flaky job, retried within its runs, too: every interval, with no offset)
    scheduled = [(f"job{n}", config.offset_ms(n)) for n in range(config.jobs)]
    scheduled += [(FLAKY_JOB, 0)] if config.flaky else []
    for job, offset in scheduled:
        expected = range((int(started * 1000) // step + 2) * step + offset,
                         int(faults_over * 1000), step)
        missed = [s for s in expected if s >= first and (job, s) not in runs]
        report.missed_slots += len(missed)
        if seen.answers is not None:
            for s in missed:
                acked = [float(e["t"]) for e in events.get((job, s), [])
                         if e["e"] in ("claim", "skip")]
                if any(lo <= t <= hi for t in acked for lo, hi in windows):
                    report.missed_lost_commit += 1
                elif bisect.bisect_left(answered, s) == bisect.bisect_left(answered, s + step):
                    report.missed_store_unreachable += 1
                else:
                    report.missed_while_answered.append((job, s))
    _judge_cancels(report, faults, runs, seen.open_after, seen.statuses or {}, effect_of)
    _judge_leases(report, runs, events)
    _judge_fences(report, runs, events, faults)
    _judge_lost_effects(report, events, effects, faults)
    report.left_running.sort()
    return report


def _owner_faults(faults: list[Fault], history: list[Attempt]) -> int:
    """How many faults hit a member ranked first for one of the jobs the coordinator
    ranked it first for (:attr:`Fault.jobs`), in the fleet's own view: the member that
    made the first claim of the job's latest slot before the fault."""
    firsts: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    for a in history:
        if a.attempt == 1:
            firsts[a.job].append((a.slot, a.claimed_at.timestamp(), a.instance_id))
    for claims in firsts.values():
        claims.sort()
    hit = 0
    for f in faults:
        for job in f.jobs:
            before = [c for c in firsts.get(job, []) if c[1] <= f.start]
            if before and before[-1][2] == f.target:
                hit += 1
                break
    return hit


def _zombie_writes(faults: list[Fault], history: list[Attempt],
                   events: dict[tuple[str, int], list[dict[str, Any]]]) -> int:
    """How many ``zombie`` faults sent their fenced write as a superseded attempt's: another
    attempt of the frozen run was claimed (the store's history) while it was stopped, and
    the write was made after it resumed (its ``thawed`` record)."""
    claims: dict[tuple[str, int], list[tuple[float, str]]] = defaultdict(list)
    for a in history:
        claims[(a.job, a.slot)].append((a.claimed_at.timestamp(), a.instance_id))
    sent = 0
    for f in faults:
        if not f.kind.startswith("zombie-") or f.kind == "zombie-idle":
            continue
        frozen = [(key, float(e["t"]), e["k"]) for key, evs in events.items() for e in evs
                  if e["e"] == "freeze" and e["i"] == f.target
                  and f.start - ZOMBIE_WAIT_S - 1 <= float(e["t"]) <= f.end]
        if any(at <= claimed <= f.end and instance != f.target
               and any(e["e"] == "thawed" and e["k"] == token for e in events[key])
               for key, at, token in frozen for claimed, instance in claims.get(key, [])):
            sent += 1
    return sent


def _kept(stored: dict[tuple[int, str], Attempt], claim: dict[str, Any]) -> bool:
    """Whether the store's history has the attempt of the acknowledged ``claim`` record
    (a lossy failover may have lost it, or numbered another claim of that worker so)."""
    record = stored.get((int(claim["a"]), str(claim["i"])))
    return (record is not None and claim.get("n") is not None
            and round(record.claimed_at.timestamp() * 1000) == int(claim["n"]))


#: The outcomes an attempt's holder gives it itself (its lease ends with them).
_RELEASED = (Outcome.COMPLETED, Outcome.FAILED, Outcome.TIMED_OUT, Outcome.HANDED_OVER)


def _judge_leases(report: Report, runs: dict[tuple[str, int], list[Attempt]],
                  events: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    """At most one attempt of a run holds a live lease at any store-clock instant.

    Each attempt's lease was surely live until the latest expiry the store acknowledged
    setting for it: its claim's, and each renewal's (at the earliest: the renewal's send
    time plus the lease; the workers' records are on the store's machine and clock). A
    claim the store acknowledged as won before that instant, by another token, and kept
    (a claim a lossy failover lost is counted with the lost commits), breaks the
    invariant, unless the holder had ended its attempt itself (a finish, a failure to
    retry, a hand-over) by then, in the store's history.
    """
    for key, evs in events.items():
        claims: dict[str, dict[str, Any]] = {}
        for e in evs:
            if e["e"] == "claim" and e.get("n") is not None:
                first = claims.get(e["k"])
                if first is None or int(e["n"]) < int(first["n"]):
                    claims[e["k"]] = e  # (a claim sent again answers 'won' again, later)
        if len(claims) < 2:
            continue
        live: dict[str, int] = {}
        for e in evs:
            if e["e"] in ("claim", "hb") and e.get("x") is not None and e["k"] in claims:
                live[e["k"]] = max(int(e["x"]), live.get(e["k"], 0))
        stored = {(a.attempt, a.instance_id): a for a in runs.get(key, [])}
        found: set[int] = set()
        for token, won in claims.items():
            at = int(won["n"])
            if not _kept(stored, won):
                continue  # a claim a failover lost (counted with the lost commits)
            for other, until in live.items():
                held = claims[other]
                if other == token or int(held["n"]) > at or until <= at:
                    continue
                record = stored.get((int(held["a"]), str(held["i"])))
                if (record is not None and record.outcome in _RELEASED
                        and record.finished_at is not None
                        and record.finished_at.timestamp() * 1000 <= at):
                    continue
                found.add(int(won["a"]))
        report.lease_overlaps += [(*key, attempt) for attempt in sorted(found)]


# -- fences and lost commits (issue 21, item 5) -----------------------------------------

#: Seconds before a failover's kill in which an acknowledged write may be lost with it
#: (the replica's lag; generous for a loaded machine).
LOSS_WINDOW_S = 2.0


def _own_failovers(store: ChaosStore, faults: list[Fault]) -> list[Fault]:
    """``faults`` with the failovers the store made by itself (``failover-own``): those of
    :meth:`ChaosStore.failover_windows` that no injected failover overlaps."""
    injected = [f for f in faults if f.kind == "failover"]
    own = [Fault("failover-own", store.kind, start, end)
           for start, end in store.failover_windows()
           if not any(f.start - 1 <= end and start <= f.end + 1 for f in injected)]
    return sorted(faults + own, key=lambda f: f.start)


def _judge_fences(report: Report, runs: dict[tuple[str, int], list[Attempt]],
                  events: dict[tuple[str, int], list[dict[str, Any]]],
                  faults: list[Fault]) -> None:
    """Fences never repeat: per run, the fences of the attempts that were won or ran (the
    acknowledged claim, else the handler's first record) are all distinct and grow in the
    order the attempts started. And every
    acknowledged claim and finish missing from the store is counted, and explained by a
    failover when it was acknowledged shortly before one."""
    # (the old primary, when alive, acknowledges writes until it learns it was demoted)
    windows = [(f.start - LOSS_WINDOW_S, f.end + LOSS_WINDOW_S) for f in faults
               if f.kind in ("failover", "failover-own")]
    # A checkpoint that went backwards is a lost commit too when the run acknowledged a
    # checkpoint within a failover's window (the newer one was lost with the primary).
    kept = []
    for entry in report.checkpoint_backwards:
        cps = [float(e["t"]) for e in events.get(entry[:2], []) if e["e"] == "cp"]
        if any(lo <= t <= hi for t in cps for lo, hi in windows):
            report.lost_checkpoints.append(entry)
        else:
            kept.append(entry)
    report.checkpoint_backwards = kept
    for key, evs in events.items():
        stored = {(a.attempt, a.instance_id): a for a in runs.get(key, [])}
        first: dict[tuple[int, str, int], float] = {}
        for e in evs:
            if e["e"] in ("claim", "start", "rstart"):
                ran = (int(e["a"]), str(e["i"]), int(e.get("f", e["a"])))
                first[ran] = min(first.get(ran, float(e["t"])), float(e["t"]))
        # In the order the store issued them: an attempt it kept by its claim time (a
        # worker stopped between the store's answer and reading it logs the claim late),
        # else (lost with a failover) by the worker's first record.
        # The store keeps one record per attempt number: when one worker had the same
        # number before and after a failover, the record is the later claim's (the
        # highest fence); the earlier, lost, keeps its worker's time.
        newest: dict[tuple[int, str], int] = {}
        for attempt_no, instance, fence in first:
            newest[attempt_no, instance] = max(fence, newest.get((attempt_no, instance), fence))
        for ran in first:
            kept = stored.get(ran[:2])
            if (kept is not None and kept.claimed_at is not None
                    and ran[2] == newest[ran[:2]]):
                first[ran] = kept.claimed_at.timestamp()
        top = 0
        for (_, _, fence), _t in sorted(first.items(), key=lambda item: item[1]):
            if fence <= top:
                report.fences_repeated.append((*key, fence))
            top = max(top, fence)
        claimed = {}
        for e in evs:
            if e["e"] == "claim":
                claimed[e["k"]] = (int(e["a"]), str(e["i"]), float(e["t"]))
        for attempt, instance, at in claimed.values():
            if (attempt, instance) not in stored:
                lost = (*key, attempt, instance)
                report.lost_claims.append(lost)
                if not any(lo <= at <= hi for lo, hi in windows):
                    report.lost_unexplained.append(lost)
        won = {e["k"]: e for e in evs if e["e"] == "claim" and e.get("n") is not None}
        for e in evs:
            if e["e"] != "fin" or e["k"] not in claimed:
                continue
            attempt, instance, _ = claimed[e["k"]]
            record = stored.get((attempt, instance))
            if record is None:
                continue  # its claim was lost already (counted above)
            # A finish sent after another attempt (kept by the store) won the run, and
            # acknowledged: the store took a superseded attempt's finish.
            if e.get("w") is not None and e["k"] in won and any(
                    int(won[e["k"]]["n"]) < int(later["n"]) <= int(e["w"])
                    and _kept(stored, later)
                    for k, later in won.items() if k != e["k"]):
                report.stale_finish.append((*key, attempt))
                continue
            if str(record.outcome) != e["o"]:
                lost = (*key, attempt, instance)
                report.lost_finishes.append(lost)
                if not any(lo <= float(e["t"]) <= hi for lo, hi in windows):
                    report.lost_unexplained.append(lost)


# -- effects and checkpoints a PostgreSQL failover lost (issue 21, item 5; pglossy) ------


def _held_until(evs: list[dict[str, Any]]) -> dict[int, float]:
    """Each attempt's last known lease expiry (store ms) from its claim and heartbeats."""
    attempt_of = {e["k"]: int(e["a"]) for e in evs if e["e"] == "claim" and "k" in e}
    until: dict[int, float] = {}
    for e in evs:
        if e["e"] in ("claim", "hb") and e.get("k") in attempt_of and "x" in e:
            attempt = attempt_of[e["k"]]
            until[attempt] = max(until.get(attempt, 0.0), float(e["x"]))
    return until


def _in_windows(at: float, faults: list[Fault]) -> bool:
    return any(f.start - LOSS_WINDOW_S <= at <= f.end + LOSS_WINDOW_S for f in faults
               if f.kind in ("failover", "failover-own"))


def _judge_lost_effects(report: Report, events: dict[tuple[str, int], list[dict[str, Any]]],
                        effects: list[tuple[str, int, int, str]],
                        faults: list[Fault]) -> None:
    """Lost commits the fenced transactions and checkpoint reads show (a lossy failover).

    A fenced transaction lives in the store's own database, so a failover that loses a
    run's finish loses its effect row too, and the run's next attempt writes the effect
    once more: two "tx" records, one row. A record whose (attempt, instance) is not the
    row the store kept, committed in a failover's window, is such a lost effect
    (:attr:`Report.lost_effects`), not a double effect; a duplicate-key refusal, or two
    kept-or-unexplained records, still is. Likewise a handler that reads back a
    checkpoint older than its own last write, when that write was acknowledged in a
    failover's window and what it read was acknowledged before it (or nothing), saw a lost
    checkpoint (:attr:`Report.lost_checkpoints`), not a foreign writer's.
    """
    row = {(job, slot): (attempt, instance) for job, slot, attempt, instance in effects}
    for key in list(report.double_fenced):
        evs = events.get(key, [])
        if any(e["e"] == "tx_dup" for e in evs):
            continue
        lost, other = set(), set()
        for e in evs:
            if e["e"] == "tx":
                ran = (int(e["a"]), str(e["i"]))
                if ran != row.get(key) and _in_windows(float(e["t"]), faults):
                    lost.add(ran)
                else:
                    other.add(ran)
        if len(other - lost) <= 1:
            report.double_fenced.remove(key)
            report.lost_effects += [(*key, a, i) for a, i in sorted(lost - other)]
    for entry in list(report.stale_transaction):
        key, attempt = entry[:2], entry[2]
        if (row.get(key) or (None,))[0] == attempt:
            continue  # the kept row's own attempt: judged on the store, not on records
        txs = [e for e in events.get(key, []) if e["e"] == "tx" and int(e["a"]) == attempt]
        if txs and all(_in_windows(float(e["t"]), faults) for e in txs):
            report.stale_transaction.remove(entry)
            lost = [(*key, attempt, str(e["i"])) for e in txs]
            report.lost_effects += [x for x in lost if x not in report.lost_effects]
    for e in [e for evs in events.values() for e in evs if e["e"] == "cp_foreign"]:
        key, attempt, at = (str(e["j"]), int(e["s"])), int(e["a"]), float(e["t"])
        entry = (*key, attempt)
        cps = [c for c in events.get(key, []) if c["e"] == "cp"]
        mine = [float(c["t"]) for c in cps if int(c["a"]) == attempt and c["i"] == e["i"]
                and float(c["t"]) <= at]
        if entry not in report.stale_checkpoint or not mine:
            continue
        last = max(mine)
        seen = e.get("seen")
        older = seen is None or any(
            {"a": int(c["a"]), "step": int(c["step"])} == seen and float(c["t"]) < last
            for c in cps)
        if older and _in_windows(last, faults):
            report.stale_checkpoint.remove(entry)
            report.lost_checkpoints.append(entry)


def _judge_cancels(report: Report, faults: list[Fault],
                   runs: dict[tuple[str, int], list[Attempt]],
                   open_after: list[RunInfo],
                   statuses: dict[tuple[str, int], RunStatus] | None = None,
                   effect_of: dict[tuple[str, int], int] | None = None) -> None:
    """A cancelled run is never taken over, never completed, and stays ``cancelled``.

    Completed: an attempt of it completed, its run's status (read after the workers
    stopped) is another, or a fenced effect of it committed (PostgreSQL: the effect
    commits with the run's completion, and a finish accepted after the cancel may leave
    the cancelled attempt's outcome as it was, only the run's status changed).

    The cancel's instant is the store's: the cancelled attempt's end (every store ends
    the attempt holding the run at the cancel, or records one of its own for a run
    nobody held, ``cancelled`` at that instant). An attempt numbered after it, or claimed
    after it, took the run over; a cancel the store made leaves a ``cancelled`` attempt.
    """
    still_open = {(r.job, r.slot) for r in open_after}
    for f in faults:
        if f.kind != "cancel" or f.run is None:
            continue
        report.cancels += 1
        report.cancels_of_frozen += bool(f.holder)
        attempts = runs.get(f.run, [])
        # (pglossy) a cancel acknowledged in a failover's window may be lost with it
        if _in_windows(f.end, faults) and not any(
                a.outcome is Outcome.CANCELLED for a in attempts):
            report.lost_cancels.append(f.run)
            continue
        ended = [a for a in attempts if a.outcome is Outcome.CANCELLED]
        # (no cancelled attempt: the store did not keep the cancel, reported below; the
        # coordinator's time after the cancel returned is the bound then)
        at = min((a.finished_at.timestamp() for a in ended if a.finished_at is not None),
                 default=f.end)
        last = max((a.attempt for a in ended), default=None)
        for a in attempts:
            if a.claimed_at.timestamp() > at or (last is not None and a.attempt > last):
                report.cancelled_taken_over.append((*f.run, a.attempt))
        status = (statuses or {}).get(f.run)
        if any(a.outcome is Outcome.COMPLETED for a in attempts):
            report.cancelled_completed.append((*f.run, "completed"))
        elif f.run in (effect_of or {}):
            report.cancelled_completed.append((*f.run, "fenced effect committed"))
        elif f.run in still_open or not ended:
            report.cancelled_completed.append((*f.run, "not cancelled"))
        elif status is not None and status is not RunStatus.CANCELLED:
            report.cancelled_completed.append((*f.run, f"status {status}"))


def results_markdown(summaries: list[dict[str, Any]], command: str) -> str:
    """RESULTS.md from the :meth:`Report.summary` of each store's run."""
    lines = [
        "# Chaos results",
        "",
        f"Produced by `{command}`. Each store ran its own worker processes",
        "through a TCP proxy each; faults (SIGKILL + restart, SIGSTOP longer than the lease,",
        "store restart, partition longer than the lease, graceful restart with the clock",
        "skewed by an hour, a worker joining, a worker leaving, a worker stopped just before",
        "a fenced write until its run was taken over) were injected one at a time,",
        "each fault on a worker hitting the member ranked first for a random job; then the",
        "store and the handlers' records were audited. See `tests/chaos/__init__.py` for",
        "what each figure means.",
        "",
    ]
    rows = [(str(s["store"]), s) for s in summaries]
    fields = [
        ("server", "version"), ("slots (runs)", "slots"), ("attempts", "attempts"),
        ("fault seconds", "fault_seconds"), ("wall seconds", "wall_seconds"),
        ("faults", "faults"),
        ("double completions", "double_completions"),
        ("two attempts holding a live lease at once", "lease_overlaps"),
        ("double fenced effects", "double_fenced_effects"),
        ("finish from a superseded attempt", "stale_finish"),
        ("checkpoint from a superseded attempt", "stale_checkpoint"),
        ("transaction from a superseded attempt", "stale_transaction"),
        ("checkpoint went backwards", "checkpoint_backwards"),
        ("runs left running", "left_running"),
        ("fence numbers issued twice", "fences_repeated"),
        ("acknowledged claims lost (failover)", "lost_claims"),
        ("acknowledged finishes lost (failover)", "lost_finishes"),
        ("checkpoints gone backwards by a failover's loss", "lost_checkpoints"),
        ("fenced effects lost (failover)", "lost_effects"),
        ("runs cancelled (of which held by a stopped or partitioned worker)", None),
        ("cancels lost (failover)", "lost_cancels"),
        ("lost commits not explained by a failover", "lost_unexplained"),
        ("fenced effects written", "fenced_effects"),
        ("runs whose handler started", "runs_with_handler"),
        ("runs completed by a worker skewed by an hour", "skewed_completions"),
        ("un-fenced: handler started twice", "unfenced_started_twice"),
        ("un-fenced: handler ran to the end twice", "unfenced_done_twice"),
        ("takeovers (all / after a fault of the holder)", None),
        ("takeover latency p50 / p99 / max (ms)", None),
        ("takeovers later than lease + check interval + 250 ms", "late_takeovers"),
        ("hand-over latency p50 / p99 (ms)", None),
        ("slots nobody claimed", "missed_slots"),
        ("of which the store answered nothing until the next slot", "missed_store_unreachable"),
        ("of which a failover lost the acknowledged claim or skip", "missed_lost_commit"),
        ("slots never claimed while the store answered", "missed_while_answered"),
        ("faults on a job's first-ranked member", "owner_faults"),
        ("fenced writes sent by a superseded attempt (zombie faults)", "zombie_writes"),
        ("first claim after its slot p50 / p99 / max (ms)", None),
        ("seconds from the last fault until no old run was open", "recovery_s"),
        ("runs open at shutdown, newer than the horizon", "open_at_shutdown"),
        ("outcomes of attempts", "outcomes"),
    ]
    lines.append("| | " + " | ".join(name for name, _ in rows) + " |")
    lines.append("|---|" + "---|" * len(rows))
    for label, key in fields:
        cells = []
        for _, s in rows:
            if label.startswith("takeovers (all"):
                cells.append(f"{s['takeovers']} / {s['takeovers_measured']}")
            elif label.startswith("takeover latency"):
                cells.append(f"{s['takeover_p50_ms']} / {s['takeover_p99_ms']} / "
                             f"{s['takeover_max_ms']}")
            elif label.startswith("first claim after"):
                cells.append(f"{s['claim_delay_p50_ms']} / {s['claim_delay_p99_ms']} / "
                             f"{s['claim_delay_max_ms']}")
            elif label.startswith("runs cancelled"):
                cells.append(f"{s['cancels']} ({s.get('cancels_of_frozen', '-')})")
            elif label.startswith("hand-over latency"):
                cells.append(f"{s['handover_p50_ms']} / {s['handover_p99_ms']}")
            else:
                value = s.get(key, "-")  # type: ignore[arg-type]
                if isinstance(value, dict):
                    value = ", ".join(f"{k} {v}" for k, v in sorted(value.items()))
                cells.append(str(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    total = sum(s["slots"] for s in summaries)
    unf = sum(s["unfenced_started_twice"] for s in summaries)
    handled = sum(s["runs_with_handler"] for s in summaries)
    lines += [
        "",
        f"Total: {total} slots on a machine with {os.cpu_count()} CPU cores. A handler",
        "that ignores fencing (the un-fenced record, written when the handler starts)",
        f"ran twice for {unf} of {handled} runs "
        f"({100 * unf / max(handled, 1):.2f} %): every takeover of a run whose handler had",
        "already started repeats un-fenced work, by nature. Fenced writes (checkpoints,",
        "finish, `ctx.transaction()`) must never be accepted twice, nor from a superseded",
        "attempt: the invariant rows above count the runs where one was.",
        "",
    ]
    violations = {s["store"]: s["violation_examples"] for s in summaries
                  if s["violation_examples"]}
    if violations:
        lines += ["## Violations", ""]
        for name, found in violations.items():
            for what, items in found.items():
                lines.append(f"- {name}: {what}: {s_count(summaries, name, what)} "
                             f"(first: {items})")
        lines.append("")
    return "\n".join(lines)


def s_count(summaries: list[dict[str, Any]], store: str, what: str) -> int:
    """How many runs broke ``what`` on ``store``."""
    return sum(int(s["violations"].get(what, 0)) for s in summaries if s["store"] == store)
