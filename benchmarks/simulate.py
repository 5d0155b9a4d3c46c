"""Scale simulator: predicts how versions propagate through a deltamesh mesh far larger than this machine
can emulate, from a model calibrated on the emulated transfer runs.

The model (simulate_model.py): links with a rate and an RTT; per hop, parallel TCP connections fetching
pieces (slow start, a per-connection window, one idle RTT per piece request, shared link);
cut-through relays (a hop ends no earlier than one piece after its upstream) or store-and-forward
relays (hops add up); codec costs from measured bytes per changed weight and speeds. It is calibrated
on the `long_link` scenario of benchmarks/transfer.py (window from the single stream, per-piece
overhead from deltamesh's fetch), then shown beside every other measured scenario, out of sample.
Then it predicts per-version time to all pools, origin egress and staleness for Qwen3-14B, Qwen3-235B
and a 1T model over 8 regions, with its assumptions printed, and sets the papers' figures beside it.
Last, the latency budget at scale (simulate_scale.py): step end to every pool serving, stage by stage
and rank by rank, for Qwen3-14B in the seed's cross-region setup and a 1T MoE over 8 regions, with
sharded publishing beside today's path (rank 0 builds every version), from one core's stage speeds
measured by benchmarks/stage_speeds.py and the seed's node shape.

Measurements come from ~/.cache/deltamesh/transfer/results.json when benchmarks/transfer.py has run here (or
--measured FILE), else from the runs recorded in BENCHMARKS.md (benchmarks/transfer_recorded.json). `--json` prints
one object: {"calibration", "emulated": [{"scenario", "method", "predicted_s", "measured_s", "ratio",
"fitted"}], "big_models": [...], "papers": [...], "latency_at_scale": [{"model", "setup", "path",
"total_s", "target_s", "stages": {...}, "dominant", "assumptions": {...}, "gpu_not_measured"}],
"assumptions": {...}}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from common import emit
from simulate_model import Tcp
from simulate_scale import NOT_MODELLED, CoreSpeeds, Node, at_scale_rows, speeds_from_report
from simulate_scale_report import print_at_scale
from simulate_scenarios import (
    MODELS,
    STEP_SECONDS,
    Codec,
    Mesh,
    big_model_rows,
    calibrate,
    check_rows,
    codec_from_training,
    emulated_rows,
    paper_rows,
)

from deltamesh.cache import cache_dir

RESULTS = cache_dir("transfer", "results.json")
LATENCY = cache_dir("latency", "results.json")
"""benchmarks/latency.py's last `--json` run here: the software time a relay hop adds beyond its link."""
STAGE_SPEEDS = cache_dir("stage_speeds", "results.json")
"""benchmarks/stage_speeds.py's last run here: one core's speed per stage, for the latency budget at scale."""
RECORDED = Path(__file__).resolve().with_name("transfer_recorded.json")
"""The transfer runs recorded in BENCHMARKS.md (## Transfer over WAN), for machines where the emulator has not run."""


