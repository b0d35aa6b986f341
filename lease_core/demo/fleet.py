"""The fleet demo: a small fleet showing winner, backups, takeover and hand-over.

Three instances (A, B, C) share one store and run two jobs:

- ``report`` every 2 s, a short job: one instance wins each slot, the others stand by;
- ``export`` every 10 s, a long job in twelve steps that checkpoints after each step.

The demo kills the instance running an ``export`` mid-run (SIGKILL for processes), so a
backup takes the run over with attempt 2 and resumes from the checkpoint. Then it stops
the instance running the next ``export`` gracefully, so the run is handed over at once.
It prints a timeline, the history table, and a verdict checked in the store: every slot
completed exactly once.

With PostgreSQL or Redis the instances are separate OS processes; with the memory
backend they are tasks in this process. On PostgreSQL and Redis the store's tables or
keys are named under a namespace of the run's own (``anarchon_demo_<hex>``; see
:mod:`lease_core.demo.namespace`), claimed only while nothing by its names exists, and
removed when the demo ends unless kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from lease_core import Attempt, Backend, RunContext, Scheduler, backend_from_url
from lease_core.errors import ConfigurationError

from .namespace import claimed, namespace_for

__all__ = ["URL_VARIABLE", "run_demo", "until_stopped", "verdict", "worker_main"]

NAMES = ("A", "B", "C")
LEASE = "3s"
HEARTBEAT = "0.5s"
STEPS = 12
STEP_S = 0.4


def build_scheduler(backend: Backend, name: str) -> Scheduler:
    """The scheduler every demo instance runs."""
    scheduler = Scheduler(backend, instance_id=name, lease=LEASE, heartbeat=HEARTBEAT)

    @scheduler.every("report", "2s")
    async def report(ctx: RunContext) -> None:
        await anyio.sleep(0.2)

    @scheduler.every("export", "10s", timeout="30s")
    async def export(ctx: RunContext) -> None:
        done = await ctx.checkpoint.get() or 0
        for _step in range(done, STEPS):
            ctx.raise_if_stopping()
            await anyio.sleep(STEP_S)
            await ctx.checkpoint.set(_step + 1)

    return scheduler


# --------------------------------------------------------------------------- fleets


class Fleet(ABC):
    """Runs the demo's instances and can kill or stop each one."""

    @abstractmethod
    async def start(self, name: str) -> None:
        """Start instance ``name``."""

    @abstractmethod
    async def kill(self, name: str) -> None:
        """End instance ``name`` abruptly: no hand-over, no finish."""

    @abstractmethod
    async def stop(self, name: str) -> None:
        """Stop instance ``name`` gracefully (hand-over) and wait for it."""

    async def stop_all(self) -> None:
        """Stop every instance still running."""
        for name in list(self.alive):
            await self.stop(name)

    @property
    @abstractmethod
    def alive(self) -> list[str]:
        """Instances still running."""


#: The variable a worker reads the store's URL from (its URL argument is ``-``), so a
#: password in the URL does not show in ``ps``.
URL_VARIABLE = "ANARCHON_DEMO_URL"


class ProcessFleet(Fleet):
    """Each instance is a separate OS process running :func:`worker_main`."""

    def __init__(self, url: str, namespace: str = "") -> None:
        self.url = url
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.command = ["-m", "lease_core.demo", "worker", "-", "{name}", namespace]
        """The worker's arguments after the interpreter; ``{name}`` is the instance, and
        the URL ``-`` (given in :data:`URL_VARIABLE`)."""

    async def start(self, name: str) -> None:
        """Start a worker process; return once its scheduler has started."""
        args = [name if arg == "{name}" else arg for arg in self.command]
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            [sys.executable, *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, URL_VARIABLE: self.url},
        )
        self.procs[name] = proc
        assert proc.stdout is not None
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        if line.strip() != b"started":
            raise RuntimeError(f"demo instance {name} failed to start")

    async def kill(self, name: str) -> None:
        """SIGKILL the process."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(proc.wait)
        _close_pipe(proc)

    async def stop(self, name: str) -> None:
        """SIGTERM the process, which stops its scheduler gracefully."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(proc.wait)
        _close_pipe(proc)

    @property
    def alive(self) -> list[str]:
        """Processes still running."""
        return list(self.procs)

    def close(self) -> None:
        """Kill any process left (after an error)."""
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
            _close_pipe(proc)
        self.procs.clear()


