"""The latency budget of the demo's report: stage figures from the wall-clock times the trainer, the
gateways and the pools record (mesh/demo/latency.py), and how `MeshState` gathers those times from the
services' answers (no processes).

`RECORDED` is what report.json kept for versions 1-3 of a real run (`benchmarks/latency.py --model tiny
--steps 4`: trainer step records, the three gateways' `stored_at`, the pools' `timeline`), trimmed to
the keys the functions read; the expected figures are worked out from those times here.
"""

from __future__ import annotations

import copy
import statistics

import pytest

from deltamesh.mesh.demo.latency import increments, latency, latency_medians, version_latency
from deltamesh.mesh.demo.state import MeshState, PoolReading

UPSTREAMS = {"us-east": "", "eu-west": "us-east", "ap-south": "eu-west"}
T = 1796155560.0


def near(x: float):
    """Equal within a microsecond: wall times around 1.8e9 s carry about 2e-7 s of float resolution."""
    return pytest.approx(x, abs=1e-6)


def _times(version: int, step_end: float, trainer: tuple[float, ...], stored: tuple[float, float, float],
           pools: dict[str, tuple[float, ...]], payload: int) -> dict:
    names = ("cast", "encoded", "signed", "upload_start", "uploaded")
    stages = ("head", "fetched", "verified", "applied", "persisted", "serving")
    return {"version": version, "step_time": T + step_end + 0.006,
            "trainer": {"step_end": T + step_end, **{n: T + t for n, t in zip(names, trainer)}},
            "upstreams": dict(UPSTREAMS), "stored_at": {r: T + t for r, t in zip(UPSTREAMS, stored)},
            "pools": {p: {s: T + t for s, t in zip(stages, marks)} for p, marks in pools.items()}, "bytes": payload}


RECORDED = [
    _times(1, 0.4612, (0.4622, 0.5222, 0.5225, 0.5225, 0.5566), (0.5524, 0.6058, 0.6741),
           {"us-1": (0.6264, 0.6506, 0.6556, 0.6630, 0.7370, 0.7394),
            "eu-1": (0.5584, 0.6169, 0.6237, 0.6291, 0.6479, 0.6486),
            "ap-1": (0.7421, 0.9281, 0.9319, 0.9572, 0.9970, 1.0071)}, 4797),
    _times(2, 0.6529, (0.6536, 0.6793, 0.6796, 0.6796, 0.7039), (0.7031, 0.7771, 0.9051),
           {"us-1": (0.7413, 0.7712, 0.8024, 0.8167, 0.9899, 0.9915),
            "eu-1": (0.7259, 0.7988, 0.8098, 0.8754, 0.9834, 0.9857),
            "ap-1": (1.0122, 1.0360, 1.0388, 1.0997, 1.1443, 1.1453)}, 7489),
    _times(3, 0.7333, (0.7345, 0.7667, 0.7671, 0.7671, 0.8144), (0.8078, 0.9667, 1.0677),
           {"us-1": (1.0023, 1.0438, 1.0491, 1.0696, 1.1824, 1.1860),
            "eu-1": (0.9907, 1.0336, 1.0449, 1.0617, 1.0964, 1.0979),
            "ap-1": (1.0122, 1.0749, 1.0862, 1.1066, 1.1443, 1.1453)}, 6214),
]


def test_stages_are_seconds_after_the_step_end_with_the_latest_host_as_aggregate():
    times = RECORDED[1]
    row = version_latency(times)
    t0 = times["trainer"]["step_end"]
    stages = row["stages"]
    assert row["version"] == 2 and row["bytes"] == 7489
    assert stages["step_end"] == 0.0 and stages["encoded"] == near(0.6793 - 0.6529)
    assert stages["origin_stored"] == near(times["stored_at"]["us-east"] - t0)
    assert stages["relay_stored:ap-south"] == near(0.9051 - 0.6529)
    assert stages["all_relays_stored"] == stages["relay_stored:ap-south"]
    assert stages["pool:eu-1:applied"] == near(0.8754 - 0.6529)
    assert stages["all_pools_serving"] == near(1.1453 - 0.6529) == row["all_pools_seconds"]
    pool_stages = [k for k in stages if k.startswith("pool:us-1:")]
    assert [k.rsplit(":", 1)[1] for k in pool_stages] == ["head", "fetched", "verified", "applied", "persisted",
                                                          "serving"]


