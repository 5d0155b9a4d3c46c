"""Stage speeds per core: how fast one core runs each stage a version passes through (cast, scan,
encode, sign, hash, decode, apply in place, after-swap check: stage_runs.py), in bytes of bf16 model
per second, and how the same stages scale on every core of this machine.

Two cases: a synthetic model with Qwen3-14B's layer shapes (hidden 5120, intermediate 17408, 40/8
heads of 128; `--layers` decoder layers, 1 by default, and an embedding of 16384 rows: 0.83 GB in
bf16), whose fp32 master weights take a step that moves ~1% of the bf16 words, crowded into the small
weights as a real step's are (inputs.adam_step_case); and the real SmolLM2-135M step at lr 5e-6 (its
fp32 master weights are the base's). Each stage runs alone, first limited to one core (the calling
thread pinned to one CPU, which the codec's threads inherit, and torch on one thread), then on every
core this process may use, the two taking turns within each repeat, after one untimed run of each
(first touches of fresh memory, thread pools starting); figures are medians of `--repeats`.
benchmarks/simulate.py scales the synthetic case's one-core speeds to a node's cores per rank. Run it
alone (`flock /tmp/deltamesh-heavy.lock ...` where others share the machine): a core another job
takes shows as a slower stage.

`--json` prints one object: {"cases": [{"name", "model_bytes", "tensors", "delta_bytes",
"manifest_entries", "manifest_bytes", "changed_fraction", "one_ulp_share",
"changed_magnitude_over_all", "seconds": {"<cores>": {"<stage>": [s, ...]}}, "gbps": {"<cores>":
{"<stage>": GB/s}}, "scaling": {"<stage>": all-cores over one-core speed}}], "per_core": {"<stage>":
GB/s}, "per_core_case", "delta_ratio", "sign_s_per_entry", "load_s_per_entry", "cores", "repeats",
"machine", "commit"}; the same object is saved to ~/.cache/deltamesh/stage_speeds/results.json,
where simulate.py takes it from.

    .venv/bin/python benchmarks/stage_speeds.py [--layers 1] [--repeats 3] [--no-smollm2] [--quick] [--json]
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from common import bench_parser, emit, parse_bench_args
from inputs import Case, adam_step_case, qwen3_shapes
from rich.console import Console
from rich.table import Table
from stage_runs import STAGES, change_statistics, prepare, run_once
from swap_compare import commit_of

from deltamesh.cache import cache_dir
from deltamesh.delta import load_manifest
from deltamesh.delta.parallel import usable_cores
from deltamesh.logs import setup_logging
from deltamesh.mesh.demo.models import smollm2_adam_versions, smollm2_state_dict, to_bf16

RESULTS = cache_dir("stage_speeds", "results.json")
HERE = Path(__file__).resolve().parent
SYNTHETIC_SHAPES = {"hidden": 5120, "intermediate": 17408, "q_heads": 40, "kv_heads": 8, "head_dim": 128,
                    "vocab": 16384}
QUICK_SHAPES = {"hidden": 512, "intermediate": 1536, "q_heads": 8, "kv_heads": 4, "head_dim": 64, "vocab": 4096}
SMOLLM2_LR = 5e-6


@contextlib.contextmanager
def cores(n: int) -> Iterator[None]:
    """Run the block on the first `n` of the CPUs this thread may use: the thread's affinity (the
    codec's worker threads inherit it) and torch's thread count; both are restored afterwards."""
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, set(sorted(before)[:n]))
    torch.set_num_threads(n)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def build_cases(args) -> list[Case]:
    shapes = qwen3_shapes(layers=args.layers, **(QUICK_SHAPES if args.quick else SYNTHETIC_SHAPES))
    cases = [adam_step_case(shapes, name=f"synthetic, Qwen3-14B layer shapes x{args.layers}" +
                            (" (quick: hidden 512)" if args.quick else ""))]
    if args.smollm2:
        master = smollm2_state_dict()
        cases.append(Case(f"smollm2-135m adam lr={SMOLLM2_LR:g}", to_bf16(master),
                          smollm2_adam_versions([SMOLLM2_LR])[SMOLLM2_LR], note="real pretrained weights, one "
                          "Adam step", master=master))
    return cases


def measure(case: Case, repeats: int, all_cores: int) -> dict[str, Any]:
    prepared = prepare(case)
    counts = sorted({1, all_cores})
    seconds: dict[str, dict[str, list[float]]] = {str(n): {} for n in counts}
    for n in counts:  # a first run, untimed: the first touch of fresh memory and thread pools starting
        with cores(n):
            run_once(prepared)
    for _ in range(repeats):
        for n in counts:
            with cores(n):
                for stage, s in run_once(prepared).items():
                    seconds[str(n)].setdefault(stage, []).append(s)
    load = []
    for _ in range(repeats):  # checking and loading the signed manifest alone, on one core
        with cores(1):
            start = time.perf_counter()
            load_manifest(prepared.forward.manifest_bytes, [prepared.key.public_key()])
            load.append(time.perf_counter() - start)
    gbps = {n: {stage: case.model_bytes / statistics.median(s) / 1e9 for stage, s in by.items()}
            for n, by in seconds.items()}
    top = str(counts[-1])
    return {"name": case.name, "note": case.note, "model_bytes": case.model_bytes, "tensors": len(case.new),
            "delta_bytes": prepared.delta_bytes, "manifest_entries": prepared.manifest_entries,
            "manifest_bytes": prepared.manifest_bytes, **change_statistics(case), "seconds": seconds, "gbps": gbps,
            "scaling": {stage: gbps[top][stage] / gbps["1"][stage] for stage in gbps["1"]},
            "load_seconds": statistics.median(load)}


def summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-core speeds the simulator scales (the synthetic case's: its tensors are as large as a
    big model's), and the manifest's costs per entry (the case with the most entries)."""
    synthetic, listed = cases[0], max(cases, key=lambda c: c["manifest_entries"])
    sign = statistics.median(listed["seconds"]["1"]["sign"])
    return {"per_core": synthetic["gbps"]["1"], "per_core_case": synthetic["name"],
            "delta_ratio": synthetic["delta_bytes"] / synthetic["model_bytes"],
            "sign_s_per_entry": sign / listed["manifest_entries"],
            "load_s_per_entry": listed["load_seconds"] / listed["manifest_entries"]}


