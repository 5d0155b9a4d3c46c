"""Data policies as pure functions: filters, the staleness bounds, replay fraction and selectors,
complete-group assembly, curators, plug-in loading, and the balance formula."""

from __future__ import annotations

import math
import random

import pytest

from deltamesh.mesh.broker.balance import BalanceWindow, target_gpus
from deltamesh.mesh.broker.config import CuratorConfig
from deltamesh.mesh.broker.curators import make_curator
from deltamesh.mesh.broker.policies import (
    GROUP_FILTERS,
    BatchPolicy,
    filter_chain,
    resolve,
    select_latest,
    select_reward,
    select_uniform,
)
from deltamesh.mesh.broker.store_interface import GroupSummary


def summary(gid: str, *, size: int = 4, version: int = 0, rewards: tuple[float, float] = (0.0, 1.0),
            task: str | None = None, seq: int = 0) -> GroupSummary:
    lo, hi = rewards
    return GroupSummary("m", gid, task or f"t-{gid}", size, version, version, lo, hi, (lo + hi) / 2, seq)


def test_zero_adv_drops_exactly_uniform_groups():
    verdict = filter_chain(["keep_all", "zero_adv"])
    assert verdict(summary("a", rewards=(1.0, 1.0))) == "zero_adv"
    assert verdict(summary("b", rewards=(0.0, 0.0))) == "zero_adv"
    assert verdict(summary("c", rewards=(0.0, 1e-6))) is None
    assert filter_chain(["keep_all"])(summary("a", rewards=(1.0, 1.0))) is None


def test_plugins_load_by_dotted_name_and_unknown_names_fail():
    assert resolve(GROUP_FILTERS, "deltamesh.mesh.broker.policies:zero_adv", "filter") is GROUP_FILTERS["zero_adv"]
    with pytest.raises(ValueError, match="unknown filter 'nope'"):
        resolve(GROUP_FILTERS, "nope", "filter")
    with pytest.raises(ValueError, match="cannot load filter"):
        resolve(GROUP_FILTERS, "deltamesh.mesh.broker.policies:missing", "filter")


def test_batches_never_split_a_group():
    fresh = [summary("a", size=3), summary("b", size=4), summary("c", size=2), summary("d", size=3)]
    plan = BatchPolicy().plan(fresh, [], size=8, version=0, rng=random.Random(0))
    # a (3) and b (4) fit; c (2) and d (3) would each overflow 8: the batch holds 7 whole samples
    assert plan.ready and [g.group_id for g in plan.fresh] == ["a", "b"] and plan.samples == 7
    # not enough waiting: not ready, nothing taken
    assert not BatchPolicy().plan(fresh[:2], [], size=8, version=0, rng=random.Random(0)).ready


def test_fill_takes_whole_groups_in_order_and_skips_what_overflows():
    fresh = [summary("a", size=3), summary("b", size=6), summary("c", size=5)]
    plan = BatchPolicy().plan(fresh, [], size=8, version=0, rng=random.Random(0))
    assert [g.group_id for g in plan.fresh] == ["a", "c"] and plan.samples == 8


def test_staleness_bound_drops_what_it_must():
    fresh = [summary(f"g{v}", version=v) for v in range(10)]
    policy = BatchPolicy(max_staleness=3)
    plan = policy.plan(fresh, [], size=8, version=9, rng=random.Random(0))
    assert [g.group_id for g in plan.stale] == [f"g{v}" for v in range(6)]  # 9 - v > 3
    assert [g.group_id for g in plan.fresh] == ["g6", "g7"]
    assert BatchPolicy().plan(fresh, [], size=8, version=100, rng=random.Random(0)).stale == []
    # the bound is inclusive: exactly max_staleness behind is still fresh enough
    assert policy.plan([summary("x", version=6)], [], size=4, version=9, rng=random.Random(0)).ready


def test_replay_fraction_holds_and_falls_back_to_fresh():
    fresh = [summary(f"f{i}") for i in range(8)]
    replay = [summary(f"r{i}", seq=i) for i in range(8)]
    policy = BatchPolicy(replay_fraction=0.25)
    plan = policy.plan(fresh, replay, size=16, version=0, rng=random.Random(0))
    assert plan.ready and len(plan.replay) == 1 and len(plan.fresh) == 3  # 4 of 16 samples from replay
    empty = policy.plan(fresh, [], size=16, version=0, rng=random.Random(0))
    assert empty.replay == [] and len(empty.fresh) == 4


def test_replay_staleness_bound_retires_old_groups():
    replay = [summary(f"r{v}", version=v) for v in range(6)]
    plan = BatchPolicy(replay_fraction=0.5, replay_max_staleness=2).plan(
        [summary("f", size=4), summary("f2", size=4)], replay, size=8, version=5, rng=random.Random(0))
    assert [g.group_id for g in plan.retired] == ["r0", "r1", "r2"]
    assert [g.group_id for g in plan.replay] == ["r5"]  # latest of the eligible ones


