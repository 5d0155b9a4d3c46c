"""Version latency benchmark: each version followed from the trainer's step end to every pool serving it.

It runs the end-to-end topology exactly as benchmarks/e2e.py does (`run_mesh`: the demo mesh, an
origin gateway and two relay regions, us-east -> eu-west at 100 Mbit/s +40 ms -> ap-south at 50
Mbit/s +80 ms, one transformers pool per region, SmolLM2-135M-Instruct by default or `--model tiny`)
and reads the latency budget of every version from the demo's report (mesh/demo/latency.py): the
trainer's stages (step_end, cast, encoded, signed, upload_start, uploaded), the origin and each relay
holding the whole version (origin_stored, relay_stored:<region>, all_relays_stored), and each pool's
stages (pool:<name>:head, fetched, verified, applied, persisted, serving) up to every pool serving
it (all_pools_serving). Every time is wall-clock on the host of the stage (one machine here; across
hosts NTP is assumed). The table shows, per stage, the median seconds after step_end and the median
increment since the stage before it on the same host (the origin: since the upload started; a relay:
since its upstream held it; a pool's first stage: since the origin held it). Medians are over the
versions after the first (warm-up).

`--baseline PATH` also runs the same topology from another checkout (a `git worktree` of an older
commit) in the same invocation, through that checkout's own benchmarks/e2e.py and this venv
(swap_compare.py's package shim), and prints the medians both report, side by side: publish seconds
and all_pools_seconds (step record -> the last pool's engine swapped the version in; older commits
have no stage times).

A second table sets each relay region's median time after the origin held the version against what
its links need (one RTT per hop plus the version's bytes at the slowest link's rate).

`--json` prints {"versions": [{"version", "stages": {"<stage>": seconds}, "all_pools_seconds",
"bytes"}], "medians": {"stages", "increments", "all_pools_seconds", "bytes", "publish_seconds",
"e2e_all_pools_seconds"}, "regions": {"<region>": {"hops", "after_origin_s", "link_need_s",
"over_need"}}, "hop_overhead_s" (median time a one-hop relay took beyond its link's need),
"model_bytes", "machine": {"cpus", "load_average"}, "outcome", "commit"} (plus "baseline" with
--baseline). The same object is saved to ~/.cache/deltamesh/latency/results.json (results-tiny.json
for `--model tiny`), where benchmarks/simulate.py takes the software time a relay hop adds from.

    .venv/bin/python benchmarks/latency.py [--model tiny] [--steps 6] [--baseline /tmp/base] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from e2e import figures, run_mesh
from rich.console import Console
from rich.table import Table
from swap_compare import PARTS, _env_for, commit_of

from deltamesh.cache import cache_dir
from deltamesh.delta import dir_manifest
from deltamesh.logs import setup_logging

HERE = Path(__file__).resolve().parent
MODEL = "policy"
RESULTS = cache_dir("latency")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--run-dir", help="keep the run here (default: a temporary directory, removed afterwards)")
    p.add_argument("--baseline", type=Path, help="checkout of an older commit (a git worktree) to run side by side")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = p.parse_args(argv)
    if args.baseline is not None and not all((args.baseline / part).is_dir() for part in ("deltamesh", *PARTS)):
        p.error(f"{args.baseline} is not a deltamesh checkout")
    return args


def measure(report: dict[str, Any]) -> dict[str, Any]:
    """This checkout's figures from its demo report: the latency rows and their medians, each region
    against what its links need, the model's bytes, and the medians e2e.py reports (what a baseline
    without stage times is compared on)."""
    lat = report["models"][MODEL]["latency"]
    e2e = figures(report)["medians"]
    medians = {**lat["medians"], "publish_seconds": e2e["publish_seconds"],
               "e2e_all_pools_seconds": e2e["all_pools_seconds"]}
    regions = region_figures(lat["versions"][1:] or lat["versions"], report["links"])
    overheads = [r["after_origin_s"] - r["link_need_s"] for r in regions.values() if r["hops"] == 1]
    held = dir_manifest(Path(report["run_dir"]) / "pools" / next(iter(report["pools"])) / MODEL)
    return {"versions": lat["versions"], "medians": medians, "regions": regions,
            "hop_overhead_s": statistics.median(overheads) if overheads else None,
            "model_bytes": None if held is None else held.model_bytes, "outcome": report["outcome"]}


def region_figures(versions: list[dict[str, Any]], links: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per relay region: the median seconds from origin_stored to relay_stored, against what its links
    need (issue 17's yardstick: one RTT per hop plus the version's bytes at the slowest link's rate)."""
    upstream = {name.split("->")[1]: name.split("->")[0] for name in links}
    out = {}
    for region in upstream:
        path, at = [], region
        while at in upstream:
            path.append(links[f"{upstream[at]}->{at}"])
            at = upstream[at]
        after, need = [], []
        for v in versions:
            stages = v["stages"]
            if f"relay_stored:{region}" not in stages or "origin_stored" not in stages or not v["bytes"]:
                continue
            after.append(stages[f"relay_stored:{region}"] - stages["origin_stored"])
            rate = min(link["bandwidth_mbps"] or float("inf") for link in path) * 1e6
            need.append(sum((link["rtt_ms_p50"] or link["delay_ms"]) / 1e3 for link in path) + v["bytes"] * 8 / rate)
        if after:
            out[region] = {"hops": len(path), "after_origin_s": statistics.median(after),
                           "link_need_s": statistics.median(need),
                           "over_need": statistics.median(after) / statistics.median(need)}
    return out


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """The same topology from the `--baseline` checkout: its e2e.py's medians (one JSON line)."""
    env = {**os.environ, "DELTAMESH_CACHE": os.environ.get("DELTAMESH_CACHE", str(cache_dir()))}
    with tempfile.TemporaryDirectory(prefix="latency-baseline-") as tmp:
        env = _env_for(args.baseline, Path(tmp) / "shim", env)
        check = subprocess.run([sys.executable, "-c", "import deltamesh.mesh as m; print(m.__file__)"], env=env,
                               capture_output=True, text=True, check=True, cwd=tmp)
        if not Path(check.stdout.strip()).resolve().is_relative_to(args.baseline.resolve()):
            raise RuntimeError(f"the baseline run would import {check.stdout.strip()}, not {args.baseline}'s code")
        cmd = [sys.executable, str(args.baseline / "benchmarks" / "e2e.py"), "--json", "--model", args.model,
               "--steps", str(args.steps), "--lr", str(args.lr)]
        # A neutral working directory: a checkout's own deltamesh/ would shadow the shim.
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise RuntimeError(f"the baseline's e2e.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"commit": commit_of(args.baseline) or str(args.baseline), "outcome": out["outcome"], "machine": out.get("machine"),
            "medians": {k: out["medians"][k] for k in ("publish_seconds", "all_pools_seconds")},
            "all_pools_seconds": [s["all_pools_seconds"] for s in out["steps"]]}


