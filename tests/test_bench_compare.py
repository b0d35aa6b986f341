"""The CI benchmark gate (benchmarks/compare.py): which ratios fail, and what is measured
again; and the benchmarks' logic that needs no timing (what each side sends, the ratios)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from backends.embedded.redis import EmbeddedRedis
from backends.redis import SCRIPTS, RedisBackend
from benchmarks import compare
from benchmarks.throughput import INSTANCE, LEASE_MS, redis_claim_command, redis_claim_won
from lease_core.abc import ClaimRequest


def _write(path: Path, ratios: dict[str, float]) -> Path:
    path.write_text(json.dumps({"ratios": ratios}))
    return path


def test_a_ratio_fails_only_when_every_measurement_regressed(tmp_path: Path) -> None:
    old = _write(tmp_path / "old.json", {"cpu.pg.r250.x": 2.0, "lease.pg.vs_y": 1.0})
    bad = _write(tmp_path / "bad.json", {"cpu.pg.r250.x": 1.0, "lease.pg.vs_y": 1.0})
    good = _write(tmp_path / "good.json", {"cpu.pg.r250.x": 1.9})
    assert compare.main([str(old), str(bad)]) == 1
    assert compare.main([str(old), str(bad), str(good)]) == 0
    assert compare.main([str(old), str(bad), str(bad)]) == 1


def test_a_ratio_missing_from_every_new_run_fails(tmp_path: Path) -> None:
    """A ratio the baseline tracks and no run produced fails (it passed, "only in old"),
    and its section is measured again; a ratio only in the new runs does not fail."""
    old = _write(tmp_path / "old.json", {"lease.pg.vs_y": 1.0, "burst.redis.100.z": 2.0})
    new = _write(tmp_path / "new.json", {"lease.pg.vs_y": 1.0, "cpu.pg.r250.x": 0.1})
    sections = tmp_path / "sections.txt"
    assert compare.main([str(old), str(new), "--sections-file", str(sections)]) == 1
    assert sections.read_text().strip() == "burst"
    again = _write(tmp_path / "again.json", {"burst.redis.100.z": 2.0})
    assert compare.main([str(old), str(new), str(again)]) == 0


def test_the_sections_behind_the_regressed_ratios_are_written(tmp_path: Path) -> None:
    old = _write(tmp_path / "old.json", {"cpu.memory.r2000.x": 1.0, "claim.pg.a": 1.0,
                                         "batch.pg.b": 1.0, "heartbeat.pg.n1.c": 1.0})
    new = _write(tmp_path / "new.json", {"cpu.memory.r2000.x": 0.5, "claim.pg.a": 0.5,
                                         "batch.pg.b": 0.5, "heartbeat.pg.n1.c": 1.0})
    sections = tmp_path / "sections.txt"
    assert compare.main([str(old), str(new), "--sections-file", str(sections)]) == 1
    assert sections.read_text().strip() == "cpu,peers,throughput"


def test_an_unknown_prefix_asks_for_every_section() -> None:
    assert compare.sections_of(["fleet_kill.pg.i5.t", "cpu.pg.r250.x"]) == ["cpu", "fleet_kill"]
    assert compare.sections_of(["somethingnew.pg.x", "cpu.pg.r250.x"]) == []


def test_every_tracked_prefix_names_a_real_section() -> None:
    from benchmarks.run import SECTIONS

    assert set(compare.SECTION_OF_PREFIX.values()) <= set(SECTIONS)
    baseline = compare.load_ratios(Path(compare.__file__).parent / "baseline-quick.json")
    assert compare.sections_of(sorted(baseline)), "a baseline ratio has no known section"


def test_a_ratio_that_is_not_a_number_fails(tmp_path: Path) -> None:
    """NaN compares false with everything: it passed as if it had not regressed."""
    old = _write(tmp_path / "old.json", {"lease.pg.vs_y": 1.0})
    nan = tmp_path / "nan.json"
    nan.write_text('{"ratios": {"lease.pg.vs_y": NaN}}')
    inf = tmp_path / "inf.json"
    inf.write_text('{"ratios": {"lease.pg.vs_y": Infinity}}')
    good = _write(tmp_path / "good.json", {"lease.pg.vs_y": 0.9})
    assert compare.main([str(old), str(nan)]) == 1
    assert compare.main([str(old), str(inf)]) == 1
    # a finite measurement among the runs is the best one, whichever file comes first
    assert compare.main([str(old), str(nan), str(good)]) == 0
    assert compare.main([str(old), str(good), str(nan)]) == 0


def test_a_baseline_or_threshold_that_gates_nothing_is_refused(tmp_path: Path) -> None:
    new = _write(tmp_path / "new.json", {"lease.pg.vs_y": 0.01})
    for bad in ("0", "-1.0", "NaN"):
        old = tmp_path / "old.json"
        old.write_text('{"ratios": {"lease.pg.vs_y": ' + bad + '}}')
        assert compare.main([str(old), str(new)]) == 2
    old = _write(tmp_path / "old.json", {"lease.pg.vs_y": 1.0})
    assert compare.main([str(old), str(new), "--threshold", "1"]) == 2
    assert compare.main([str(old), str(new), "--threshold", "-0.5"]) == 2
    assert compare.main([str(old), str(new), "--threshold", "0.5"]) == 1


def test_a_fleet_kill_trial_with_a_slot_never_claimed_fails_its_ratio() -> None:
    """The tracked ratio was (lease + heartbeat) ÷ the worst *claimed* next slot: a trial
    whose orphan missed its next slot, the one after claimed on time, kept it high."""
    from benchmarks import fleet_kill

    def trial(worst: int | None, unclaimed: int) -> dict[str, Any]:
        return {"next_slot_late_ms": {"max": worst}, "unclaimed_slots": unclaimed}

    fine = fleet_kill.summarise([trial(1000, 0), trial(1000, 0)])
    assert fine["met"] and fine["ratio_target_over_worst"]["median"] == 3.5
    for bad in ([trial(1000, 0), trial(900, 1), trial(900, 2)],
                [trial(None, 0), trial(None, 0)]):
        summary = fleet_kill.summarise(bad)
        assert not summary["met"]
        assert summary["ratio_target_over_worst"]["median"] == 0.0
    ratios = fleet_kill.ratios({"instances": 5, "stores": {"pg": summary}})
    assert ratios == {"fleet_kill.pg.i5.target_over_worst_next_slot": 0.0}


@pytest.mark.anyio
@pytest.mark.asyncio_only
async def test_the_raw_redis_claim_sends_what_the_library_sends(
        redis62_server: EmbeddedRedis) -> None:
    """The raw side of the Redis claim cells (throughput, cluster, cpu) sent 10 of the
    claim script's 12 arguments (no history sequence, no 'scheduled' flag): not the
    library's command. Both sides' claims, read back from the server's SLOWLOG."""
    client = redis.asyncio.Redis.from_url(redis62_server.url)
    prefix = "rawcmp"
    backend = RedisBackend(client, prefix=prefix)
    await backend.start()
    config = await client.config_get("slowlog-log-slower-than")
    try:
        await client.config_set("slowlog-log-slower-than", 0)
        await client.slowlog_reset()
        for slot in (1, 2):  # a new job, then a listed one (the marker and sequence kept)
            await backend.claim(ClaimRequest("lib", slot, INSTANCE, f"t{slot}", LEASE_MS))
        markers: dict[str, Any] = {}
        seqs: dict[str, int] = {}
        for slot in (1, 2):
            command = redis_claim_command(prefix, "raw", slot, f"t{slot}", markers, seqs)
            redis_claim_won("raw", await client.execute_command(*command), markers, seqs)
        log = await client.slowlog_get(128)
    finally:
        await client.config_set("slowlog-log-slower-than",
                                config["slowlog-log-slower-than"])
        await backend.close()
        await client.aclose()
    sent: dict[str, list[list[bytes]]] = {"lib": [], "raw": []}
    for entry in reversed(log):  # oldest first
        args = entry["command"].split(b" ")
        if args[0].upper() == b"EVALSHA" and args[1] == SCRIPTS["claim"].sha.encode():
            side = "lib" if b"/lib}" in args[3] else "raw"
            sent[side].append([a.replace(b"/raw}", b"/lib}") for a in args])
    assert len(sent["lib"]) == 2
    assert sent["raw"] == sent["lib"]
