"""The Markdown report and the PNG plots, made from a results JSON."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["plots", "ratios", "targets", "write_markdown"]

#: library / raw in every claim cell (pg8000 included).
CLAIM_TARGET = 0.8
#: Issue 18: runs per client CPU-second with spread slots, and highest/lowest load.
CPU_RUNS_TARGET = 3000
CPU_FLAT_TARGET = 0.8
#: Lease peers doing the same work as the ``Lease`` (on the same kind of connection, or
#: handing out a fencing token too; benchmarks/lease.py): their ratios are reported, but
#: the issue's targets are against the other peers.
LEASE_FAIRER_PEERS = frozenset({"shedlock_upsert_psycopg_pool", "fenced_lock_script",
                                "shedlock_fenced_raw_psycopg"})
#: anarchon claim+finish / redis-py asyncio Lock acquire+release (median per round).
REDIS_PEER_TARGET = 1.0
#: anarchon claim+finish / ShedLock upsert+unlock through raw psycopg (median per round):
#: issue 18 item 5 (a claim keeps history, an upsert does not).
PG_PEER_TARGET = 0.6
REDUCTION_TARGET = 10.0
#: A burst of jobs due at one instant: peer ÷ anarchon, round trips and time.
BURST_ROUND_TRIPS_TARGET = 5.0
BURST_TIME_TARGET = 3.0
#: Below this much store CPU on either side (seconds, the median of the bursts), a burst's
#: store-CPU ratio is reported but not tracked: a few milliseconds of redis-server CPU are
#: within the kernel's accounting noise, so the ratio of two such figures is bimodal.
BURST_STORE_CPU_FLOOR_S = 0.05
#: The sections whose module reports its own ratios, targets and Markdown.
SECTION_MODULES = ("fleet", "fleet_kill", "burst_fleet")
#: The peer each store's target is judged against.
PEER_OF_TARGET = {"redis": ("redis_py_asyncio_lock", REDIS_PEER_TARGET),
                  "pg": ("shedlock_upsert_raw_psycopg", PG_PEER_TARGET)}


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Every figure compare.py tracks, each oriented so that higher is better."""
    out: dict[str, float] = {}
    for cell in results.get("throughput", {}).get("cells", []):
        out[cell["key"]] = cell["ratio"]
    for row in results.get("heartbeat", []):
        if row.get("ratio"):
            out[row["key"] + ".speed_vs_raw"] = row["ratio"]
    for row in results.get("load", []):
        factor = row.get("reduction") or row.get("reduction_round_trips")
        if factor:
            out[row["key"] + ".reduction_vs_model"] = factor
    peers = results.get("peers", {})
    for store in ("redis", "pg"):
        for name, spread in peers.get(store, {}).get("ratio", {}).items():
            out[f"peers.{store}.vs_{name}"] = spread["median"]
    for key, section in peers.get("batch", {}).items():
        spread = section["ratio"]["claim_one_at_a_time"]
        out[f"batch.{key}.vs_one_at_a_time"] = spread["median"]
    cluster = results.get("cluster", {})
    for name, section in cluster.items():
        if isinstance(section, dict) and "ratio" in section:
            out[f"cluster.redis.{name}.vs_raw"] = section["ratio"]["raw"]["median"]
    for key, cell in results.get("burst", {}).items():
        for figure, spread in cell["ratio_peer_over_anarchon"].items():
            # The first handler's start (a lock holder starts at once) and the new
            # connections (the locks' clients connect before the slot) are reported,
            # not tracked: they are near zero, so noise alone would move them by half.
            if figure not in ("first_ms", "connections") and _tracked(cell, figure):
                out[f"burst.{key}.{figure}_vs_{cell['peer']}"] = spread["median"]
        if cell.get("balance"):
            # fair share ÷ the busiest instance's handlers: 1.0 is a perfect spread
            out[f"burst.{key}.fair_share_over_busiest"] = round(
                1 / cell["balance"]["median"], 3)
    for name in SECTION_MODULES:
        if results.get(name):
            out.update(_section(name).ratios(results[name]))
    for store, section in results.get("lease", {}).items():
        for name, spread in section["ratio"].items():
            if not name.startswith("anarchon"):
                out[f"lease.{store}.vs_{name}"] = spread["median"]
    cpu = results.get("cpu", {})
    for cell in cpu.get("cells", []):
        at = f"cpu.{cell['store']}.r{cell['offered_runs_s']}"
        out[f"{at}.runs_per_cpu_s_vs_raw"] = cell["ratio_vs_raw"]["median"]
        if cell.get("exact_ratio_vs_raw"):  # the same statements as the raw side's
            out[f"{at}.exact_runs_per_cpu_s_vs_raw"] = cell["exact_ratio_vs_raw"]["median"]
    return out