def load_measured(path: Path | None) -> tuple[dict[str, dict], str, list[dict]]:
    """(scenario name -> measured scenario, where from, extra long-link runs to check against)."""
    if path is not None and not path.exists():
        raise SystemExit(f"{path}: no such file")
    source = path or (RESULTS if RESULTS.exists() else None)
    label = str(source) if source else "figures recorded in BENCHMARKS.md"
    report = json.loads((source or RECORDED).read_text())
    return {s["name"]: s for s in report["scenarios"]}, label, report.get("checks", [])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--measured", type=Path, help="transfer.py results file (default ~/.cache/deltamesh/transfer/results.json)")
    ap.add_argument("--check", type=Path, action="append", default=[],
                    help="another transfer.py results file of long_link runs to compare with (repeatable)")
    ap.add_argument("--latency", type=Path,
                    help="benchmarks/latency.py --json output (default ~/.cache/deltamesh/latency/results.json)")
    ap.add_argument("--stage-speeds", type=Path,
                    help="benchmarks/stage_speeds.py --json output "
                         "(default ~/.cache/deltamesh/stage_speeds/results.json)")
    ap.add_argument("--gpu-gbps", type=float, default=1000.0,
                    help="a GPU's speed for the cast and the dense scan, printed apart as NOT MEASURED")
    ap.add_argument("--wan-mbit", type=float, default=Mesh.wan_mbit, help="rate of each inter-region link")
    ap.add_argument("--changed", type=float, default=Mesh.changed_fraction, help="fraction of weights changed per step")
    ap.add_argument("--encode-gbps", type=float, default=Codec.encode_gbps, help="codec encode speed per node")
    ap.add_argument("--apply-gbps", type=float, default=Codec.apply_gbps, help="codec apply speed per node")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measured, source, checks = load_measured(args.measured)
    for extra in args.check:
        checks += json.loads(extra.read_text())["scenarios"]
    if "long_link" in measured:
        tcp, calibration = calibrate(measured)
    else:
        tcp, calibration = Tcp(), {"note": "no long_link measurement: uncalibrated defaults"}
    calibration["source"] = source
    codec = codec_from_training(measured.get("real_training"),
                                Codec(encode_gbps=args.encode_gbps, apply_gbps=args.apply_gbps))
    mesh = replace(Mesh(), wan_mbit=args.wan_mbit, changed_fraction=args.changed)
    emulated = emulated_rows(measured, tcp) + check_rows(checks, tcp)
    speeds, hop_s = load_speeds(args.stage_speeds), load_hop_overhead(args.latency)
    report = {
        "calibration": calibration,
        "emulated": [{"scenario": r.scenario, "method": r.method, "predicted_s": round(r.predicted, 3),
                      "measured_s": r.measured, "ratio": None if r.ratio is None else round(r.ratio, 3),
                      "fitted": r.fitted} for r in emulated],
        "big_models": big_model_rows(tcp, codec, mesh),
        "papers": paper_rows(tcp, codec, mesh),
        "latency_at_scale": at_scale_rows(speeds, tcp, codec, mesh.changed_fraction, hop_s, gpu_gbps=args.gpu_gbps),
        "assumptions": {**assumptions(tcp, codec, mesh), "latency_at_scale": {
            "core_speeds": asdict(speeds), "node": asdict(Node()), "hop_overhead_s": hop_s,
            "gpu_gbps_not_measured": args.gpu_gbps, "not_modelled": NOT_MODELLED}},
    }
    emit(report, args, print_report)
    return 0


def _report(path: Path | None, default: Path) -> tuple[dict | None, Path | None]:
    """A benchmark's JSON report: `path`, else its last run here (`default`), else none."""
    if path is not None and not path.exists():
        raise SystemExit(f"{path}: no such file")
    source = path or (default if default.exists() else None)
    return (None, None) if source is None else (json.loads(source.read_text()), source)


def load_speeds(path: Path | None) -> CoreSpeeds:
    """One core's stage speeds from a stage_speeds.py report, else the figures recorded in BENCHMARKS.md."""
    report, source = _report(path, STAGE_SPEEDS)
    return CoreSpeeds() if report is None else speeds_from_report(report, str(source))


def load_hop_overhead(path: Path | None) -> float:
    """The software time a relay hop adds beyond its link, from a latency.py report (else none)."""
    report, _ = _report(path, LATENCY)
    return max(0.0, float(report.get("hop_overhead_s") or 0.0)) if report else 0.0


