"""The fence handed to systems outside the store: ``fence_of`` and ``ctx.fence``."""

from __future__ import annotations

import anyio
import pytest

from backends.redis import RedisBackend
from lease_core import RunContext, Scheduler, fence_of
from lease_core._structures import FENCE_NUMBER_BITS
from lease_core.testing import claim_now
from tests.helpers import Instance, quiet_offset, store_now_ms, wait_for
from tests.stores import Store


def test_a_later_epoch_fences_above_every_number_of_an_earlier_one() -> None:
    top = (1 << FENCE_NUMBER_BITS) - 1
    assert fence_of(0, 3) == 3
    assert fence_of(1_790_000_000_000, 1) > fence_of(1_789_999_999_999, top)
    assert fence_of(7, 2) > fence_of(7, 1)


@pytest.mark.parametrize(("epoch", "number"), [(-1, 1), (0, -1), (0, 1 << FENCE_NUMBER_BITS)])
def test_fence_of_refuses_a_value_out_of_range(epoch: int, number: int) -> None:
    with pytest.raises(ValueError, match=rf"fence_of\({epoch}, {number}\)"):
        fence_of(epoch, number)


@pytest.mark.anyio
async def test_with_no_loss_detected_the_fence_is_the_attempt_number(store: Store) -> None:
    """On PostgreSQL and in memory; on Redis a job new to the server starts an epoch (it
    may have lost its keys with no caller left that saw them), so its fence is the
    attempt number above that epoch."""
    started = await store_now_ms(store.backend())
    offset = quiet_offset(started)
    seen: list[tuple[int, int]] = []
    s = Scheduler(store.backend(), instance_id="a", lease="2s", heartbeat="0.5s")

    @s.every("fenced", "1h", offset=offset)
    async def fenced(ctx: RunContext) -> None:
        seen.append((ctx.attempt, ctx.fence))

    async with anyio.create_task_group() as tg:
        inst = await Instance(s).start(tg)
        slot = s.jobs["fenced"].schedule.previous_at_or_before(s.store_now_ms())
        assert slot is not None
        await claim_now(s, "fenced", slot)
        await wait_for(lambda: bool(seen), timeout=10, what="the run")
        await inst.stop()
    [(attempt, fence)] = seen
    assert attempt == 1
    if isinstance(s.backend, RedisBackend):
        epoch = fence >> FENCE_NUMBER_BITS
        assert epoch >= started and fence == fence_of(epoch, 1)
    else:
        assert fence == 1
