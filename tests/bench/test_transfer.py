"""The transfer benchmark's bookkeeping (medians, utilization, staleness, per-version times, the
Prometheus counter it reads, results merging, tables) on hand-made timelines, and quick real runs
of its long-link scenario and of an ad-hoc link given by flags (`your_link`, also as docs/CLI.md
shows it) through the WAN emulator (need root)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import transfer
from aiohttp import web
from transfer_baseline import MIN_RATE_BPS, baseline_seconds
from transfer_link import pool_link_mbit
from transfer_long_link import tls_gap
from transfer_mesh import metric_sum
from transfer_report import print_report
from transfer_runs import Sample, steady_mbit, summarize
from transfer_tls import RunPki
from transfer_training import stage_times, staleness, training_json

from deltamesh.http import serving
from deltamesh.tls import TlsSettings, server_context

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_summary_takes_medians_and_utilization_against_the_link_rate():
    samples = [Sample(10.0, 200, 210, {"steady_mbit": 300.0}), Sample(8.0, 200, 212, {"steady_mbit": 380.0}),
               Sample(40.0, 400, 420, {"steady_mbit": None})]
    out = summarize(samples, payload_bytes=400_000_000, mbit=400)
    assert out["seconds"] == 10.0 and out["runs"] == [10.0, 8.0, 40.0]
    assert out["utilization"] == pytest.approx(0.8)  # 3.2 Gbit in 10 s over 400 Mbit/s
    assert out["origin_egress_bytes"] == 200 and out["origin_wire_bytes"] == 212
    assert out["steady_mbit"] == 340.0  # median of the runs that have one


def test_steady_rate_runs_from_the_first_tenth_to_the_end():
    result = {"progress": [[100.0, 10_000_000], [101.0, 20_000_000], [102.0, 60_000_000]]}
    assert steady_mbit(result) == pytest.approx(200.0)
    assert steady_mbit({"progress": [[1.0, 5]]}) is None


def test_metric_sum_adds_every_labelled_sample_of_one_counter_only():
    text = "\n".join([
        "# HELP deltamesh_gateway_bytes_out_total Piece bytes served",
        'deltamesh_gateway_bytes_out_total{kind="full",peer_role="downstream"} 3e+06',
        'deltamesh_gateway_bytes_out_total{kind="delta",peer_role="pool"} 1000.0',
        'deltamesh_gateway_bytes_out_created{kind="full",peer_role="downstream"} 1.7e+09',
        "deltamesh_gateway_bytes_out_totalx 5",
    ])
    assert metric_sum(text, "deltamesh_gateway_bytes_out_total") == 3_001_000


def test_a_capped_single_stream_is_extrapolated_from_its_windows_second_half_and_says_so():
    # 10 s window from t_go = 1: 10 MB by 5 s, 30 MB by 10 s (4 MB/s in the second half); 100 MB in all.
    capped = {"t_go": 101.0, "t_done": 111.0, "bytes": 30_000_000, "total": 100_000_000, "capped": True,
              "marks": [[2.5, 4_000_000], [5.0, 10_000_000], [7.5, 20_000_000], [10.0, 30_000_000]]}
    seconds, note = baseline_seconds(capped, t_start=100.0)
    assert seconds == pytest.approx(1 + 10 + 70_000_000 / 4_000_000)
    assert note == {"extrapolated": True, "window_s": 10.0, "received_bytes": 30_000_000, "rate_mbit": 32.0}
    # A download that ended inside its window is measured, not extrapolated.
    done = {"t_go": 101.0, "t_done": 104.5, "bytes": 100, "total": 100, "capped": False, "marks": []}
    assert baseline_seconds(done, t_start=100.0) == (4.5, {"extrapolated": False})


def test_a_capped_stream_that_stalled_gets_a_huge_time_not_a_division_by_zero():
    stalled = {"t_go": 0.0, "t_done": 10.0, "bytes": 5_000_000, "total": 6_000_000, "capped": True,
               "marks": [[5.0, 5_000_000], [10.0, 5_000_000]]}
    seconds, note = baseline_seconds(stalled, t_start=0.0)
    assert seconds == pytest.approx(10 + 1_000_000 / MIN_RATE_BPS) and note["extrapolated"]


def test_tls_gap_is_tls_minus_plain_utilization_in_points_where_both_ran():
    methods = {"deltamesh": {"utilization": 0.543}, "deltamesh_tls": {"utilization": 0.512},
               "deltamesh_warm": {"utilization": 0.883}, "single_stream": {"utilization": 0.1}}
    assert tls_gap(methods) == {"cold": -3.1}
    assert tls_gap({**methods, "deltamesh_tls_warm": {"utilization": 0.871}}) == {"cold": -3.1, "warm": -1.2}


def test_agent_probes_verify_an_https_gateway_against_the_runs_ca(tmp_path):
    pki = RunPki(tmp_path / "pki")
    flags = pki.server_flags("127.0.0.1", "origin-tls")
    tls = TlsSettings(cert=flags[1], key=flags[3])
    app = web.Application()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="deltamesh_gateway_bytes_out_total 7\n")

    app.router.add_get("/metrics", metrics)

    async def probe(url: str, *extra: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(sys.executable, str(BENCHMARKS / "transfer_agent.py"), "fetch",
                                                    url, *extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        return proc.returncode, (out + err).decode()

    async def main() -> None:
        async with serving(app, "127.0.0.1:0", ssl_context=server_context(tls)) as base:
            assert base.startswith("https://")
            code, out = await probe(f"{base}/metrics", "--ca", str(pki.ca))
            assert code == 0 and metric_sum(out, "deltamesh_gateway_bytes_out_total") == 7
            code, out = await probe(f"{base}/metrics")  # not the system store's: refused, never downgraded
            assert code != 0 and "CERTIFICATE_VERIFY_FAILED" in out

    asyncio.run(main())


def _timeline():
    # v0 published at 0-2 s, v1 at 10-11 s, v2 at 20-21 s; pool a keeps up, pool b skips v1.
    published = [{"version": v, "t_start": 10.0 * v, "t_done": 10.0 * v + (2 if v == 0 else 1),
                  "manifests": [{"kind": "full" if v == 0 else "delta", "payload_bytes": 100 if v == 0 else 5}]}
                 for v in range(3)]
    reached = {"a": {0: 5.0, 1: 13.0, 2: 23.0}, "b": {0: 6.0, 2: 25.0}}
    return published, reached


def test_staleness_counts_versions_behind_the_newest_published():
    published, reached = _timeline()
    st = staleness(published, reached)
    assert st["max"] == 2  # b still on v0 between v2's publish (21 s) and 25 s
    assert 0 < st["mean"] < 1
    assert st["p95"] >= 1


def test_training_json_times_each_version_to_every_pool_holding_it_or_newer():
    published, reached = _timeline()
    costs = [{"version": v, "full_bytes": 100, "delta_bytes": None if v == 0 else 5,
              "changed_fraction": None if v == 0 else 0.01} for v in range(3)]
    out = training_json(costs, published, reached, 0.0, 10.0, 2)
    v0, v1, v2 = out["versions"]
    assert v0["all_pools_seconds"] == 6.0 and v0["first_pool_seconds"] == 5.0
    assert v1["all_pools_seconds"] == 15.0  # b had it only when it reached v2 at 25 s
    assert v2["all_pools_seconds"] == 5.0 and v2["published"] == "delta"
    assert out["median_delta_seconds"] == 10.0


def test_stage_times_time_each_region_from_the_start_and_the_end_of_the_publish(tmp_path):
    base = 1_780_000_000  # log lines carry local time, as logging writes them
    for region, after_s in (("regionA", 0.2), ("regionB", 0.3), ("regionC", 0.9)):
        when = datetime.fromtimestamp(base + 2 + after_s).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        (tmp_path / f"gateway-{region}.log").write_text(
            f"{when} I deltamesh.gateway.server.relay: relay: m v1 delta complete (1 pieces in 0.10s)\n")
    published = [{"version": 1, "t_start": base + 0.0, "t_done": base + 2.0}]
    stages = stage_times(tmp_path, published, [])[1]
    assert stages["to_regions_seconds"] == 2.3
    assert stages["to_regions_after_publish_seconds"] == 0.3
    assert stages["to_last_region_after_publish_seconds"] == 0.9


def test_results_are_merged_by_scenario_and_printed(tmp_path, capsys):
    path = tmp_path / "results.json"
    scenario = {"name": "long_link", "link": {"mbit": 400, "rtt_ms": 300}, "tcp_buffers": "linux",
                "connections": 16, "piece_bytes": 3e6, "load_average": [1.0],
                "methods": {m: {"seconds": 5.0, "utilization": 0.8, "origin_egress_bytes": 200e6,
                                "payload_bytes": 200e6, "runs": [5.0]} for m in ("deltamesh", "single_stream")}}
    scenario["tls_minus_plain_points"] = {"cold": -3.1, "warm": -1.2}
    transfer.save({"scenarios": [scenario]}, path)
    transfer.save({"scenarios": [{**scenario, "name": "relay_chain", "two_hops_over_one": {"deltamesh": 1.1},
                                  "link": {"mbit": 200, "rtt_ms": 300, "hops": [{"mbit": 400, "rtt_ms": 150}]}}]}, path)
    transfer.save({"scenarios": [{**scenario, "connections": 8}]}, path)
    saved = json.loads(path.read_text())
    assert [s["name"] for s in saved["scenarios"]] == ["long_link", "relay_chain"]
    assert saved["scenarios"][0]["connections"] == 8
    print_report(saved)
    table = capsys.readouterr().out
    assert "long_link: 200 MB version over 400 Mbit/s, 300 ms RTT" in table
    assert "two hops / one hop (direct): deltamesh 1.10x" in table
    assert "utilization over TLS minus plain (points): cold -3.1, warm -1.2" in table


@pytest.mark.slow
@pytest.mark.netns
def test_quick_long_link_run_prints_its_json(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the WAN emulator needs root")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "transfer.py"), "--quick", "--scenario", "long_link",
                           "--json", "--no-verify", "--payload-mb", "4", "--save", str(tmp_path / "results.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    (scenario,) = report["scenarios"]
    assert scenario["name"] == "long_link" and scenario["link"] == {"mbit": 400, "rtt_ms": 60.0}
    for method in ("deltamesh", "single_stream"):
        m = scenario["methods"][method]
        assert 0 < m["utilization"] < 1 and m["seconds"] > 0.06  # at least one RTT
        # Everything the origin served was the version, once; its links carried it plus headers.
        assert m["origin_egress_bytes"] == m["payload_bytes"]
        assert m["payload_bytes"] < m["origin_wire_bytes"] < 1.1 * m["payload_bytes"]
        # The keys the figures are read by, and one record of what the link did per run.
        assert len(m["runs"]) == len(m["run_utilization"]) == len(m["link_records"]) >= 1
        for record in m["link_records"]:
            assert {"ok", "problems", "directions", "tcp"} <= set(record)
            assert {d["name"] for d in record["directions"]} == {"origin -> regionA", "regionA -> origin"}
            assert {"dropped", "late", "max_held", "packets"} <= set(record["directions"][0])
            assert {"retrans", "min_rcv_window", "max_rcv_window"} <= set(record["tcp"])
    assert not list(tmp_path.glob("transfer-*")), "the scenario's scratch folder was left behind"


def test_lossy_scenarios_run_bbr_and_the_others_cubic_unless_told():
    assert transfer.congestion_for("long_link_loss", None) == "bbr"
    assert transfer.congestion_for("relay_chain_loss", None) == "bbr"
    for name in ("long_link", "relay_chain", "fan_out", "real_training", "your_link"):
        assert transfer.congestion_for(name, None) == "cubic"
    assert transfer.congestion_for("long_link_loss", "cubic") == "cubic"
    assert transfer.congestion_for("long_link", "bbr") == "bbr"
    assert transfer.parse_args([]).congestion is None
    with pytest.raises(SystemExit):
        transfer.parse_args(["--congestion", "vegas"])


def test_your_link_takes_mbit_and_rtt_together_and_alone(capsys):
    for argv in (["--mbit", "200"], ["--rtt-ms", "20"], ["--mbit", "200", "--rtt-ms", "20", "--scenario", "long_link"],
                 ["--mbit", "0", "--rtt-ms", "20"]):
        assert transfer.main(argv) == 2, argv
    assert "--mbit and --rtt-ms go together" in capsys.readouterr().err
    assert pool_link_mbit(200) == 1000 and pool_link_mbit(800) == 1600  # the pool's LAN is never the bottleneck


def test_your_link_results_merge_beside_the_named_scenarios(tmp_path):
    path = tmp_path / "results.json"
    transfer.save({"scenarios": [{"name": "your_link", "methods": {}}]}, path)
    transfer.save({"scenarios": [{"name": "long_link", "methods": {}}]}, path)
    assert [s["name"] for s in json.loads(path.read_text())["scenarios"]] == ["long_link", "your_link"]


def _your_link_run(argv: list[str], tmp_path: Path, **kw) -> subprocess.CompletedProcess:
    if os.geteuid() != 0:
        pytest.skip("the WAN emulator needs root")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, **kw)


@pytest.mark.slow
@pytest.mark.netns
def test_your_link_from_flags_prints_its_json(tmp_path):
    done = _your_link_run([sys.executable, str(BENCHMARKS / "transfer.py"), "--mbit", "200", "--rtt-ms", "20",
                           "--payload-mb", "4", "--repeats", "1", "--json", "--save", str(tmp_path / "r.json")],
                          tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (scenario,) = json.loads(done.stdout)["scenarios"]
    link = scenario["link"]
    assert scenario["name"] == "your_link" and (link["mbit"], link["rtt_ms"]) == (200, 20)
    # Half the asked rate, not 90%: in two of five full-suite CI runs the emulator's own check read this
    # link at 134.2 Mbit/s (191 on an idle machine), before any deltamesh code ran. Its accuracy is
    # tests/wan's subject; here it must only be measured and reported.
    assert 0.5 * 200 < link["measured_mbit"] < 200 and link["measured_rtt_ms"] >= 19.5
    assert scenario["pool_link"] == {"mbit": 1000, "rtt_ms": 0}
    for method in ("deltamesh", "single_stream"):
        m = scenario["methods"][method]
        floor = max(0.02, m["payload_bytes"] * 8 / 200e6)  # one RTT; the whole version at the link's rate
        assert m["seconds"] > floor and 0 < m["utilization"] < 1
        assert m["origin_egress_bytes"] == m["payload_bytes"] > 4e6  # the version left the origin once
        assert m["payload_bytes"] < m["origin_wire_bytes"] < 1.1 * m["payload_bytes"]
    assert not list(tmp_path.glob("transfer-*")), "the scenario's scratch folder was left behind"


@pytest.mark.slow
@pytest.mark.netns
def test_your_link_line_of_the_cli_docs_runs_as_written(tmp_path):
    blocks = re.findall(r"```bash\n(.*?)```", (BENCHMARKS.parent / "docs" / "CLI.md").read_text(), flags=re.S)
    (line,) = [ln for b in blocks for ln in b.splitlines() if ln.startswith("python benchmarks/transfer.py")]
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python` is this environment's
    done = _your_link_run(["bash", "-c", f"PATH={path} {line}"], tmp_path, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "your_link: 6 MB version over 200 Mbit/s, 20 ms RTT" in done.stdout, done.stdout
    assert re.search(r"deltamesh\s+\d+\.\d\d\s+\d+\.\d%", done.stdout), done.stdout