def assumptions(tcp: Tcp, codec: Codec, mesh: Mesh) -> dict:
    return {
        "tcp": asdict(tcp), "codec": asdict(codec),
        "mesh": {"regions": len(mesh.paths()) + 1, "tree": "origin -> 3 hubs (RTT ms "
                 f"{', '.join(f'{r:g}' for r in mesh.hub_rtts_ms)}) -> 4 leaves (RTT ms from their hub "
                 f"{', '.join(f'{r:g}' for _, r in mesh.leaf_rtts_ms)})",
                 "wan_mbit": mesh.wan_mbit, "pools_per_region": mesh.pools_per_region,
                 "pool_lan": f"{mesh.lan.mbit:g} Mbit/s, {mesh.lan.rtt_ms:g} ms",
                 "changed_fraction": mesh.changed_fraction, "full_every": mesh.full_every,
                 "node_bytes": mesh.node_bytes},
        "models_bf16_bytes": MODELS, "step_seconds": STEP_SECONDS,
        "connections": "per link: enough to fill it with 25% to spare (a window per RTT each, one idle RTT per "
                       "4 MiB piece), 4 to 512",
        "not_modelled": "CPU (except the emulation host's serving rate, in the fan_out '+ host CPU' rows), "
                        "losses other than a full queue, an origin uplink slower than its links, disk speed",
    }


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def print_report(r: dict) -> None:
    c = r["calibration"]
    print(f"Calibration ({c['source']}): " + ", ".join(f"{k} {v}" for k, v in c.items() if k != "source"))
    print("\nEmulated scenarios, predicted beside measured (seconds; fitted = used for calibration)")
    print(f"  {'scenario':<34} {'method':<22} {'predicted':>10} {'measured':>10} {'pred/meas':>10}")
    for row in r["emulated"]:
        measured = "-" if row["measured_s"] is None else f"{row['measured_s']:.2f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}" + (" fitted" if row["fitted"] else
                                                                          (" ok" if abs(row["ratio"] - 1) <= 0.2 else " OFF"))
        print(f"  {row['scenario']:<34} {row['method']:<22} {row['predicted_s']:>10.2f} {measured:>10} {ratio:>10}")
    a = r["assumptions"]
    print(f"\nBig models over {a['mesh']['regions']} regions: {a['mesh']['tree']}; {a['mesh']['wan_mbit']:g} Mbit/s "
          f"links; {a['mesh']['pools_per_region']} pools per region on {a['mesh']['pool_lan']}; "
          f"{a['mesh']['changed_fraction']:.1%} of weights changed per step; codec {a['codec']['bytes_per_changed']:.2f} "
          f"B/changed weight, full {a['codec']['full_ratio']:.2f}x bf16, encode/apply "
          f"{a['codec']['encode_gbps']:g}/{a['codec']['apply_gbps']:g} GB/s per node, one node per "
          f"{a['mesh']['node_bytes'] / 1e9:.0f} GB; TCP as calibrated above; fetches per link sized to fill it")
    print(f"  {'model':<11} {'delta GB':>9} {'full GB':>8} {'delta net':>10} {'+codec':>8} {'full->all':>10} "
          f"{'egress delta':>13} {'egress/ver':>11} {'step':>8} {'stale':>6} {'AstraFlow delta':>16}")
    for m in r["big_models"]:
        print(f"  {m['model']:<11} {m['delta_bytes'] / 1e9:>9.2f} {m['full_bytes'] / 1e9:>8.0f} "
              f"{_s(m['delta_network_seconds']):>10} {_s(m['delta_seconds_to_all_pools']):>8} "
              f"{_s(m['full_seconds_to_all_pools']):>10} {m['origin_egress_delta'] / 1e9:>10.2f} GB "
              f"{m['origin_egress_per_version'] / 1e9:>8.1f} GB {_s(m['step_seconds']):>8} "
              f"{m['staleness_mean_versions']:>6.2f} {_s(m['astraflow_seconds_to_all_pools']):>16}")
    print("  (delta net: publish to all pools, network only; +codec: with encode and apply; full->all: a full\n"
          "   snapshot with its codec; egress/ver: with the full snapshot every 10 versions; stale: mean versions\n"
          "   a pool is behind at that step time; AstraFlow delta: every pool pulls a 10 B/changed delta from the\n"
          "   trainer node, one stream each, one pool at a time)")
    print_at_scale(r["latency_at_scale"], CoreSpeeds(**a["latency_at_scale"]["core_speeds"]))
    print("\nPaper figures beside the model")
    for p in r["papers"]:
        print(f"  {p['source']}: {p['what']}: paper {p['paper']}; model: {p['model']}")
    print(f"\nNot modelled: {a['not_modelled']}.")


if __name__ == "__main__":
    sys.exit(main())
