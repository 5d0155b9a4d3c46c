"""The encoder's dense passes in torch (device_scan.py) find what the numpy path finds, bit for bit.

Run here on CPU tensors (no GPU in CI): `scan_on_device` against `scan_changes` + `TensorChanges.of`
on every dtype the codec carries, with NaN payloads, +-0.0, infinities and sign flips, odd sizes and
tails shorter than 8 bytes, views that start off an 8-byte boundary, empty tensors, and chunks from
one 8-byte block up; and `encode_delta(..., device_passes=True)` against the numpy path on whole
versions, random ones and a real SmolLM2 Adam step: the same pieces and the same manifest.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltamesh.delta import encode_delta
from deltamesh.delta.bitdiff import scan_changes
from deltamesh.delta.device_scan import scan_on_device
from deltamesh.delta.dtypes import NP_SWORDS, NP_UWORDS, TORCH_DTYPES, np_words, word_view
from deltamesh.delta.manifest import DTYPE_SIZES, FLOAT_DTYPES
from deltamesh.delta.piece_writer import TensorChanges
from deltamesh.delta.smallwords import MagnitudeSample, sample_stride, small_words_before, small_words_before_torch
from deltamesh.delta.tensors import tensor_digest

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIZES = [0, 1, 2, 3, 5, 7, 8, 9, 15, 33, 257, 1001, 5000]
CHUNKS = [8, 24, 64, 1000, None]  # bytes of each version per step; None: the device's default
SPECIAL = {1: [0x7F, 0xFF, 0x80, 0x00, 0x01, 0x79], 2: [0x7FC1, 0xFF81, 0x7F80, 0x8000, 0x0000, 0x0001],
           4: [0x7FC00001, 0xFFBFFFFF, 0x80000000, 0x00000000, 0x7F800000],
           8: [0x7FF8000000000001, 0x8000000000000000, 0x0000000000000000]}


def _words(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Random unsigned words of `dtype`, a tenth of them special values (NaN payloads, +-0.0, +-Inf)."""
    width = DTYPE_SIZES[dtype]
    if dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8)
    words = rng.integers(0, 256, n * width, dtype=np.uint8).view(NP_UWORDS[width])
    if dtype in FLOAT_DTYPES:
        spots = np.flatnonzero(rng.random(n) < 0.1)
        words[spots] = rng.choice(np.array(SPECIAL[width], dtype=np.uint64), spots.size).astype(words.dtype)
    return words


def _moved(rng: np.random.Generator, dtype: str, old: np.ndarray, fraction: float) -> np.ndarray:
    """`old` with a `fraction` of its words moved by +-1 or +-2, sign-flipped (so -0.0 <-> +0.0) or replaced."""
    new = old.copy()
    chosen = np.flatnonzero(rng.random(old.size) < fraction)
    if dtype == "BOOL":
        new[chosen] ^= 1
        return new
    t = new.dtype.type
    how = rng.integers(0, 4, chosen.size)
    steps = rng.choice(np.array([1, 2, np.iinfo(t).max, np.iinfo(t).max - 1], dtype=new.dtype), chosen.size)
    new[chosen[how == 0]] += steps[how == 0]
    new[chosen[how == 1]] ^= t(1 << (old.itemsize * 8 - 1))
    new[chosen[how == 2]] = _words(rng, dtype, int((how == 2).sum()))
    new[chosen[how == 3]] += steps[how == 3]
    return new


