"""The optimizer step on a tiny real model: inputs checking, metrics, micro-batches, clipping, config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deltamesh.config import ConfigError, load_config
from deltamesh.trainer.config import OptimizerConfig, TrainerConfig
from deltamesh.trainer.distributed import SINGLE, DistContext
from deltamesh.trainer.loss_inputs import LossInputs
from deltamesh.trainer.losses import rewards_differ
from deltamesh.trainer.step import (
    TrainState,
    batch_logprobs,
    build_optimizer,
    clip_grad_norm,
    learning_rate,
    published_weights,
    train_step,
)


def _inputs(**changes) -> dict:
    base = dict(
        input_ids=torch.zeros(2, 4, dtype=torch.int64),
        loss_mask=torch.tensor([[False, True, True, False], [False, False, True, True]]),
        behaviour_logprobs=torch.zeros(2, 4),
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
    )
    base.update(changes)
    return base


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"input_ids": torch.zeros(2, 4)}, "integer"),
        ({"loss_mask": torch.ones(2, 3, dtype=torch.bool)}, "loss_mask has shape"),
        ({"rewards": torch.zeros(3)}, "rewards has shape"),
        ({"group_ids": torch.zeros(2, 1)}, "group_ids has shape"),
        ({"loss_mask": torch.ones(2, 4, dtype=torch.bool)}, "column 0"),
        ({"attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])}, "padding"),
        ({"rewards": torch.tensor([1.0, float("nan")])}, "rewards must be finite"),
        ({"behaviour_logprobs": torch.tensor([[0.0, -float("inf"), 0.0, 0.0]] * 2)}, "finite on every loss token"),
        ({"ref_logprobs": torch.full((2, 4), float("nan"))}, "ref_logprobs must be finite"),
    ],
)
def test_malformed_inputs_are_rejected_with_a_clear_message(changes, needle):
    with pytest.raises(ValueError, match=needle):
        LossInputs(**_inputs(**changes))


def test_inputs_take_their_dtypes_and_slice():
    x = LossInputs(**_inputs(loss_mask=torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]]), group_ids=torch.tensor([0.0, 0.0])))
    assert x.loss_mask.dtype == torch.bool and x.group_ids.dtype == torch.int64
    assert x.loss_tokens == 4 and x.slice(1, 2).rows == 1 and x.slice(1, 2).loss_tokens == 2


def test_a_step_trains_publishes_bf16_and_counts_versions(tiny):
    cfg = tiny.trainer_config()
    model = tiny.tiny_model()
    batches = tiny.fixed_batches(model, 2)
    state = TrainState(model, build_optimizer(model, cfg.optim), version=41)
    before = published_weights(model)
    m1 = train_step(state, batches[0], cfg)
    v42 = published_weights(model)
    snapshot = {k: v.clone() for k, v in v42.items()}
    train_step(state, batches[1], cfg)
    assert (state.version, state.step) == (43, 2)
    assert m1["version"] == 42 and m1["tokens"] == batches[0].loss_tokens
    assert all(isinstance(v, float) and v == v for v in m1.values())
    assert 0.0 < m1["m2po_masked_frac"] < 0.5 and 0.0 < m1["clip_frac"] < 0.5
    assert m1["m2_kept"] <= cfg.loss.m2_threshold < m1["m2"]
    assert m1["kl"] >= 0.0 and m1["grad_norm"] > cfg.optim.max_grad_norm
    # Tied embeddings are published once, every floating tensor as bf16, as a snapshot.
    assert "lm_head.weight" not in v42 and "model.embed_tokens.weight" in v42
    assert all(t.dtype == torch.bfloat16 for t in v42.values())
    assert any(not torch.equal(before[k], v42[k]) for k in v42)
    assert all(torch.equal(snapshot[k], v42[k]) for k in v42)


def test_micro_batches_see_the_whole_batch_for_m2po(tiny):
    metrics = {}
    for micro in (None, 2):
        cfg = tiny.trainer_config(micro_batch_size=micro)
        model = tiny.tiny_model()
        batch = tiny.fixed_batches(model, 1)[0]
        metrics[micro] = train_step(TrainState(model, build_optimizer(model, cfg.optim)), batch, cfg)
    whole, split = metrics[None], metrics[2]
    for key in ("m2po_masked_frac", "clip_frac", "tokens"):
        assert whole[key] == split[key]
    for key in ("loss", "kl", "m2", "grad_norm"):
        assert whole[key] == pytest.approx(split[key], rel=1e-5, abs=1e-9)


def test_a_batch_without_loss_tokens_or_that_does_not_split_is_refused(tiny):
    cfg = tiny.trainer_config()
    model = tiny.tiny_model()
    batch = tiny.fixed_batches(model, 1)[0]
    batch.loss_mask[:] = False
    with pytest.raises(ValueError, match="no loss tokens"):
        train_step(TrainState(model, build_optimizer(model, cfg.optim)), batch, cfg)
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        DistContext(rank=1, world_size=3).row_range(8)
    assert DistContext(rank=1, world_size=4).row_range(8) == (2, 4)


def test_grad_clipping_by_hand():
    lin = torch.nn.Linear(2, 1, bias=True)
    lin.weight.grad = torch.tensor([[3.0, 0.0]])
    lin.bias.grad = torch.tensor([4.0])
    assert clip_grad_norm(lin, 1.0, SINGLE) == pytest.approx(5.0)
    torch.testing.assert_close(lin.weight.grad, torch.tensor([[0.6, 0.0]]))
    torch.testing.assert_close(lin.bias.grad, torch.tensor([0.8]))
    # Under the bound nothing changes, bit for bit.
    clipped = lin.bias.grad.clone()
    assert clip_grad_norm(lin, 2.0, SINGLE) == pytest.approx(1.0)
    assert torch.equal(lin.bias.grad, clipped)


def test_warmup_and_weight_decay_groups():
    cfg = OptimizerConfig(lr=1e-4, warmup_steps=4)
    assert [learning_rate(cfg, s) for s in range(6)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    decay, no_decay = build_optimizer(model, OptimizerConfig(weight_decay=0.1)).param_groups
    assert [p.dim() for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert [p.dim() for p in no_decay["params"]] == [1, 1, 1] and no_decay["weight_decay"] == 0.0


def test_trainer_config_from_toml(tmp_path: Path):
    p = tmp_path / "mesh.toml"
    p.write_text(
        '[trainer]\nmodel_id = "qwen"\nmicro_batch_size = 4\n'
        "[trainer.loss]\nm2_threshold = 0.04\nkl_coef = 0.001\n"
        "[trainer.optim]\nlr = 1e-6\nbetas = [0.9, 0.95]\n"
        '[trainer.checkpoint]\ndir = "ckpt"\nkeep = 3\n'
    )
    cfg = load_config(TrainerConfig, p, section="trainer", overrides={"optim.max_grad_norm": 0.5})
    assert cfg.model_id == "qwen" and cfg.micro_batch_size == 4
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.max_grad_norm == 0.5
    assert cfg.checkpoint.dir == Path("ckpt") and cfg.checkpoint.keep == 3


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[trainer.loss]\neps_low = 1.5\n", "eps_low"),
        ("[trainer.loss]\nm2_threshold = -1\n", "m2_threshold"),
        ("[trainer.loss]\ntemperature = 0\n", "temperature"),
        ("[trainer.optim]\nlr = 0\n", "lr must be"),
        ("[trainer.optim]\nbetas = [0.9, 1.0]\n", "betas"),
        ("[trainer.checkpoint]\nkeep = 0\n", "keep"),
        ("[trainer]\nmicro_batch_size = 0\n", "micro_batch_size"),
        ("[trainer.loss]\nclip = 0.2\n", "unknown keys"),
    ],
)
def test_bad_trainer_config_is_an_error(tmp_path: Path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config(TrainerConfig, p, section="trainer")


def test_broker_batches_become_loss_inputs():
    import numpy as np

    from deltamesh.data import Trajectory, decode_batch, encode_batch
    from deltamesh.trainer.loss_inputs import inputs_from_batch

    def traj(i: int, group: str, n: int, reward: float) -> Trajectory:
        mask = np.array([0, 0] + [1] * (n - 2), np.uint8)
        return Trajectory(
            id=f"t{i}", task_id="task", group_id=group, group_size=2, model_id="m",
            tokens=np.arange(1, n + 1, dtype=np.int32), logprobs=-0.5 * mask.astype(np.float32),
            loss_mask=mask, versions=np.full(n, 3, np.int32), reward=reward,
        )

    trajs = [traj(0, "a", 5, 1.0), traj(1, "a", 3, 0.0), traj(2, "b", 4, 0.5), traj(3, "b", 4, 0.5)]
    batch = decode_batch(encode_batch(trajs, [False] * 4, model_id="m", batch_id="b1", version=3))
    x = inputs_from_batch(batch)
    assert x.input_ids.shape == (4, 5) and x.input_ids.dtype == torch.int64
    assert x.attention_mask.tolist()[1] == [1, 1, 1, 0, 0]
    assert x.loss_mask.tolist()[1] == [False, False, True, False, False]
    assert x.group_ids.tolist() == [0, 0, 1, 1] and x.rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert x.behaviour_logprobs[0, 2].item() == -0.5 and x.ref_logprobs is None


def test_reference_logprobs_for_the_kl_penalty(tiny):
    from deltamesh.trainer.step import batch_logprobs, sequence_logprobs

    cfg = tiny.trainer_config(micro_batch_size=3)
    reference = tiny.tiny_model()
    batch = tiny.fixed_batches(reference, 1)[0]
    ref = batch_logprobs(reference, batch, cfg)
    whole = sequence_logprobs(reference, batch.input_ids, batch.attention_mask, 1.0).detach()
    torch.testing.assert_close(ref, whole)
    # The policy equals the reference here, so the KL term starts at zero.
    batch.ref_logprobs = ref
    model = tiny.tiny_model()
    metrics = train_step(TrainState(model, build_optimizer(model, cfg.optim)), batch, cfg)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)


def test_a_batch_whose_groups_all_have_equal_rewards_leaves_the_weights_alone_but_still_makes_a_version(tiny):
    """No group's rewards differ: every advantage is 0 and the loss is the KL penalty at its minimum (the
    policy is the reference). AdamW would still move every weight (normalised noise and weight decay),
    so no update is taken; the version still advances, as the loop publishes one per batch. A batch
    with a signal after it does train."""
    cfg = tiny.trainer_config()
    reference = tiny.tiny_model()
    flat, signal = tiny.fixed_batches(reference, 2)
    flat.rewards = torch.ones_like(flat.rewards)
    flat.ref_logprobs = batch_logprobs(reference, flat, cfg)
    model = tiny.tiny_model()
    state = TrainState(model, build_optimizer(model, cfg.optim), version=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = train_step(state, flat, cfg)
    assert metrics["updated"] == 0.0 and (state.version, state.step) == (8, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    assert train_step(state, signal, cfg)["updated"] == 1.0 and state.version == 9
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_the_skip_a_batch_with_equal_rewards_moves_the_weights(tiny):
    """The drift the skip prevents (OptimizerConfig.skip_without_signal false: the old behaviour)."""
    cfg = tiny.trainer_config()
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, skip_without_signal=False))
    model = tiny.tiny_model()
    flat = tiny.fixed_batches(model, 1)[0]
    flat.rewards = torch.zeros_like(flat.rewards)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert train_step(TrainState(model, build_optimizer(model, cfg.optim)), flat, cfg)["updated"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("rewards, groups, differ", [
    ([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1], False),
    ([0.1, 0.1, 0.1], [3, 3, 3], False),
    ([1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1], True),
    ([1.0, 0.0], [0, 1], False),  # groups of one: advantage 0
])
def test_rewards_differ_per_group(rewards, groups, differ):
    assert rewards_differ(torch.tensor(rewards), torch.tensor(groups)) is differ
