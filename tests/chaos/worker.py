"""One chaos worker: an OS process running a scheduler until SIGTERM (or SIGKILL).

Started by the coordinator as ``python -m tests.chaos.worker CONFIG_JSON``. It prints
``started`` once its scheduler runs. Every handler writes an append-only record of what
it did (one JSON line per event, ``O_APPEND``) to the worker's log file, checkpoints its
progress, and on PostgreSQL writes its effect inside ``ctx.transaction()``.

On request (``zombie`` faults, see :class:`Freezer`) the process stops itself (SIGSTOP)
just before its next fenced write of a kind (a checkpoint, a fenced transaction, a
finish): the coordinator keeps it stopped past its lease, and the write goes out as it
resumes, a superseded attempt's, which the store must refuse.

With ``skew`` set, the process's wall clock (``time.time``) and the scheduler's local
clock are both shifted by that many seconds: leases follow the store's clock, so a
skewed worker must behave exactly like the others.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import anyio

from lease_core import LeaseLost, Retry, RunContext, Scheduler, backend_from_url, fence_of

__all__ = ["main"]

_real_time = time.time


class EventLog:
    """Append-only JSON lines; each line is one ``write`` on an ``O_APPEND`` descriptor."""

    def __init__(self, path: str, instance: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.instance = instance

    def write(self, event: str, ctx: RunContext, **fields: Any) -> None:
        """Record ``event`` of the attempt ``ctx`` with the real (unskewed) wall time."""
        self.raw({"e": event, "j": ctx.job, "s": ctx.slot, "a": ctx.attempt,
                  "f": ctx.fence, "i": self.instance, "t": _real_time(), **fields})

    def raw(self, record: dict[str, Any]) -> None:
        """Append one record as it is."""
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


class Freezer:
    """Stops this process just before a fenced write, once, when the coordinator asks.

    The coordinator writes the kind of write (``cp``, ``tx``, ``fin``) to the file
    ``path``; the first write of that kind takes the request (renames the file, so a
    request the coordinator withdraws is never taken late), records ``freeze`` and stops
    the process (SIGSTOP) before the write is sent. Nothing checks the lease between the
    resume and the write: as a process paused between its check and its write, the
    write reaches the store from an attempt that may have been superseded meanwhile.
    The write is made through :meth:`sent`, shielded: without that, the handler's
    cancellation by its local lease deadline (due at once on resume) took most of them
    before they were sent, and the store's fencing was not put to the test.
    """

    def __init__(self, path: str | None, log: EventLog) -> None:
        self.path, self.log = path, log

    def before(self, kind: str, job: str, slot: int, token: str) -> bool:
        """Called just before a fenced write of ``kind`` of the run (job, slot); True when
        the process stopped (the write is then to be made through :meth:`sent`)."""
        if self.path is None or not os.path.exists(self.path):
            return False
        try:
            with open(self.path) as request:
                if request.read().strip() != kind:
                    return False
            os.rename(self.path, self.path + ".taken")
        except OSError:
            return False  # withdrawn meanwhile
        self.log.raw({"e": "freeze", "w": kind, "j": job, "s": slot, "k": token,
                      "i": self.log.instance, "t": _real_time()})
        os.kill(os.getpid(), signal.SIGSTOP)
        return True

    async def sent(self, kind: str, job: str, slot: int, token: str, write: Any) -> Any:
        """Await ``write`` (the frozen write), shielded from cancellation, and record
        ``thawed`` with what became of it: ``ok`` (its answer) or the exception raised."""
        outcome: Any = "cancelled"
        try:
            with anyio.CancelScope(shield=True):
                result = await write
            outcome = result if isinstance(result, bool | list) else True
            return result
        except Exception as exc:
            outcome = type(exc).__name__
            raise
        finally:
            self.log.raw({"e": "thawed", "w": kind, "j": job, "s": slot, "k": token,
                          "ok": outcome, "i": self.log.instance, "t": _real_time()})


def acknowledged(backend: Any, log: EventLog, freezer: Freezer | None = None) -> None:
    """Record every claim the store acknowledged as won (``claim``: with its token, fence,
    the store's time ``n`` and the lease's expiry ``x``, in ms), every lease renewal it
    acknowledged (``hb``: by token, ``x`` an expiry it set at the earliest, the real time
    the renewal was sent plus the lease) and every finish it acknowledged (``fin``: by
    token, ``w`` the real time it was sent), so the audit can tell when each attempt
    surely held a live lease, find a superseded attempt's finish the store took, and find
    the acknowledged commits a failover lost."""
    claim_many, finish_many, beat = backend.claim_many, backend.finish_many, backend.heartbeat
    set_checkpoint = backend.set_checkpoint
    freezer = freezer or Freezer(None, log)

    async def claims(requests: Any) -> Any:
        results = await claim_many(requests)
        for request, result in zip(requests, results, strict=True):
            if str(result.status) == "won":
                log.raw({"e": "claim", "j": result.job, "s": result.slot, "a": result.attempt,
                         "f": fence_of(result.epoch, result.attempt), "k": request.token,
                         "n": result.now_ms, "x": result.expires_ms,
                         "i": log.instance, "t": _real_time()})
            elif str(result.status) == "skipped":  # a skip recorded (sentinelfix)
                log.raw({"e": "skip", "j": result.job, "s": result.slot,
                         "i": log.instance, "t": _real_time()})
        return results

    async def finishes(items: Any) -> Any:
        froze = bool(items) and freezer.before("fin", items[0][0].job, items[0][0].slot,
                                               items[0][0].token)
        sent = _real_time()  # (the store's time of the finish is later: "w", in ms)
        if froze:
            lease = items[0][0]
            done = await freezer.sent("fin", lease.job, lease.slot, lease.token,
                                      finish_many(items))
        else:
            done = await finish_many(items)
        for (lease, outcome, _), ok in zip(items, done, strict=True):
            if ok:
                log.raw({"e": "fin", "j": lease.job, "s": lease.slot, "k": lease.token,
                         "o": str(outcome), "w": int(sent * 1000), "i": log.instance,
                         "t": _real_time()})
        return done

    async def heartbeat(leases: Any) -> Any:
        # The store renews at its own time, on this machine's clock, after this instant:
        # each renewed lease is live until sent + lease_ms at least.
        sent = _real_time()
        result = await beat(leases)
        renewed = result.held if result.renewed is None else result.renewed
        for lease in leases:
            if lease.token in renewed:
                log.raw({"e": "hb", "j": lease.job, "s": lease.slot, "k": lease.token,
                         "x": int(sent * 1000) + lease.lease_ms, "i": log.instance,
                         "t": _real_time()})
        return result

    async def checkpoint(lease: Any, value: Any) -> Any:
        if freezer.before("cp", lease.job, lease.slot, lease.token):
            return await freezer.sent("cp", lease.job, lease.slot, lease.token,
                                      set_checkpoint(lease, value))
        return await set_checkpoint(lease, value)

    async def claim(request: Any) -> Any:
        (result,) = await claims([request])
        return result

    async def finish(lease: Any, outcome: Any, error: Any = None) -> Any:
        (ok,) = await finishes([(lease, outcome, error)])
        return ok

    backend.claim_many, backend.finish_many, backend.heartbeat = claims, finishes, heartbeat
    backend.claim, backend.finish = claim, finish
    backend.set_checkpoint = checkpoint


class TransientFailure(Exception):
    """The flaky job's failure, which its retry policy retries."""


