"""The latency budget at scale as a terminal table, with its assumptions and the targets (the rows
simulate_scale.py computes; printed by benchmarks/simulate.py)."""

from __future__ import annotations

from typing import Any

from deltamesh.delta.parallel import MAX_WORKERS

from simulate_scale import NOT_MODELLED, CoreSpeeds, Node, target_of
from simulate_scenarios import GB


def print_at_scale(rows: list[dict[str, Any]], speeds: CoreSpeeds, node: Node = Node()) -> None:
    """The stage table, each row's assumptions and its variants, what is not modelled, the targets."""
    threads = min(node.cores_per_rank, MAX_WORKERS)
    per_core = ", ".join(f"{s} {v:.2f}" for s, v in speeds.per_core.items())
    scaling = ", ".join(f"{s} {v:.2f}x" for s, v in speeds.scaling.items())
    print(f"\nLatency budget at scale, per rank: step end -> every pool serving (speeds: {speeds.source})")
    print(f"  node: {node.gpus} GPUs and {node.cores} host cores, {node.cores_per_rank} per rank: torch's cast on "
          f"{node.cores_per_rank} threads, the codec on {threads} (delta/parallel.py MAX_WORKERS {MAX_WORKERS}); host "
          f"memory {node.memory_gbps:g} GB/s peak, shared by the node's ranks")
    print(f"  one core, GB of bf16 model/s: {per_core}; manifest per entry on one core: sign "
          f"{speeds.sign_s_per_entry * 1e6:.1f} us, check and load {speeds.load_s_per_entry * 1e6:.1f} us")
    print(f"  on {speeds.scaled_cores} cores there, over one: {scaling}. The table scales one core's speed by the "
          f"threads; 'as measured' below scales it as those {speeds.scaled_cores} cores did (Amdahl)")
    names = list(rows[0]["stages"]) if rows else []
    print(f"  {'model':<10} {'path':<7} " + " ".join(f"{n:>14}" for n in names) + f" {'total':>8}  dominant")
    for r in rows:
        cells = " ".join(f"{s:>12.2f} s" for s in r["stages"].values())
        print(f"  {r['model'].split(' (')[0]:<10} {r['path']:<7} {cells} {r['total_s']:>6.1f} s  {r['dominant']}")
    for r in rows:
        a = r["assumptions"]
        bounds = ", ".join(f"{s} {b['gbps']:.1f} ({b['bound']})" for s, b in a["rank_gbps"].items())
        print(f"\n  {r['model']}, {r['setup']}:\n    {a['trainer_ranks']} trainer rank(s) of "
              f"{a['shard_bytes'] / GB:.1f} GB; delta {a['delta_bytes'] / GB:.2f} GB ({a['changed_fraction']:.1%} "
              f"changed at {a['bytes_per_changed']:.2f} B each); pool: {a['pool']}, fetches "
              f"{a['fetch_fraction']:.3f} and holds {a['held_fraction']:.3f} of it; each regional gateway sends "
              f"{a['gateway_egress_bytes'] / GB:.1f} GB to {a['pools_per_region']} pool(s); manifest "
              f"{a['manifest_entries']:,} entries\n"
              f"    per rank GB/s: {bounds}")
        slower = r["scaling_as_measured"]
        print(f"    threads scaling as measured: total {slower['total_s']:.1f} s (" + ", ".join(
            f"{s} {v:.2f} s" for s, v in slower["stages"].items() if v != r["stages"][s]) + ")")
        gpu = r.get("gpu_not_measured")
        if gpu is not None:
            print(f"    NOT MEASURED: with the cast and the dense scan on the trainer's GPUs at a stated "
                  f"{gpu['gpu_gbps']:g} GB/s, scan/encode {gpu['stages']['scan/encode']:.2f} s, "
                  f"total {gpu['total_s']:.1f} s")
    print(f"  Not modelled: {NOT_MODELLED}.")
    for r in rows:
        target = target_of(r["model"])
        if target is not None and r["path"] == "sharded":
            verdict = "meets" if r["total_s"] <= target else "misses"
            print(f"  {r['model'].split(' (')[0]}: sharded {r['total_s']:.1f} s {verdict} the {target:g} s target "
                  f"({r['scaling_as_measured']['total_s']:.1f} s with threads scaling as measured); {r['dominant']} "
                  f"dominates ({r['stages'][r['dominant']] / r['total_s']:.0%})")
