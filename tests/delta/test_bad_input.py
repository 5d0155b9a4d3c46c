"""Bad input: truncated or corrupted pieces and manifests, wrong keys, wrong bases, misuse.

Every case must raise a `CodecError` subclass with a message, never crash, hang, write out of
bounds or yield wrong weights. A flipped piece byte is caught by the piece hash; the decoder itself
is also fed corrupted and truncated pieces behind a manifest re-signed to match them (what a
compromised signer could send), where only its own validation and the result hashes stand guard.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from deltamesh.delta import (
    Applier,
    BaseMismatchError,
    CodecError,
    CorruptError,
    SignatureError,
    SmallWordIndex,
    apply,
    decode_piece,
    encode_delta,
    encode_full,
    generate_key,
    load_manifest,
    piece_digest,
)
from deltamesh.delta.manifest import PieceEntry


def _versions():
    g = torch.Generator().manual_seed(0)
    old = {
        "w": (torch.randn(40, 25, generator=g) * 0.02).to(torch.bfloat16),
        "f": torch.randn(30, generator=g),
        "i": torch.arange(12, dtype=torch.int64),
        "s": (torch.randn(64, 80, generator=g) * 0.02).to(torch.bfloat16),  # changes among small words
    }
    old["s"].view(-1)[::23] = 0.0
    new = {k: v.clone() for k, v in old.items()}
    new["s"].view(-1)[::23] = 1e-4
    new["s"].view(-1).view(torch.int16)[(old["s"].abs() < 0.001).view(-1)] += 1
    new["w"].view(-1).view(torch.int16)[::37] += 1
    new["w"].view(-1).view(torch.int16)[5::53] -= 2
    new["f"][::7] = float("nan")
    new["i"][3] = -(2**62)
    new["extra"] = torch.ones(3, dtype=torch.float16)
    return old, new


@pytest.fixture(scope="module")
def encoded(key):
    old, new = _versions()
    delta = encode_delta(old, new, model_id="m", version=2, base_version=1, key=key, piece_bytes=400)
    full = encode_full(new, model_id="m", version=2, key=key, piece_bytes=4096)
    assert 3 <= len(delta.pieces) <= 8 and 3 <= len(full.pieces) <= 8
    assert any(p[20] == 1 for p in delta.pieces)  # a segment located among small words
    return old, new, delta, full


def _resigned(manifest, key, index, data):
    """The manifest re-signed so that piece `index` is exactly `data` (bypasses the piece hash)."""
    pieces = list(manifest.pieces)
    pieces[index] = PieceEntry(len(data), piece_digest(data), pieces[index].tensors)
    return load_manifest(dataclasses.replace(manifest, pieces=tuple(pieces)).signed(key), [key.public_key()])


def _corrupt_variants(piece: bytes, rng: np.random.Generator, cuts: int, flips: int) -> list[bytes]:
    """About `cuts` truncations of `piece`, then `flips` copies with one bit flipped at distinct bytes."""
    variants = [piece[:cut] for cut in range(0, len(piece), max(1, len(piece) // cuts))]
    for at in rng.choice(len(piece), min(len(piece), flips), replace=False):
        bad = bytearray(piece)
        bad[at] ^= 1 << int(rng.integers(8))
        variants.append(bytes(bad))
    return variants


def _apply_all(manifest, base, pieces, index, data):
    applier = Applier(manifest, base)
    for i, p in enumerate(pieces):
        applier.add_piece(i, data if i == index else p)
    return applier.finish()


@pytest.mark.parametrize("which", ["delta", "full"])
def test_every_truncation_of_every_piece_is_refused(encoded, which):
    old, _, delta, full = encoded
    enc = delta if which == "delta" else full
    base = old if which == "delta" else None
    for i, piece in enumerate(enc.pieces):
        for cut in range(len(piece)):
            with pytest.raises(CorruptError, match=f"piece {i}"):
                Applier(enc.manifest, base).add_piece(i, piece[:cut])


@pytest.mark.parametrize("which", ["delta", "full"])
def test_flipped_piece_bytes_are_refused(encoded, which):
    old, _, delta, full = encoded
    enc = delta if which == "delta" else full
    rng = np.random.default_rng(0)
    for i, piece in enumerate(enc.pieces):
        for at in rng.choice(len(piece), min(len(piece), 40), replace=False):
            bad = bytearray(piece)
            bad[at] ^= 1 << int(rng.integers(8))
            with pytest.raises(CorruptError, match="hash mismatch"):
                decode_piece(enc.manifest, i, bytes(bad))


@pytest.mark.parametrize("which", ["delta", "full"])
def test_decoder_survives_corrupt_pieces_behind_a_matching_hash(key, same_weights, encoded, which):
    """Truncations and flips of each piece, with the manifest re-signed to match: the decoder must
    raise CorruptError (or decode something in bounds that the result hashes then refuse)."""
    old, new, delta, full = encoded
    enc = delta if which == "delta" else full
    base = old if which == "delta" else None
    rng = np.random.default_rng(1)
    outcomes = {"decoder": 0, "result hash": 0, "harmless": 0}
    for i, piece in enumerate(enc.pieces):
        for data in _corrupt_variants(piece, rng, cuts=25, flips=60):
            manifest = _resigned(enc.manifest, key, i, data)
            try:
                updates = decode_piece(manifest, i, data)
            except CorruptError:
                outcomes["decoder"] += 1
                continue
            for u in updates:  # whatever decoded stays inside its tensor
                assert 0 <= u.start and u.start + u.count <= u.numel
                if u.positions is not None:
                    assert u.positions.size == 0 or (u.positions.min() >= u.start and u.positions.max() < u.start + u.count)
            try:
                result = _apply_all(manifest, base, enc.pieces, i, data)
            except CodecError:
                outcomes["result hash"] += 1
                continue
            assert same_weights(result, new)
            outcomes["harmless"] += 1
    # "harmless": bits zstd itself ignores; everything the codec's own layout holds is checked.
    assert outcomes["decoder"] > 0 and outcomes["harmless"] <= 0.02 * sum(outcomes.values())


def test_corrupt_pieces_applied_in_place_off_a_small_word_index_restore_the_weights(key, same_weights, encoded):
    """The same corrupt pieces behind re-signed manifests, applied in place by a receiver whose
    small-word index describes its weights (changes located by rank are read off the index, through
    the compiled loops): each either raises with the weights restored bit for bit, or gives `new`."""
    old, new, delta, _ = encoded
    back = encode_delta(new, old, model_id="m", version=3, base_version=2, key=key)
    rng = np.random.default_rng(2)
    raised = 0
    for i, piece in enumerate(delta.pieces):
        for data in _corrupt_variants(piece, rng, cuts=10, flips=25):
            index = SmallWordIndex()
            live = apply({k: v.clone() for k, v in new.items()}, back.manifest, back.pieces, in_place=True,
                         small_index=index)
            assert index.weights_hash == delta.manifest.base_hash and len(index)
            manifest = _resigned(delta.manifest, key, i, data)
            pieces = [data if k == i else p for k, p in enumerate(delta.pieces)]
            try:
                result = apply(live, manifest, pieces, in_place=True, small_index=index)
            except CodecError:
                raised += 1
                assert same_weights(live, old)
                continue
            assert same_weights(result, new)
    assert raised > 0


def test_manifest_truncations_and_flips_are_refused(encoded, key):
    _, _, delta, _ = encoded
    data = delta.manifest_bytes
    trusted = [key.public_key()]
    for cut in range(0, len(data), 7):
        with pytest.raises(CodecError):
            load_manifest(data[:cut], trusted)
    rng = np.random.default_rng(2)
    for at in rng.choice(len(data), 200, replace=False):
        bad = bytearray(data)
        bad[at] ^= 1 << int(rng.integers(7))  # keep it ASCII, so most flips still parse as JSON
        try:
            load_manifest(bytes(bad), trusted)
        except CodecError as e:
            assert str(e)
        else:  # only a flip that JSON reads back identically (e.g. escaped to the same text) passes
            assert load_manifest(bytes(bad), trusted) == delta.manifest


def test_tampered_manifest_and_wrong_key_are_signature_errors(encoded, key):
    _, _, delta, _ = encoded
    env = json.loads(delta.manifest_bytes)
    env["body"] = env["body"].replace('"version":2', '"version":3')
    with pytest.raises(SignatureError, match="bad signature"):
        load_manifest(json.dumps(env).encode(), [key.public_key()])
    with pytest.raises(SignatureError, match="not trusted"):
        load_manifest(delta.manifest_bytes, [generate_key().public_key()])


def test_wrong_base_is_refused_and_left_alone(encoded, same_weights):
    old, new, delta, _ = encoded
    with pytest.raises(BaseMismatchError, match="applies to v1"):
        Applier(delta.manifest, new)
    with pytest.raises(BaseMismatchError, match="needs its base"):
        Applier(delta.manifest, None)
    work = {k: v.clone() for k, v in new.items()}
    with pytest.raises(BaseMismatchError):
        apply(work, delta.manifest, delta.pieces, in_place=True)
    assert same_weights(work, new)
    with pytest.raises(BaseMismatchError):
        apply(old, delta.manifest, delta.pieces, base_hash="0" * 32)


def test_missing_duplicate_and_out_of_range_pieces(encoded):
    old, _, delta, _ = encoded
    applier = Applier(delta.manifest, old)
    applier.add_piece(0, delta.pieces[0])
    with pytest.raises(CodecError, match="already added"):
        applier.add_piece(0, delta.pieces[0])
    with pytest.raises(CorruptError, match="out of range"):
        applier.add_piece(len(delta.pieces), delta.pieces[0])
    with pytest.raises(CodecError, match="missing"):
        applier.finish()
    with pytest.raises(CodecError, match="already finished"):
        applier.add_piece(1, delta.pieces[1])
    with pytest.raises(CodecError, match="pieces given"):
        apply(old, delta.manifest, delta.pieces[:-1])


def test_in_place_apply_that_fails_its_result_check_restores_the_base(key, encoded, same_weights):
    old, _, delta, _ = encoded
    entries = list(delta.manifest.tensors)
    entries[0] = dataclasses.replace(entries[0], hash="0" * 32)  # a result no apply can produce
    manifest = dataclasses.replace(delta.manifest, tensors=tuple(entries))
    work = {k: v.clone() for k, v in old.items()}
    with pytest.raises(CorruptError, match="does not match the manifest"):
        apply(work, manifest, delta.pieces, in_place=True)
    assert same_weights(work, old)
    applier = Applier(delta.manifest, work, in_place=True)
    for i, p in enumerate(delta.pieces):
        applier.add_piece(i, p)
    applier.abort()
    assert same_weights(work, old)


def test_delta_for_a_tensor_the_base_lacks(encoded):
    old, _, delta, _ = encoded
    short = {k: v for k, v in old.items() if k != "w"}
    with pytest.raises(BaseMismatchError):
        apply(short, delta.manifest, delta.pieces)