def _small_crowded(rng: np.random.Generator, dtype: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A float tensor whose changes crowd into its small words and zeros, as an optimizer step's do
    (so the scan locates them by small-word rank)."""
    values = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02)
    values[torch.from_numpy(rng.random(n) < 0.05)] = 0.0
    old = values.to(TORCH_DTYPES[dtype])
    new = old.clone()
    words = word_view(new)
    small = (old.abs().float() < 0.004) & torch.from_numpy(rng.random(n) < 0.5)
    words[small] += 1
    unsigned = NP_UWORDS[DTYPE_SIZES[dtype]]
    return np_words(old).view(unsigned).copy(), words.numpy().view(unsigned).copy()


def _tensor(words: np.ndarray, dtype: str, offset: int = 0) -> torch.Tensor:
    """A tensor of `words`; with `offset`, a view starting `offset` words into a larger buffer."""
    signed = np.concatenate([np.zeros(offset, words.dtype), words]).view(NP_SWORDS[DTYPE_SIZES[dtype]])
    return torch.from_numpy(signed).view(TORCH_DTYPES[dtype])[offset:]


def _same_changes(a: TensorChanges | None, b: TensorChanges | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(_same_field(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))


def _same_field(x, y) -> bool:
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
    if dataclasses.is_dataclass(x) and x is not None:
        return dataclasses.is_dataclass(y) and all(_same_field(getattr(x, f.name), getattr(y, f.name))
                                                   for f in dataclasses.fields(x))
    return x == y


def _numpy_scan(base: torch.Tensor, new: torch.Tensor, dtype: str) -> tuple[TensorChanges | None, str, str]:
    """What encode.py's numpy path finds for one tensor: its changes and the digests of both versions."""
    b, n = np_words(base.contiguous()), np_words(new.contiguous())
    floating = dtype in FLOAT_DTYPES
    hash_old, hash_new = xxhash.xxh3_128(), xxhash.xxh3_128()
    sample = MagnitudeSample(b.itemsize, sample_stride(b.size)) if floating else None
    positions, old_words, new_words = scan_changes(b, n, hash_old, hash_new, sample.add if sample else None)
    changes = TensorChanges.of(3, b, positions, old_words, new_words, floating, sample) if positions.size else None
    return changes, hash_new.hexdigest(), hash_old.hexdigest()


@SETTINGS
@given(dtype=st.sampled_from(sorted(TORCH_DTYPES)), n=st.sampled_from(SIZES), seed=st.integers(0, 2**32 - 1),
       fraction=st.sampled_from([0.0, 0.01, 0.2, 1.0]), chunk=st.sampled_from(CHUNKS), offset=st.sampled_from([0, 1, 3]))
def test_device_scan_finds_what_the_numpy_scan_finds(dtype, n, seed, fraction, chunk, offset):
    rng = np.random.default_rng(seed)
    old = _words(rng, dtype, n)
    base, new = _tensor(old, dtype, offset), _tensor(_moved(rng, dtype, old, fraction), dtype)
    scan = scan_on_device(3, base, new, hash_base=True, chunk_bytes=chunk)
    changes, digest, base_digest = _numpy_scan(base, new, dtype)
    assert _same_changes(scan.changes, changes)
    assert (scan.digest, scan.base_digest) == (digest, base_digest) == (tensor_digest(new), tensor_digest(base))
    assert scan_on_device(3, base, new, hash_base=False, chunk_bytes=chunk).base_digest is None


@SETTINGS
@given(dtype=st.sampled_from(["BF16", "F16", "F32", "F8_E4M3"]), seed=st.integers(0, 2**32 - 1),
       chunk=st.sampled_from([8, 1000, 4096, None]), offset=st.sampled_from([0, 1]))
def test_changes_crowded_into_small_words_are_counted_alike(dtype, seed, chunk, offset):
    rng = np.random.default_rng(seed)
    old, moved = _small_crowded(rng, dtype, 9000)
    base, new = _tensor(old, dtype, offset), _tensor(moved, dtype)
    scan = scan_on_device(3, base, new, hash_base=False, chunk_bytes=chunk)
    changes, _, _ = _numpy_scan(base, new, dtype)
    assert changes is not None and changes.small is not None  # the path under test was taken
    assert _same_changes(scan.changes, changes)


def test_rows_held_from_an_offset_and_without_small_words():
    """A process holding rows from element `offset` on names its changes from the tensor's start (ranks
    among small words stay counted in the words held), and may be told not to locate by rank at all."""
    old, moved = _small_crowded(np.random.default_rng(11), "BF16", 9000)
    base, new = _tensor(old, "BF16"), _tensor(moved, "BF16")
    whole = scan_on_device(3, base, new, hash_base=False).changes
    shifted = scan_on_device(3, base, new, hash_new=False, hash_base=False, offset=1000).changes
    assert whole.small is not None and np.array_equal(shifted.positions, whole.positions + 1000)
    assert np.array_equal(shifted.plain.locations, whole.plain.locations + 1000)
    assert _same_field(shifted.small, whole.small)
    plain = scan_on_device(3, base, new, hash_new=False, hash_base=False, small_words=False)
    assert plain.digest is None and plain.base_digest is None
    positions, old_words, new_words = scan_changes(old, moved)
    assert _same_changes(plain.changes, TensorChanges.coded(3, positions, old_words, new_words, True, None, None))


@pytest.mark.parametrize("chunk_words", [1, 63, 64, 65, 4096, 1 << 20])
def test_small_words_before_in_torch_counts_as_numpy_does(chunk_words):
    rng = np.random.default_rng(7)
    old, _ = _small_crowded(rng, "BF16", 20000)
    positions = np.unique(np.concatenate([[0, 63, 64, 65, 19999], rng.integers(0, 20000, 500)]))
    words = torch.from_numpy(old.view(np.int16))
    for small_max in (0, 0x3B00, 0x7FFF):
        got = small_words_before_torch(words, torch.from_numpy(positions), small_max, chunk_words)
        assert np.array_equal(got.numpy(), small_words_before(old, positions, small_max))
    sample_np, sample_torch = MagnitudeSample(2, 61), MagnitudeSample(2, 61)
    sample_np.add_words(old[::61])
    sample_torch.add_torch(words)
    assert np.array_equal(sample_np.counts, sample_torch.counts) and sample_np.size == sample_torch.size


@st.composite
def versions(draw):
    """(old, new) weights of a few tensors of any dtype and size, plus added, removed, reshaped and
    re-typed ones (those travel whole whatever the scan)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old, new = {}, {}
    for k in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(sorted(TORCH_DTYPES)))
        shape = draw(st.sampled_from([(), (0,), (3, 0), (1,), (7,), (3, 5), (33,), (129, 3), (64, 80)]))
        words = _words(rng, dtype, int(np.prod(shape, dtype=np.int64)))
        moved = _moved(rng, dtype, words, draw(st.sampled_from([0.0, 0.01, 0.3, 1.0])))
        old[f"t{k}"], new[f"t{k}"] = _tensor(words, dtype).reshape(shape), _tensor(moved, dtype).reshape(shape)
    if draw(st.booleans()):
        o, n = _small_crowded(rng, "BF16", 8192)
        old["crowded"], new["crowded"] = _tensor(o, "BF16").reshape(64, 128), _tensor(n, "BF16").reshape(64, 128)
    if draw(st.booleans()):
        new["added"] = _tensor(_words(rng, "F32", 6), "F32")
        old["removed"] = _tensor(_words(rng, "I16", 4), "I16")
        old["retyped"], new["retyped"] = _tensor(_words(rng, "F16", 6), "F16"), _tensor(_words(rng, "BF16", 6), "BF16")
    return old, new


@SETTINGS
@given(pair=versions(), piece_bytes=st.sampled_from([300, 4096, 1 << 22]), known_base=st.booleans())
def test_device_passes_encode_the_same_bytes(key, pair, piece_bytes, known_base):
    old, new = pair
    base_hash = None
    if known_base:
        base_hash = encode_delta(old, old, model_id="m", version=1, base_version=0, key=None).manifest.weights_hash
    made = [encode_delta(old, new, model_id="m", version=2, base_version=1, key=None, piece_bytes=piece_bytes,
                         base_hash=base_hash, device_passes=device) for device in (False, True)]
    _assert_same_encoding(*made, key)


def _assert_same_encoding(a, b, key) -> None:
    assert a.pieces == b.pieces
    manifests = [dataclasses.replace(e.manifest, created_ms=0) for e in (a, b)]
    assert manifests[0] == manifests[1]
    assert manifests[0].signed(key) == manifests[1].signed(key)  # Ed25519 signs deterministically


@pytest.mark.slow  # SmolLM2's versions come from the model cache (built once, ~1 min)
def test_device_passes_encode_a_real_smollm2_step_byte_for_byte(key):
    from deltamesh.mesh.demo.models import smollm2_adam_versions, smollm2_state_dict, to_bf16

    old = to_bf16(smollm2_state_dict())
    new = smollm2_adam_versions([5e-6])[5e-6]
    made = [encode_delta(old, new, model_id="smollm2", version=1, base_version=0, key=None, piece_bytes=1 << 18,
                         device_passes=device) for device in (False, True)]
    assert len(made[0].pieces) > 4
    _assert_same_encoding(*made, key)
    # The real step's changes crowd into small words: the torch count of them was taken and agreed.
    name = "model.layers.0.mlp.down_proj.weight"
    assert scan_on_device(0, old[name], new[name], hash_base=False).changes.small is not None


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("with_cuts", [False, True])
def test_device_passes_encode_a_ranks_rows_the_same(world, with_cuts):
    """A trainer rank's part (rows from an offset, cut for pool ranks' shares, tiles hashed) is the same
    whichever path scanned it."""
    from deltamesh.delta.encode import table_of
    from deltamesh.delta.layouts import PoolLayout, cuts_for
    from deltamesh.delta.parts import encode_part
    from deltamesh.trainer.distributed import shard_rows

    rng = np.random.default_rng(13)
    old, new = {}, {}
    for name, shape in (("model.embed_tokens.weight", (200, 64)), ("model.layers.0.self_attn.q_proj.weight", (64, 64)),
                        ("model.layers.0.self_attn.k_proj.weight", (16, 64)), ("model.norm.weight", (64,)),
                        ("model.layers.0.mlp.down_proj.weight", (64, 128))):
        o, n = _small_crowded(rng, "BF16", int(np.prod(shape)))
        old[name], new[name] = _tensor(o, "BF16").reshape(shape), _tensor(n, "BF16").reshape(shape)
    table = table_of(new)
    cuts = cuts_for(table, [PoolLayout(tp=2, kv_heads=2)]) if with_cuts else None
    for rank in range(world):
        rows = {s.name: shard_rows(s.rows, world, rank) for s in table if s.shape}
        held = {n: t[slice(*rows[n])] for n, t in new.items()}
        base = {n: t[slice(*rows[n])] for n, t in old.items()}
        parts = [encode_part(table, held, base=base, rows=rows, cuts=cuts, piece_bytes=2048, hash_base=True,
                             device_passes=device) for device in (False, True)]
        assert parts[0].describe() == parts[1].describe()
        assert [p.data for p in parts[0].pieces] == [p.data for p in parts[1].pieces]