def test_each_stage_is_charged_from_the_stage_before_it_on_its_host():
    row = version_latency(RECORDED[1])
    steps = increments(row["stages"], UPSTREAMS)
    assert "step_end" not in steps and steps["cast"] == near(0.6536 - 0.6529)
    assert steps["origin_stored"] == near(0.7031 - 0.6796), "from the upload's start"
    assert steps["relay_stored:eu-west"] == near(0.7771 - 0.7031)
    assert steps["relay_stored:ap-south"] == near(0.9051 - 0.7771), "from its upstream, not the origin"
    assert steps["pool:ap-1:head"] == near(1.0122 - 0.7031), "a pool's first stage: from the origin"
    assert steps["pool:ap-1:applied"] == near(1.0997 - 1.0388)
    assert steps["all_pools_serving"] == near(1.1453 - 0.9051)


def test_medians_leave_out_the_first_version():
    medians = latency_medians(RECORDED)
    assert medians["versions"] == [2, 3]
    later = [version_latency(t) for t in RECORDED[1:]]
    assert medians["all_pools_seconds"] == near(statistics.median(r["all_pools_seconds"] for r in later))
    assert medians["stages"]["relay_stored:eu-west"] == near(
        statistics.median(r["stages"]["relay_stored:eu-west"] for r in later))
    assert medians["bytes"] == statistics.median([7489, 6214])


def test_missing_times_leave_the_stage_and_its_aggregate_out():
    times = copy.deepcopy(RECORDED[2])
    del times["pools"]["ap-1"]["serving"]  # the run ended before ap-1 served it
    times["stored_at"]["eu-west"] = None
    times["trainer"] = {}  # a trainer that records no stage times: its step record's time is the start
    row = version_latency(times)
    assert "all_pools_serving" not in row["stages"] and row["all_pools_seconds"] is None
    assert "relay_stored:eu-west" not in row["stages"] and "all_relays_stored" not in row["stages"]
    assert row["stages"]["origin_stored"] == near(0.8078 - 0.7393)
    assert "pool:ap-1:persisted" in row["stages"]


def test_mesh_state_gathers_the_three_sources_per_version():
    """Step records, listings (every gateway's `stored_at`) and pool timelines, as the monitor reads them;
    a pool that a full snapshot took past v2 is charged v2's stages by the version it took (v3)."""
    state = MeshState(("policy",), upstreams={"a": "", "b": "a"})
    state.pools = {"p1": PoolReading("p1", "a"), "p2": PoolReading("p2", "b")}
    listing = [{"version": v, "kind": "delta", "payload_bytes": 50 + v, "complete": True, "weights_hash": f"h{v}",
                "stored_at": 100.0 + 10 * v} for v in (1, 2, 3)]
    state.origin_listing("policy", listing)
    state.gateway_listing("policy", "a", listing)
    state.gateway_listing("policy", "b", [{**e, "stored_at": e["stored_at"] + 1} for e in listing]
                          + [{**listing[0], "kind": "full", "stored_at": 0.5}])  # held whole earlier as a full
    for v in (1, 2, 3):
        state.trainer_step("policy", {"time": 100.0 + 10 * v, "version": v, "published": True, "publish_bytes": 1,
                                      "stages": {"step_end": 99.9 + 10 * v, "uploaded": 100.0 + 10 * v}}, "t->a")
    p1 = {str(v): {"head": 102.0 + 10 * v, "serving": 103.0 + 10 * v} for v in (1, 2, 3)}
    state.pool_status("p1", {"models": {"policy": {"engine_version": 3, "timeline": p1}}}, now=140.0)
    state.pool_status("p2", {"models": {"policy": {"engine_version": 3, "timeline": {
        "1": {"head": 104.0, "serving": 105.0}, "3": {"head": 134.0, "serving": 135.0}}}}}, now=140.0)
    budget = latency(state, "policy")
    times = {t["version"]: t for t in budget["times"]}
    assert times[1]["stored_at"] == {"a": 110.0, "b": 0.5}
    assert times[2]["pools"]["p2"] == {"head": 134.0, "serving": 135.0}
    v2 = {r["version"]: r for r in budget["versions"]}[2]
    assert v2["stages"]["relay_stored:b"] == near(121.0 - 119.9)
    assert v2["all_pools_seconds"] == near(135.0 - 119.9) and v2["bytes"] == 52
    assert budget["medians"]["versions"] == [2, 3]
