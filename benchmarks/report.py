"""The plots of BENCHMARKS.md, drawn from a results file of `benchmarks/run_all.py --json` (matplotlib,
Agg backend: no display needed) into docs/figures/ as PNGs:

- `codec_ratio.png`: bytes of a real SmolLM2 step's delta against the full bf16 checkpoint, per
  learning rate, for deltamesh and the baselines of benchmarks/codec.py (and the order-0 entropy);
- `transfer_utilization.png`: the long link's utilization over time while one version crosses it
  (each tenth of the version's bytes as it arrived), deltamesh cold and warm against one stream;
- `latency_stages.png`: a version's way from the trainer's step end to every pool serving it, stage
  by stage on each host (the medians of benchmarks/latency.py);
- `broker_batch.png`: the broker's ingest rate against the size of the pools' submissions
  (benchmarks/broker.py --sweep).

A plot whose benchmark is missing from the results file is left out (and said so). Usage:

    .venv/bin/python benchmarks/report.py RESULTS.json [--out docs/figures]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

METHODS = {"deltamesh": "deltamesh", "pulse": "PULSE (gaps + zstd)", "slime": "slime (XOR + zstd-1)",
           "astraflow": "AstraFlow (index + value)"}
LINK_CEILING = 0.956
"""TCP payload at MTU 1500: the most of a link's rate a transfer can use."""


def codec_ratio(results: dict[str, Any], ax) -> bool:
    from matplotlib.ticker import FuncFormatter

    cases = []
    for case in (results.get("codec") or {}).get("cases", []):
        found = re.fullmatch(r"smollm2-135m adam lr=([0-9.e-]+)", case["name"])
        if found:
            cases.append((float(found.group(1)), case))
    if not cases:
        return False
    cases.sort(key=lambda c: c[0])
    lrs = [lr for lr, _ in cases]
    for method, label in METHODS.items():
        ratios = [c["results"][method]["ratio_vs_full"] for _, c in cases if method in c["results"]]
        if len(ratios) == len(cases):
            ax.plot(lrs, ratios, marker="o", linewidth=2.5 if method == "deltamesh" else 1.2, label=label)
    floor = [c["full_bytes"] / c["order0_entropy_bytes"] for _, c in cases if c.get("order0_entropy_bytes")]
    if len(floor) == len(cases):
        ax.plot(lrs, floor, linestyle="--", color="gray", label="order-0 entropy (no context)")
    for i, (lr, case) in enumerate(cases):
        ax.annotate(f"{100 * case['changed_fraction']:.2f}% of words changed", (lr, case["results"]["deltamesh"]["ratio_vs_full"]),
                    textcoords="offset points", xytext=(0, -16), fontsize=8,
                    ha="left" if i == 0 else "right" if i == len(cases) - 1 else "center")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if str(v)[0] in "2358" else ""))
    ax.set_xlabel("learning rate of the Adam step")
    ax.set_ylabel("times smaller than full bf16 safetensors")
    ax.set_title("SmolLM2-135M, one real Adam step: delta size against the checkpoint")
    ax.legend(fontsize=8)
    return True


def transfer_utilization(results: dict[str, Any], ax) -> bool:
    scenario = next((s for s in (results.get("transfer") or {}).get("scenarios", []) if s["name"] == "long_link"), None)
    if scenario is None:
        return False
    rate = scenario["link"]["mbit"] * 1e6
    labels = {"deltamesh": "deltamesh, cold", "deltamesh_warm": "deltamesh, warm (asked ahead)",
              "deltamesh_tls_warm": "deltamesh over TLS, warm", "single_stream": "one HTTP stream, cold"}
    drawn = False
    for method, label in labels.items():
        m = scenario["methods"].get(method)
        if not m or len(m.get("timeline") or []) < 2:
            continue
        points = [(0.0, 0)] + [(t, n) for t, n in m["timeline"]]
        times, shares = [], []
        for (t0, n0), (t1, n1) in zip(points, points[1:]):
            if t1 > t0:
                times += [t0, t1]
                shares += [100 * (n1 - n0) * 8 / (t1 - t0) / rate] * 2
        ax.plot(times, shares, linewidth=1.8, label=f"{label}: {m['seconds']:.1f} s, {100 * m['utilization']:.0f}% overall")
        drawn = True
    if not drawn:
        return False
    ax.axhline(100 * LINK_CEILING, linestyle="--", color="gray", linewidth=1, label="TCP payload ceiling")
    ax.set_xlabel("seconds since the version was released")
    ax.set_ylabel("% of the link's rate")
    ax.set_ylim(0, 105)
    link = scenario["link"]
    ax.set_title(f"one {scenario['methods']['deltamesh']['payload_bytes'] / 1e6:.0f} MB version over "
                 f"{link['mbit']:.0f} Mbit/s x {link['rtt_ms']:.0f} ms RTT (each tenth of its bytes)")
    ax.legend(fontsize=8)
    return True


