"""The demo's accounting and report from service answers as the monitor receives them (no processes).

The inputs are the JSON shapes the gateways, pools and trainer really produce (version listings,
per-version traffic, pool status, step records); the test checks what each link is charged per version, when every pool served a
version, how far behind each pool was, the bit-exact verdict, and that report.json and report.png are
written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.demo.report import FinalCheck, build_report, thirds, write_report
from deltamesh.mesh.demo.state import MeshState, PoolReading


def entry(version: int, kind: str, payload: int, complete: bool = True, weights_hash: str = "") -> dict:
    return {"version": version, "kind": kind, "base_version": None if kind == "full" else version - 1,
            "payload_bytes": payload, "pieces": 1, "present": 1 if complete else 0, "complete": complete,
            "weights_hash": weights_hash or f"h{version}"}


def traffic(version: int, received: int) -> dict:
    """One version of a gateway's `/v1/models/{model}/traffic`."""
    return {"version": version, "received_bytes": received, "received": [], "served_bytes": 0, "served": []}


def step(version: int, reward: float, at: float, pools: dict[str, int], kinds: tuple[str, ...] = ("delta",)) -> dict:
    return {"time": at, "step": version, "version": version, "samples": 8, "reward_mean": reward, "pools": pools,
            "wait_fraction": 0.25, "wait_seconds": 0.1, "train_seconds": 0.3, "staleness_mean": 1.0,
            "published": True, "publish_seconds": 0.05, "publish_bytes": 60 + version, "publish_kinds": list(kinds)}


def pool_status(version: int, swapped_at: float) -> dict:
    return {"models": {"policy": {"engine_version": version, "last_swap_at": swapped_at}},
            "worker": {"submitted": 10 * version}}


def mesh_state() -> MeshState:
    state = MeshState(("policy",))
    state.pools = {"p1": PoolReading("p1", "a"), "p2": PoolReading("p2", "b")}
    state.origin_listing("policy", [entry(0, "full", 1000), entry(1, "delta", 50), entry(2, "delta", 40),
                                    entry(2, "full", 1010)])
    # The relay received v2's delta, and part of its full (a pool asked for it): the link is charged
    # what arrived.
    state.relay_traffic("policy", "a->b", [traffic(0, 1000), traffic(1, 50), traffic(2, 40 + 300)])
    state.trainer_step("policy", step(1, 0.1, at=100.0, pools={"p1": 8}), "trainer->a")
    state.trainer_step("policy", step(2, 0.5, at=110.0, pools={"p2": 8}, kinds=("delta", "full")), "trainer->a")
    state.pool_status("p1", pool_status(1, 100.5), now=101.0)
    state.pool_status("p2", pool_status(1, 101.0), now=101.0)
    state.pool_status("p1", pool_status(2, 110.2), now=111.0)
    state.pool_status("p2", pool_status(2, 111.5), now=112.0)
    return state


def test_links_are_charged_per_version_and_pool_timings_follow_the_swaps():
    state = mesh_state()
    run = state.models["policy"]
    assert run.versions[1].link_bytes == {"a->b": 50, "trainer->a": 61}
    assert run.versions[2].link_bytes == {"a->b": 340, "trainer->a": 62}
    assert run.full_bytes_at(1) == 1000 and run.full_bytes_at(2) == 1010
    assert state.all_pools_at("policy", 2) == 111.5
    assert state.served_at_time("p2", "policy", 110.0) == 1
    assert state.pool_behind("p2", "policy") == 0
    # The rest of v2's full arrives later: the link is charged it too; a gateway that forgot its
    # figures (restarted) takes nothing back.
    state.relay_traffic("policy", "a->b", [traffic(2, 40 + 1010)])
    assert run.versions[2].link_bytes["a->b"] == 1050
    state.relay_traffic("policy", "a->b", [traffic(2, 0)])
    assert run.versions[2].link_bytes["a->b"] == 1050


@pytest.mark.slow  # matplotlib's first import and font scan
def test_report_rows_checks_and_files(tmp_path):
    state = mesh_state()
    checks = [FinalCheck("p1", "policy", 2, 2, "h2", 2, "h2"), FinalCheck("p2", "policy", 2, 2, "other", 2, "h2")]
    report = build_report(state, DemoConfig(steps=2), run_dir=tmp_path, outcome="completed", error="",
                          checks=checks, processes=[])
    rows = report["models"]["policy"]["steps"]
    assert rows[1]["all_pools_seconds"] == 1.5 and rows[1]["pool_behind"] == {"p1": 1, "p2": 1}
    assert rows[1]["full_bytes"] == 1010
    assert report["models"]["policy"]["trained_samples_by_pool"] == {"p1": 8, "p2": 8}
    assert [c["bit_exact"] for c in report["final_checks"]] == [True, False]
    assert report["summary"]["all_pools_bit_exact"] is False
    assert report["summary"]["policy"]["periodic_full_versions"] == [
        {"version": 2, "full_bytes": 1010, "link_bytes": {"a->b": 340, "trainer->a": 62}}]
    json_path, chart = write_report(tmp_path, report)
    assert json.loads(json_path.read_text())["outcome"] == "completed"
    assert chart is not None and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_thirds():
    assert thirds([0.0, 0.1, 0.2, 0.6, 0.7, 0.8]) == (0.05, 0.75)
    assert thirds([1.0, 2.0]) == (None, None)