def _close_pipe(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdout is not None:
        proc.stdout.close()


class TaskFleet(Fleet):
    """Each instance is a scheduler in a task of this process (memory backend)."""

    def __init__(self, tg: TaskGroup, backend: Backend) -> None:
        self.tg = tg
        self.backend = backend
        self.scopes: dict[str, anyio.CancelScope] = {}
        self.stops: dict[str, anyio.Event] = {}
        self.done: dict[str, anyio.Event] = {}

    async def start(self, name: str) -> None:
        """Start a scheduler task."""
        await self.tg.start(self._run, name)

    async def _run(self, name: str, *, task_status: TaskStatus[None]) -> None:
        self.scopes[name] = scope = anyio.CancelScope()
        self.stops[name] = stop = anyio.Event()
        self.done[name] = done = anyio.Event()
        try:
            with scope:
                async with build_scheduler(self.backend, name) as scheduler:
                    task_status.started()
                    await stop.wait()
                    await scheduler.stop(grace="2s")
        finally:
            done.set()

    async def kill(self, name: str) -> None:
        """Cancel the task: like a crash, nothing is handed over."""
        self.scopes.pop(name).cancel()
        await self.done[name].wait()

    async def stop(self, name: str) -> None:
        """Stop the scheduler gracefully."""
        self.scopes.pop(name)
        self.stops[name].set()
        await self.done[name].wait()

    @property
    def alive(self) -> list[str]:
        """Tasks still running."""
        return list(self.scopes)


# --------------------------------------------------------------------------- worker


def worker_main(url: str, name: str, namespace: str) -> None:
    """Run one demo instance until SIGTERM (then stop gracefully) or SIGKILL, or until
    the demo that started it is gone."""

    parent = os.getppid()  # (read before "started": the demo may end right after)

    async def main() -> None:
        backend = backend_from_url(url, namespace=namespace)
        async with build_scheduler(backend, name) as scheduler:
            print("started", flush=True)
            await until_stopped(parent)
            await scheduler.stop(grace="2s")

    anyio.run(main)


async def until_stopped(parent: int) -> None:
    """Wait for SIGTERM or SIGINT, or for the demo process ``parent`` that started this
    worker to end (it is SIGKILLed, or ended without stopping its workers): then this
    process has another parent. A worker outlived its demo, and ran on the user's store
    for ever."""
    async with anyio.create_task_group() as tg:
        async def signalled() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()

        tg.start_soon(signalled)
        while os.getppid() == parent:  # noqa: ASYNC110 - a parent's end sets no event
            await anyio.sleep(0.2)
        tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- timeline


class Timeline:
    """Prints each attempt as it is claimed and as it ends, read from the store."""

    def __init__(self, backend: Backend, since_ms: int, out: Any, fleet: Fleet) -> None:
        self.backend = backend
        self.fleet = fleet
        self.since_ms = since_ms
        self.t0 = time.monotonic()
        self.seen: dict[tuple[str, int, int], Any] = {}
        self.out = out

    def say(self, text: str) -> None:
        """Print one timeline line."""
        print(f"  {time.monotonic() - self.t0:6.1f}s  {text}", file=self.out, flush=True)

    async def poll(self) -> list[Attempt]:
        """Read the history and print what changed."""
        attempts = [a for a in await self.backend.history(None, 1000) if a.slot >= self.since_ms]
        for a in sorted(attempts, key=lambda a: (a.claimed_at, a.attempt)):
            key = (a.job, a.slot, a.attempt)
            old = self.seen.get(key, "new")
            if old == "new":
                backups = [n for n in self.fleet.alive if n != a.instance_id]
                standby = f"; {', '.join(backups)} stand by" if backups and not a.outcome else ""
                self.say(f"{a.instance_id} wins {a.job:<6} slot {_hms(a.slot)}  "
                         f"attempt {a.attempt} ({a.reason})"
                         + (f" -> {a.outcome}" if a.outcome else standby))
            elif a.outcome is not None and old is None:
                detail = f": {a.error}" if a.error and a.outcome != "completed" else ""
                self.say(f"{a.instance_id} {a.job:<6} slot {_hms(a.slot)}  attempt {a.attempt} "
                         f"-> {a.outcome}{detail}")
            self.seen[key] = a.outcome
        return attempts

    async def until(self, predicate: Any, limit: float, what: str) -> Any:
        """Poll until ``predicate(attempts)`` returns something truthy."""
        deadline = time.monotonic() + limit
        while True:
            attempts = await self.poll()
            found = await predicate(attempts)
            if found:
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(f"demo: timed out waiting for {what}")
            await anyio.sleep(0.2)


def _hms(ms: int) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ms / 1000))


