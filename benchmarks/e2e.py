"""End-to-end benchmark: the demo mesh with the real SmolLM2-135M-Instruct, RL at lr 5e-6 for 10 steps.

It runs what `deltamesh demo --model smollm2` runs, less the web console and the evaluator: the
broker, an origin gateway and two remote regions (us-east -> eu-west at 100 Mbit/s +40 ms, eu-west ->
ap-south at 50 Mbit/s +80 ms, emulated in the gateways), a pool per region (transformers engine on
CPU) and the trainer, each a process on this machine, and reads the per-step figures from the demo's report: the trainer's compute
time for the step, the publish time (encode, sign, upload to the origin), the time from the end of the
step until every pool serves the new version, the bytes each link carried for the version, and the
trainer's wait fraction. The baseline, side by side in the same run, is a full sync per version (what
a system without deltas ships on every link): the full snapshot's bytes, and the time it would hold
each capped link. Medians are over the steps after the first (the first includes one-time warm-up).
A version that is also a periodic full snapshot (v10) carries the full on the trainer's upload at
once; the relays mirror that full in the background and the run may end before they are done, so
the relay links show what had arrived complete by then.
`--json` prints {"steps": [{"step", "train_seconds", "publish_seconds", "all_pools_seconds",
"link_bytes": {"<link>": n}, "full_bytes", "wait_fraction"}], "medians": {...}, "links": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from deltamesh.logs import setup_logging
from deltamesh.mesh.demo.config import DemoConfig, DemoEvalConfig
from deltamesh.mesh.demo.run import DemoResult, run_demo
from deltamesh.mesh.demo.view import human_bytes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--run-dir", help="keep the run here (default: a temporary directory, removed afterwards)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args()


def figures(report: dict[str, Any]) -> dict[str, Any]:
    steps = [{
        "step": r["step"], "version": r["version"], "train_seconds": r["train_seconds"],
        "publish_seconds": r["publish_seconds"], "all_pools_seconds": r["all_pools_seconds"],
        "link_bytes": r["link_bytes"], "full_bytes": r["full_bytes"], "wait_fraction": r["wait_fraction"],
        "publish_kinds": r["publish_kinds"],
    } for r in report["models"]["policy"]["steps"]]
    later = steps[1:] or steps

    def median(key: str) -> float | None:
        values = [s[key] for s in later if s[key] is not None]
        return statistics.median(values) if values else None

    links = {}
    full = median("full_bytes")
    for name in sorted({n for s in steps for n in s["link_bytes"]}):
        carried = [s["link_bytes"][name] for s in later if name in s["link_bytes"]]
        link = report["links"].get(name, {"bandwidth_mbps": 0.0, "delay_ms": 0.0, "rtt_ms_p50": None})
        mbps = link["bandwidth_mbps"]
        links[name] = {
            "bandwidth_mbps": mbps, "delay_ms": link["delay_ms"], "rtt_ms_p50": link["rtt_ms_p50"],
            "median_bytes_per_version": statistics.median(carried) if carried else None,
            "full_sync_bytes": full,
            "full_sync_seconds_at_cap": full * 8 / (mbps * 1e6) if full and mbps else None,
        }
    return {"steps": steps, "links": links, "outcome": report["outcome"],
            "all_pools_bit_exact": report["summary"]["all_pools_bit_exact"],
            "medians": {k: median(k) for k in ("train_seconds", "publish_seconds", "all_pools_seconds",
                                                "wait_fraction", "full_bytes")}}


def print_table(console: Console, out: dict[str, Any], title: str) -> None:
    names = sorted({n for s in out["steps"] for n in s["link_bytes"]})
    table = Table(title=title)
    for col in ("step", "train s", "publish s", "all pools s", "wait fraction", *names, "full sync"):
        table.add_column(col, justify="right")

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for s in out["steps"]:
        table.add_row(f"{s['step']}" + (" (+full)" if "full" in s["publish_kinds"] else ""),
                      secs(s["train_seconds"]), secs(s["publish_seconds"]), secs(s["all_pools_seconds"]),
                      f"{s['wait_fraction']:.2f}", *[human_bytes(s["link_bytes"].get(n)) for n in names],
                      human_bytes(s["full_bytes"]))
    m = out["medians"]
    table.add_row("median (steps 2+)", secs(m["train_seconds"]), secs(m["publish_seconds"]),
                  secs(m["all_pools_seconds"]), secs(m["wait_fraction"]),
                  *[human_bytes(out["links"][n]["median_bytes_per_version"]) for n in names],
                  human_bytes(m["full_bytes"]))
    console.print(table)
    links = Table(title="per link: deltamesh vs a full sync per version (baseline)")
    for col in ("link", "cap", "added latency", "RTT p50", "deltamesh bytes/version", "full sync bytes",
                "x smaller", "full sync time at cap"):
        links.add_column(col, justify="left" if col == "link" else "right")
    for name, link in out["links"].items():
        mine, full = link["median_bytes_per_version"], link["full_sync_bytes"]
        capped = bool(link["bandwidth_mbps"])
        links.add_row(name, f"{link['bandwidth_mbps']:g} Mbit/s" if capped else "-",
                      f"+{link['delay_ms']:g} ms" if link["delay_ms"] else "-",
                      "-" if link["rtt_ms_p50"] is None else f"{link['rtt_ms_p50']:.0f} ms", human_bytes(mine),
                      human_bytes(full), f"{full / mine:.0f}x" if mine and full else "-",
                      "-" if link["full_sync_seconds_at_cap"] is None else f"{link['full_sync_seconds_at_cap']:.1f} s")
    console.print(links)
    console.print(f"outcome: {out['outcome']}; every pool bit-exact on the final version: "
                  f"{out['all_pools_bit_exact']}; load average {out['machine']['load_average']} on "
                  f"{out['machine']['cpus']} CPUs (start, end)")


def run_mesh(args: argparse.Namespace, console: Console) -> tuple[DemoResult, dict[str, Any]]:
    """Run the demo mesh as `args` say (--model, --steps, --lr, --run-dir); its result, and how busy
    the machine was (every figure is wall time on a machine shared with other work)."""
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="deltamesh-e2e-") as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp) / "run"
        # No web console: its reads of every service each second would be load on the mesh measured.
        # No evaluator: scoring a version is minutes of generation on the same cores, and no version's
        # path to the pools waits for it (benchmarks/learning.py measures with it).
        config = DemoConfig(model=args.model, steps=args.steps, lr=args.lr, run_dir=str(run_dir), console=False,
                            eval=DemoEvalConfig(every=0))
        result = asyncio.run(run_demo(config, console=console, live=False))
    return result, {"cpus": os.cpu_count(), "load_average": [round(load_start, 1), round(os.getloadavg()[0], 1)]}


def main() -> int:
    args = parse_args()
    setup_logging("WARNING" if args.json else "INFO")
    result, machine = run_mesh(args, Console(stderr=args.json))
    out = figures(result.report)
    out["machine"] = machine
    if args.json:
        print(json.dumps(out))
    else:
        print_table(Console(width=160), out,
                    f"end to end: {args.model} at lr {args.lr:g}, {args.steps} steps, demo mesh")
    return 0 if result.outcome == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
