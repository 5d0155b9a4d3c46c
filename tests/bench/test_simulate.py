"""The scale simulator's model behaves as the physics it stands for, its calibration recovers known
parameters, and the command prints predictions beside measurements from a results file."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import simulate
from simulate_latency import budget_rows, costs_from_latency
from simulate_model import Link, Path, Tcp, connections_for, fetch, relay_path, single_stream
from simulate_scenarios import Codec, Mesh, big_model_rows, calibrate, emulated_rows

MB = 1e6


def test_one_stream_is_window_bound_and_parallel_fetch_fills_the_link():
    link, tcp = Link(400, 300), Tcp(window=2e6)
    one = single_stream(200 * MB, link, tcp)
    # window / RTT = 6.7 MB/s: ~30 s for 200 MB, plus a ramp of a few RTTs.
    assert 200 * MB / (2e6 / 0.3) < one < 200 * MB / (2e6 / 0.3) + 4
    many = fetch(200 * MB, 4 * MB, link, tcp, connections=32)
    assert many.steady_bps == pytest.approx(link.rate, rel=0.1)
    assert many.seconds < one / 3


def test_more_connections_help_until_the_link_is_full():
    link, tcp = Link(400, 300), Tcp(window=2e6)
    times = [fetch(100 * MB, 4 * MB, link, tcp, n).seconds for n in (1, 4, 16, 64)]
    assert times[0] > times[1] > times[2]
    assert times[3] > 100 * MB / link.rate  # never faster than the link
    # 47.8 MB/s over 6.7 MB/s per connection, idle one RTT in every 4 MiB piece: 1.25 x 10.6
    assert connections_for(link, tcp) == 14


def test_a_large_window_makes_one_stream_ramp_bound_only():
    link = Link(400, 300)
    big = single_stream(200 * MB, link, Tcp(window=256e6))
    # slow start from 10 segments to the 15 MB bandwidth-delay product takes ~10 RTTs
    assert 200 * MB / link.rate + 5 * 0.3 < big < 200 * MB / link.rate + 15 * 0.3


def test_cut_through_beats_store_and_forward_which_adds_the_hops():
    tcp = Tcp(window=2e6)
    hops = (Link(400, 150), Link(200, 150))
    path = Path(hops, (16, 16))
    cut = relay_path(200 * MB, 3 * MB, path, tcp)
    stored = relay_path(200 * MB, 3 * MB, path, tcp, cut_through=False, first_hop_waits=True)
    each = [fetch(200 * MB, 3 * MB, k, tcp, 16).seconds for k in hops]
    # a relay learns of a version in 2.5 RTTs (poll answer, listing, manifest), the last hop in 1.5
    assert stored == pytest.approx(sum(each) + 2.5 * hops[0].rtt + 1.5 * hops[1].rtt, rel=0.01)
    assert max(each) < cut < max(each) + 1.5  # the slowest hop plus a piece and the control round trips


def test_calibration_recovers_the_parameters_that_made_the_measurements():
    link, total, piece = Link(400, 300), 150 * MB, 3 * MB
    truth = Tcp(window=2e6, window_rtt_ms=300, window_exponent=0.5, shared_efficiency=0.85, shared_growth=1.6)
    through = Link(400, 150)
    parallel = fetch(total, piece, link, truth, 16)
    measured = {
        "long_link": {"link": {"mbit": 400, "rtt_ms": 300}, "piece_bytes": piece, "connections": 16, "methods": {
            "deltamesh": {"seconds": parallel.seconds, "payload_bytes": total,
                          "steady_mbit": parallel.steady_bps * 8 / 1e6},
            "single_stream": {"seconds": single_stream(total, link, truth), "payload_bytes": total}}},
        "fan_out": {"link": {"mbit": 400, "rtt_ms": 150}, "pool_link": {"mbit": 1000, "rtt_ms": 0}, "pools": 12,
                    "piece_bytes": piece, "connections": 16, "methods": {
                        "deltamesh": {"seconds": 30.0, "payload_bytes": total},
                        "astraflow": {"seconds": 12 * single_stream(total, through, truth), "payload_bytes": total}}},
    }
    tcp, fitted = calibrate(measured)
    assert tcp.window == pytest.approx(2e6, rel=0.02)
    assert tcp.window_at(150) == pytest.approx(truth.window_at(150), rel=0.03)
    assert tcp.window_exponent == pytest.approx(0.5, abs=0.05)
    assert tcp.shared_efficiency == pytest.approx(0.85, abs=0.03)
    assert tcp.shared_growth == pytest.approx(1.6, abs=0.1)
    rows = emulated_rows(measured, tcp)
    fitted_rows = [r for r in rows if r.fitted]
    assert {(r.scenario, r.method) for r in fitted_rows} == {
        ("long_link", "deltamesh"), ("long_link", "single_stream"), ("fan_out", "astraflow")}
    assert all(abs(r.ratio - 1) < 0.03 for r in fitted_rows)


def test_big_models_scale_with_their_size_and_beat_per_pool_pulls():
    rows = big_model_rows(Tcp(window=2e6), Codec(), replace(Mesh(), wan_mbit=10_000))
    assert [r["model"] for r in rows] == ["Qwen3-14B", "Qwen3-235B", "1T"]
    for small, large in zip(rows, rows[1:]):
        assert large["full_seconds_to_all_pools"] > small["full_seconds_to_all_pools"]
    for r in rows:
        assert r["delta_bytes"] < r["full_bytes"] / 10
        assert r["astraflow_seconds_to_all_pools"] > r["delta_seconds_to_all_pools"]
        assert r["origin_egress_per_version"] < r["astraflow_origin_egress"]


def test_command_prints_predictions_beside_a_results_file(tmp_path, capsys):
    link, truth = Link(400, 300), Tcp(window=2e6)
    total, piece = 200 * MB, 2.9 * MB
    results = {"scenarios": [
        {"name": "long_link", "link": {"mbit": 400, "rtt_ms": 300}, "piece_bytes": piece, "connections": 16,
         "methods": {"deltamesh": {"seconds": fetch(total, piece, link, truth, 16).seconds, "payload_bytes": total},
                     "single_stream": {"seconds": single_stream(total, link, truth), "payload_bytes": total}}},
        {"name": "relay_chain", "link": {"mbit": 200, "rtt_ms": 300, "hops": [{"mbit": 400, "rtt_ms": 150},
                                                                              {"mbit": 200, "rtt_ms": 150}]},
         "piece_bytes": piece, "connections": 16,
         "methods": {m: {"seconds": 12.0, "payload_bytes": total, "publish_seconds": 1.0}
                     for m in ("deltamesh", "store_and_forward", "direct")}},
    ]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert simulate.main(["--measured", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calibration"]["window_bytes"] == pytest.approx(2e6, rel=0.02)
    methods = {(r["scenario"], r["method"]) for r in report["emulated"]}
    assert ("relay_chain", "store_and_forward") in methods and ("long_link", "deltamesh") in methods
    assert {p["source"] for p in report["papers"]} >= {"AstraFlow (arXiv 2605.15565)", "shardcast / INTELLECT-2"}
    assert simulate.main(["--measured", str(path)]) == 0
    table = capsys.readouterr().out
    assert "predicted" in table and "Qwen3-235B" in table and "14 min" in table


def test_recorded_figures_are_used_without_a_results_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(simulate, "RESULTS", tmp_path / "absent.json")
    monkeypatch.setattr(simulate, "LATENCY", tmp_path / "absent-latency.json")
    assert simulate.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calibration"]["source"] == "figures recorded in BENCHMARKS.md"
    assert len(report["big_models"]) == 3
    assert report["assumptions"]["stage_costs"]["source"].startswith("defaults")


def test_the_latency_budget_takes_its_stage_costs_from_a_latency_run(tmp_path, capsys):
    # Two versions of a 1 GB model; stages in seconds after the step's end, two pools each.
    version = {"version": 1, "bytes": 10**6, "all_pools_seconds": 2.0, "stages": {
        "step_end": 0.0, "cast": 0.25, "encoded": 0.6, "signed": 0.75, "upload_start": 0.76, "origin_stored": 0.8,
        "relay_stored:eu-west": 0.9, "pool:a:fetched": 1.0, "pool:a:verified": 1.1, "pool:a:applied": 1.5,
        "pool:a:serving": 2.0, "pool:b:fetched": 1.0, "pool:b:verified": 1.1, "pool:b:applied": 1.5,
        "pool:b:serving": 2.0}}
    report = {"versions": [version, {**version, "version": 2}], "hop_overhead_s": 0.05, "model_bytes": 1e9}
    costs = costs_from_latency(report)
    assert costs.cast_gbps == pytest.approx(4.0) and costs.encode_gbps == pytest.approx(2.0)
    assert costs.apply_gbps == pytest.approx(2.0) and costs.check_gbps == pytest.approx(2.0)
    assert costs.hop_overhead_s == pytest.approx(0.05)

    rows = budget_rows(Tcp(), Codec(), Mesh(), costs)
    slower = budget_rows(Tcp(), Codec(), Mesh(), replace(costs, check_gbps=1.0))
    for row, slow in zip(rows, slower):
        assert row["seconds_to_all_pools"] == pytest.approx(sum(row["stages"].values()))
        assert slow["stages"]["serve check"] == pytest.approx(2 * row["stages"]["serve check"])
    assert {r["model"] for r in rows} == {"Qwen3-14B", "1T MoE"}

    path = tmp_path / "latency.json"
    path.write_text(json.dumps(report))
    assert simulate.main(["--latency", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["assumptions"]["stage_costs"]["check_gbps"] == pytest.approx(2.0)
    # The command's network stages use the calibrated TCP; the stages over the weights are the same.
    for printed, row in zip(out["latency_budget"], rows):
        for stage in ("cast", "encode + sign", "verify + apply", "serve check"):
            assert printed["stages"][stage] == pytest.approx(row["stages"][stage])