# --------------------------------------------------------------------------- scenario


async def _scenario(fleet: Fleet, backend: Backend, out: Any) -> bool:
    since = await backend.now_ms()
    timeline = Timeline(backend, since, out, fleet)
    for name in NAMES:
        await fleet.start(name)
    timeline.say(f"instances {', '.join(NAMES)} started (lease {LEASE}, heartbeat {HEARTBEAT})")

    async def export_in_progress(attempts: list[Attempt], attempt: int = 1) -> Any:
        for a in attempts:
            if a.job == "export" and a.outcome is None and a.attempt == attempt:
                progress = await backend.get_checkpoint("export", a.slot) or 0
                if progress >= 3:
                    return a
        return None

    victim = await timeline.until(export_in_progress, 30, "an export run")
    progress = await backend.get_checkpoint("export", victim.slot)
    timeline.say(f"*** killing {victim.instance_id} mid-export "
                 f"(step {progress}/{STEPS}); no hand-over, the lease must expire")
    await fleet.kill(victim.instance_id)

    async def taken_over(attempts: list[Attempt]) -> Any:
        return next((a for a in attempts if a.job == "export" and a.slot == victim.slot
                     and a.attempt == 2 and a.outcome == "completed"), None)

    await timeline.until(taken_over, 30, "the takeover to complete")

    async def next_export(attempts: list[Attempt]) -> Any:
        found = await export_in_progress(attempts)
        return found if found and found.slot > victim.slot else None

    second = await timeline.until(next_export, 30, "the next export run")
    timeline.say(f"*** stopping {second.instance_id} gracefully: its run is handed over")
    stop_started = time.monotonic()
    await fleet.stop(second.instance_id)

    async def handed_over(attempts: list[Attempt]) -> Any:
        return next((a for a in attempts if a.job == "export" and a.slot == second.slot
                     and a.reason == "hand-over"), None)

    await timeline.until(handed_over, 10, "the hand-over")
    timeline.say(f"hand-over picked up {time.monotonic() - stop_started:.1f}s after stop "
                 f"(the lease is {LEASE})")

    async def hand_over_done(attempts: list[Attempt]) -> Any:
        return next((a for a in attempts if a.job == "export" and a.slot == second.slot
                     and a.reason == "hand-over" and a.outcome == "completed"), None)

    await timeline.until(hand_over_done, 30, "the handed-over run to complete")
    await fleet.stop_all()
    attempts = await timeline.poll()
    return verdict(attempts, victim.slot, second.slot, out)


def verdict(attempts: list[Attempt], killed: int, handed: int, out: Any) -> bool:
    """Print the history and the verdict checked in it; return True when it is OK.

    OK: no run completed twice, every run completed or was skipped, except the runs the
    last instances left when the fleet stopped (claimed, or handed over with no instance
    left to continue them, after slot ``handed``); the run at slot ``killed`` was taken
    over by attempt 2 and the one at ``handed`` handed over. The verdict counts each kind
    of run apart: only those that completed are said to have.
    """
    print("\nHistory (from the store, oldest first):", file=out)
    print(f"  {'job':<7}{'slot':<10}{'att':>4}  {'instance':<9}{'reason':<10}{'outcome'}",
          file=out)
    for a in sorted(attempts, key=lambda a: (a.slot, a.job, a.attempt)):
        print(f"  {a.job:<7}{_hms(a.slot):<10}{a.attempt:>4}  {a.instance_id:<9}"
              f"{a.reason!s:<10}{a.outcome or 'running'}", file=out)
    by_run: dict[tuple[str, int], list[Attempt]] = {}
    for a in attempts:
        by_run.setdefault((a.job, a.slot), []).append(a)
    problems = []
    kinds = {"completed": 0, "skipped": 0, "left": 0}
    for (job, slot), runs in sorted(by_run.items()):
        completed = [a for a in runs if a.outcome == "completed"]
        skipped = [a for a in runs if a.outcome == "skipped"]
        open_ = [a for a in runs if a.outcome is None]
        if open_ and not completed and slot > handed:
            kinds["left"] += 1  # claimed just before the last instance stopped
            continue
        if len(completed) > 1:
            problems.append(f"{job} {_hms(slot)} completed {len(completed)} times")
        elif completed:
            kinds["completed"] += 1
        elif skipped:
            kinds["skipped"] += 1
        elif _trailing(runs, handed):
            kinds["left"] += 1
        else:
            problems.append(f"{job} {_hms(slot)} never completed")
    killed_runs = by_run.get(("export", killed), [])
    if not any(a.reason == "takeover" and a.attempt == 2 and a.outcome == "completed"
               for a in killed_runs):
        problems.append("the killed export was not taken over")
    if not any(a.reason == "hand-over" and a.outcome == "completed"
               for a in by_run.get(("export", handed), [])):
        problems.append("the stopped export was not handed over")
    if problems:
        print(f"\nVERDICT: FAILED - {'; '.join(problems)}", file=out)
        return False
    checked = f"{len(by_run)} runs checked in the store: "
    if kinds["completed"] == len(by_run):
        checked += "each completed exactly once"
    else:
        checked += f"{kinds['completed']} completed exactly once"
        if kinds["skipped"]:
            checked += f", {kinds['skipped']} skipped"
        if kinds["left"]:
            checked += (f", {kinds['left']} left unfinished when the last instance "
                        "stopped (no instance was left to run them)")
    print(f"\nVERDICT: OK - {checked}; the killed run was taken over (attempt 2) and the "
          "stopped one handed over.", file=out)
    return True


