"""The data interface: trajectory submissions (binary and JSON) and training batches round-trip, any
safetensors reader can load them, and every malformed or wrongly typed input is refused with a reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load, save

from deltamesh.data import (
    DataFormatError,
    decode_batch,
    decode_trajectories,
    encode_batch,
    encode_trajectories,
)
from deltamesh.mesh.broker.json_form import trajectories_from_json

LIMITS = {"max_trajectories": 64, "max_tokens": 4096}


def as_json(trajectories) -> dict:
    return {"trajectories": [{**t.header(), "tokens": t.tokens.tolist(), "logprobs": t.logprobs.tolist(),
                              "loss_mask": t.loss_mask.tolist(), "versions": t.versions.tolist()} for t in trajectories]}


def test_binary_and_json_submissions_round_trip(make_group, make_trajectory):
    trajs = make_group("g", [0.0, 1.0, 0.5]) + [make_trajectory("x", "h", tokens=30, version=7, group_size=1)]
    for back in (decode_trajectories(encode_trajectories(trajs), **LIMITS),
                 trajectories_from_json(json.loads(json.dumps(as_json(trajs))), **LIMITS)):
        assert [b.header() for b in back] == [t.header() for t in trajs]
        for b, t in zip(back, trajs):
            for name in ("tokens", "logprobs", "loss_mask", "versions"):
                assert np.array_equal(getattr(b, name), getattr(t, name))
        assert (back[-1].min_version, back[-1].max_version) == (7, 7)


def test_submission_is_plain_safetensors(make_group):
    data = encode_trajectories(make_group("g", [1.0, 0.0]))
    arrays = load(data)
    assert arrays["offsets"].tolist() == [0, 12, 24]
    assert arrays["tokens"].dtype == np.int32 and arrays["loss_mask"].dtype == np.uint8


def _binary_with(make_group, **replace):
    trajs = make_group("g", [1.0, 0.0])
    arrays = load(encode_trajectories(trajs))
    headers = [t.header() for t in trajs]
    meta = {"format": "deltamesh.trajectories/1", "trajectories": json.dumps(headers)}
    for key, value in replace.items():
        if key == "headers":
            meta["trajectories"] = json.dumps(value(headers))
        elif key == "meta":
            meta = value(meta)
        else:
            arrays[key] = value(arrays[key])
    return save(arrays, metadata=meta)


@pytest.mark.parametrize("change, reason", [
    ({"tokens": lambda a: a.astype(np.int64)}, "tokens' must be int32"),
    ({"offsets": lambda a: a[:-1]}, "offsets must run"),
    ({"offsets": lambda a: np.array([0, 13, 24])}, None),  # still consistent: lengths 13 and 11 are fine
    ({"offsets": lambda a: np.array([0, 30, 24])}, "offsets must run"),
    ({"loss_mask": lambda a: np.where(a == 1, 2, a).astype(np.uint8)}, "loss_mask must hold only 0 and 1"),
    ({"loss_mask": lambda a: np.zeros_like(a)}, "no generated token"),
    ({"logprobs": lambda a: np.where(a < 0, np.nan, a).astype(np.float32)}, "logprobs must be finite"),
    ({"versions": lambda a: np.full_like(a, -1)}, "policy version >= 0"),
    ({"tokens": lambda a: -a}, "token ids must be >= 0"),
    ({"headers": lambda h: [{**h[0], "reward": "1"}, h[1]]}, "reward must be a finite number"),
    ({"headers": lambda h: [{**h[0], "group_size": 2.0}, h[1]]}, "group_size must be an integer"),
    ({"headers": lambda h: [{**h[0], "id": ""}, h[1]]}, "id must be a non-empty string"),
    ({"headers": lambda h: [{**h[0], "model_id": 5}, h[1]]}, "model_id must be"),
    ({"headers": lambda h: [{**h[0], "timings": {"x": "slow"}}, h[1]]}, "timings must be"),
    ({"headers": lambda h: [{**h[0], "colour": "red"}, h[1]]}, "unknown fields"),
    ({"headers": lambda h: [h[0], h[0]]}, "same trajectory id twice"),
    ({"headers": lambda h: h[:1]}, "offsets must run"),
    ({"meta": lambda m: {**m, "format": "other/1"}}, "format must be"),
    ({"meta": lambda m: {**m, "trajectories": "[{"}}, "is not JSON"),
])
def test_malformed_binary_submissions_are_refused(make_group, change, reason):
    data = _binary_with(make_group, **change)
    if reason is None:
        assert len(decode_trajectories(data, **LIMITS)) == 2
        return
    with pytest.raises(DataFormatError, match=reason):
        decode_trajectories(data, **LIMITS)


@pytest.mark.parametrize("data, reason", [
    (b"", "too short"),
    (b"\xff" * 16, "header is longer"),
    ((4).to_bytes(8, "little") + b"[1] ", "must be a JSON object"),
    ((2).to_bytes(8, "little") + b"{]", "header is not JSON"),
])
def test_garbage_is_refused(data, reason):
    with pytest.raises(DataFormatError, match=reason):
        decode_trajectories(data, **LIMITS)


def test_limits_are_enforced(make_group, make_trajectory):
    with pytest.raises(DataFormatError, match="allowed 1..4096"):
        decode_trajectories(encode_trajectories([make_trajectory("big", "g", tokens=5000)]), **LIMITS)
    with pytest.raises(DataFormatError, match="1..2 headers"):
        decode_trajectories(encode_trajectories(make_group("g", [1.0, 0.0, 1.0])), max_trajectories=2, max_tokens=99)


@pytest.mark.parametrize("mutate, reason", [
    (lambda b: b.pop("trajectories"), "body must be"),
    (lambda b: b["trajectories"][0].update(tokens="abc"), "tokens must be a list"),
    (lambda b: b["trajectories"][0].update(tokens=[1.5] * 12), "tokens must be a flat list of integers"),
    (lambda b: b["trajectories"][0].update(tokens=[2**40] * 12), "outside int32"),
    (lambda b: b["trajectories"][0].update(logprobs=[[0.0]] * 12), "flat list"),
    (lambda b: b["trajectories"][0].update(versions=[0] * 3), "differ in length"),
    (lambda b: b["trajectories"][0].update(reward=None), "reward must be"),
    (lambda b: b["trajectories"].append(7), "must be an object"),
])
def test_malformed_json_submissions_are_refused(make_group, mutate, reason):
    body = as_json(make_group("g", [1.0, 0.0]))
    mutate(body)
    with pytest.raises(DataFormatError, match=reason):
        trajectories_from_json(body, **LIMITS)


def test_batch_round_trip_pads_and_keeps_groups(make_group, make_trajectory):
    trajs = make_group("a", [1.0, 0.0]) + [make_trajectory("b-0", "b", group_size=1, tokens=20, version=3)]
    data = encode_batch(trajs, [True, True, False], model_id="m", batch_id="b1", version=4)
    batch = decode_batch(data)
    assert (batch.model_id, batch.batch_id, batch.version, len(batch)) == ("m", "b1", 4, 3)
    assert batch.tokens.shape == (3, 20) and batch.lengths.tolist() == [12, 12, 20]
    assert batch.groups == ["a", "b"] and batch.group_index.tolist() == [0, 0, 1]
    assert batch.replay.tolist() == [1, 1, 0] and batch.rewards.tolist() == [1.0, 0.0, 1.0]
    assert np.array_equal(batch.tokens[0, :12], trajs[0].tokens) and (batch.tokens[0, 12:] == 0).all()
    assert (batch.versions[0, 12:] == -1).all() and batch.samples[2]["min_version"] == 3
    assert batch.samples[0]["timings"] == {"generate_s": 0.5} and batch.samples[0]["replay"] is True
    tensors = batch.tensors()
    assert tensors["tokens"].shape == (3, 20) and str(tensors["loss_mask"].dtype) == "torch.uint8"
    assert set(load(data)) == set(tensors)  # readable by the safetensors library as it is


def test_batch_decode_refuses_other_bytes(make_group):
    with pytest.raises(DataFormatError, match="format must be"):
        decode_batch(encode_trajectories(make_group("g", [1.0])))