def test_sandbox_outcomes_are_reported_per_pool_and_added_up():
    """A code workflow's pools report their sandbox's counts (only the outcomes seen so far); the report
    lists every outcome per pool and in the summary, and nothing for a pool without a sandbox."""
    state = mesh_state()
    state.pools["p1"].status["sandbox"] = {"passed": 3, "error": 5}
    state.pools["p2"].status["sandbox"] = {"failed": 2, "error": 1, "timeout": 1}
    report = build_report(state, DemoConfig(steps=2, workflow="solver_testgen"), run_dir=Path("/x"),
                          outcome="completed", error="", checks=[], processes=[])
    zero = {"passed": 0, "failed": 0, "error": 0, "timeout": 0, "resource_limit": 0}
    assert report["pools"]["p1"]["sandbox"] == {**zero, "passed": 3, "error": 5}
    assert report["summary"]["sandbox"] == {**zero, "passed": 3, "failed": 2, "error": 6, "timeout": 1}
    assert report["summary"]["policy"]["reward_mean"] == pytest.approx(0.3)
    plain = build_report(mesh_state(), DemoConfig(steps=2), run_dir=Path("/x"), outcome="completed", error="",
                         checks=[], processes=[])
    assert plain["summary"]["sandbox"] is None and plain["pools"]["p1"]["sandbox"] is None


def mismatch(version: int, pools: dict[str, tuple[int, float, bool]]) -> dict:
    """A step record's `mismatch`: per pool (tokens, mean |d|, flagged), as the trainer writes it."""
    return {"version": version, "pools": {p: {"tokens": n, "abs": a, "k3": a * a / 2, "flagged": f,
                                              "reason": "4.0x the median of the other pools" if f else ""}
                                          for p, (n, a, f) in pools.items()}}


def test_the_report_view_and_summary_show_each_pools_mismatch_and_name_a_flagged_pool():
    """The trainer's per-pool mismatch goes into each step row, a per-pool section (token-weighted), the
    summary's flagged pools, the live view's pool table and the closing summary on the terminal."""
    from rich.console import Console

    from deltamesh.mesh.demo.run import DemoResult
    from deltamesh.mesh.demo.summary import print_summary
    from deltamesh.mesh.demo.view import ProgressLines, render

    state = mesh_state()
    run = state.models["policy"]
    run.steps[0]["mismatch"] = mismatch(0, {"p1": (100, 0.01, False), "p2": (300, 0.03, False)})
    run.steps[1]["mismatch"] = mismatch(1, {"p1": (100, 0.03, False), "p2": (100, 0.2, True)})
    report = build_report(state, DemoConfig(steps=2), run_dir=Path("/x"), outcome="completed", error="",
                          checks=[], processes=[])
    policy = report["models"]["policy"]
    assert policy["steps"][1]["mismatch_version"] == 1 and policy["steps"][1]["mismatch"]["p2"]["flagged"]
    assert policy["mismatch"]["p1"] == {"versions": 2, "tokens": 200, "abs_mean": pytest.approx(0.02),
                                        "k3_mean": pytest.approx(0.00025), "abs_max": 0.03, "flagged_versions": []}
    assert policy["mismatch"]["p2"]["abs_mean"] == pytest.approx((300 * 0.03 + 100 * 0.2) / 400)
    assert policy["mismatch"]["p2"]["flagged_versions"] == [1]
    assert report["summary"]["policy"]["mismatch_flagged"] == {"p2": [1]}

    assert state.pool_mismatch("p2", "policy")["flagged"] and state.pool_mismatch("p1", "policy")["abs"] == 0.03
    state.pools["p1"].region, state.pools["p2"].region = "us-east", "eu-west"  # the default topology's
    console = Console(record=True, width=200)
    console.print(render(state, DemoConfig(steps=2), "trainer->a", "/x"))
    live = console.export_text()
    assert "mismatch" in live and "0.200 jumped" in live and "0.030" in live
    assert "mismatch jumped: p2" in ProgressLines().lines(state)[1]

    console = Console(record=True, width=200)
    print_summary(console, DemoResult("completed", report, Path("/x/report.json"), None))
    closing = console.export_text()
    assert "trainer-side mismatch per pool" in closing
    assert "pool p2: its logprobs jumped away from the trainer's at 1 version(s)" in closing
    assert "pool p1:" not in closing