def test_replay_selectors():
    groups = [summary(f"r{i}", rewards=(0.0, r)) for i, r in enumerate([0.2, 1.0, 0.6, 1.0])]
    assert [g.group_id for g in select_latest(groups, random.Random(0))] == ["r3", "r2", "r1", "r0"]
    assert [g.group_id for g in select_reward(groups, random.Random(0))] == ["r3", "r1", "r2", "r0"]
    picks = [select_uniform(groups, random.Random(seed))[0].group_id for seed in range(400)]
    counts = {g: picks.count(g) for g in ("r0", "r1", "r2", "r3")}
    assert all(60 < c < 140 for c in counts.values()), counts  # each ~100 of 400


def test_filter_solved_curator():
    cur = make_curator(CuratorConfig(name="filter_solved", history=2))
    assert cur.admit("t")
    cur.observe(summary("a", task="t", rewards=(1.0, 1.0)))
    assert not cur.admit("t")
    cur.observe(summary("b", task="t", rewards=(0.0, 1.0)))
    assert cur.admit("t")  # one of the last two groups was not fully solved
    cur.observe(summary("c", task="t", rewards=(1.0, 1.0)))
    cur.observe(summary("d", task="t", rewards=(1.0, 1.0)))
    assert not cur.admit("t") and cur.admit("other")


def test_greso_skips_zero_variance_prompts_with_learned_probability():
    cfg = CuratorConfig(name="greso", greso_target=0.0, greso_step=0.05, greso_start=0.9, greso_min=0.1, seed=1)
    cur = make_curator(cfg)
    for i in range(30):  # every group uniform: zero-variance share 1 > target 0, so exploration falls
        cur.observe(summary(f"s{i}", task=f"solved{i % 3}", rewards=(1.0, 1.0)))
    assert cur.explore["easy"] == pytest.approx(0.1)
    assert cur.explore["hard"] == 1.0  # no all-failed group seen: its share 0 is on target
    cur.observe(summary("v", task="varied", rewards=(0.0, 1.0)))
    assert cur.admit("varied") and cur.admit("never-seen")
    admitted = sum(cur.admit("solved0") for _ in range(2000))
    assert admitted < 20  # p = 0.1 ** 10 in a row; the rest of the time it is skipped
    # a prompt with a single zero-variance group is admitted with about the exploration probability
    cur.observe(summary("h", task="hard", rewards=(0.0, 0.0)))
    rate = sum(cur.admit("hard") for _ in range(4000)) / 4000
    assert rate == pytest.approx(cur.explore["hard"], abs=0.03)


def test_greso_raises_exploration_when_zero_variance_is_rare():
    cur = make_curator(CuratorConfig(name="greso", greso_target=0.5, greso_step=0.1, greso_start=0.5))
    for i in range(10):
        cur.observe(summary(f"v{i}", rewards=(0.0, 1.0)))
    assert cur.explore["easy"] == 1.0


@pytest.mark.parametrize("gpus, w, n_p, n_c", [
    (8, 0.5, 100, 100), (8, 0.11, 10, 10), (8, 0.10, 10, 10), (8, 0.07, 100, 50), (8, 0.01, 100, 50),
    (8, 0.01, 100, 0), (8, 0.0, 0, 10), (8, 0.04, 100, 99), (3, 0.9, 1, 1), (0, 0.5, 1, 1),
])
def test_target_formula(gpus, w, n_p, n_c):
    if w > 0.10:
        expected = math.ceil(gpus / (1 - w))
    elif w < 0.05 and n_p > 0 and n_c > 0:
        expected = min(gpus, math.ceil(gpus * n_c / n_p * 1.10))
    else:
        expected = gpus
    assert target_gpus(gpus, w, n_p, n_c) == expected


def test_balance_window_counts_per_step_and_forgets_old_steps():
    window = BalanceWindow(window_steps=2)
    window.produced, window.consumed = 10, 4
    window.add_step(wait_s=1.0, step_s=4.0)
    window.produced = 6
    window.add_step(wait_s=0.0, step_s=4.0)
    assert window.summary() == {"steps": 2, "wait_s": 1.0, "step_s": 8.0, "wait_fraction": 0.125,
                                "produced": 16, "consumed": 4}
    window.add_step(wait_s=2.0, step_s=2.0)  # the first step leaves the window
    assert window.summary()["wait_fraction"] == pytest.approx(2.0 / 6.0)
    assert window.summary()["produced"] == 6


def test_target_follows_the_thresholds_it_is_given():
    from deltamesh.mesh.broker.config import ScaleThresholds

    assert target_gpus(8, 0.15, 10, 10) == 10  # above the default 0.10: grow
    assert target_gpus(8, 0.15, 10, 10, ScaleThresholds(scale_up_above=0.2)) == 8  # within a wider band: hold
    assert target_gpus(8, 0.01, 100, 50, ScaleThresholds(headroom=1.5)) == 6  # ceil(8 * 0.5 * 1.5)
