"""Leader election with a Lease: one process of the fleet leads, the others wait.

Run it in several terminals against one store; exactly one prints "leading". Stop the
leader (Ctrl-C or SIGTERM, or kill it) and another takes over: at its next try, within a second,
after a clean exit (the lease is released), within the ttl after a crash. A store that
stops answering makes the leader step down (within the ttl) and every process stand by,
trying again each second, until it answers.

    python docs/examples/leader_election.py redis://localhost:6379/0
    python docs/examples/leader_election.py postgresql://localhost/postgres
"""

from __future__ import annotations

import signal
import sys

import anyio

from lease_core import BackendUnavailable, Lease, LeaseLost, backend_from_url
from lease_core.abc import Backend


async def lead(lease: Lease) -> None:
    """The leader's work; ``lease.token`` fences what it writes elsewhere."""
    print(f"leading with token {lease.token}", flush=True)
    await anyio.sleep_forever()


async def elect(backend: Backend, name: str = "leader", *, ttl: str = "10s",
                terms: int | None = None) -> list[int]:
    """Hold ``name`` for the life of the process, again after each loss; return the
    tokens of the terms served (``terms`` ends it after that many, for tests)."""
    tokens: list[int] = []
    while terms is None or len(tokens) < terms:
        lease = Lease(backend, name, ttl=ttl)
        try:
            async with lease:  # waits until this process leads
                assert lease.token is not None
                tokens.append(lease.token)
                await lead(lease)
        except LeaseLost as exc:  # the store stopped answering: the body was cancelled
            print(f"lost the lead: {exc}", flush=True)
        except BackendUnavailable as exc:  # the acquire could not reach the store
            print(f"store unavailable ({exc}); trying again in 1 s", flush=True)
            await anyio.sleep(1)
    return tokens


async def main(url: str) -> None:
    """Lead until Ctrl-C or SIGTERM (what a container runtime sends), then step down:
    the lease is released on the way out, so another process leads at its next try."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(elect, backend_from_url(url))
            async for _ in signals:
                tg.cancel_scope.cancel()
                break
    print("stepped down", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "memory://")