def _tracked(cell: dict[str, Any], figure: str) -> bool:
    """False for a store-CPU ratio whose smaller side is below the floor."""
    if figure != "store_cpu_s":
        return True
    sides = [m.get("store_cpu_s") or 0.0 for m in cell["median"].values()]
    return min(sides) >= BURST_STORE_CPU_FLOOR_S


def _section(name: str) -> Any:
    """The module of a section that reports its own ratios, targets and Markdown."""
    return importlib.import_module(f".{name}", __package__)


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Each target of issue 5: met or not, with the figure it was judged on."""
    out: dict[str, Any] = {}
    cells = results.get("throughput", {}).get("cells", [])
    if cells:
        worst = min(cells, key=lambda c: c["ratio"])
        out["every_claim_cell_vs_raw"] = {"target": CLAIM_TARGET, "worst": worst["ratio"],
                                          "worst_cell": worst["key"],
                                          "met": worst["ratio"] >= CLAIM_TARGET}
    peers = results.get("peers", {})
    for store, (peer, target) in PEER_OF_TARGET.items():
        spread = peers.get(store, {}).get("ratio", {}).get(peer)
        if spread:
            out[f"{store}_claim_finish_vs_{peer}"] = {
                "target": target, "median": spread["median"],
                "spread": [spread["min"], spread["max"]], "rounds": spread["rounds"],
                "met": spread["median"] >= target}
    double = sum(c.get("double_wins", 0) for c in cells)
    if cells:
        out["exactly_one_winner"] = {"double_wins": double, "met": double == 0}
    hb = results.get("heartbeat", [])
    pg_hb = [r for r in hb if r["store"] == "pg" and r.get("statements_per_tick") is not None]
    if pg_hb:
        out["pg_one_statement_per_tick"] = {
            "per_size": {r["leases"]: r["statements_per_tick"] for r in pg_hb},
            "met": all(r["statements_per_tick"] == 1 for r in pg_hb)}
    rd_hb = [r for r in hb if r["store"] == "redis"]
    if rd_hb:
        out["redis_one_round_trip_per_tick"] = {
            "per_size": {r["leases"]: r["round_trips_per_tick"] for r in rd_hb},
            "met": all(r["round_trips_per_tick"] == 1 for r in rd_hb)}
    if results.get("scale"):
        from .scale import targets as scale_targets

        out.update(scale_targets(results["scale"]))
    for name in SECTION_MODULES:
        if results.get(name):
            out.update(_section(name).targets(results[name]))
    for key, cell in results.get("burst", {}).items():
        for figure, target in (("round_trips", BURST_ROUND_TRIPS_TARGET),
                               ("latency_ms", BURST_TIME_TARGET)):
            spread = cell["ratio_peer_over_anarchon"].get(figure)
            if spread:
                out[f"burst_{key}_{figure}_vs_{cell['peer']}"] = {
                    "target": target, "median": spread["median"],
                    "spread": [spread["min"], spread["max"]], "rounds": spread["rounds"],
                    "met": spread["median"] >= target}
        if cell.get("balance"):
            out[f"burst_{key}_balance"] = {
                "target": "<= 1.5", "median": cell["balance"]["median"],
                "spread": [cell["balance"]["min"], cell["balance"]["max"]],
                "met": cell["targets_met"]["balance"]}
    for store, section in results.get("lease", {}).items():
        for name, spread in section["ratio"].items():
            if not name.startswith("anarchon") and name not in LEASE_FAIRER_PEERS:  # issue 19
                out[f"lease_{store}_vs_{name}"] = {
                    "target": 1.0, "median": spread["median"],
                    "spread": [spread["min"], spread["max"]], "rounds": spread["rounds"],
                    "met": spread["median"] >= 1.0}
    load = [r for r in results.get("load", []) if r["store"] == "pg" and r.get("reduction")]
    if load:
        biggest = max(load, key=lambda r: r["jobs"])
        out["store_load_10x_below_model"] = {
            "jobs": biggest["jobs"], "reduction": biggest["reduction"],
            "target": REDUCTION_TARGET, "met": biggest["reduction"] >= REDUCTION_TARGET}
    cpu = results.get("cpu", {})
    for store, flatness in cpu.get("flatness", {}).items():
        cells = [c for c in cpu.get("cells", []) if c["store"] == store]
        if store == "redis" or not cells or flatness is None:
            continue  # issue 18 sets the targets on memory and PostgreSQL
        worst = min(c["runs_per_cpu_s"] for c in cells)
        out[f"cpu_{store}_runs_per_cpu_s"] = {
            "target": CPU_RUNS_TARGET, "worst": worst, "met": worst >= CPU_RUNS_TARGET}
        out[f"cpu_{store}_flat"] = {"target": CPU_FLAT_TARGET, "flatness": flatness,
                                    "met": flatness >= CPU_FLAT_TARGET}
    return out


def plots(results: dict[str, Any], out_dir: Path, stem: str) -> list[str]:
    """Throughput, statements per second, peers and bursts as PNGs; returns the file names."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    cells = results.get("throughput", {}).get("cells", [])
    if cells:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, mode in zip(axes, ("uncontended", "contended"), strict=True):
            for driver in sorted({c["driver"] for c in cells}):
                rows = sorted((c for c in cells if c["driver"] == driver and c["mode"] == mode),
                              key=lambda c: c["claimers"])
                if not rows:
                    continue
                xs = [c["claimers"] for c in rows]
                line = ax.plot(xs, [c["library_ops_s"] for c in rows], marker="o",
                               label=f"{driver} library")[0]
                ax.plot(xs, [c["raw_ops_s"] for c in rows], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{driver} raw")
            for b in results.get("throughput", {}).get("pgbench", []):
                if mode == "uncontended" and "tps" in b:
                    ax.scatter([b["clients"]], [b["tps"]], marker="*", s=120, color="black",
                               zorder=5, label="pgbench (claim SQL)" if b is results[
                                   "throughput"]["pgbench"][0] else None)
            ax.set_title(f"claims per second, {mode}")
            ax.set_xlabel("concurrent claimers")
            ax.set_ylabel("claims / s")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        name = f"{stem}-throughput.png"
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        made.append(name)
    load = [r for r in results.get("load", []) if r["store"] == "pg"]
    if load:
        load.sort(key=lambda r: r["jobs"])
        xs = [r["jobs"] for r in load]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(xs, [r["statements_s"] for r in load], marker="o", label="anarchon, all statements")
        ax.plot(xs, [r["claim_statements_s"] for r in load], marker=".", linestyle=":",
                label="anarchon, claims and finishes")
        ax.plot(xs, [r["upkeep_statements_s"] for r in load], marker="o",
                label="anarchon, heartbeats + checks")
        ax.plot(xs, [r["model_upkeep_s"]["low"] for r in load], marker="x", linestyle="--",
                label="reference model, upkeep (low)")
        ax.plot(xs, [r["model_upkeep_s"]["high"] for r in load], marker="x", linestyle="--",
                label="reference model, upkeep (high)")
        rd = sorted((r for r in results.get("load", []) if r["store"] == "redis"),
                    key=lambda r: r["jobs"])
        if rd:
            ax.plot([r["jobs"] for r in rd], [r["round_trips_s"] for r in rd], marker="s",
                    label="anarchon on Redis, round trips")
        ax.set_xlabel("jobs (3 instances, heartbeat 1 s)")
        ax.set_ylabel("per second")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{stem}-statements.png"
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        made.append(name)
    made += _peer_plot(plt, results, out_dir, stem)
    made += _burst_plot(plt, results, out_dir, stem)
    return made


def _peer_plot(plt: Any, results: dict[str, Any], out_dir: Path, stem: str) -> list[str]:
    """Per store, each contender's median operations/s and anarchon's per-round ratios."""
    peers = results.get("peers", {})
    stores = [s for s in ("redis", "pg") if peers.get(s, {}).get("ops_s")]
    if not stores:
        return []
    fig, axes = plt.subplots(1, len(stores), figsize=(6.5 * len(stores), 4.5), squeeze=False)
    for ax, store in zip(axes[0], stores, strict=True):
        section = peers[store]
        names = list(section["ops_s"])
        values = [section["ops_s"][n] for n in names]
        colors = ["tab:blue" if n.startswith("anarchon") else "tab:gray" for n in names]
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(range(len(names)), [n.replace("_", " ") for n in names], fontsize=7)
        for i, name in enumerate(names):
            spread = section.get("ratio", {}).get(name)
            if spread:
                ax.annotate(f"anarchon ÷ this {spread['median']:.2f} "
                            f"[{spread['min']:.2f}, {spread['max']:.2f}]",
                            (values[i], i), fontsize=7, xytext=(3, -3),
                            textcoords="offset points")
        ax.set_title(f"{'Redis' if store == 'redis' else 'PostgreSQL'}: claim + finish "
                     "against lock + unlock (ops/s, median of rounds)", fontsize=9)
        ax.set_xlim(0, max(values) * 1.7)
        ax.set_xlabel("operations / s, one sequential client")
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    name = f"{stem}-peers.png"
    fig.savefig(out_dir / name, dpi=100)
    plt.close(fig)
    return [name]


def _burst_plot(plt: Any, results: dict[str, Any], out_dir: Path, stem: str) -> list[str]:
    """Per burst cell, anarchon beside its peer: time to every handler, round trips."""
    burst = results.get("burst", {})
    if not burst:
        return []
    keys = list(burst)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    figures = (("latency_ms", "slot → every handler started (ms)"),
               ("round_trips", "round trips (requests sent)"))
    for ax, (figure, label) in zip(axes, figures, strict=True):
        width = 0.38
        ours = [burst[k]["median"]["anarchon"][figure] for k in keys]
        theirs = [burst[k]["median"][burst[k]["peer"]][figure] for k in keys]
        xs = range(len(keys))
        ax.bar([x - width / 2 for x in xs], ours, width, label="anarchon (claim_many)")
        ax.bar([x + width / 2 for x in xs], theirs, width, color="tab:gray",
               label="per-(job, slot) lock (redis-py Lock / ShedLock)")
        ax.set_xticks(list(xs), [f"{k.split('.')[0]} {k.split('.')[1]} jobs" for k in keys],
                      fontsize=8)
        for x, a, b in zip(xs, ours, theirs, strict=True):
            ax.annotate(f"{a:,.0f}", (x - width / 2, a), ha="center", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
            ax.annotate(f"{b:,.0f}", (x + width / 2, b), ha="center", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_ylim(1, max(ours + theirs) * 3)
        ax.set_title(f"{label}, median of the bursts", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    name = f"{stem}-burst.png"
    fig.savefig(out_dir / name, dpi=100)
    plt.close(fig)
    return [name]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def write_markdown(results: dict[str, Any], path: Path, images: list[str]) -> None:
    """The human report beside the JSON."""
    env = results["environment"]
    lines = [f"# anarchon benchmarks ({results['mode']})", ""]
    lines += [f"- Python {env['python']}, {env['cpu_count']} CPUs, load at start "
              f"{env['load_average_at_start']}",
              f"- PostgreSQL {env['servers'].get('postgresql')} "
              f"(pg_stat_statements: {env['pg_stat_statements']}; "
              + ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in env["servers"].items()
                          if k.startswith("postgresql."))
              + f"), {env['servers'].get('redis')}",
              "- drivers: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v),
              f"- wall time {results.get('elapsed_s')} s", ""]
    lines += ["## Targets", "", "| target | figure | met |", "| --- | --- | --- |"]
    for name, t in results.get("targets", {}).items():
        figure = {k: v for k, v in t.items() if k != "met"}
        lines.append(f"| {name} | `{json.dumps(figure)}` | {'yes' if t['met'] else '**no**'} |")
    tp = results.get("throughput")
    if tp:
        lines += ["", "## Claim throughput (claims/s, median of the rounds)", "",
                  "library and raw alternate in short rounds; library/raw is the median of "
                  "the per-round ratios [min, max]; the ratio of the two sides' best rounds "
                  "is shown apart.", "",
                  "| store | driver | mode | claimers | library | raw | library/raw "
                  "[min, max] | of the bests | rounds |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for c in tp["cells"]:
            low, high = c.get("ratio_spread", [c["ratio"], c["ratio"]])
            lines.append(f"| {c['store']} | {c['driver']} | {c['mode']} | {c['claimers']} | "
                         f"{c['library_ops_s']} | {c['raw_ops_s']} | {c['ratio']:.2f} "
                         f"[{low:.2f}, {high:.2f}] | {c.get('ratio_of_bests', c['ratio']):.2f} "
                         f"| {c.get('rounds', '')} |")
        for b in tp.get("pgbench", []):
            lines.append(f"\npgbench, claim SQL (uncontended path, extended protocol), "
                         f"{b['clients']} clients: {b.get('tps', b.get('error'))} tps")
    hb = results.get("heartbeat")
    if hb:
        lines += ["", "## Heartbeat cost per tick", "",
                  "| store | leases | statements or round trips / tick | script calls / tick "
                  "| library ms | raw ms | raw/library speed |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in hb:
            per = r.get("statements_per_tick", r.get("round_trips_per_tick"))
            lines.append(f"| {r['store']} | {r['leases']} | {_fmt(per)} | "
                         f"{_fmt(r.get('evalsha_per_tick'))} | {r['library_ms']} | "
                         f"{r['raw_ms']} | {_fmt(r['ratio'])} |")
        pg = [r for r in hb if r["store"] == "pg"]
        if pg:
            lines.append(f"\nWith a user's pool left at psycopg's default (autocommit off) "
                         f"the PostgreSQL heartbeat costs "
                         f"{pg[0].get('statements_per_tick_default_pool')} statements per tick "
                         f"({pg[0].get('by_kind_default_pool')}).")
    load = results.get("load")
    if load:
        lines += ["", "## Store load, 3 instances in steady state (heartbeat 1 s, lease 5 s)",
                  "", "| store | jobs | all /s | claims+finishes /s | upkeep /s | held | watched "
                  "| model upkeep /s (low-high) | model/ours |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
        for r in load:
            if r["store"] == "pg":
                lines.append(f"| pg statements | {r['jobs']} | {r['statements_s']} | "
                             f"{r['claim_statements_s']} | {r['upkeep_statements_s']} | "
                             f"{r['held_avg']} | {r['watched_avg']} | "
                             f"{r['model_upkeep_s']['low']}-{r['model_upkeep_s']['high']} | "
                             f"{r['reduction']} |")
            else:
                lines.append(f"| redis round trips (commands incl. scripts) | {r['jobs']} | "
                             f"{r['round_trips_s']} ({r['commands_s_incl_scripts']}) | - | "
                             f"{r['upkeep_round_trips_s']} | {r['held_avg']} | "
                             f"{r['watched_avg']} | {r['model_upkeep_s']['low']}-"
                             f"{r['model_upkeep_s']['high']} | {r['reduction_round_trips']} |")
        for r in load:
            if r["store"] == "pg" and r.get("by_kind_s"):
                lines.append(f"\n{r['jobs']} jobs, statements/s by kind: `{r['by_kind_s']}`")
    rss = results.get("rss")
    if rss:
        lines += ["", "## Memory", "",
                  f"One instance holding {rss['held']} leases: RSS {rss['rss_mb_holding']} MB "
                  f"(after start {rss['rss_mb_started']} MB; {rss['kb_per_lease']} KB per "
                  "lease, handler tasks included)."]
    fo = results.get("failover")
    if fo:
        lines += ["", f"## Failover and hand-over (lease {fo['lease_ms']} ms, heartbeat and "
                  f"check every {fo['check_interval_ms']} ms; store timestamps)", "",
                  "| store | figure | median ms | p95 ms | trials |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for store in ("pg", "redis"):
            if store not in fo:
                continue
            for fig in ("kill_after_kill", "kill_after_last_heartbeat", "kill_after_expiry",
                        "stop_after_stop", "stop_after_hand_over"):
                s = fo[store][fig]
                lines.append(f"| {store} | {fig} | {_fmt(s['median_ms'])} | "
                             f"{_fmt(s['p95_ms'])} | {s['n']} |")
    peers = results.get("peers")
    if peers:
        lines += ["", "## Peers (one sequential client, interleaved rounds)", "",
                  "anarchon ÷ peer, per round; median and spread (min, q1, q3, max).", "",
                  "| store | peer | median ops/s | anarchon ÷ peer: median | min | q1 | q3 "
                  "| max | rounds |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for store in ("redis", "pg"):
            section = peers.get(store)
            if not section:
                continue
            ops = section["ops_s"]
            lines.append(f"| {store} | anarchon_claim_finish | {ops['anarchon_claim_finish']} "
                         "| 1.00 | | | | | |")
            for name, r in section["ratio"].items():
                lines.append(f"| {store} | {name} | {ops[name]} | {r['median']:.2f} | "
                             f"{r['min']:.2f} | {r['q1']:.2f} | {r['q3']:.2f} | "
                             f"{r['max']:.2f} | {r['rounds']} |")
            for name, note in section.get("notes", {}).items():
                lines.append(f"\n{name}: {note}")
        batch = peers.get("batch", {})
        if batch:
            lines += ["", "## Batched claim (claim_many of 10 against 10 claims one at a time)",
                      "", "| backend | batched claims/s | one at a time claims/s | ratio: median "
                      "| min | max |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
            for key, section in batch.items():
                r = section["ratio"]["claim_one_at_a_time"]
                lines.append(f"| {key} | {section['ops_s']['claim_many']} | "
                             f"{section['ops_s']['claim_one_at_a_time']} | {r['median']:.2f} | "
                             f"{r['min']:.2f} | {r['max']:.2f} |")
    cluster = results.get("cluster")
    if cluster:
        lines += ["", f"## Redis Cluster ({cluster['nodes']} nodes, {cluster['server']})", "",
                  "library ÷ raw (same scripts, same RedisCluster client), interleaved rounds.",
                  "", "| cell | library ops/s | raw ops/s | ratio: median | min | max "
                  "| scripts per node per tick |", "| --- | ---: | ---: | ---: | ---: | ---: "
                  "| --- |"]
        for name, section in cluster.items():
            if isinstance(section, dict) and "ratio" in section:
                r = section["ratio"]["raw"]
                lines.append(f"| {name} | {section['ops_s']['library']} | "
                             f"{section['ops_s']['raw']} | {r['median']:.2f} | "
                             f"{r['min']:.2f} | {r['max']:.2f} | "
                             f"{section.get('evalsha_per_node', '-')} |")
    scale = results.get("scale")
    if scale:
        from .scale import markdown as scale_markdown

        lines += ["", *scale_markdown(scale)]
    burst = results.get("burst")
    if burst:
        lines += ["", "## Burst: jobs due at one instant, 3 schedulers in one process", "",
                  "Medians of the interleaved rounds; ratios are peer ÷ anarchon per round "
                  "(higher is better for anarchon).", "",
                  "| store.jobs | contender | slot → last handler ms | round trips | "
                  "store CPU s | commands | connections |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for key, cell in burst.items():
            for name, m in cell["median"].items():
                lines.append(f"| {key} | {name} | {m['latency_ms']:.0f} | "
                             f"{m['round_trips']:.0f} | {m['store_cpu_s']:.3f} | "
                             f"{_fmt(m.get('commands'))} | {_fmt(m.get('connections'))} |")
            for figure, r in cell["ratio_peer_over_anarchon"].items():
                lines.append(f"| {key} | ratio {figure} | {r['median']:.2f} "
                             f"[{r['min']:.2f}, {r['max']:.2f}] | | | | |")
            b = cell.get("balance")
            if b:
                lines.append(f"| {key} | anarchon balance (busiest ÷ fair share) | "
                             f"{b['median']:.2f} [{b['min']:.2f}, {b['max']:.2f}] | | | | |")
    for name in SECTION_MODULES:
        if results.get(name):
            lines += ["", *_section(name).markdown(results[name])]
    if images:
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in images]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    target = Path(sys.argv[1]).with_suffix(".md")
    write_markdown(data, target, plots(data, target.parent, target.stem))
    print(target)
