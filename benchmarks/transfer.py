"""Cross-region transfer benchmark: deltamesh and its baselines over emulated WAN links, side by side.

Scenarios (transfer_long_link.py, transfer_scenarios.py and transfer_training.py describe each method):

1. `long_link`: one 400 Mbit/s, 300 ms link; a 200 MB version, deltamesh's parallel piece fetch cold
   and warm vs one HTTP stream (`single_stream`), and the same fetch from a gateway serving HTTPS
   (`deltamesh_tls`).
2. `long_link_loss`: the same link losing packets at random, each way: one scenario per rate of
   `--loss` (default 0.1% and 1%, named `long_link_loss_0.1pct`, ...), deltamesh (`--loss-connections`
   parallel fetches) beside one stream; BBR unless `--congestion` says otherwise (`congestion_for`).
3. `relay_chain`: origin -> A -> B over two long hops; deltamesh cut-through relaying vs
   `store_and_forward` vs B pulling straight from the origin (`direct`); `relay_chain_loss`: the same
   with the first `--loss` rate on every long link.
4. `fan_out`: origin -> 3 regions x 4 pools; deltamesh relays vs every pool pulling its own copy from
   the origin (`astraflow`).
5. `real_training`: successive training steps of real SmolLM2-135M weights (one Adam optimizer,
   lr 5e-6, next-token loss on real text) published and propagated over the fan-out mesh to 12
   `deltamesh pool sync` agents.

6. `your_link` (`--mbit N --rtt-ms N`, instead of the others): an ad-hoc origin -> relay region ->
   pool topology across one link of that rate and RTT, deltamesh vs `single_stream`
   (transfer_link.py), for a version of `--payload-mb`: the figures of the scenarios for your own link.

Needs root and the WAN emulator (benchmarks/wan/setup.sh). Scenarios 1-4 first measure their first
long link and print the measured rate and RTT beside the asked ones. The figures the targets are about
(deltamesh cold and warm, direct) run --repeats times (default 10), the others --side-repeats (3);
each figure is the median, every run is listed beside it with the record of what the link did during
it (drops, lateness, queues, TCP retransmits and windows: wan/records.py) and whether the emulator's
link check held. A single-stream download is measured for --baseline-window-s and extrapolated from
its rate in the window's second half, which the table and JSON say (`extrapolated_runs`).
`--json` prints one object {"scenarios": [{"name", "link": {"mbit", "rtt_ms", ...}, "methods":
{"<method>": {"seconds", "utilization", "runs", "run_utilization", "link_records", "links_ok",
"origin_egress_bytes", "payload_bytes", ...}}}]} (long_link adds "tls_minus_plain_points": {"cold",
"warm"}; relay chains "two_hops_over_one" and "two_hops_over_one_runs"); utilization = payload bits /
seconds / link rate. Results are also saved (merged by scenario name) to
~/.cache/deltamesh/transfer/results.json (results-quick.json with --quick, results-link.json for
your_link), which benchmarks/simulate.py reads.
`--quick` runs a small version over links with a fifth of the RTT, once: for trying things out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from deltamesh.cache import cache_dir
from deltamesh.logs import setup_logging

log = logging.getLogger("transfer")

ORDER = ("long_link", "long_link_loss", "relay_chain", "relay_chain_loss", "fan_out", "real_training")
RESULTS = cache_dir("transfer")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=ORDER, action="append", help="run only this scenario (repeatable)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--quick", action="store_true", help="16 MB version, RTTs / 5, one run, 4 training steps")
    ap.add_argument("--repeats", type=int, help="runs of the methods the targets are about (default 10; 1 with --quick)")
    ap.add_argument("--side-repeats", type=int, default=3, help="runs of every other method (default 3)")
    ap.add_argument("--baseline-window-s", type=float, default=12.0,
                    help="seconds a single-stream download is measured before its time is extrapolated")
    ap.add_argument("--loss", default="0.1,1", help="comma-separated random loss rates (%%) of the lossy scenarios")
    ap.add_argument("--loss-connections", type=int, default=64, help="parallel piece fetches over a lossy long link")
    ap.add_argument("--payload-mb", type=float, help="version size for scenarios 1-3 and your_link (default 200)")
    ap.add_argument("--mbit", type=float, help="with --rtt-ms: run only your_link, over a link of this rate")
    ap.add_argument("--rtt-ms", type=float, help="with --mbit: the RTT of your_link's long link")
    ap.add_argument("--methods", help="comma-separated baselines and variants (e.g. deltamesh_warm, deltamesh_tls) "
                                      "to run beside deltamesh (default: all)")
    ap.add_argument("--connections", type=int, default=16,
                    help="parallel piece fetches over long links (relay gateways, pullers)")
    ap.add_argument("--tcp-buffers", choices=("linux", "tuned"), default="linux",
                    help="hosts' TCP buffer limits: the kernel's long-standing defaults, or 64 MiB")
    ap.add_argument("--congestion", choices=("cubic", "bbr"),
                    help="TCP congestion control: every host's default (baselines' servers included) and every "
                         "gateway's `congestion` setting (default: bbr over lossy links, cubic elsewhere: the "
                         "faster of the two on each, BENCHMARKS.md)")
    ap.add_argument("--initcwnd", type=int, default=0,
                    help="initial congestion and receive windows (segments) on every host's routes, as an operator "
                         "would set them for long links (default: Linux's own, 10)")
    ap.add_argument("--steps", type=int, help="training versions after the first (default 6; 4 with --quick)")
    ap.add_argument("--step-seconds", type=float, default=20.0, help="seconds between two published training versions")
    ap.add_argument("--save", type=Path, help="results file to merge into (default ~/.cache/deltamesh/transfer/results.json, "
                                              "results-quick.json with --quick)")
    ap.add_argument("--rtt-scale", type=float, help="multiply every link's RTT (default 1; 0.2 with --quick)")
    ap.add_argument("--pool-rtt-ms", type=float, default=0.0,
                    help="RTT of the region-to-pool links (default 0: rate-limited, no delayer; the topology says 2)")
    ap.add_argument("--no-verify", action="store_true", help="skip measuring the links before the runs")
    ap.add_argument("--log-level", default=os.environ.get("DELTAMESH_LOG", "WARNING"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    if (args.mbit is None) != (args.rtt_ms is None) or (args.mbit is not None and args.scenario):
        print("--mbit and --rtt-ms go together, and without --scenario", file=sys.stderr)
        return 2
    if args.mbit is not None and not (args.mbit > 0 and args.rtt_ms >= 0):
        print("--mbit must be > 0 and --rtt-ms >= 0", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("the transfer benchmark needs root (network namespaces); see benchmarks/wan/README.md", file=sys.stderr)
        return 2
    from transfer_mesh import congestion_allowed
    from transfer_payload import payload_manifest, prepare_payload
    from transfer_runs import Settings
    from transfer_scenarios import SCENARIOS

    names = ["your_link"] if args.mbit is not None else [n for n in ORDER if n in (args.scenario or ORDER)]
    payload_mb = args.payload_mb or (16.0 if args.quick else 200.0)
    payload = prepare_payload(payload_mb)
    pieces = len(payload_manifest(payload).pieces)
    payload_bytes = (payload / "version.bin").stat().st_size
    settings = Settings(payload=payload, payload_bytes=payload_bytes, piece_bytes=payload_bytes / pieces,
                        repeats=args.repeats or (1 if args.quick else 10), side_repeats=args.side_repeats,
                        baseline_window_s=args.baseline_window_s, loss_connections=args.loss_connections,
                        loss_rates=tuple(float(x) / 100 for x in args.loss.split(",")),
                        rtt_scale=args.rtt_scale or (0.2 if args.quick else 1.0),
                        connections=args.connections, tcp_buffers=args.tcp_buffers,
                        congestion=congestion_for(names[0], args.congestion), initcwnd=args.initcwnd,
                        verify=not args.no_verify,
                        methods=frozenset(args.methods.split(",")) if args.methods else None,
                        pool_rtt_ms=args.pool_rtt_ms)
    started = time.time()
    scenarios = []
    with contextlib.ExitStack() as allowed:
        for cc in {congestion_for(name, args.congestion) for name in names}:
            allowed.enter_context(congestion_allowed(cc))
        for name in names:
            settings = replace(settings, congestion=congestion_for(name, args.congestion))
            t0 = time.monotonic()
            log.warning("scenario %s ...", name)
            if name == "your_link":
                from transfer_link import your_link

                result = your_link(settings, args.mbit, args.rtt_ms)
            elif name == "real_training":
                from transfer_training import real_training

                result = real_training(settings, steps=args.steps or (4 if args.quick else 6),
                                       step_seconds=args.step_seconds)
            else:
                result = SCENARIOS[name](settings)
            for scenario in result if isinstance(result, list) else [result]:
                scenario["wall_seconds"] = round(time.monotonic() - t0, 1)
                scenario["load_average"] = [round(x, 2) for x in os.getloadavg()]
                scenarios.append(scenario)
    report = {"scenarios": scenarios, "quick": args.quick, "started": started,
              "wall_seconds": round(time.time() - started, 1),
              "payload_mb": payload_mb, "command": " ".join(["benchmarks/transfer.py", *(argv or sys.argv[1:])])}
    default = "results-link.json" if args.mbit is not None else "results-quick.json" if args.quick else "results.json"
    save(report, args.save or RESULTS / default)
    if args.json:
        print(json.dumps(report))
    else:
        from transfer_report import print_report

        print_report(report)
    return 0


def congestion_for(scenario: str, chosen: str | None) -> str:
    """The congestion control a scenario runs with: the one `--congestion` chose, else BBR over lossy
    links (cubic is loss-limited there: ~24% of the long link at 0.1% against ~67%) and cubic on the
    others (BBR is slower at a version's end: BENCHMARKS.md, docs/api/gateway.md, Long links)."""
    return chosen or ("bbr" if scenario.endswith("_loss") else "cubic")


def rank(name: str) -> int:
    """Where a scenario goes in the results: ORDER's place of its name, or of the family it is of
    (`long_link_loss_0.1pct` is a `long_link_loss`)."""
    family = name if name in ORDER else name.rsplit("_", 1)[0]
    return ORDER.index(family) if family in ORDER else len(ORDER)


def save(report: dict, path: Path) -> None:
    """Merge this run's scenarios into the results file, replacing earlier runs of the same names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {"scenarios": []}
    ran = {s["name"] for s in report["scenarios"]}
    kept = [s for s in old.get("scenarios", []) if s["name"] not in ran]
    merged = {**old, **report, "scenarios": sorted(kept + report["scenarios"], key=lambda s: rank(s["name"]))}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
