"""Learning through the mesh: SmolLM2-135M-Instruct trained by RL on arithmetic word problems, scored on held-out ones.

Each mode is one run of the demo mesh (mesh/demo): the broker, an origin gateway and two emulated remote
regions (us-east -> eu-west at 100 Mbit/s +40 ms, eu-west -> ap-south at 50 Mbit/s +80 ms, in the
gateways), a rollout pool in each remote region (the pools' engine: vLLM in process, or transformers
with --engine transformers), the trainer (M2PO or PPO clipping) and the evaluator (`deltamesh eval`,
following the origin gateway like a pool), every one a process on this machine. The evaluator scores
version 0, every k-th version and the final one on the held-out problems (arithmetic levels the
trainer also trains on, a problem set it never sees: mesh/workflows/arithmetic.py), avg@n at the
pools' temperature, each score tied to the weights hash its engine proved it served.

Modes: `sync` (max staleness 0: pools generate only at the trainer's version, on-policy),
`async_m2po_s4` and `async_m2po_s8` (pools run up to 4 or 8 versions behind, M2PO),
`async_clip_s8` (the same at 8, plain PPO clipping), `solver_verifier` (the solver trained beside a
verifier that reviews its answers, async at 4, M2PO; its solver is scored). `--quick` runs `sync`
and `async_m2po_s4` with fewer steps. Every figure is wall time on a machine shared with other work
(the load average at the start and end of each run is recorded). `--json` prints {"runs": [{"mode",
"eval": [{"version", "step", "accuracy", "train_s", "weights_hash", ...}], "wall_s", "train_wall_s",
"trainer_wait_fraction", "staleness_mean", "staleness_max", "reward", ...}], "pipeline": {...},
"settings": {...}}; --plot DIR draws accuracy against step and against wall time (learning_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learning_report import pipeline_model, plot_runs, print_runs
from rich.console import Console

from deltamesh.config import from_dict
from deltamesh.logs import setup_logging
from deltamesh.mesh.demo.config import DemoConfig, DemoEvalConfig
from deltamesh.mesh.demo.run import run_demo
from deltamesh.mesh.demo.topology import Topology


@dataclass(frozen=True)
class Mode:
    name: str
    max_staleness: int
    loss: str = "m2po"
    workflow: str = "math"


MODES = {m.name: m for m in (
    Mode("sync", 0), Mode("async_m2po_s4", 4), Mode("async_m2po_s8", 8), Mode("async_clip_s8", 8, loss="clip"),
    Mode("solver_verifier", 4, workflow="solver_verifier"),
)}
QUICK = ("sync", "async_m2po_s4")

# The origin and two emulated remote regions, a pool in each remote one: every version crosses a WAN
# link before a pool can use it.
TOPOLOGY = {
    "gateways": [{"region": "us-east"}, {"region": "eu-west", "upstream": "us-east", "bandwidth_mbps": 100, "delay_ms": 40},
                 {"region": "ap-south", "upstream": "eu-west", "bandwidth_mbps": 50, "delay_ms": 80}],
    "pools": [{"name": "eu-1", "region": "eu-west"}, {"name": "ap-1", "region": "ap-south"}],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="", help=f"comma-separated, of {', '.join(MODES)} (default: all; --quick: "
                                               f"{', '.join(QUICK)})")
    p.add_argument("--quick", action="store_true", help="sync and async_m2po_s4 only, --quick-steps steps each")
    p.add_argument("--steps", type=int, default=60, help="trainer steps per run (default 60)")
    p.add_argument("--quick-steps", type=int, default=30, help="trainer steps per run with --quick (default 30)")
    p.add_argument("--every", type=int, default=5, help="score every k-th version (default 5; 0: no evaluator, for "
                                                        "the trainer's wait without one beside a run with it)")
    p.add_argument("--problems", type=int, default=40, help="held-out problems (default 40)")
    p.add_argument("--samples", type=int, default=4, help="samples per held-out problem: avg@n (default 4)")
    p.add_argument("--engine", choices=("vllm", "transformers"), default="vllm", help="the pools' and evaluator's engine")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the demo's SmolLM2 recipe)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", help="keep each run under DIR/<mode> (default: temporary, removed afterwards)")
    p.add_argument("--plot", metavar="DIR", help="draw learning-vs-step.png and learning-vs-wall.png into DIR")
    p.add_argument("--save", metavar="PATH", help="also write the JSON object to PATH")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = p.parse_args(argv)
    names = [m for m in args.modes.split(",") if m] or list(QUICK if args.quick else MODES)
    unknown = [m for m in names if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; known: {list(MODES)}")
    args.mode_names = names
    return args


def demo_config(mode: Mode, args: argparse.Namespace, run_dir: Path) -> DemoConfig:
    steps = args.quick_steps if args.quick else args.steps
    return DemoConfig(
        model="smollm2", engine=args.engine, workflow=mode.workflow, steps=steps, seed=args.seed, lr=args.lr,
        loss=mode.loss, max_staleness=mode.max_staleness, run_dir=str(run_dir), console=False,
        topology=from_dict(Topology, TOPOLOGY, where="topology"),
        eval=DemoEvalConfig(every=args.every, problems=args.problems, samples=args.samples),
        # SmolLM2 here: minutes to load and check the weights before the first step, and the evaluator's
        # last score after the trainer's last step.
        start_timeout_s=1800.0, settle_timeout_s=900.0)


def run_figures(mode: Mode, report: dict[str, Any], load: tuple[float, float], seconds: float) -> dict[str, Any]:
    """What one run showed: the held-out curve, wall time, trainer wait, staleness and reward."""
    model_id = "solver" if mode.workflow == "solver_verifier" else "policy"
    m = report["models"][model_id]
    steps = m["steps"]
    later = steps[1:] or steps  # the first step's wait includes the mesh's start
    start = steps[0]["time"] - (steps[0]["step_seconds"] or 0.0) if steps else None
    return {
        "mode": mode.name, "max_staleness": mode.max_staleness, "loss": mode.loss, "workflow": mode.workflow,
        "outcome": report["outcome"], "error": report["error"], "steps": len(steps),
        "eval": [{k: r[k] for k in ("version", "step", "accuracy", "train_s", "correct", "samples", "problems",
                                    "by_level", "weights_hash", "weights_match")} for r in m["eval"]],
        "wall_s": seconds,
        "train_wall_s": None if start is None or not steps else steps[-1]["time"] - start,
        "trainer_wait_fraction": statistics.fmean(s["wait_fraction"] for s in later) if later else None,
        "train_seconds_median": statistics.median(s["train_seconds"] for s in later) if later else None,
        "wait_seconds_median": statistics.median(s["wait_seconds"] for s in later) if later else None,
        "all_pools_seconds_median": _median([s["all_pools_seconds"] for s in later]),
        "staleness_mean": statistics.fmean(s["staleness_mean"] for s in steps) if steps else None,
        "staleness_max": max((s["staleness_max"] for s in steps), default=None),
        "reward": [s["reward"] for s in steps],
        "all_pools_bit_exact": report["summary"]["all_pools_bit_exact"],
        "load_average": [round(load[0], 1), round(load[1], 1)],
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_mode(mode: Mode, args: argparse.Namespace, console: Console, root: Path) -> dict[str, Any]:
    run_dir = root / mode.name
    config = demo_config(mode, args, run_dir)
    load_start, started = os.getloadavg()[0], time.monotonic()
    result = asyncio.run(run_demo(config, console=console, live=False))
    return run_figures(mode, result.report, (load_start, os.getloadavg()[0]), time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("WARNING" if args.json else "INFO")
    console = Console(stderr=args.json)
    runs = []
    with tempfile.TemporaryDirectory(prefix="deltamesh-learning-") as tmp:
        root = Path(args.run_dir) if args.run_dir else Path(tmp)
        for name in args.mode_names:
            runs.append(run_mode(MODES[name], args, console, root))
            console.print(f"{name}: {runs[-1]['outcome']}, held-out curve "
                          f"{[(r['step'], round(r['accuracy'], 3)) for r in runs[-1]['eval']]}")
    out = {"runs": runs, "pipeline": pipeline_model(runs),
           "settings": {"engine": args.engine, "steps": args.quick_steps if args.quick else args.steps,
                        "every": args.every, "problems": args.problems, "samples": args.samples,
                        "seed": args.seed, "quick": args.quick, "cpus": os.cpu_count(),
                        "date": time.strftime("%Y-%m-%d")}}
    if args.plot:
        plot_runs(runs, Path(args.plot))
    if args.save:
        Path(args.save).write_text(json.dumps(out, indent=2))
    if args.json:
        print(json.dumps(out))
    else:
        print_runs(Console(width=170), out)
    return 0 if all(r["outcome"] == "completed" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
