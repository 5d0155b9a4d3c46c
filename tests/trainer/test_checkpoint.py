"""Checkpoints: bit-exact resume, atomic writes, retention, and clear errors on bad checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltamesh.trainer.checkpoint import (
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_latest,
    save_checkpoint,
)
from deltamesh.trainer.step import TrainState, build_optimizer, published_weights, train_step


def _state(tiny, seed: int = 0) -> TrainState:
    model = tiny.tiny_model(seed)
    return TrainState(model, build_optimizer(model, tiny.trainer_config().optim))


def _master(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_continues_bit_exactly(tiny, tmp_path: Path):
    cfg = tiny.trainer_config()
    batches = tiny.fixed_batches(tiny.tiny_model(), 5)
    straight = _state(tiny)
    for batch in batches[:3]:
        train_step(straight, batch, cfg)
    path = save_checkpoint(tmp_path, straight, extra={"model_id": "tiny"})
    rng_at_save = torch.get_rng_state()
    for batch in batches[3:]:
        train_step(straight, batch, cfg)

    torch.manual_seed(1234)
    restarted = _state(tiny, seed=7)  # different initial weights: everything must come from the checkpoint
    meta = resume_latest(tmp_path, restarted)
    assert meta is not None and meta["extra"] == {"model_id": "tiny"} and path == tmp_path / "v0000000003"
    assert (restarted.version, restarted.step) == (3, 3)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    for batch in batches[3:]:
        train_step(restarted, batch, cfg)
    assert (restarted.version, restarted.step) == (5, 5)
    _assert_same(_master(restarted), _master(straight))
    _assert_same(published_weights(restarted.model), published_weights(straight.model))
    for p_a, p_b in zip(straight.optimizer.param_groups[0]["params"], restarted.optimizer.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(straight.optimizer.state[p_a][key], restarted.optimizer.state[p_b][key])


def test_only_the_newest_complete_checkpoints_are_kept(tiny, tmp_path: Path):
    state = _state(tiny)
    (tmp_path / ".tmp-v0000000009-1").mkdir(parents=True)  # a crashed write
    (tmp_path / checkpoint_name(8)).mkdir()  # no meta.json: never finished
    for version in (1, 2, 3, 4):
        state.version = version
        save_checkpoint(tmp_path, state, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["v0000000003", "v0000000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "v0000000004"
    assert not list(tmp_path.glob(".tmp-*"))
    # Checkpointing a version again replaces it whole.
    state.step = 99
    save_checkpoint(tmp_path, state, keep=2)
    assert json.loads((tmp_path / "v0000000004" / "meta.json").read_text())["step"] == 99
    assert resume_latest(tmp_path / "empty", _state(tiny)) is None


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("flip_model_byte", "model.safetensors is corrupt"),
        ("truncate_optimizer", "optimizer.safetensors is corrupt"),
        ("drop_meta", "not a checkpoint"),
        ("garble_meta", "unreadable"),
        ("future_format", "unknown checkpoint format"),
        ("meta_without_rng", "lacks 'rng'"),
    ],
)
def test_a_damaged_checkpoint_is_refused_and_changes_nothing(tiny, tmp_path: Path, damage, needle):
    path = save_checkpoint(tmp_path, _state(tiny))
    assert path is not None
    meta_file = path / "meta.json"
    if damage == "flip_model_byte":
        data = bytearray((path / "model.safetensors").read_bytes())
        data[-3] ^= 0x01
        (path / "model.safetensors").write_bytes(bytes(data))
    elif damage == "truncate_optimizer":
        f = path / "optimizer.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "drop_meta":
        meta_file.unlink()
    elif damage == "garble_meta":
        meta_file.write_text("{not json")
    else:
        meta = json.loads(meta_file.read_text())
        if damage == "future_format":
            meta["format"] = 99
        else:
            del meta["rng"]
        meta_file.write_text(json.dumps(meta))
    target = _state(tiny, seed=3)
    target.version = 17
    before = _master(target)
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(path, target)
    _assert_same(_master(target), before)
    assert target.version == 17


def test_a_checkpoint_of_another_architecture_is_refused(tiny, tmp_path: Path):
    path = save_checkpoint(tmp_path, _state(tiny))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    state = TrainState(other, build_optimizer(other, tiny.trainer_config().optim))
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_checkpoint(path, state)


def test_a_checkpoint_before_the_first_step_leaves_adam_untouched(tiny, tmp_path: Path):
    cfg = tiny.trainer_config()
    batch = tiny.fixed_batches(tiny.tiny_model(), 1)[0]
    plain, saved = _state(tiny), _state(tiny)
    save_checkpoint(tmp_path, saved)
    assert not saved.optimizer.state
    resumed = _state(tiny, seed=2)
    train_step(resumed, batch, cfg)  # state that the checkpoint must wipe
    load_checkpoint(tmp_path / "v0000000000", resumed)
    assert not resumed.optimizer.state and resumed.version == 0
    for s in (plain, saved, resumed):
        train_step(s, batch, cfg)
    _assert_same(_master(saved), _master(plain))
    _assert_same(_master(resumed), _master(plain))
