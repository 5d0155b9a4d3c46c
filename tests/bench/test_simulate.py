"""The scale simulator's model behaves as the physics it stands for, its calibration recovers known
parameters, and the command prints predictions beside measurements from a results file."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import simulate
from simulate_layouts import DenseLayout, MoeLayout
from simulate_model import Link, Path, Tcp, connections_for, fetch, relay_path, single_stream
from simulate_scale import SCENARIOS, CoreSpeeds, Node, at_scale_rows, budget, threads_worth
from simulate_scenarios import Codec, Mesh, big_model_rows, calibrate, emulated_rows

from deltamesh.delta.parallel import MAX_WORKERS

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
    monkeypatch.setattr(simulate, "STAGE_SPEEDS", tmp_path / "absent-speeds.json")
    assert simulate.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calibration"]["source"] == "figures recorded in BENCHMARKS.md"
    assert len(report["big_models"]) == 3
    assert report["assumptions"]["latency_at_scale"]["core_speeds"]["source"].startswith("figures recorded")


def test_layouts_count_the_models_parameters_and_a_pool_ranks_share():
    qwen, moe = DenseLayout(), MoeLayout()
    assert qwen.params == pytest.approx(14.77e9, rel=0.001) and qwen.tensors == 40 * 11 + 3
    assert moe.params == pytest.approx(1.026e12, rel=0.001)
    g = qwen.groups()
    # Tensor parallel: a rank fetches its quarter of the column-parallel weights and every row-parallel one
    # (a block of columns crosses every row range a trainer rank encoded), and holds a quarter of both.
    fetched, held = qwen.pool_share(4)
    assert fetched == pytest.approx((g["column"] / 4 + g["row"] + g["replicated"]) / qwen.params)
    assert held == pytest.approx(0.25, abs=1e-4) and 0.45 < fetched < 0.5
    assert qwen.pool_share(1) == pytest.approx((1.0, 1.0))
    # Expert parallel: its experts and every dense tensor, fetched and held alike.
    m = moe.groups()
    assert moe.pool_share(32) == pytest.approx(((m["dense"] + m["experts"] / 32) / moe.params,) * 2)
    assert moe.pool_share(4)[0] <= 0.35 and moe.pool_share(2)[0] <= 0.6


def _speeds(**per_core: float) -> CoreSpeeds:
    base = {"cast": 1.0, "scan": 2.0, "encode": 0.5, "hash": 10.0, "decode": 10.0, "apply": 4.0, "check": 5.0}
    return CoreSpeeds({**base, **per_core}, sign_s_per_entry=1e-6, load_s_per_entry=2e-6, delta_ratio=0.005,
                      source="test")


def test_stage_arithmetic_scales_one_core_by_the_ranks_threads_and_shards():
    seed, node, tcp, codec = SCENARIOS[0], Node(), Tcp(), Codec(bytes_per_changed=1.0)
    speeds = _speeds()
    sharded, today = (budget(seed, s, speeds, node, tcp, codec) for s in (True, False))
    model, threads = seed.layout.params * 2, min(14, MAX_WORKERS)
    shard = model / seed.trainer_ranks
    assert node.cores_per_rank == 14
    assert sharded["stages"]["cast"] == pytest.approx(shard / (1.0 * 14 * 1e9))
    assert sharded["stages"]["scan/encode"] == pytest.approx(shard / (0.5 * threads * 1e9))
    assert today["stages"]["scan/encode"] == pytest.approx(seed.trainer_ranks * sharded["stages"]["scan/encode"])
    a = sharded["assumptions"]
    delta = 0.01 * seed.layout.params
    assert a["delta_bytes"] == pytest.approx(delta)
    entries = seed.layout.tensors * seed.trainer_ranks + math.ceil(delta / 2**22)
    assert a["manifest_entries"] == entries
    expected = (entries * 2e-6 + a["fetch_fraction"] * delta / (10.0 * threads * 0.005 * 1e9)
                + a["held_fraction"] * model / (4.0 * threads * 1e9))
    assert sharded["stages"]["verify + apply"] == pytest.approx(expected)
    for row in (sharded, today):
        assert row["total_s"] == pytest.approx(sum(row["stages"].values()))
        assert row["dominant"] == max(row["stages"], key=row["stages"].get)
    # A stage's time follows its speed alone; the network does not depend on the CPU.
    slower = budget(seed, True, _speeds(apply=2.0, encode=0.25), node, tcp, codec)
    assert slower["stages"]["scan/encode"] == pytest.approx(2 * sharded["stages"]["scan/encode"])
    for stage in ("upload", "origin -> every region", "fetch", "cast"):
        assert slower["stages"][stage] == pytest.approx(sharded["stages"][stage])


def test_a_stage_faster_than_the_nodes_memory_is_bound_by_it():
    seed, node = SCENARIOS[0], Node()
    row = budget(seed, True, _speeds(check=1000.0), node, Tcp(), Codec())
    bound = row["assumptions"]["rank_gbps"]["check"]
    # The pool's 4 ranks share a node: each reads its share at a quarter of the node's bandwidth.
    assert bound == {"gbps": pytest.approx(node.memory_gbps / 4), "bound": "memory"}
    assert row["stages"]["check"] == pytest.approx(row["assumptions"]["held_fraction"] * seed.layout.params * 2
                                                   / (node.memory_gbps / 4 * 1e9))


def test_the_gpu_figure_is_apart_and_labelled_not_measured():
    rows = at_scale_rows(_speeds(), Tcp(), Codec(), 0.01, gpu_gbps=1000.0)
    assert [r["path"] for r in rows] == ["sharded", "rank 0"] * 2
    for r in rows:
        gpu = r.get("gpu_not_measured")
        assert (gpu is not None) == (r["path"] == "sharded")
        if gpu is not None:  # only the cast and the scan move; the measured row keeps its own figures
            assert gpu["measured"] is False and gpu["total_s"] < r["total_s"]
            assert {k: v for k, v in gpu["stages"].items() if k not in ("cast", "scan/encode")} == \
                {k: v for k, v in r["stages"].items() if k not in ("cast", "scan/encode")}


def test_command_prints_the_latency_at_scale_with_its_assumptions(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(simulate, "RESULTS", tmp_path / "absent.json")
    monkeypatch.setattr(simulate, "LATENCY", tmp_path / "absent-latency.json")
    speeds = {"per_core": {"cast": 1.0, "scan": 2.0, "encode": 0.5, "hash": 10.0, "decode": 10.0, "apply": 4.0,
                           "check": 5.0, "sign": 3000.0}, "per_core_case": "a test case", "delta_ratio": 0.005,
              "sign_s_per_entry": 1e-6, "load_s_per_entry": 2e-6, "machine": {"load_average": [0.1, 0.2]},
              "cores": 2, "cases": [{"scaling": {"encode": 1.5, "apply": 2.0}}]}
    path = tmp_path / "speeds.json"
    path.write_text(json.dumps(speeds))
    assert simulate.main(["--stage-speeds", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["latency_at_scale"]
    for name in ("Qwen3-14B", "1T"):
        mine = [r for r in rows if name in r["model"]]
        assert [r["path"] for r in mine] == ["sharded", "rank 0"]
        for r in mine:
            assert {"model", "setup", "total_s", "stages", "assumptions"} <= r.keys()
            assert r["total_s"] == pytest.approx(sum(r["stages"].values()))
            assert r["assumptions"]["speeds"].startswith("benchmarks/stage_speeds.py, " + str(path))
        assert mine[0]["total_s"] < mine[1]["total_s"]
        assert mine[0]["target_s"] == {"Qwen3-14B": 10.0, "1T": 60.0}[name]
    assert set(rows[0]["stages"]) == {"cast", "scan/encode", "manifest", "upload", "origin -> every region",
                                      "fetch", "verify + apply", "check"}
    assert report["assumptions"]["latency_at_scale"]["core_speeds"]["per_core"]["encode"] == 0.5
    assert report["assumptions"]["latency_at_scale"]["core_speeds"]["scaling"]["encode"] == 1.5
    for r in rows:  # the same with threads scaling as they did on the measuring machine's two cores
        slower = r["scaling_as_measured"]
        assert slower["total_s"] == pytest.approx(sum(slower["stages"].values()))
        assert slower["stages"]["scan/encode"] > r["stages"]["scan/encode"]
        assert slower["stages"]["upload"] == pytest.approx(r["stages"]["upload"])
    assert simulate.main(["--stage-speeds", str(path)]) == 0
    table = capsys.readouterr().out
    assert "Latency budget at scale" in table and "NOT MEASURED" in table and "14 per rank" in table
    assert "dominates" in table and "Not modelled" in table and "scaling as measured" in table
    with pytest.raises(SystemExit, match="no such file"):
        simulate.main(["--stage-speeds", str(tmp_path / "nowhere.json")])


def test_threads_scale_as_measured_by_amdahls_law_fitted_on_the_measuring_cores():
    speeds = replace(_speeds(), scaling={"cast": 2.0, "scan": 2.0, "encode": 1.5, "hash": 2.0, "decode": 2.0,
                                         "apply": 1.0, "check": 2.0}, scaled_cores=2)
    assert threads_worth("cast", 8, speeds) == 8  # scaled fully on two cores: fully on eight
    assert threads_worth("apply", 8, speeds) == pytest.approx(1.0)  # did not scale: one core's worth
    # 1.5x on two cores: two thirds of the work runs in parallel, so eight threads give 1 / (1/3 + 2/24).
    assert threads_worth("encode", 8, speeds) == pytest.approx(2.4)
    seed, node = SCENARIOS[0], Node()
    linear, slower = (budget(seed, True, speeds, node, Tcp(), Codec(), as_measured=m) for m in (False, True))
    assert slower["stages"]["scan/encode"] == pytest.approx(linear["stages"]["scan/encode"] * 8 / 2.4)
