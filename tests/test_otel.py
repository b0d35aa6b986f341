"""OpenTelemetry metrics from a scheduler's events, and the Prometheus example of the docs."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import lease_core.engine.base
from lease_core import MemoryBackend, Outcome, RunContext, Scheduler
from lease_core.otel import instrument
from lease_core.testing import claim_now
from tests.helpers import quiet_offset_now, wait_for, wait_history

pytestmark = pytest.mark.anyio

FAST = {"lease": "1.2s", "heartbeat": "0.2s"}


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def current_slot(s: Scheduler, job: str) -> int:
    slot = s.jobs[job].schedule.previous_at_or_before(s.store_now_ms())
    assert slot is not None
    return slot


async def test_attempts_durations_and_leases_held() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)
    release = anyio.Event()

    @s.every("ok", "1h", catch_up="none", offset=quiet_offset_now())
    async def ok(ctx: RunContext) -> None:
        await release.wait()

    @s.every("boom", "1h", catch_up="none", offset=quiet_offset_now())
    async def boom(ctx: RunContext) -> None:
        raise ValueError("boom")

    instrument(s, meter_provider=provider)
    async with s:
        for job in ("ok", "boom"):
            await claim_now(s, job, current_slot(s, job))

        def held() -> dict[str, int]:
            found = points(reader).get("anarchon.leases.held", [])
            return {p.attributes["job"]: p.value for p in found}

        await wait_for(lambda: held().get("ok") == 1, what="one lease held")
        release.set()
        await wait_history(s, lambda h: len(h) == 2 and all(a.outcome for a in h))
        await wait_for(lambda: held() == {"ok": 0, "boom": 0}, what="no lease held")
        found = points(reader)
    attempts = {(p.attributes["job"], p.attributes["reason"], p.attributes["outcome"]): p.value
                for p in found["anarchon.attempts"]}
    assert attempts == {("ok", "scheduled", "completed"): 1, ("boom", "scheduled", "failed"): 1}
    runs = {(p.attributes["job"], p.attributes["outcome"]): p.count
            for p in found["anarchon.run.duration"]}
    assert runs == {("ok", Outcome.COMPLETED): 1, ("boom", Outcome.FAILED): 1}
    claims = {(p.attributes["job"], p.attributes["status"]): p.count
              for p in found["anarchon.claim.duration"]}
    assert claims == {("ok", "won"): 1, ("boom", "won"): 1}
    assert all(p.sum >= 0 for p in found["anarchon.claim.duration"])


async def test_a_burst_of_more_jobs_than_the_event_buffer_is_counted_in_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job due at the same instant: their claims are settled, and their Claimed
    events made, in one go, faster than any subscriber takes them. With more jobs than
    EVENT_BUFFER (1,000), the instrument's buffer overflowed at each burst, however fast
    it recorded: attempts went uncounted, and anarchon.leases.held fell below zero (the
    ends of attempts whose claims were dropped). A subscriber's buffer holds a burst of
    every declared job."""
    monkeypatch.setattr(lease_core.engine.base, "EVENT_BUFFER", 20)  # as 1,000, cheaper
    jobs = 60
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    s = Scheduler(MemoryBackend(), instance_id="a", lease="10s", heartbeat="1s")
    slot = (int(time.time() * 1000) + 1500) // 1000 * 1000 + 1000  # memory: wall clock

    async def handler(ctx: RunContext) -> None:
        pass

    for j in range(jobs):
        s.every(f"burst-{j}", "1h", handler, offset=(slot % 3_600_000) / 1000,
                catch_up="none")
    instrument(s, meter_provider=provider)
    async with s:
        await wait_history(s, lambda h: len([a for a in h if a.slot == slot and a.outcome
                                             is Outcome.COMPLETED]) == jobs,
                           timeout=15)

        def counted() -> float:
            return sum(p.value for p in points(reader).get("anarchon.attempts", []))

        await wait_for(lambda: counted() >= jobs, what="every attempt counted")
        found = points(reader)
    assert s.events_dropped == 0
    assert counted() == jobs
    assert {p.value for p in found["anarchon.leases.held"]} == {0}, "no lease held"
    assert len(found["anarchon.leases.held"]) == jobs


@pytest.mark.asyncio_only
async def test_the_readme_prometheus_example_serves_the_metrics() -> None:
    readme = (Path(__file__).parent.parent / "docs" / "pages" / "guides" / "operating.md"
              ).read_text()
    match = re.search(r"```python\n(from opentelemetry.exporter.prometheus.*?)```", readme, re.S)
    assert match, "the Prometheus example of docs/pages/guides/operating.md"
    namespace: dict[str, Any] = {}
    exec(match.group(1), namespace)

    s = Scheduler(MemoryBackend(), instance_id="a", **FAST)

    @s.every("ok", "1h", catch_up="none", offset=quiet_offset_now())
    async def ok(ctx: RunContext) -> None:
        pass

    server, provider = namespace["expose_metrics"](s, port=0)
    try:
        async with s:
            await claim_now(s, "ok", current_slot(s, "ok"))
            url = f"http://127.0.0.1:{server.server_port}/metrics"

            def scraped() -> str:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return str(response.read().decode())

            async def counted() -> bool:
                text = await anyio.to_thread.run_sync(scraped)
                return any(
                    line.startswith("anarchon_attempts_total{") and line.endswith("} 1.0")
                    and all(label in line for label in (
                        'job="ok"', 'outcome="completed"', 'reason="scheduled"'))
                    for line in text.splitlines()
                )

            await wait_for(counted, what="the attempt scraped")
    finally:
        server.shutdown()
        server.server_close()
        provider.shutdown()