def build(config: dict[str, Any], log: EventLog) -> Scheduler:
    """The scheduler of one worker, with the chaos jobs declared."""
    backend = backend_from_url(config["url"], **config["options"])
    freezer = Freezer(config.get("freeze"), log)
    acknowledged(backend, log, freezer)
    skew = float(config.get("skew", 0.0))
    scheduler = Scheduler(
        backend, instance_id=config["instance"], lease=config["lease"],
        heartbeat=config["heartbeat"], history_size=1_000_000,
        clock=(lambda: time.monotonic() + skew) if skew else None,
    )
    steps = int(config["steps"])
    step_s = float(config["step_s"])
    fenced = bool(config["fenced"])
    effects = config.get("effects_table", "chaos_effects")

    async def effect(ctx: RunContext) -> bool:
        async with ctx.transaction() as tx:
            await tx.execute(
                f"INSERT INTO {effects} (job, slot, attempt, instance) "
                "VALUES (%s, %s, %s, %s)",
                (ctx.job, ctx.slot, ctx.attempt, ctx.instance_id),
            )
        return True

    async def handler(ctx: RunContext) -> None:
        stored = await ctx.checkpoint.get()
        log.write("start", ctx, cp=stored, r=str(ctx.reason))
        step = int(stored["step"]) if stored else 0
        # Every attempt writes at least once, so the last writer is known.
        last = {"a": ctx.attempt, "step": step}
        await ctx.checkpoint.set(last)
        log.write("cp", ctx, step=step)
        if step >= steps:
            # Taken over after its last step: it still takes a step's time, so that a
            # superseded attempt's late finish (a zombie fault) can meet it running.
            await anyio.sleep(step_s)
        for n in range(step, steps):
            await anyio.sleep(step_s)
            seen = await ctx.checkpoint.get()
            if seen != last:
                # Only this attempt may write while it holds the run.
                log.write("cp_foreign", ctx, seen=seen, expected=last)
            last = {"a": ctx.attempt, "step": n + 1}
            await ctx.checkpoint.set(last)
            log.write("cp", ctx, step=n + 1)
        if fenced:
            froze = freezer.before("tx", ctx.job, ctx.slot, ctx.token)
            try:
                if froze:
                    await freezer.sent("tx", ctx.job, ctx.slot, ctx.token, effect(ctx))
                else:
                    await effect(ctx)
            except LeaseLost:
                raise
            except Exception as exc:
                if "duplicate key" in str(exc) or "unique" in str(exc).lower():
                    log.write("tx_dup", ctx, error=str(exc)[:200])
                raise
            log.write("tx", ctx)
        log.write("done", ctx)

    flaky_ms = int(config["jobs"][0][1])

    # The flaky job's handler outlives this timeout on the turns it times out.
    flaky_timeout = 3 * step_s

    def flaky(ctx: RunContext) -> None:
        # A sync handler (it runs in a thread). Every other run fails on its first try,
        # transiently, and is retried within its run: half of those raise, half outlive
        # their timeout (the thread goes on after the scheduler gave up on it, then
        # returns): the retry must wait for the thread, not start beside it.
        log.write("rstart", ctx, r=str(ctx.reason))
        turn = ctx.slot // flaky_ms
        if ctx.reason != "retry" and turn % 4 == 2:
            time.sleep(flaky_timeout + 4 * step_s)
            log.write("rfail", ctx, why="timed out")
            return
        time.sleep(step_s)
        if ctx.reason != "retry" and turn % 2 == 0:
            log.write("rfail", ctx)
            raise TransientFailure("the ledger is busy (chaos)")
        log.write("rdone", ctx)

    if config.get("flaky"):
        scheduler.every("flaky", f"{flaky_ms}ms", flaky, timeout=flaky_timeout,
                        retry=Retry(retries=3, backoff="100ms", jitter=0.2))

    for name, interval_ms, overlap, offset_ms in config["jobs"]:
        scheduler.every(name, f"{interval_ms}ms", handler, overlap=overlap,
                        offset=f"{offset_ms}ms" if offset_ms else None,
                        timeout=config.get("timeout", "20s"))
    return scheduler


def main(argv: list[str]) -> None:
    """Run one worker with the JSON configuration ``argv[0]``."""
    config = json.loads(argv[0])
    skew = float(config.get("skew", 0.0))
    if skew:
        time.time = lambda: _real_time() + skew
    log = EventLog(config["log"], config["instance"])
    if config.get("verbose"):
        # The library's own log (claims retried, leases lost, ...) on stderr, with times.
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr,
            format="%(created).3f %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            scheduler = build(config, log)
            async with scheduler:
                print("started", flush=True)
                async for _ in signals:
                    break
                await scheduler.stop(grace=config.get("grace", "5s"))

    anyio.run(run)


if __name__ == "__main__":
    main(sys.argv[1:])
