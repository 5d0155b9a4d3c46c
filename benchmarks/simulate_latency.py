"""The latency budget at scale: from a trainer's step end to every pool serving, stage by stage, for
models far larger than this machine holds.

Stage costs are taken from a measured run of benchmarks/latency.py (the stages that pass over the
weights, per model byte: the bf16 cast, encode with signing, the pool's verify and apply into its
engine, the after-swap check; and the software time each relay hop adds beyond its link), or from
the defaults below when it has not run here. The network is simulate_model.py's propagation model,
with the TCP behaviour calibrated on the emulated runs (simulate.py). A big model is cut across
nodes, one per `Mesh.node_bytes` of weights (an FSDP trainer's shards, a tensor-parallel pool's
ranks): cast, encode, apply and check run on every node at once on its own shard, and the shards'
deltas travel together. What is not modelled: a GPU engine's apply speed (it is taken from the CPU
engine measured here, slow beside GPU memory), and the trainer's upload competing with other traffic
on its uplink.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from simulate_model import Tcp, connections_for, fetch
from simulate_scenarios import GB, Codec, Mesh, tree_seconds

SMOLLM2_BYTES = 269_060_520
"""bf16 bytes of SmolLM2-135M, the model benchmarks/latency.py runs by default."""

BIG_MODELS = (
    # (name, bf16 bytes, delta bytes or None for the codec's own figure, what the delta figure is)
    ("Qwen3-14B", 28e9, 1.5e9, "1.5 GB delta (AstraFlow's figure)"),
    ("Qwen3-14B", 28e9, None, "deltamesh's delta"),
    ("1T MoE", 2000e9, None, "deltamesh's delta"),
)


@dataclass(frozen=True)
class StageCosts:
    """Per-stage speeds, in bf16 model bytes per second (GB/s), and the software time per relay hop."""

    cast_gbps: float = 4.0
    """fp32 master weights to their bf16 copy."""
    encode_gbps: float = Codec.encode_gbps
    """Compare with the base, hash, encode and sign (BENCHMARKS.md, ## Codec)."""
    apply_gbps: float = Codec.apply_gbps
    """The pool's verify and apply into its engine in place, with every hash checked."""
    check_gbps: float = 9.0
    """The check of what the engine serves after the swap (~30 ms for SmolLM2 here: BENCHMARKS.md)."""
    hop_overhead_s: float = 0.0
    """Software time a relay hop adds beyond its link's round trips and bytes."""
    source: str = "defaults (benchmarks/latency.py has not run here)"


def _durations(versions: list[dict[str, Any]], start: str, end: str) -> list[float]:
    """Seconds from stage `start` to stage `end` of each version (and each host where they are per host)."""
    out = []
    for v in versions:
        stages = v["stages"]
        for name, t in stages.items():
            if name == end or name.endswith(":" + end):
                host = name[: -len(end)]
                begin = stages.get(host + start, stages.get(start))
                if begin is not None and t is not None and t >= begin:
                    out.append(t - begin)
    return out


def costs_from_latency(report: dict[str, Any]) -> StageCosts:
    """Stage costs from a benchmarks/latency.py `--json` report (fields it lacks keep their defaults)."""
    model_bytes = float(report.get("model_bytes") or SMOLLM2_BYTES)
    versions = [v for v in report.get("versions", []) if v.get("stages")]
    costs = StageCosts(source="benchmarks/latency.py run")
    speeds = {"cast_gbps": ("step_end", "cast"), "encode_gbps": ("cast", "signed"),
              "apply_gbps": ("fetched", "applied"), "check_gbps": ("applied", "serving")}
    found = {}
    for field_name, (start, end) in speeds.items():
        seconds = _durations(versions, start, end)
        if seconds and statistics.median(seconds) > 0:
            found[field_name] = model_bytes / statistics.median(seconds) / GB
    hops = report.get("hop_overhead_s")
    if hops is not None:
        found["hop_overhead_s"] = max(0.0, float(hops))
    return replace(costs, **found) if found else StageCosts()


def budget_rows(tcp: Tcp, codec: Codec, mesh: Mesh, costs: StageCosts) -> list[dict[str, Any]]:
    """Step end to every pool serving for each big model, and where the time goes."""
    rows = []
    depth = max(len(hops) for hops in mesh.paths())
    for name, model_bytes, delta_bytes, what in BIG_MODELS:
        delta = delta_bytes if delta_bytes is not None else (
            mesh.changed_fraction * model_bytes / 2 * codec.bytes_per_changed)
        shard = model_bytes / math.ceil(model_bytes / mesh.node_bytes)
        upload = fetch(delta, 4 * 2**20, mesh.lan, tcp, connections_for(mesh.lan, tcp), fresh=False, warm=True)
        stages = {
            "cast": shard / (costs.cast_gbps * GB),
            "encode + sign": shard / (costs.encode_gbps * GB),
            "upload to origin": upload.seconds + mesh.lan.rtt,
            "origin to every pool": tree_seconds(delta, mesh, tcp) + depth * costs.hop_overhead_s,
            "verify + apply": shard / (costs.apply_gbps * GB),
            "serve check": shard / (costs.check_gbps * GB),
        }
        total = sum(stages.values())
        rows.append({"model": name, "delta": what, "model_bytes": model_bytes, "delta_bytes": delta,
                     "nodes": math.ceil(model_bytes / mesh.node_bytes), "stages": stages,
                     "seconds_to_all_pools": total, "largest_stage": max(stages, key=stages.get)})
    return rows


def budget_assumptions(costs: StageCosts) -> dict[str, Any]:
    return {"stage_costs": asdict(costs)}


def print_budget(rows: list[dict[str, Any]], costs: StageCosts) -> None:
    print(f"\nLatency budget at scale (stage costs: {costs.source}; cast {costs.cast_gbps:.2f}, encode "
          f"{costs.encode_gbps:.2f}, verify+apply {costs.apply_gbps:.2f}, serve check {costs.check_gbps:.2f} GB/s "
          f"per node; {costs.hop_overhead_s * 1000:.0f} ms software per relay hop)")
    names = list(rows[0]["stages"]) if rows else []
    print(f"  {'model':<10} {'delta':<34} {'GB':>6} " + " ".join(f"{n:>20}" for n in names) + f" {'total':>9}")
    for r in rows:
        total = r["seconds_to_all_pools"]
        cells = " ".join(f"{s:>8.2f} s ({s / total:>4.0%})".rjust(20) for s in r["stages"].values())
        print(f"  {r['model']:<10} {r['delta']:<34} {r['delta_bytes'] / GB:>6.2f} {cells} {total:>7.1f} s")
