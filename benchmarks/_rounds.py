"""Interleaved rounds of sequential contenders, the loop the lease and A/B benchmarks share.

Each contender is ``fn(i)``, called one after the other for a turn of ``seconds``; the
rounds rotate the order (reversed every other round) so that a busy moment of a shared
machine moves one contender's turn, not always the same one's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

__all__ = ["Op", "interleave", "turn"]

Op = Callable[[int], Awaitable[None]]


async def turn(fn: Op, seconds: float, start_at: int) -> tuple[float, float, int]:
    """Run ``fn`` for ``seconds``: operations per second, CPU seconds per op, next i."""
    i = start_at
    cpu, wall = time.process_time(), time.perf_counter()
    while time.perf_counter() - wall < seconds:
        await fn(i)
        i += 1
    elapsed, used = time.perf_counter() - wall, time.process_time() - cpu
    done = max(1, i - start_at)
    return done / elapsed, used / done, i


async def interleave(contenders: dict[str, Op], *, rounds: int, seconds: float,
                     warm_up: float = 0.1) -> tuple[dict[str, list[float]],
                                                   dict[str, list[float]]]:
    """A warm-up turn each, then ``rounds`` rounds; per contender, the operations per
    second and the CPU seconds per operation of each round."""
    names = list(contenders)
    rate: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    nexts = dict.fromkeys(names, 0)
    for name in names:  # warm-up: connections, scripts, plans
        _, _, nexts[name] = await turn(contenders[name], min(warm_up, seconds), nexts[name])
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order.reverse()
        for name in order:
            ops, per_op, nexts[name] = await turn(contenders[name], seconds, nexts[name])
            rate[name].append(ops)
            cpu[name].append(per_op)
    return rate, cpu