def print_table(out: dict[str, Any]) -> None:
    console = Console(width=160)
    n = str(out["cores"])
    table = Table(title=f"stage speeds, GB of bf16 model per second: one core, and all {n} cores "
                        f"(medians of {out['repeats']}; load average {out['machine']['load_average']})")
    table.add_column("case")
    for stage in STAGES:
        table.add_column(stage, justify="right")
    for c in out["cases"]:
        table.add_row(f"{c['name']} ({c['model_bytes'] / 1e9:.2f} GB), 1 core",
                      *[f"{c['gbps']['1'][s]:.2f}" if s in c["gbps"]["1"] else "-" for s in STAGES])
        if n in c["gbps"] and n != "1":
            table.add_row(f"  all {n} cores (x one core)", *[
                f"{c['gbps'][n][s]:.2f} ({c['scaling'][s]:.2f}x)" if s in c["gbps"][n] else "-" for s in STAGES])
    console.print(table)
    for c in out["cases"]:
        console.print(f"{c['name']}: {c['changed_fraction']:.2%} of words changed, {c['one_ulp_share']:.0%} of "
                      f"those by one ulp, their median magnitude {c['changed_magnitude_over_all']:.4f} of all words'; "
                      f"delta {c['delta_bytes'] / 1e6:.1f} MB ({c['delta_bytes'] / c['model_bytes']:.4f} of the "
                      f"model); manifest {c['manifest_entries']} entries, {c['manifest_bytes'] / 1e3:.0f} kB")
    console.print(f"per manifest entry on one core: sign {out['sign_s_per_entry'] * 1e6:.1f} us, check and load "
                  f"{out['load_s_per_entry'] * 1e6:.1f} us; simulate.py scales the per-core speeds of "
                  f"{out['per_core_case']!r}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="a small synthetic model (hidden 512) only, one repeat",
                     repeats="runs of every stage on each core count")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the synthetic model")
    p.add_argument("--no-smollm2", dest="smollm2", action="store_false", help="leave out the real SmolLM2 step")
    args = parse_bench_args(p, argv)
    if args.quick:
        args.smollm2 = False
    if sys.platform != "linux":
        raise SystemExit("stage_speeds.py pins itself to one CPU: it needs Linux's sched_setaffinity")
    setup_logging("WARNING")
    all_cores, load_start = usable_cores(), os.getloadavg()[0]
    cases = [measure(case, args.repeats, all_cores) for case in build_cases(args)]
    out = {"cases": cases, **summary(cases), "cores": all_cores, "repeats": args.repeats,
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                       "load_average": [round(load_start, 1), round(os.getloadavg()[0], 1)]},
           "commit": commit_of(HERE.parent)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    emit(out, args, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