def table_order(stages: dict[str, float]) -> list[str]:
    """The trainer, the origin, the relays, then each pool's stages (the pool that starts first first),
    the aggregates last; by median time within each."""
    def key(stage: str) -> tuple[int, float, float]:
        if stage.startswith("pool:"):
            host = stage.rsplit(":", 1)[0]
            return 5, min(t for s, t in stages.items() if s.startswith(host + ":")), stages[stage]
        for rank, prefix in enumerate(("origin_stored", "relay_stored:", "all_relays_stored")):
            if stage.startswith(prefix):
                return 2 + rank, 0.0, stages[stage]
        return (6 if stage == "all_pools_serving" else 1), 0.0, stages[stage]

    return sorted(stages, key=key)


def print_tables(out: dict[str, Any], title: str) -> None:
    console = Console(width=150)
    m = out["medians"]
    stages, steps = m["stages"], m["increments"]
    table = Table(title=title)
    for col in ("stage", "after step_end (s)", "increment (s)"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage in table_order(stages):
        step = steps.get(stage)
        table.add_row(stage, f"{stages[stage]:.3f}", "-" if step is None else f"{step:.3f}")
    console.print(table)
    regions = Table(title="each relay region after the origin held the version, against its links' need "
                          "(RTT per hop + bytes at the slowest rate)")
    for col in ("region", "hops", "after origin_stored (s)", "link need (s)", "x need"):
        regions.add_column(col, justify="left" if col == "region" else "right")
    for name, r in out["regions"].items():
        regions.add_row(name, str(r["hops"]), f"{r['after_origin_s']:.3f}", f"{r['link_need_s']:.3f}",
                        f"{r['over_need']:.1f}x")
    console.print(regions)

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    console.print(f"medians over versions {m['versions']}: all pools serving {secs(m['all_pools_seconds'])} s "
                  f"after step_end; {m['bytes'] or 0:,.0f} bytes per version; outcome {out['outcome']}; load "
                  f"average {out['machine']['load_average']} on {out['machine']['cpus']} CPUs (start, end)")
    base = out.get("baseline")
    if base is None:
        return
    side = Table(title="side by side, same topology, same invocation (medians, versions 2+)")
    for col in ("checkout", "publish s", "all pools s (step record -> last pool swapped)", "all pools serving s"):
        side.add_column(col, justify="left" if col == "checkout" else "right")
    side.add_row(f"this: {out['commit']}", secs(m["publish_seconds"]), secs(m["e2e_all_pools_seconds"]),
                 secs(m["all_pools_seconds"]))
    side.add_row(f"baseline: {base['commit']}", secs(base["medians"]["publish_seconds"]),
                 secs(base["medians"]["all_pools_seconds"]), "- (no stage times)")
    console.print(side)
    console.print(f"baseline outcome {base['outcome']}, load average {base['machine']['load_average']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("WARNING" if args.json else "INFO")
    with tempfile.TemporaryDirectory(prefix="deltamesh-latency-") as tmp:
        args.run_dir = args.run_dir or str(Path(tmp) / "run")  # kept until the pools' weights are measured
        result, machine = run_mesh(args, Console(stderr=True))
        out = {**measure(result.report), "machine": machine, "commit": commit_of(HERE.parent)}
    if args.baseline is not None:
        out["baseline"] = run_baseline(args)
    # benchmarks/simulate.py takes the relay hop's software time from the last SmolLM2 run here.
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("results.json" if args.model == "smollm2" else f"results-{args.model}.json")).write_text(
        json.dumps(out, indent=2))
    if args.json:
        print(json.dumps(out))
    else:
        print_tables(out, f"version latency: {args.model}, {args.steps} steps, e2e topology (3 regions)")
    return 0 if result.outcome == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
