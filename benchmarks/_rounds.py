"""Interleaved rounds of sequential contenders, the loop the lease and A/B benchmarks share,
and :func:`load_tree`, which the A/B tools use to import two checkouts side by side.

Each contender is ``fn(i)``, called one after the other for a turn of ``seconds``; the
rounds rotate the order (reversed every other round) so that a busy moment of a shared
machine moves one contender's turn, not always the same one's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["Op", "interleave", "load_tree", "round_order", "turn"]

T = TypeVar("T")

#: The project's top-level packages, imported afresh from each tree.
PACKAGES = ("adapters", "backends", "lease_core", "benchmarks")

Op = Callable[[int], Awaitable[None]]


def load_tree(tree: str, imports: Callable[[], T]) -> T:
    """Call ``imports`` with the project's packages imported afresh from checkout ``tree``.

    The modules already loaded stay alive through the objects that hold them, so two
    trees' classes can run side by side in one process.
    """
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    try:
        return imports()
    finally:
        sys.path.remove(tree)


def round_order(names: list[str], r: int) -> list[str]:
    """The contenders' order in round ``r``: rotated by ``r``, reversed every other full
    rotation. (Reversing every other *round* cancels the rotation when there are two
    contenders, and halves the rotations with four: the same one always went first.)"""
    order = names[r % len(names):] + names[:r % len(names)]
    if (r // len(names)) % 2:
        order.reverse()
    return order


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
        for name in round_order(names, r):
            ops, per_op, nexts[name] = await turn(contenders[name], seconds, nexts[name])
            rate[name].append(ops)
            cpu[name].append(per_op)
    return rate, cpu
