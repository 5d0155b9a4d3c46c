"""Proof of what the engine serves: detection and cost of the check after every swap (serve_check.py).

A live engine (the transformers engine and vLLM in process) on SmolLM2-135M takes `--swaps` correct
in-place deltas, alternating between the real weights and those after one real Adam step at lr 5e-6
(~1% of words moved by an ulp), and after each the pool's check reads the weights back and compares
them to the version's signed hashes: every one must pass (false alarms: 0). Then faults, `--faults`
of each kind, each followed by a full reload that must pass the check: "stale" (the engine's update
"succeeds" but vLLM's reload, or the transformers engine's write, is a no-op), "touched" (one word of
a tensor the delta wrote, changed inside the engine right after the swap) and "untouched" (one word of
a norm that the step leaves as it is, changed inside the engine right after a swap; caught by the rotation
within `--rotation` versions, or by the transformers engine's next apply, whose result hashes cover
every tensor). The check's cost is its wall time (what generation waits) and the CPU time this process
spent in it (what it costs on an idle machine; the 2 cores here are shared). Also measured: how far one step moves a greedy probe's logprobs, beside how far two
engines' kernels put them apart on the same weights (why a probe-logprob check cannot see a step).

    .venv/bin/python benchmarks/swap_check.py [--swaps 50] [--faults 5] [--engines transformers vllm] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import bench_parser, emit, parse_bench_args

from deltamesh.delta import CodecError, decode_version, encode_delta, generate_key, read_weights
from deltamesh.mesh.demo.models import smollm2_adam_versions, smollm2_model_dir, smollm2_version_dirs
from deltamesh.mesh.engines.base import Engine, EngineError, SamplingParams
from deltamesh.mesh.pool.config import ServeCheckConfig
from deltamesh.mesh.pool.serve_check import ServeCheck

log = logging.getLogger("benchmarks.swap_check")

ENGINES = ("transformers", "vllm")
MODEL = "smollm2"
PROBE = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="10 swaps and 2 faults of each kind", repeats="unused")
    p.add_argument("--swaps", type=int, default=50, help="correct swaps per engine")
    p.add_argument("--faults", type=int, default=5, help="injected faults of each kind per engine")
    p.add_argument("--rotation", type=int, default=ServeCheckConfig().rotation, help="the check's rotation")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--lr", type=float, default=5e-6)
    args = parse_bench_args(p, argv)
    if args.quick:
        args.swaps, args.faults = 10, 2
    return args


def start_engine(name: str, model_dir: Path) -> Engine:
    if name == "vllm":
        from deltamesh.mesh.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

        return VLLMEngine(VLLMEngineConfig(model_id=MODEL, model_dir=str(model_dir)))
    from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig

    return TransformersEngine(TransformersEngineConfig(model_id=MODEL, model_dir=str(model_dir)))


class Faults:
    """Fault injection into one live engine of either kind (never what the pool does: tests only)."""

    def __init__(self, engine: Engine, kind: str) -> None:
        self.engine, self.kind = engine, kind

    def bump(self, name: str) -> None:
        """One word of checkpoint tensor `name` moves by an ulp inside the engine (a vLLM parameter that
        is not fused, or the transformers engine's live tensor)."""
        def bump(t: torch.Tensor) -> None:
            with torch.no_grad():
                t.data.view(-1).view(torch.int16)[3] += 1

        if self.kind == "vllm":
            self.engine._engine.apply_model(lambda model: bump(model.get_parameter(name)))  # type: ignore[attr-defined]
        else:
            bump(self.engine._live[name])  # type: ignore[attr-defined]

    def stale(self) -> Any:
        """Make the engine's next update a no-op that still "succeeds"; returns the undo."""
        if self.kind == "vllm":
            weights = self.engine._weights  # type: ignore[attr-defined]
            load = weights.load
            weights.load = lambda tensors, names: None
            return lambda: setattr(weights, "load", load)
        engine = self.engine

        async def stale(version):  # claims the version, writes nothing
            engine._set_version(version.manifest.version, version.manifest.weights_hash)  # type: ignore[attr-defined]

        engine.apply_update = stale  # type: ignore[method-assign]
        return lambda: delattr(engine, "apply_update")


async def probe(engine: Engine) -> dict[str, list]:
    (gen,) = await engine.generate([engine.encode("The capital of France is")], PROBE)
    return {"tokens": gen.tokens, "logprobs": gen.logprobs}


def probe_gap(a: dict[str, list], b: dict[str, list]) -> float:
    """Largest logprob difference between two greedy probes, over the tokens where both chose alike."""
    same = 0
    while same < min(len(a["tokens"]), len(b["tokens"])) and a["tokens"][same] == b["tokens"][same]:
        same += 1
    return max((abs(x - y) for x, y in zip(a["logprobs"][:same], b["logprobs"][:same])), default=0.0)


async def measure_engine(name: str, weights: dict[str, dict[str, torch.Tensor]], dirs: dict[str, Path],
                         args: argparse.Namespace) -> dict[str, Any]:
    key = generate_key()
    engine = await asyncio.to_thread(start_engine, name, dirs["v0"])
    check = ServeCheck(ServeCheckConfig(rotation=args.rotation))
    faults = Faults(engine, name)
    rng = random.Random(7)
    state = {"version": 0, "at": "v0"}
    swap_s: list[float] = []
    check_s: list[float] = []
    checked: list[int] = []
    false_alarms = 0
    probes = {"v0": await probe(engine)}
    untouched = next(n for n in sorted(weights["v0"])
                     if torch.equal(weights["v0"][n].view(torch.int16), weights["v1"][n].view(torch.int16)))
    check_cpu_s: list[float] = []

    def next_delta():
        old = state["at"]
        new = "v1" if old == "v0" else "v0"
        v = state["version"] + 1
        enc = encode_delta(weights[old], weights[new], model_id=MODEL, version=v, base_version=v - 1, key=key)
        return new, decode_version(enc.manifest, enc.pieces)

    async def swap() -> tuple[Any, str | None]:
        """One delta into the engine and the check after it: (check result or None, caught by the apply)."""
        new, version = await asyncio.to_thread(next_delta)
        touched = [version.manifest.tensors[i].name for i in version.updates]
        started = time.perf_counter()
        try:
            await engine.apply_update(version)
        except (CodecError, EngineError) as e:
            return None, f"{type(e).__name__}: {e}"
        swap_s.append(time.perf_counter() - started)
        state.update(version=version.version, at=new)
        cpu = time.process_time()
        result = await check.run(engine, version.manifest, touched)
        check_cpu_s.append(time.process_time() - cpu)
        return result, None

    async def recover() -> bool:
        """A full reload of the version that should be served, checked in full."""
        version = state["version"]  # what the engine claims after a failed check; still serves after a refused apply
        await engine.load_version(dirs[state["at"]], version)
        state["version"] = version
        enc = encode_delta(weights["v1" if state["at"] == "v0" else "v0"], weights[state["at"]], model_id=MODEL,
                           version=version, base_version=version - 1, key=key)
        return (await check.run(engine, enc.manifest, None)).ok

    try:
        for _ in range(args.swaps):
            result, refused = await swap()
            if refused or not result.ok:
                false_alarms += 1
                log.error("false alarm: %s", refused or result.reason)
                continue
            check_s.append(result.seconds)
            checked.append(result.checked)
            if state["at"] == "v1" and "v1" not in probes:
                probes["v1"] = await probe(engine)
        unreadable = result.unreadable if result else -1
        fault_rows = []
        for kind in ("stale", "touched", "untouched"):
            caught = recovered = 0
            latencies: list[int] = []
            by: dict[str, int] = {}
            for _ in range(args.faults):
                undo = faults.stale() if kind == "stale" else None
                for after in range(1, args.rotation + 2):
                    if kind == "touched" and after == 1:
                        apply_update = engine.apply_update

                        async def corrupting(version, apply_update=apply_update):
                            await apply_update(version)
                            target = rng.choice([n for n in (version.manifest.tensors[i].name for i in version.updates)
                                                 if n.endswith(("down_proj.weight", "o_proj.weight"))])
                            faults.bump(target)

                        engine.apply_update = corrupting  # type: ignore[method-assign]
                        undo = functools.partial(delattr, engine, "apply_update")
                    result, refused = await swap()
                    if undo is not None:
                        undo()
                        undo = None
                    if kind == "untouched" and after == 1:
                        faults.bump(untouched)  # right after the swap and its check
                        continue
                    if refused or not result.ok:
                        caught += 1
                        latencies.append(after - (1 if kind == "untouched" else 0))
                        by["apply" if refused else "check"] = by.get("apply" if refused else "check", 0) + 1
                        break
                recovered += await recover()
            fault_rows.append({"kind": kind, "injected": args.faults, "caught": caught, "recovered": recovered,
                               "caught_by": by, "versions_to_catch_max": max(latencies, default=None)})
    finally:
        await engine.close()
    gc.collect()
    ratios = [c / s for c, s in zip(check_s, swap_s)]
    shift = probe_gap(probes["v0"], probes.get("v1", probes["v0"]))
    return {
        "engine": name, "swaps": args.swaps, "false_alarms": false_alarms, "rotation": args.rotation,
        "tensors_checked_median": statistics.median(checked) if checked else 0, "unreadable": unreadable,
        "check_ms_median": 1e3 * statistics.median(check_s), "check_ms_p90": 1e3 * _quantile(check_s, 0.9),
        "check_ms_max": 1e3 * max(check_s), "check_cpu_ms_median": 1e3 * statistics.median(check_cpu_s[:len(check_s)]),
        "untouched_tensor": untouched, "swap_s_median": statistics.median(swap_s),
        "check_share_median": statistics.median(ratios), "check_share_p90": _quantile(ratios, 0.9),
        "faults": fault_rows, "probe_logprobs": probes, "probe_shift_one_step": shift,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title="check after every swap: correct swaps (SmolLM2-135M, real Adam step)")
    for col in ("engine", "swaps", "false alarms", "tensors read", "unreadable", "check ms (median / p90 / max)", "check CPU ms",
                "swap s (median)", "check / swap (median / p90)", "probe shift, one step (nats)"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for c in result["engines"]:
        table.add_row(c["engine"], str(c["swaps"]), str(c["false_alarms"]), f"{c['tensors_checked_median']:.0f}",
                      str(c["unreadable"]), f"{c['check_ms_median']:.1f} / {c['check_ms_p90']:.1f} / {c['check_ms_max']:.1f}",
                      f"{c['check_cpu_ms_median']:.1f}",
                      f"{c['swap_s_median']:.3f}", f"{100 * c['check_share_median']:.1f}% / {100 * c['check_share_p90']:.1f}%",
                      f"{c['probe_shift_one_step']:.4f}")
    console.print(table)
    faults = Table(title="injected faults")
    for col in ("engine", "fault", "injected", "caught", "caught by", "versions to catch (max)", "recovered"):
        faults.add_column(col, justify="left" if col in ("engine", "fault", "caught by") else "right")
    for c in result["engines"]:
        for f in c["faults"]:
            faults.add_row(c["engine"], f["kind"], str(f["injected"]), str(f["caught"]),
                           ", ".join(f"{k} {n}" for k, n in f["caught_by"].items()),
                           str(f["versions_to_catch_max"]), str(f["recovered"]))
    console.print(faults)
    if "kernel_gap" in result:
        console.print(f"transformers vs vLLM, same weights, greedy probe logprobs: up to {result['kernel_gap']:.4f} nats apart")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    weights = {"v0": read_weights(smollm2_model_dir()), "v1": smollm2_adam_versions([args.lr])[args.lr]}
    result: dict[str, Any] = {"model": "smollm2-135m", "lr": args.lr, "threads": torch.get_num_threads(), "engines": []}
    with tempfile.TemporaryDirectory(prefix="swap-check-") as tmp:
        dirs = smollm2_version_dirs(Path(tmp), weights)
        for name in args.engines:
            result["engines"].append(asyncio.run(measure_engine(name, weights, dirs, args)))
    if len(result["engines"]) == 2:
        result["kernel_gap"] = probe_gap(*(c["probe_logprobs"]["v0"] for c in result["engines"]))
    emit(result, args, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
