"""The small-word index: a holder of weights that applies delta after delta in place reads the base's
small words off the index it moved along with the last version, instead of passing over the tensors'
words, and gets the same bits; an index that does not describe the weights costs a pass, never a
wrong result."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch

from deltamesh.delta import (
    BaseMismatchError,
    CorruptError,
    SmallWordIndex,
    apply_version,
    decode_version,
    encode_delta,
    weights_hash,
    word_view,
)

small_index_module = importlib.import_module("deltamesh.delta.small_index")
smallwords = importlib.import_module("deltamesh.delta.smallwords")


def _chain(rl_step, steps: int) -> list[dict[str, torch.Tensor]]:
    """Versions whose changes crowd into small words and zeros (located by rank), some words
    leaving and joining the small ones along the way."""
    g = torch.Generator().manual_seed(5)
    w = {"proj": (torch.randn(96, 128, generator=g) * 0.02).to(torch.bfloat16),
         "embed": (torch.randn(64, 96, generator=g) * 0.02).to(torch.bfloat16),
         "norm": torch.ones(128, dtype=torch.bfloat16)}
    w["proj"].view(-1)[::17] = 0.0
    versions = [w]
    for step in range(steps):
        old = versions[-1]
        new = rl_step(old, seed=20 + step, share=0.03)
        new["norm"] = old["norm"].clone()
        for name in ("proj", "embed"):
            words = word_view(new[name])
            words[(old[name].abs() < 0.003).view(-1)] += 1 + step % 2
            words[step::211] ^= 0x3F00  # a few words jump far: some leave the small ones, some join
        versions.append(new)
    return versions


def _bits(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in weights.items()}


def _count_passes(monkeypatch) -> list[str]:
    """Record every pass over a tensor's words made to find its small words (index built or not)."""
    passes: list[str] = []
    scan, positions = small_index_module._all_small, smallwords.small_positions
    monkeypatch.setattr(small_index_module, "_all_small", lambda *a: passes.append("index") or scan(*a))
    monkeypatch.setattr(smallwords, "small_positions", lambda *a: passes.append("scan") or positions(*a))
    return passes


def test_a_chain_of_deltas_reads_small_words_off_the_index(key, rl_step, monkeypatch):
    versions = _chain(rl_step, 4)
    live = {n: t.clone() for n, t in versions[0].items()}
    index = SmallWordIndex()
    passes = _count_passes(monkeypatch)
    for v in range(1, len(versions)):
        enc = encode_delta(versions[v - 1], versions[v], model_id="m", version=v, base_version=v - 1, key=key,
                           piece_bytes=2048)
        decoded = decode_version(enc.manifest, enc.pieces)
        assert any(u.small_ranks is not None for us in decoded.updates.values() for u in us)
        passes.clear()
        apply_version(decoded, live, base_hash=enc.manifest.base_hash, in_place=True, small_index=index)
        assert _bits(live) == _bits(versions[v])
        assert index.weights_hash == enc.manifest.weights_hash
        if v == 1:
            assert passes and set(passes) == {"index"}  # the first apply builds the index in its pass
        else:
            # Moved along with every version: no pass over the words, and no second try without it.
            assert passes == []
    # Its entries are exactly the small words of the weights now held.
    for name in ("proj", "embed"):
        entry = index.entry(name)
        if entry is not None:
            words = live[name].view(-1).view(torch.int16).numpy().view(np.uint16)
            bound, positions = entry
            assert np.array_equal(positions, np.flatnonzero(smallwords.is_small(words, bound)))


def test_an_index_that_does_not_describe_the_weights_costs_a_pass_not_a_wrong_result(key, rl_step, monkeypatch):
    """Positions read off a wrong index (as a bug or a memory fault would leave it) fail the result
    hashes; the apply restores the weights, clears the index and locates from the words themselves."""
    versions = _chain(rl_step, 2)
    live = {n: t.clone() for n, t in versions[0].items()}
    index = SmallWordIndex()
    encs = [encode_delta(versions[v - 1], versions[v], model_id="m", version=v, base_version=v - 1, key=key)
            for v in (1, 2)]
    apply_version(decode_version(encs[0].manifest, encs[0].pieces), live, in_place=True, small_index=index,
                  base_hash=encs[0].manifest.base_hash)
    entry = index._entries["proj"]
    index._entries["proj"] = dataclasses.replace(entry, positions=entry.positions[1:])  # one small word lost
    passes = _count_passes(monkeypatch)
    apply_version(decode_version(encs[1].manifest, encs[1].pieces), live, in_place=True, small_index=index,
                  base_hash=encs[1].manifest.base_hash)
    assert _bits(live) == _bits(versions[2])
    assert "scan" in passes and len(index) == 0  # the second try passed over the words; the index is gone


def test_a_wrong_base_is_refused_and_a_wrong_result_drops_the_index(key, rl_step):
    versions = _chain(rl_step, 2)
    enc = encode_delta(versions[1], versions[2], model_id="m", version=2, base_version=1, key=key)
    index = SmallWordIndex()
    live = {n: t.clone() for n, t in versions[1].items()}
    apply_version(decode_version(enc.manifest, enc.pieces), {n: t.clone() for n, t in live.items()},
                  base_hash=enc.manifest.base_hash, in_place=True, small_index=index)
    assert len(index) and index.weights_hash == enc.manifest.weights_hash
    # Weights that are not the delta's base: refused before anything is read off or moved in the index.
    drifted = {n: t.clone() for n, t in versions[0].items()}
    before = _bits(drifted)
    with pytest.raises(BaseMismatchError):
        apply_version(decode_version(enc.manifest, enc.pieces), drifted, base_hash=weights_hash(drifted),
                      in_place=True, small_index=index)
    assert _bits(drifted) == before and index.weights_hash == enc.manifest.weights_hash
    # Weights that are not the base, claimed to be: the result hashes fail with and without the index.
    live = {n: t.clone() for n, t in versions[1].items()}
    apply_version(decode_version(enc.manifest, enc.pieces), {n: t.clone() for n, t in live.items()},
                  base_hash=enc.manifest.base_hash, in_place=True, small_index=index)
    word_view(live["proj"])[3] ^= 0x4000
    before = _bits(live)
    with pytest.raises(CorruptError, match="does not match the manifest's hash"):
        apply_version(decode_version(enc.manifest, enc.pieces), live, base_hash=enc.manifest.base_hash,
                      in_place=True, small_index=index)
    assert _bits(live) == before and len(index) == 0