def latency_stages(results: dict[str, Any], ax) -> bool:
    medians = (results.get("latency") or {}).get("medians") or {}
    stages, steps = medians.get("stages") or {}, medians.get("increments") or {}
    if not stages:
        return False
    rows = sorted(((name, at) for name, at in stages.items() if name in steps and name != "step_end"),
                  key=lambda item: item[1])
    colors = {"trainer": "#4c72b0", "gateway": "#55a868", "pool": "#c44e52", "all": "#333333"}
    for i, (name, at) in enumerate(rows):
        start = at - max(0.0, steps[name])
        kind = "pool" if name.startswith("pool:") else "gateway" if "stored" in name else \
            "all" if name.startswith("all_") else "trainer"
        ax.barh(i, at - start, left=start, color=colors[kind])
        ax.text(at + 0.02, i, f"{at:.2f} s", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [name.replace("pool:", "") for name, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds after the trainer's step ended (median over versions)")
    total = medians.get("all_pools_seconds")
    ax.set_title("a SmolLM2 version from step end to every pool serving it" +
                 (f": {total:.2f} s" if isinstance(total, (int, float)) else ""))
    return True


def broker_batch(results: dict[str, Any], ax) -> bool:
    sweep = (results.get("broker") or {}).get("sweep") or []
    if not sweep:
        return False
    sizes = [p["trajectories_per_submission"] for p in sweep]
    ax.plot(sizes, [p["ingest_traj_per_s"] for p in sweep], marker="o", linewidth=2, label="ingest, trajectories/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("trajectories per submission (2,048 tokens each; 8 pools submitting at once)")
    ax.set_ylabel("trajectories/s, acknowledged once durable")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(sizes, [p["batch_latency_ms_p50"] for p in sweep], marker="s", color="gray", linestyle="--",
              label="ready batch of 256, p50 ms")
    twin.set_ylabel("ms")
    twin.set_ylim(bottom=0)
    ax.set_title("broker (SQLite, fsync, group commit): ingest against submission size")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    return True


PLOTS: dict[str, tuple[Callable[[dict[str, Any], Any], bool], tuple[float, float]]] = {
    "codec_ratio.png": (codec_ratio, (7, 4.5)),
    "transfer_utilization.png": (transfer_utilization, (8, 4.5)),
    "latency_stages.png": (latency_stages, (8, 6)),
    "broker_batch.png": (broker_batch, (7, 4.5)),
}


def draw(results_file: dict[str, Any], out: Path) -> list[Path]:
    """Every plot the results allow, written under `out`; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    results = results_file.get("results", results_file)
    stamp = " ".join(str(results_file[k]) for k in ("date", "commit") if results_file.get(k))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (plot, size) in PLOTS.items():
        fig, ax = plt.subplots(figsize=size)
        if plot(results, ax):
            if stamp:
                fig.text(0.99, 0.005, stamp, ha="right", va="bottom", fontsize=6, color="gray")
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            written.append(out / name)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a results file of benchmarks/run_all.py --json")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "figures")
    args = p.parse_args(argv)
    written = draw(json.loads(args.results.read_text()), args.out)
    for name in PLOTS:
        print(f"{args.out / name}: {'written' if args.out / name in written else 'no data in the results file'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
