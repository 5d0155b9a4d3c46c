"""The transfer benchmark's tables: one per scenario, methods side by side with their medians, then
every run of each method with what the link did during it (its record's one-line summary, and
whether the emulator's link check held), and the targets, counted run by run."""

from __future__ import annotations

from wan.record_view import summary

MB = 1e6

TARGETS = {
    "long_link": "targets: warm >= 85% in at least 9 of 10 runs, cold >= 65%; over TLS within 5 points of plain",
    "long_link_loss": "targets: at 0.1% loss warm >= 70%; at 1% beside one stream",
    "relay_chain": "target: two hops (deltamesh) <= 1.15x one hop (direct) in at least 9 of 10 runs",
    "relay_chain_loss": "target: two hops (deltamesh) <= 1.15x one hop (direct) in at least 9 of 10 runs",
    "fan_out": "targets: origin egress <= 3x the version; all 12 pools <= 1.25x one pool",
    "your_link": "origin -> relay region over this link -> pool beside the relay; clock from the publish's start",
}
FLOORS = {("long_link", "deltamesh_warm"): 0.85, ("long_link", "deltamesh"): 0.65,
          ("long_link_loss_0.1pct", "deltamesh_warm"): 0.70}
"""(scenario, method) -> the utilization each run is held to."""


def family(name: str) -> str:
    return name if name in TARGETS else name.rsplit("_", 1)[0]


def _link(link: dict) -> str:
    text = f"{link['mbit']:g} Mbit/s, {link['rtt_ms']:g} ms RTT"
    if "hops" in link:
        text = " + ".join(f"{h['mbit']:g} Mbit/s {h['rtt_ms']:g} ms" for h in link["hops"]) + f" (direct: {text})"
    if link.get("loss", {}).get("rate"):
        text += f", {link['loss']['rate']:.1%} random loss each way"
    if link.get("measured_rtt_ms") is not None:
        rate = "" if link.get("measured_mbit") is None else f"{link['measured_mbit']:.0f} Mbit/s, "
        text += f"; measured {rate}{link['measured_rtt_ms']:.1f} ms"
    if link.get("check_message"):
        text += f" (LINK CHECK FAILED: {link['check_message']})"
    return text


def print_network_scenario(s: dict) -> None:
    payload = next(iter(s["methods"].values()))["payload_bytes"]
    print(f"\n{s['name']}: {payload / MB:.0f} MB version over {_link(s['link'])}")
    print(f"  TCP buffers {s['tcp_buffers']}, congestion control {s.get('congestion', 'bbr')}, "
          f"initcwnd {s.get('initcwnd', 10)}, "
          f"{s['connections']} parallel fetches on long links; "
          f"median of runs; load average {s.get('load_average', ['?'])[0]}")
    print(f"  {'method':<20} {'seconds':>8} {'util':>6} {'steady Mbit/s':>14} {'origin egress MB':>17} "
          f"{'x version':>10}  runs")
    for method, m in s["methods"].items():
        steady = f"{m['steady_mbit']:.0f}" if "steady_mbit" in m else "-"
        print(f"  {method:<20} {m['seconds']:>8.2f} {m['utilization']:>6.1%} {steady:>14} "
              f"{m['origin_egress_bytes'] / MB:>17.1f} {m['origin_egress_bytes'] / payload:>10.2f}  "
              f"{', '.join(f'{x:.2f}' for x in m['runs'])}")
    if "two_hops_over_one" in s:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in s["two_hops_over_one"].items())
        print(f"  two hops / one hop (direct): {ratios}")
    if "two_hops_over_one_runs" in s:
        runs = s["two_hops_over_one_runs"]
        print(f"  two hops / one hop, round by round: {', '.join(f'{r:.2f}' for r in runs)} "
              f"({s['two_hops_within_target']} of {len(runs)} <= 1.15)")
    if s.get("tls_minus_plain_points"):
        gaps = ", ".join(f"{k} {v:+.1f}" for k, v in s["tls_minus_plain_points"].items())
        print(f"  utilization over TLS minus plain (points): {gaps}")
    if "one_pool_seconds" in s:
        dm = s["methods"]["deltamesh"]
        print(f"  one pool alone: {s['one_pool_seconds']:.2f}s; all {s['pools']} pools / one pool: "
              f"{s['all_over_one_pool']:.2f}x; first pool done after {dm.get('first_pool_seconds', 0):.2f}s")
    if "pool_link" in s:
        print(f"  pool link: {s['pool_link']['mbit']:g} Mbit/s, {s['pool_link']['rtt_ms']:g} ms RTT")
    for method, m in s["methods"].items():
        print_runs(s["name"], method, m)
    print(f"  {TARGETS[family(s['name'])]}")


def print_runs(scenario: str, method: str, m: dict) -> None:
    """Each run of a method: its time and utilization (extrapolated or not), then its link record."""
    if "run_utilization" not in m:  # a result from before per-run figures were kept
        return
    floor = FLOORS.get((scenario, method))
    if floor is not None:
        met = sum(1 for u in m["run_utilization"] if u >= floor)
        print(f"  {method}: {met} of {len(m['runs'])} runs at >= {floor:.0%} of the link")
    records = m.get("link_records") or [None] * len(m["runs"])
    notes = m.get("run_notes") or [{}] * len(m["runs"])
    for k, (seconds, util, record, note) in enumerate(zip(m["runs"], m["run_utilization"], records, notes), 1):
        how = f" (extrapolated from {note['window_s']:g} s at {note['rate_mbit']:g} Mbit/s)" if note.get("extrapolated") else ""
        print(f"    {method} run {k}: {seconds:.2f} s, {util:.1%}{how}" + (f"; {summary(record)}" if record else ""))


def print_training(s: dict) -> None:
    print(f"\nreal_training: {s['model']} lr {s['lr']:g}, {len(s['versions'])} versions, one every "
          f"{s['step_seconds']:g}s, to {s['pools']} pools over the fan-out mesh")
    print(f"  {'version':>7} {'kind':>10} {'delta MB':>9} {'full MB':>8} {'changed':>8} {'publish s':>10} "
          f"{'regions s':>10} {'after pub s':>12} {'pool apply s':>13} {'first pool s':>13} {'all pools s':>12}")
    for v in s["versions"]:
        delta = "-" if v["delta_bytes"] is None else f"{v['delta_bytes'] / MB:.2f}"
        changed = "-" if v["changed_fraction"] is None else f"{v['changed_fraction']:.2%}"
        all_s = "-" if v["all_pools_seconds"] is None else f"{v['all_pools_seconds']:.2f}"
        first = "-" if v["first_pool_seconds"] is None else f"{v['first_pool_seconds']:.2f}"
        regions, after, apply = (_opt(v.get(k)) for k in ("to_regions_seconds", "to_regions_after_publish_seconds",
                                                           "pool_fetch_apply_seconds"))
        print(f"  {v['version']:>7} {v['published']:>10} {delta:>9} {v['full_bytes'] / MB:>8.1f} {changed:>8} "
              f"{v['publish_seconds']:>10.2f} {regions:>10} {after:>12} {apply:>13} {first:>13} {all_s:>12}")
    st = s["staleness"]
    print(f"  staleness (versions behind the head, every pool every {st['sample_s']:g}s): mean {st['mean']:.2f}, "
          f"p95 {st['p95']:.0f}, max {st['max']:.0f}; deltas median {s['median_delta_seconds']:.2f}s to all pools")


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(report: dict) -> None:
    for s in report["scenarios"]:
        if s["name"] == "real_training":
            print_training(s)
        else:
            print_network_scenario(s)
