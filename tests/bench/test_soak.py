"""The chaos soak (benchmarks/soak.py): its seeded schedule, its invariant checks on hand-made histories,
and a short real soak of the whole mesh under faults that must end with every invariant held.

The short soak needs root (network namespaces, tmpfs stores, PostgreSQL run as its own user), the WAN
emulator's and PostgreSQL's packages and a C compiler (the clock shim); `make test` installs them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from soak_checks import CONVERGE_BOUND_S, JUDGE_MIN_S, Invariants, slope_per_min
from soak_faults import FaultLog, Injector
from soak_schedule import KINDS, MAX_CONCURRENT, count_kinds, make_schedule

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_seed_gives_the_same_schedule_and_another_seed_another():
    assert [f.as_json() for f in make_schedule(7, 8)] == [f.as_json() for f in make_schedule(7, 8)]
    assert [f.as_json() for f in make_schedule(7, 8)] != [f.as_json() for f in make_schedule(8, 8)]


@pytest.mark.parametrize("minutes,faults,kinds", [(8, 25, 6), (60, 200, 8)])
def test_a_run_of_some_minutes_plans_enough_faults_of_enough_kinds(minutes, faults, kinds):
    seed_counts = [count_kinds(make_schedule(seed, minutes)) for seed in range(5)]
    for counts in seed_counts:
        assert sum(counts.values()) >= faults and len(counts) >= kinds, counts


def test_faults_never_share_a_target_and_at_most_a_few_run_at_once():
    schedule = make_schedule(3, 60)
    for f in schedule:
        overlapping = [g for g in schedule if g is not f and g.at_s <= f.at_s < g.at_s + g.busy_s]
        assert not any(set(g.holds) & set(f.holds) for g in overlapping), f.describe()
        running = [g for g in schedule if g.at_s <= f.at_s < g.at_s + g.duration_s]
        assert len(running) <= MAX_CONCURRENT


def test_every_kind_the_schedule_draws_has_an_action(tmp_path):
    """Each kind is injected by its own method; no kind is planned that nothing can inject."""
    injector = Injector(mesh=None, faults=FaultLog(tmp_path / "faults.jsonl", 0.0))  # type: ignore[arg-type]
    assert set(injector.actions()) == set(KINDS)


def _checks() -> Invariants:
    return Invariants(seed=5, max_staleness=4)


def test_a_pool_whose_version_goes_down_or_restarts_below_its_directory_is_a_violation():
    c = _checks()
    c.pool_status(1.0, "p", 100, {"engine_version": 5, "dir_version": 5})
    c.pool_status(2.0, "p", 100, {"engine_version": 7, "dir_version": 6})
    assert c.held("pool_versions")
    c.pool_status(3.0, "p", 200, {"engine_version": 6, "dir_version": 6})  # restarted: resumes its directory
    assert c.held("pool_versions")
    c.pool_status(4.0, "p", 200, {"engine_version": 4, "dir_version": 6})
    assert not c.held("pool_versions") and "went back from v6 to v4" in c.violations[0].detail
    d = _checks()
    d.pool_status(1.0, "p", 1, {"engine_version": 9, "dir_version": 9})
    d.pool_status(2.0, "p", 2, {"engine_version": 8, "dir_version": 8})
    assert "below v9" in d.violations[0].detail and d.violations[0].seed == 5


def test_a_failed_serve_check_is_a_violation():
    c = _checks()
    c.pool_status(1.0, "p", 1, {"engine_version": 3, "checks": {"ok": 3, "failed": 0}})
    c.pool_status(2.0, "p", 1, {"engine_version": 4, "checks": {"ok": 3, "failed": 1}, "last_check": "v4: mismatch"})
    assert [v.invariant for v in c.violations] == ["pool_versions"] and "v4: mismatch" in c.violations[0].detail


def test_two_hashes_for_one_version_is_a_violation():
    c = _checks()
    c.gateway_listing(1.0, "us", [{"version": 3, "weights_hash": "a" * 32}])
    c.gateway_listing(2.0, "eu", [{"version": 3, "weights_hash": "a" * 32}, {"version": 4, "weights_hash": "b" * 32}])
    assert c.held("one_hash")
    c.gateway_listing(3.0, "ap", [{"version": 4, "weights_hash": "c" * 32}])
    assert not c.held("one_hash")


def test_lost_and_twice_trained_trajectories_are_violations_and_a_rolled_back_step_is_not():
    c = _checks()
    for step, ids in [(1, ["a", "b"]), (2, ["c"]), (3, ["d"]), (2, ["c"]), (3, ["e"])]:  # restart from step 1
        c.trainer_record(float(step), {"step": step, "ids": ids, "wait_seconds": 0.1})
    c.trajectories(9.0, {"p": {"a", "b", "c", "d", "e"}}, {i: "consumed" for i in "abcde"})
    assert c.held("trajectories"), c.violations
    c.trainer_record(10.0, {"step": 4, "ids": ["a"]})
    c.trajectories(11.0, {"p": {"a", "x"}}, {"a": "consumed", "weird": "?"})
    details = " ".join(v.detail for v in c.violations)
    assert "not in the broker's database" in details and "['x']" in details and "trained twice" in details


def test_convergence_after_the_last_fault_and_between_faults_is_bounded():
    c = _checks()
    series = {"p": [(10.0, 3), (20.0, 5), (50.0, 9)], "q": [(10.0, 9), (16.0, 9)]}
    assert c.convergence(70.0, 15.0, 9, series, 70.0) == {"p": 35.0, "q": 1.0}
    assert c.held("convergence")
    slow = {"p": [(0.0, 1), (10.0 + CONVERGE_BOUND_S + 5, 9)]}
    c.convergence(300.0, 10.0, 9, slow, 300.0)
    assert not c.held("convergence")
    d = _checks()
    faults = [{"t": 0.0, "event": "inject", "index": 0, "kind": "kill"}, {"t": 5.0, "event": "heal", "index": 0},
              {"t": 200.0, "event": "inject", "index": 1, "kind": "stop"}, {"t": 210.0, "event": "heal", "index": 1}]
    stuck = {"p": [(t, 1) for t in range(0, 200, 5)]}
    d.recoveries(220.0, faults, stuck, lambda t: 9, 210.0)
    assert not d.held("convergence") and "fault #0" in d.violations[0].detail


def test_batches_beyond_the_staleness_bound_are_violations():
    c = _checks()
    c.staleness(1.0, [("b1", 10, 8), ("b2", 12, 8)])
    assert c.held("staleness")
    c.staleness(2.0, [("b3", 20, 10)])
    assert not c.held("staleness") and c.figures["staleness"]["max_lag"] == 10


def test_leaks_are_judged_on_long_lives_only_and_their_slope_is_per_minute():
    assert slope_per_min([(0.0, 0.0), (60.0, 2.0), (120.0, 4.0)]) == pytest.approx(2.0)
    c = _checks()
    span = int(JUDGE_MIN_S * 2)
    flat = [(float(t), 100.0 + (t % 7)) for t in range(0, span, 10)]
    growing = [(float(t), t / 6.0) for t in range(0, span, 10)]  # 10 fds a minute
    short = [(float(t), t * 10.0) for t in range(0, 60, 5)]
    out = c.leaks(9.0, {"gw": {"fds": [short, flat]}, "pool": {"fds": [growing]}})
    assert out["gw"]["judged"] and out["pool"]["fds_slope"] == pytest.approx(10.0)
    assert [v.detail.split(":")[0] for v in c.violations] == ["pool"]


def test_established_connections_are_counted_apart_from_the_fds_a_leak_grows():
    from soak_observe import proc_sample

    before = proc_sample(0.0, os.getpid())
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        after = proc_sample(1.0, os.getpid())
        assert after.connections == before.connections + 2  # both ends live in this process
        assert after.fds == before.fds + 1  # the listening socket is judged like any other fd
    finally:
        for s in (accepted, client, listener):
            s.close()


def test_connections_are_reported_but_not_judged():
    c = _checks()
    span = int(JUDGE_MIN_S * 2)
    growing = [(float(t), t / 6.0) for t in range(0, span, 10)]
    out = c.leaks(9.0, {"broker": {"connections": [growing]}})
    assert out["broker"]["connections_slope"] == pytest.approx(10.0) and c.held("leaks")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the soak needs root (network namespaces, tmpfs, PostgreSQL)")
def test_a_short_soak_under_faults_keeps_every_invariant(tmp_path):
    """`benchmarks/soak.py --quick --seed 1 --json` (a 1.5-minute fault phase), as scripts outside the
    tests drive it; CI runs it, so any violation fails the build."""
    run = tmp_path / "soak"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "soak.py"), "--quick", "--seed", "1", "--json",
                           "--run-dir", str(run)], capture_output=True, text=True, timeout=900)
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["violations"] == [], json.dumps(result["violations"], indent=1)
    assert done.returncode == 0
    assert sum(result["faults"].values()) >= 6 and len(result["faults"]) >= 6, result["faults"]
    assert result["converged_s_max"] is not None and result["converged_s_max"] <= CONVERGE_BOUND_S
    assert set(result["leaks"]) >= {"gateway-us", "broker-a", "trainer", "pool-eu-1"}
    assert all({"fds_slope", "rss_slope"} <= set(row) for row in result["leaks"].values())
    assert (run / "versions.png").stat().st_size > 0 and (run / "faults.jsonl").exists()