def _trailing(runs: list[Attempt], handed: int) -> bool:
    # Runs still handed over when the whole fleet stopped: a later instance continues them.
    return all(a.outcome == "handed_over" for a in runs) and runs[0].slot > handed


@contextlib.contextmanager
def _embedded(kind: str) -> Iterator[str]:
    if kind == "postgres":
        from backends.embedded.postgres import embedded_postgres

        with embedded_postgres() as dsn:
            yield dsn
    else:
        from backends.embedded.redis import embedded_redis

        with embedded_redis() as url:
            yield url


def run_demo(backend: str = "postgres", url: str | None = None, out: Any = None, *,
             keep: bool = False, namespace: str | None = None) -> bool:
    """Run the demo; return True when the verdict checked in the store is OK.

    On PostgreSQL and Redis the store's tables or keys are created under ``namespace`` (a
    new ``anarchon_demo_<hex>`` by default), refused with
    :class:`~lease_core.demo.namespace.NamespaceInUse` when any of its names exists, and
    removed when the demo ends, however it ends, unless ``keep``.
    """
    out = out or sys.stdout
    if backend == "memory" and url is None:
        if keep or namespace is not None:
            raise ConfigurationError("--keep and --namespace are for a store given with "
                                     "--url: the memory store ends with the demo")
        return anyio.run(_memory_demo, out)
    if keep and url is None:
        raise ConfigurationError("--keep needs --url: the embedded server and all it holds "
                                 "are deleted when the demo ends")
    ns = namespace_for(url, namespace) if url is not None else None
    with contextlib.ExitStack() as stack:
        if url is None:
            print(f"Starting embedded {backend} ...", file=out, flush=True)
            url = stack.enter_context(_embedded(backend))
            ns = namespace_for(url, namespace)
        assert ns is not None
        print(f"Store: {_safe(url)}", file=out, flush=True)
        stack.enter_context(claimed(ns, "fleet", out, keep=keep, shown_url=_safe(url)))
        print("\nTimeline:", file=out, flush=True)
        result: bool = anyio.run(_process_demo, url, ns.name, out)
        return result


def _safe(url: str) -> str:
    from lease_core._redact import redact

    return redact(url)


async def _memory_demo(out: Any) -> bool:
    from backends.memory import MemoryBackend

    print("Store: memory (three schedulers as tasks in this process)\n\nTimeline:", file=out)
    backend = MemoryBackend()
    await backend.start()
    try:
        async with anyio.create_task_group() as tg:
            fleet = TaskFleet(tg, backend)
            ok = await _scenario(fleet, backend, out)
            tg.cancel_scope.cancel()
        return ok
    finally:
        await backend.close()


async def _process_demo(url: str, namespace: str, out: Any) -> bool:
    backend = backend_from_url(url, namespace=namespace)
    await backend.start()
    fleet = ProcessFleet(url, namespace)
    try:
        return await _scenario(fleet, backend, out)
    finally:
        fleet.close()
        await backend.close()
