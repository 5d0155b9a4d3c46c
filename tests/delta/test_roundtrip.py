"""Property tests: every delta and full snapshot round-trips bit-exactly, whatever the input.

Weights are drawn as raw words (so every bit pattern occurs: NaN payloads, +-Inf, -0.0,
subnormals), changed in every way a word can change (+-1 and +-2 steps, sign flips, specials,
random words) at fractions from none to all, in every supported dtype and in awkward shapes; pieces
are made tiny so versions split into many, and applied in random order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltamesh.delta import Applier, apply, encode_delta, encode_full, load_manifest, weights_hash
from deltamesh.delta.dtypes import NP_SWORDS, NP_UWORDS, TORCH_DTYPES
from deltamesh.delta.dtypes import WORD_DTYPES as WORD_TORCH
from deltamesh.delta.manifest import DTYPE_SIZES

DTYPES = sorted(TORCH_DTYPES)
SHAPES = [(), (0,), (1,), (2, 0, 3), (7,), (3, 5), (33,), (129, 3), (1000,), (4, 257)]
SPECIALS = {  # NaN payloads, infinities, zeros, smallest subnormals, of each float width
    1: [0x7F, 0xFF, 0x7C, 0xFC, 0x00, 0x80, 0x01, 0x81],
    2: [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x7C00, 0xFC00, 0x7E01, 0x0000, 0x8000, 0x0001, 0x8001],
    4: [0x7FC00001, 0xFFBFFFFF, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x80000001],
    8: [0x7FF8000000000001, 0xFFF0000000000000, 0x7FF0000000000000, 0x8000000000000000, 0x0000000000000001],
}
FRACTIONS = [0.0, 0.001, 0.01, 0.1, 0.5, 1.0]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_words(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    width = DTYPE_SIZES[dtype]
    if dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8)
    words = rng.integers(0, 256, n * width, dtype=np.uint8).view(NP_UWORDS[width])
    if dtype in ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2") and n:
        spots = rng.random(n) < 0.05
        words[spots] = rng.choice(np.array(SPECIALS[width], dtype=np.uint64), int(spots.sum())).astype(words.dtype)
    return words


def changed_words(rng: np.random.Generator, dtype: str, old: np.ndarray, fraction: float) -> np.ndarray:
    width = DTYPE_SIZES[dtype]
    new = old.copy()
    chosen = np.flatnonzero(rng.random(old.size) < fraction)
    if dtype == "BOOL":
        new[chosen] ^= 1
        return new
    kind = rng.integers(0, 6, chosen.size)
    t = new.dtype.type
    top = t(1 << (width * 8 - 1))
    steps = {0: t(1), 1: t(np.iinfo(t).max), 2: t(2), 3: t(np.iinfo(t).max - 1)}  # +1, -1, +2, -2
    for k, step in steps.items():
        sel = chosen[kind == k]
        new[sel] = new[sel] + step
    new[chosen[kind == 4]] ^= top  # sign flip
    rand = chosen[kind == 5]
    new[rand] = random_words(rng, dtype, rand.size)
    return new


def to_tensor(words: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    signed = words.view(NP_SWORDS[DTYPE_SIZES[dtype]])
    return torch.from_numpy(signed.copy()).view(TORCH_DTYPES[dtype]).reshape(shape)


def adam_like(rng: np.random.Generator, dtype: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Old and new words of a float tensor after an optimizer-like step: zeros and small-magnitude
    words change (to arbitrary small values, or by an ulp or two), large ones stay; the codec then
    locates changes among the base's small words (see smallwords.py)."""
    width = DTYPE_SIZES[dtype]
    t = TORCH_DTYPES[dtype]
    values = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02)
    values[torch.from_numpy(rng.random(n) < 0.05)] = 0.0
    old = values.to(t).view(-1)
    small = old.abs().float() < 0.004
    new = old.clone()
    new_words = new.view(WORD_TORCH[width])
    new_words[small] += torch.from_numpy(rng.choice([1, -1, 2], n)).to(new_words.dtype)[small]
    zeros = old == 0
    new[zeros] = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 1e-3).to(t)[zeros]
    unsigned = NP_UWORDS[width]
    return old.view(WORD_TORCH[width]).numpy().view(unsigned).copy(), new_words.numpy().view(unsigned).copy()


