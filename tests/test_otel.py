"""OpenTelemetry metrics from a scheduler's events, and the Prometheus example of the docs."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

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
