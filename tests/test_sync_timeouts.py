"""The blocking calls of the sync front ends give up on a store that stopped answering.

Through a network partition (a proxy that stops forwarding without closing), a query
waits for the kernel's TCP timeout, many minutes: ``SyncScheduler.history()``,
``SyncAdmin`` operations, ``SyncLease.current_holder()`` and ``SyncLease.release()``
blocked their thread (a web view, a shutdown hook) as long as the partition lasted, with
no way for sync code to bound them. Each now gives up after its bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from backends.postgres import PostgresBackend
from lease_core import ConfigurationError, MemoryBackend, SyncAdmin, SyncLease, SyncScheduler
from lease_core.errors import BackendUnavailable
from tests.chaos.proxy import Proxy, proxy_in_front, with_port
from tests.stores.postgres import PgServer, drop_tables, unique_table


def _timed(calls: dict[str, Callable[[], object]]) -> dict[str, tuple[object, float]]:
    """Make the calls at once, each in a thread of its own; return how each ended, and
    when. A call still blocked a minute in fails the test (it would block for minutes)."""
    ended: dict[str, tuple[object, float]] = {}

    def run(name: str, call: Callable[[], object]) -> None:
        started = time.monotonic()
        try:
            outcome: object = call()
        except Exception as exc:
            outcome = exc
        ended[name] = (outcome, time.monotonic() - started)

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), (
        f"still blocked a minute into the partition; ended: {ended}")
    return ended


def test_sync_calls_give_up_through_a_partition(pg16_server: PgServer,
                                                caplog: pytest.LogCaptureFixture) -> None:
    table = unique_table()
    try:
        with proxy_in_front(pg16_server.dsn) as proxy, \
                caplog.at_level(logging.WARNING, logger="anarchon"):
            ended, held = _calls_through_a_partition(
                proxy, PostgresBackend(with_port(pg16_server.dsn, proxy.port), table=table))
    finally:
        anyio.run(drop_tables, pg16_server.admin_dsn, table)
    for name, what, bound in [("history", "SyncScheduler.history()", 1),
                              ("paused", "SyncAdmin.paused()", 1),
                              ("ops paused", "SyncAdmin.paused()", 1),
                              ("holder", "SyncLease 'partition'.current_holder()", 5)]:
        error, took = ended[name]
        assert isinstance(error, BackendUnavailable), (name, error)
        assert str(error).startswith(f"{what}: the store did not answer within {bound} s")
        assert "nothing was read" in str(error)
        assert took < bound + 15, (name, took)  # never the partition's length
    returned, took = ended["release"]
    assert returned is None, returned  # given up (the name frees at its ttl), not raised
    assert not held
    assert any("did not answer its release within 2 s" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def _calls_through_a_partition(proxy: Proxy, backend: PostgresBackend,
                               ) -> tuple[dict[str, tuple[object, float]], bool]:
    """Use ``backend`` (through ``proxy``) while it answers, pause the proxy, and make
    each blocking call; return how each ended and whether the lease is held after."""
    scheduler = SyncScheduler(backend, call_timeout="1s")
    admin = SyncAdmin(backend, by="ops", call_timeout="1s")
    lease = SyncLease(backend, "partition", ttl="2s")
    # Answered while the network works (the store made, the connections open).
    assert lease.acquire(timeout=0)
    assert lease.current_holder() is not None
    assert scheduler.history() == []
    assert admin.paused() == {}
    proxy.pause()
    ended = _timed({
        "history": scheduler.history,
        "paused": admin.paused,
        "ops paused": scheduler.admin.paused,
        "holder": lease.current_holder,
        "release": lease.release,
    })
    return ended, lease.held


class _SilentOperations(MemoryBackend):
    """A memory store whose operations never answer (as through a partition)."""

    async def operate(self, *args: Any, **kwargs: Any) -> Any:
        await anyio.sleep_forever()


def test_a_write_given_up_says_it_may_have_been_made() -> None:
    """A SyncAdmin operation given up may still reach the store: its error says so."""
    backend = _SilentOperations()
    scheduler = SyncScheduler(backend)
    scheduler.every("nightly", "1h", lambda ctx: None)
    scheduler.start()  # records the job in the store
    scheduler.stop()
    admin = SyncAdmin(backend, call_timeout=0.2)
    with pytest.raises(BackendUnavailable) as raised:
        admin.pause("nightly")
    assert str(raised.value).startswith("SyncAdmin.pause(): the store did not answer "
                                        "within 0.2 s")
    assert "may still have been made" in str(raised.value)


@pytest.mark.parametrize("bad", [0, -1, "soon", True])
def test_a_bad_call_timeout_is_refused(bad: object) -> None:
    for make in (lambda: SyncScheduler(MemoryBackend(), call_timeout=bad),
                 lambda: SyncAdmin(MemoryBackend(), call_timeout=bad)):
        with pytest.raises(ConfigurationError, match="call_timeout"):
            make()