@st.composite
def version_pairs(draw):
    """(old, new) weights: a few tensors, some changed, plus added, removed and reshaped ones."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old, new = {}, {}
    for k in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.sampled_from(SHAPES))
        n = int(np.prod(shape, dtype=np.int64))
        words = random_words(rng, dtype, n)
        old[f"t{k}"] = to_tensor(words, dtype, shape)
        new[f"t{k}"] = to_tensor(changed_words(rng, dtype, words, draw(st.sampled_from(FRACTIONS))), dtype, shape)
    if draw(st.booleans()):
        dtype = draw(st.sampled_from(["BF16", "F16", "F32"]))
        o, n = adam_like(rng, dtype, 8192)
        old["adam"], new["adam"] = to_tensor(o, dtype, (64, 128)), to_tensor(n, dtype, (64, 128))
    if draw(st.booleans()):
        new["added"] = to_tensor(random_words(rng, "F32", 10), "F32", (2, 5))
    if draw(st.booleans()):
        old["removed"] = to_tensor(random_words(rng, "I16", 4), "I16", (4,))
    if draw(st.booleans()):
        old["reshaped"] = to_tensor(random_words(rng, "BF16", 6), "BF16", (6,))
        new["reshaped"] = to_tensor(random_words(rng, "BF16", 6), "BF16", (2, 3))
    return old, new


@SETTINGS
@given(pair=version_pairs(), piece_bytes=st.sampled_from([300, 1000, 4096, 1 << 22]), order_seed=st.integers(0, 1000))
def test_delta_round_trip_bit_exact(key, same_weights, pair, piece_bytes, order_seed):
    old, new = pair
    enc = encode_delta(old, new, model_id="m", version=2, base_version=1, key=key, piece_bytes=piece_bytes)
    manifest = load_manifest(enc.manifest_bytes, [key.public_key()])
    assert manifest.base_hash == weights_hash(old)
    assert manifest.weights_hash == weights_hash(new)
    applier = Applier(manifest, old)
    for i in np.random.default_rng(order_seed).permutation(len(enc.pieces)):
        applier.add_piece(int(i), enc.pieces[i])
    assert same_weights(applier.finish(), new)
    # One-shot apply (base checked in the same pass) agrees, and in place turns `old` itself into `new`.
    assert same_weights(apply(old, manifest, enc.pieces), new)
    work = {n: t.clone() for n, t in old.items()}
    result = apply(work, manifest, enc.pieces, in_place=True)
    assert same_weights(result, new)


@SETTINGS
@given(pair=version_pairs(), piece_bytes=st.sampled_from([256, 2048, 1 << 22]), order_seed=st.integers(0, 1000))
def test_full_snapshot_round_trip_bit_exact(key, same_weights, pair, piece_bytes, order_seed):
    _, weights = pair
    enc = encode_full(weights, model_id="m", version=5, key=key, piece_bytes=piece_bytes)
    manifest = load_manifest(enc.manifest_bytes, [key.public_key()])
    assert manifest.kind == "full" and manifest.weights_hash == weights_hash(weights)
    applier = Applier(manifest)
    for i in np.random.default_rng(order_seed).permutation(len(enc.pieces)):
        applier.add_piece(int(i), enc.pieces[i])
    assert same_weights(applier.finish(), weights)


def test_pieces_split_and_declare_their_tensors(key):
    rng = np.random.default_rng(1)
    old = {f"w{k}": to_tensor(random_words(rng, "BF16", 20000), "BF16", (200, 100)) for k in range(3)}
    new = {n: to_tensor(changed_words(rng, "BF16", t.view(torch.int16).numpy().reshape(-1).view(np.uint16), 0.05), "BF16", (200, 100)) for n, t in old.items()}
    enc = encode_delta(old, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=1000)
    assert len(enc.pieces) > 5
    assert all(len(p) < 3000 for p in enc.pieces)  # near the target, never wildly over it
    written = sorted({t for p in enc.manifest.pieces for t in p.tensors})
    assert written == [0, 1, 2]
    full = encode_full(new, model_id="m", version=1, key=key, piece_bytes=4096)
    assert len(full.pieces) >= 7 and all(len(p) <= 4096 + 256 for p in full.pieces)


def test_unchanged_version_has_no_pieces_and_encoding_is_deterministic(key, same_weights):
    rng = np.random.default_rng(2)
    w = {"a": to_tensor(random_words(rng, "F32", 100), "F32", (10, 10))}
    enc = encode_delta(w, w, model_id="m", version=1, base_version=0, key=key)
    assert enc.pieces == []
    assert same_weights(apply(w, enc.manifest, []), w)
    new = {"a": to_tensor(changed_words(rng, "F32", w["a"].numpy().view(np.uint32).reshape(-1), 0.2), "F32", (10, 10))}
    a = encode_delta(w, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=64)
    b = encode_delta(w, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=64)
    assert a.pieces == b.pieces and a.manifest.pieces == b.manifest.pieces


@pytest.mark.parametrize("steps", [1, 2])
def test_small_moves_are_cheap(key, steps):
    """1% of bf16 words moved by +-1 (or +-2) ulp: about a byte and a bit per change, positions included."""
    rng = np.random.default_rng(3)
    n = 1 << 20
    old_words = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16
    old_words = old_words.astype(np.uint16)
    new_words = old_words.copy()
    chosen = np.flatnonzero(rng.random(n) < 0.01)
    new_words[chosen] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), chosen.size) * np.uint16(steps)
    old = {"w": to_tensor(old_words, "BF16", (1024, 1024))}
    new = {"w": to_tensor(new_words, "BF16", (1024, 1024))}
    enc = encode_delta(old, new, model_id="m", version=1, base_version=0, key=key)
    per_change = sum(map(len, enc.pieces)) / chosen.size
    assert per_change < 1.25
    full = encode_full(new, model_id="m", version=1, key=key)
    assert sum(map(len, full.pieces)) < 2 * n / 1.3


def test_small_weight_changes_are_located_among_small_words(key, same_weights):
    """Changes crowded into small weights (and zeros) are located by rank among the base's small words."""
    rng = np.random.default_rng(4)
    o, n = adam_like(rng, "BF16", 1 << 18)
    old, new = {"w": to_tensor(o, "BF16", (512, 512))}, {"w": to_tensor(n, "BF16", (512, 512))}
    enc = encode_delta(old, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=8192)
    modes = {p[16 + 4] for p in enc.pieces}  # the first segment's mode byte
    assert modes == {1} and len(enc.pieces) > 3
    assert same_weights(apply(old, enc.manifest, enc.pieces), new)
    applier = Applier(enc.manifest, old)
    for k in np.random.default_rng(5).permutation(len(enc.pieces)):
        applier.add_piece(int(k), enc.pieces[k])
    assert same_weights(applier.finish(), new)
