"""The re-implemented baseline codecs of the codec benchmark apply bit-exactly, and the benchmark's
inputs are what they claim to be. The benchmark scripts are not a package, so they load by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


baselines = load_script("baselines")
inputs = load_script("inputs")

SMALL = dict(layers=2, hidden=64, intermediate=160, q_heads=4, kv_heads=2, head_dim=16, vocab=1000)


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def snapshot(weights):
    return {k: v.clone() for k, v in weights.items()}


@pytest.fixture(scope="module")
def case():
    return inputs.synthetic_case(inputs.qwen3_shapes(**SMALL), changed=0.02, seed=3)


@pytest.mark.parametrize("name", list(baselines.BASELINES))
def test_baseline_applies_bit_exactly_and_leaves_the_base_alone(case, name):
    codec = baselines.BASELINES[name]
    before = snapshot(case.old)
    blobs = codec.encode(case.old, case.new)
    assert same(codec.apply(case.old, blobs), case.new)
    assert same(case.old, before)


@pytest.mark.parametrize("name", list(baselines.BASELINES))
def test_baseline_carries_an_unchanged_version(case, name):
    codec = baselines.BASELINES[name]
    assert same(codec.apply(case.old, codec.encode(case.old, case.old)), case.old)


def test_sizes_follow_each_published_layout(case):
    changed = case.changed_words()
    sizes = {n: baselines.encoded_size(c.encode(case.old, case.new)) for n, c in baselines.BASELINES.items()}
    assert sizes["astraflow"] == 6 * changed  # uint32 index + bf16 value
    assert sizes["full"] > case.model_bytes
    assert sizes["pulse"] < sizes["astraflow"] and sizes["slime"] < sizes["astraflow"]


def test_astraflow_index_width_grows_with_the_model():
    small = {"w": torch.empty(2**32 - 1, dtype=torch.bfloat16, device="meta")}
    large = {"w": torch.empty(2**32, dtype=torch.bfloat16, device="meta")}
    assert baselines._index_type(small).__name__ == "uint32"
    assert baselines._index_type(large).__name__ == "uint64"


def test_pulse_uses_wide_gaps_when_changes_are_far_apart():
    old = {"w": torch.zeros(300_000, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][[5, 200_000, 299_999]] = 1.0  # gaps 5, 199995, 99999: need uint32
    blobs = baselines.pulse_encode(old, new)
    assert same(baselines.pulse_apply(old, blobs), new)


def test_pulse_rejects_a_payload_of_the_wrong_length(case):
    blobs = baselines.pulse_encode(case.old, case.new)
    import zstandard

    name = next(iter(case.old))
    raw = zstandard.ZstdDecompressor().decompress(blobs[0])
    blobs[0] = zstandard.ZstdCompressor().compress(raw[:-2])
    with pytest.raises(ValueError, match=name):
        baselines.pulse_apply(case.old, blobs)


def test_baselines_refuse_a_changed_shape(case):
    name = next(iter(case.old))
    new = dict(case.new)
    new[name] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        baselines.astraflow_encode(case.old, new)


def test_synthetic_case_moves_the_asked_fraction_by_one_or_two_ulps(case):
    fraction = case.changed_words() / case.numel
    assert 0.018 < fraction <= 0.02
    for k, o in case.old.items():
        diff = (case.new[k].view(torch.int16).int() - o.view(torch.int16).int()).abs()
        assert int(diff.max()) <= 2
    assert sum(1 for k in case.old if k.endswith("q_norm.weight")) == SMALL["layers"]


def test_qwen3_0_6b_shapes_are_over_one_gib_in_bf16():
    shapes = inputs.qwen3_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    assert numel == 596_049_920  # Qwen3-0.6B's parameter count, embeddings tied
    assert 2 * numel >= 2**30
