"""The latency budget at scale as a terminal table, with its assumptions and the targets (the rows
simulate_scale.py computes; printed by benchmarks/simulate.py)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from simulate_scale import NOT_MODELLED, CoreSpeeds, Node, target_of
from simulate_scenarios import GB

from deltamesh.delta.parallel import MAX_WORKERS


def print_at_scale(rows: list[dict[str, Any]], speeds: CoreSpeeds, node: Node = Node()) -> None:
    """The stage table, each row's assumptions and its variants, what is not modelled, the targets."""
    console = Console(width=160, highlight=False)

    def say(text: str) -> None:
        console.print(text, markup=False)

    threads = min(node.cores_per_rank, MAX_WORKERS)
    per_core = ", ".join(f"{s} {v:.2f}" for s, v in speeds.per_core.items())
    scaling = ", ".join(f"{s} {v:.2f}x" for s, v in speeds.scaling.items())
    say(f"\nLatency budget at scale, per rank: step end -> every pool serving (speeds: {speeds.source})")
    say(f"  node: {node.gpus} GPUs and {node.cores} host cores, {node.cores_per_rank} per rank: torch's cast on "
          f"{node.cores_per_rank} threads, the codec on {threads} (delta/parallel.py MAX_WORKERS {MAX_WORKERS}); host "
          f"memory {node.memory_gbps:g} GB/s peak, shared by the node's ranks")
    say(f"  one core, GB of bf16 model/s: {per_core}; manifest per entry on one core: sign "
          f"{speeds.sign_s_per_entry * 1e6:.1f} us, check and load {speeds.load_s_per_entry * 1e6:.1f} us")
    say(f"  on {speeds.scaled_cores} cores there, over one: {scaling}. The table scales one core's speed by the "
          f"threads; 'as measured' below scales it as those {speeds.scaled_cores} cores did (Amdahl)")
    table = Table(title="seconds each stage adds to step end -> every pool serving")
    for column in ("model", "path", *(rows[0]["stages"] if rows else ()), "total", "dominant"):
        table.add_column(column, justify="left" if column in ("model", "path", "dominant") else "right")
    for r in rows:
        table.add_row(r["model"].split(" (")[0], r["path"], *(f"{s:.2f}" for s in r["stages"].values()),
                      f"{r['total_s']:.1f}", r["dominant"])
    console.print(table)
    for r in rows:
        a = r["assumptions"]
        bounds = ", ".join(f"{s} {b['gbps']:.1f} ({b['bound']})" for s, b in a["rank_gbps"].items())
        say(f"\n  {r['model']}, {r['setup']}:\n    {a['trainer_ranks']} trainer rank(s) of "
              f"{a['shard_bytes'] / GB:.1f} GB; delta {a['delta_bytes'] / GB:.2f} GB ({a['changed_fraction']:.1%} "
              f"changed at {a['bytes_per_changed']:.2f} B each); pool: {a['pool']}, fetches "
              f"{a['fetch_fraction']:.3f} and holds {a['held_fraction']:.3f} of it; each regional gateway sends "
              f"{a['gateway_egress_bytes'] / GB:.1f} GB to {a['pools_per_region']} pool(s); manifest "
              f"{a['manifest_entries']:,} entries\n"
              f"    per rank GB/s: {bounds}")
        slower = r["scaling_as_measured"]
        say(f"    threads scaling as measured: total {slower['total_s']:.1f} s (" + ", ".join(
            f"{s} {v:.2f} s" for s, v in slower["stages"].items() if v != r["stages"][s]) + ")")
        gpu = r.get("gpu_not_measured")
        if gpu is not None:
            say(f"    NOT MEASURED: with the cast and the dense scan on the trainer's GPUs at a stated "
                  f"{gpu['gpu_gbps']:g} GB/s, scan/encode {gpu['stages']['scan/encode']:.2f} s, "
                  f"total {gpu['total_s']:.1f} s")
    say(f"  Not modelled: {NOT_MODELLED}.")
    for r in rows:
        target = target_of(r["model"])
        if target is not None and r["path"] == "sharded":
            verdict = "meets" if r["total_s"] <= target else "misses"
            say(f"  {r['model'].split(' (')[0]}: sharded {r['total_s']:.1f} s {verdict} the {target:g} s target "
                  f"({r['scaling_as_measured']['total_s']:.1f} s with threads scaling as measured); {r['dominant']} "
                  f"dominates ({r['stages'][r['dominant']] / r['total_s']:.0%})")
