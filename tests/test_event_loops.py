"""A backend and its adapter keep nothing bound to one event loop, and leave nothing on one.

An adapter made at every start of a backend (one from a DSN or a URL) must leave nothing
behind on a loop that runs for the life of the process (the sync front ends' background
loop, a service's own). Real servers: the embedded PostgreSQL 16.
"""

from __future__ import annotations

import gc
import uuid

import anyio
import pytest

from backends.postgres import PostgresBackend
from lease_core import Lease
from tests.stores.postgres import PgServer


def _anyio_primitives() -> int:
    """How many anyio limiters and locks are alive (after a collection)."""
    gc.collect()
    kinds = (anyio.CapacityLimiter, anyio.Lock)
    return sum(1 for o in gc.get_objects() if isinstance(o, kinds))


@pytest.mark.anyio
async def test_leases_on_a_dsn_backend_leave_nothing_on_the_event_loop(
    pg16_server: PgServer,
) -> None:
    """Each start of a backend made from a DSN makes a new adapter, whose worker threads
    and slots have a limiter per loop: they went when the adapter went, not when the
    loop ends (two limiters stayed on the loop per lease taken and released, for good on
    the sync front ends' loop, which runs as long as the process)."""
    url = pg16_server.dsn.replace("postgresql://", "postgresql+pg8000://", 1)
    backend = PostgresBackend(url, table=f"anarchon_loops_{uuid.uuid4().hex[:10]}")
    counts = []
    for cycle in range(45):
        async with Lease(backend, "loops", ttl="5s"):
            pass
        if cycle in (4, 44):
            counts.append(_anyio_primitives())
    assert counts[1] - counts[0] < 10, f"anyio limiters and locks alive: {counts}"
