"""Trainer-side mismatch: the per-row sums on hand-built logprobs, the split by pool, the jump rule that
names a pool whose behaviour logprobs moved, its metrics, and the figures `train_step` takes from its
own forward pass on current-version tokens only."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from deltamesh.trainer.config import MismatchConfig
from deltamesh.trainer.metrics import TrainerMetrics
from deltamesh.trainer.mismatch import MismatchWatch, PoolMismatch, pool_mismatch, row_sums
from deltamesh.trainer.step import TrainState, build_optimizer, sequence_logprobs, train_step


def test_row_sums_on_hand_built_logprobs():
    trainer = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.2, -3.0, -1.0]])
    behaviour = torch.tensor([[0.0, -1.5, -2.0, -0.1], [0.0, -0.2, -1.0, -1.3]])
    mask = torch.tensor([[False, True, True, True], [False, False, False, True]])
    sums = row_sums(trainer, behaviour, mask)
    assert sums.dtype == torch.float64 and sums.shape == (2, 3)
    # Row 0: d = trainer - behaviour = 0.5, 0, -0.4. Row 1 counts only its last token: d = 0.3 (the
    # unmasked -2.0 difference does not count).
    k3 = [math.exp(0.5) - 1 - 0.5, 0.0, math.exp(-0.4) - 1 + 0.4]
    assert sums[0].tolist() == pytest.approx([0.9, sum(k3), 3.0], rel=1e-6)
    assert sums[1].tolist() == pytest.approx([0.3, math.exp(0.3) - 1 - 0.3, 1.0], rel=1e-6)
    assert sum(k3) == pytest.approx(0.2190413167, rel=1e-9)


def test_pool_mismatch_adds_up_rows_per_pool():
    rows = torch.tensor([[0.9, 0.2, 3.0], [0.3, 0.05, 1.0], [0.0, 0.0, 0.0], [1.2, 0.4, 2.0]], dtype=torch.float64)
    out = pool_mismatch(rows, ["a", "b", "c", "a"])
    assert sorted(out) == ["a", "b"]  # c has no token at the trainer's version
    assert (out["a"].tokens, out["a"].abs_mean, out["a"].k3_mean) == (5, pytest.approx(2.1 / 5), pytest.approx(0.12))
    assert (out["b"].tokens, out["b"].abs_mean, out["b"].k3_mean) == (1, pytest.approx(0.3), pytest.approx(0.05))
    assert list(pool_mismatch(rows[:1], [""])) == ["unknown"]


def _pool_rows(pools: dict[str, float], rows_per_pool: int = 4, tokens: int = 16, seed: int = 0):
    """Rows of a batch: each pool's behaviour logprobs are the trainer's plus noise of the given scale."""
    g = torch.Generator().manual_seed(seed)
    names, sums = [], []
    for pool, noise in pools.items():
        trainer = -torch.rand(rows_per_pool, tokens, generator=g) * 3
        behaviour = trainer + torch.randn(rows_per_pool, tokens, generator=g) * noise
        sums.append(row_sums(trainer, behaviour, torch.ones(rows_per_pool, tokens, dtype=torch.bool)))
        names += [pool] * rows_per_pool
    return torch.cat(sums), names


def test_a_pool_with_perturbed_logprobs_is_named_and_the_others_are_not(caplog):
    metrics = TrainerMetrics()
    watch = MismatchWatch(MismatchConfig(), "policy", metrics)
    rows, pools = _pool_rows({"eu-1": 0.02, "eu-2": 0.02, "ap-1": 0.03, "ap-2": 0.4})
    with caplog.at_level("WARNING", logger="deltamesh.trainer.mismatch"):
        readings = watch.observe(7, pool_mismatch(rows, pools))
    assert {p for p, r in readings.items() if r.flagged} == {"ap-2"}
    assert "other pools" in readings["ap-2"].reason and readings["ap-2"].abs_mean > 0.2
    assert all(r.abs_mean < 0.03 and r.k3_mean < 1e-3 for p, r in readings.items() if p != "ap-2")
    (warning,) = caplog.records
    assert "policy v7: pool ap-2" in warning.getMessage()
    text = generate_latest(metrics.registry).decode()
    assert 'deltamesh_trainer_mismatch_flagged{model_id="policy",pool="ap-2"} 1.0' in text
    assert 'deltamesh_trainer_mismatch_flagged{model_id="policy",pool="eu-1"} 0.0' in text
    assert 'deltamesh_trainer_mismatch_flags_total{model_id="policy",pool="ap-2"} 1.0' in text
    assert 'deltamesh_trainer_mismatch_tokens_total{model_id="policy",pool="eu-1"} 64.0' in text
    assert 'deltamesh_trainer_mismatch_k3{model_id="policy",pool="ap-2"}' in text
    assert "deltamesh_build_info" in text and "_created" not in text
    # Once the pool is fixed, its flag clears.
    rows, pools = _pool_rows({"eu-1": 0.02, "ap-2": 0.02}, seed=1)
    assert not any(r.flagged for r in watch.observe(8, pool_mismatch(rows, pools)).values())
    assert 'deltamesh_trainer_mismatch_flagged{model_id="policy",pool="ap-2"} 0.0' in generate_latest(
        metrics.registry).decode()


def test_a_lone_pool_is_judged_against_its_own_history_and_small_noise_is_never_named():
    cfg = MismatchConfig(min_history=3)
    watch = MismatchWatch(cfg, "policy")
    for seed in range(3):
        rows, pools = _pool_rows({"solo": 0.01}, seed=seed)
        assert not watch.observe(seed, pool_mismatch(rows, pools))["solo"].flagged
    rows, pools = _pool_rows({"solo": 0.3}, seed=9)
    jumped = watch.observe(3, pool_mismatch(rows, pools))["solo"]
    assert jumped.flagged and "own running median" in jumped.reason
    # Three times a tiny median is still below the floor: bf16 noise is not a jump.
    quiet = MismatchWatch(cfg, "policy")
    readings = {"a": PoolMismatch(100, 0.001, 0.0), "b": PoolMismatch(100, 0.012, 0.0)}
    assert not any(r.flagged for r in quiet.observe(1, readings).values())
    # A pool with too few tokens is neither judged nor used to judge the others.
    readings = {"a": PoolMismatch(100, 0.01, 0.0), "b": PoolMismatch(5, 0.9, 0.0), "c": PoolMismatch(100, 0.011, 0.0)}
    assert not any(r.flagged for r in quiet.observe(2, readings).values())


@pytest.mark.parametrize("changes, needle", [({"ratio": 1.0}, "ratio"), ({"floor": -1.0}, "floor"),
                                             ({"min_tokens": 0}, "min_tokens"),
                                             ({"window": 3, "min_history": 4}, "min_history")])
def test_mismatch_settings_are_checked(changes, needle):
    with pytest.raises(ValueError, match=needle):
        MismatchConfig(**changes)


@pytest.mark.parametrize("micro", [None, 3])
def test_train_step_measures_current_version_tokens_from_its_own_forward_pass(tiny, micro):
    cfg = tiny.trainer_config(micro_batch_size=micro)
    model = tiny.tiny_model()
    batch = tiny.fixed_batches(model, 1)[0]
    # Half the rows were generated at version 4, the trainer's; the other half at 3 (lag, not mismatch).
    versions = torch.full(batch.input_ids.shape, 4, dtype=torch.int64)
    versions[::2] = 3
    batch = dataclasses.replace(batch, versions=versions)
    with torch.no_grad():
        before = sequence_logprobs(model, batch.input_ids, batch.attention_mask, cfg.loss.temperature)
    expected = row_sums(before, batch.behaviour_logprobs, batch.loss_mask & (versions == 4))
    state = TrainState(model, build_optimizer(model, cfg.optim), version=4)
    metrics = train_step(state, batch, cfg)
    assert state.row_mismatch is not None and state.row_mismatch[::2].abs().sum() == 0
    torch.testing.assert_close(state.row_mismatch, expected, rtol=1e-5, atol=1e-6)
    assert metrics["mismatch_tokens"] == float(batch.loss_mask[1::2].sum())
    assert metrics["mismatch"] == pytest.approx(float(expected[:, 0].sum() / expected[:, 2].sum()), rel=1e-5)
    assert metrics["mismatch_k3"] > 0
    # A batch without token versions measures nothing.
    train_step(state, dataclasses.replace(batch, versions=None), cfg)
    assert state.row_mismatch is None


def test_docs_list_every_trainer_metric():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md").read_text()
    names = {m.name + ("_total" if m.type == "counter" else "") for m in TrainerMetrics().registry.collect()
             if m.name.startswith("deltamesh_trainer_")}
    assert len(names) == 5
    assert {n for n in names if f"`{n}`" not in doc} == set()
