"""Hot swap: decoded updates written in place into live tensors, CPU and (if present) CUDA.

An update must write only the changed words: words it does not cover keep whatever they held, even
garbage, which is how the tests tell "wrote the changes" from "rewrote the tensor". The one applier
with rollback (`swap_in_place` / `apply_version` in place) must move numpy-backed tensors and live
torch tensors (numpy views or torch ops, as on a GPU) alike, and put every written word back when a
result does not hash right.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from deltamesh.delta import (
    BaseMismatchError,
    CodecError,
    CorruptError,
    apply_version,
    decode_piece,
    decode_version,
    encode_delta,
    encode_full,
    live_tensors,
    swap_in_place,
    weights_hash,
    word_view,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# "cpu-torch": the device code path (torch ops) run on CPU tensors, so it is tested without a GPU.
PATHS = DEVICES + ["cpu-torch"]


def _apply(update, tensor: torch.Tensor, path: str) -> None:
    if path == "cpu-torch":
        update.apply_torch(word_view(tensor))
    else:
        update.apply_to(word_view(tensor))


def _pair(dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    old = {
        "w": (torch.randn(64, 33, generator=g) * 0.05).to(dtype),
        "ids": torch.randint(-1000, 1000, (50,), generator=g, dtype=torch.int32),
        # Zeros and small weights that change: located among the base's small words.
        "small": (torch.randn(128, 128, generator=g) * 0.02).to(dtype),
    }
    old["small"].view(-1)[::17] = 0.0
    new = {k: v.clone() for k, v in old.items()}
    words = word_view(new["w"])
    words[::13] += 1
    words[5::29] -= 2
    words[7::101] ^= torch.iinfo(words.dtype).min  # sign flips
    new["ids"][::9] += 12345
    tiny = old["small"].abs() < 0.002
    word_view(new["small"])[tiny.view(-1)] += 1
    new["small"].view(-1)[::17] = 3e-4
    return old, new


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_updates_write_only_changed_words_in_place(key, path, dtype):
    device = "cpu" if path == "cpu-torch" else path
    old, new = _pair(dtype)
    enc = encode_delta(old, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=1024)
    live = {n: t.clone().to(device) for n, t in old.items()}
    storage = {n: t.data_ptr() for n, t in live.items()}
    for i, piece in enumerate(enc.pieces):
        for update in decode_piece(enc.manifest, i, piece):
            _apply(update, live[update.tensor], path)
    for name, t in live.items():
        assert t.data_ptr() == storage[name]  # the same memory, changed in place
        assert torch.equal(word_view(t).cpu(), word_view(new[name]))

    assert any(p[20] == 1 for p in enc.pieces)  # some segment located changes among small words

    # Unchanged words are not touched: fill them with garbage first, they must stay garbage. (Not
    # for the small-word segment, whose decoding reads the base's magnitudes.)
    garbage = {n: t.clone() for n, t in old.items() if n != "small"}
    for name, t in garbage.items():
        untouched = word_view(old[name]) == word_view(new[name])
        word_view(t)[untouched] = 0x55
    live = {n: t.to(device) for n, t in garbage.items()}
    for i, piece in enumerate(enc.pieces):
        for update in decode_piece(enc.manifest, i, piece):
            if update.tensor in live:
                _apply(update, live[update.tensor], path)
    for name, t in live.items():
        changed = word_view(old[name]) != word_view(new[name])
        got = word_view(t).cpu()
        assert torch.equal(got[changed], word_view(new[name])[changed])
        assert bool((got[~changed] == 0x55).all())


@pytest.mark.parametrize("path", PATHS)
def test_full_updates_and_target_checks(key, path):
    device = "cpu" if path == "cpu-torch" else path
    _, new = _pair(torch.bfloat16)
    enc = encode_full(new, model_id="m", version=1, key=key, piece_bytes=2048)
    live = {n: torch.zeros_like(t, device=device) for n, t in new.items()}
    for i, piece in enumerate(enc.pieces):
        for update in decode_piece(enc.manifest, i, piece):
            _apply(update, live[update.tensor], path)
    assert all(torch.equal(word_view(live[n]).cpu(), word_view(new[n])) for n in new)
    update = decode_piece(enc.manifest, 0, enc.pieces[0])[0]  # of "ids": int32 words
    with pytest.raises(CodecError, match="words"):
        update.apply_to(torch.zeros(3, dtype=torch.int16, device=device))
    with pytest.raises(CodecError, match="1-D"):
        update.apply_to(torch.zeros(2, 2, dtype=torch.int16, device=device))


# -- the one applier, in place, with rollback: numpy-backed tensors and live torch tensors alike ---------

class _Live(torch.nn.Module):
    """A live model as engines hold one: torch-allocated parameters and a tied output weight."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.embed = torch.nn.Parameter(weights["embed"].clone(), requires_grad=False)
        self.proj = torch.nn.Parameter(weights["proj"].clone(), requires_grad=False)
        self.head = torch.nn.Parameter(weights["embed"].clone(), requires_grad=False)
        self.head = self.embed  # tied: the manifest names only "embed"


def _model_pair(rl_step) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    old = {"embed": (torch.randn(256, 64, generator=g) * 0.02).to(torch.bfloat16),
           "proj": (torch.randn(128, 128, generator=g) * 0.02).to(torch.bfloat16)}
    old["proj"].view(-1)[::17] = 0.0
    new = rl_step(old, seed=12, share=0.05)
    # Changes crowded into small words and zeros: located by rank among the base's small words.
    word_view(new["proj"])[(old["proj"].abs() < 0.002).view(-1)] += 1
    new["proj"].view(-1)[::17] = 3e-4
    return old, new


def _numpy_backed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors over numpy-allocated memory, as weights read from disk or decoded off to the side are."""
    return {n: torch.from_numpy(t.view(torch.int16).numpy().copy()).view(t.dtype) for n, t in weights.items()}


TARGETS = ["numpy", "live", "live-torch-ops"] + (["cuda"] if torch.cuda.is_available() else [])


def _target(kind: str, old: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors to write into for `kind`, and whether to force torch ops on CPU."""
    if kind == "numpy":
        return _numpy_backed(old), False
    if kind == "cuda":
        return {n: t.to("cuda") for n, t in old.items()}, False
    return live_tensors(_Live(old)), kind == "live-torch-ops"


def _bits(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in weights.items()}


@pytest.mark.parametrize("kind", TARGETS)
def test_one_decode_applies_in_place_to_any_target(key, rl_step, kind):
    old, new = _model_pair(rl_step)
    enc = encode_delta(old, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=1024)
    assert len(enc.pieces) > 2 and any(p[20] == 1 for p in enc.pieces)  # some changes located by rank
    decoded = decode_version(enc.manifest, enc.pieces)
    for turn in range(2):  # the same decoded version, applied to two fresh targets
        # The second apply reuses where the first (whose results hashed right) found the changes.
        assert set(decoded.located) == (set(decoded.updates) if turn else set())
        live, torch_ops = _target(kind, old)
        storage = {n: t.data_ptr() for n, t in live.items()}
        stats = swap_in_place(live, decoded, base_hash=enc.manifest.base_hash, torch_ops=torch_ops)
        assert stats.words_changed == decoded.changed_words > 0
        assert {n: t.data_ptr() for n, t in live.items()} == storage  # written in place
        assert _bits({n: live[n] for n in new}) == _bits(new)
        if "head" in live:
            assert torch.equal(live["head"].view(torch.int16), live["embed"].view(torch.int16))


@pytest.mark.parametrize("kind", TARGETS)
def test_a_bad_result_hash_restores_every_target_bit_for_bit(key, rl_step, kind):
    """The manifest promises a result no apply produces for the last tensor: every word written before
    the check (in every tensor) is put back, on numpy-backed and live torch tensors alike."""
    old, new = _model_pair(rl_step)
    enc = encode_delta(old, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=1024)
    entries = list(enc.manifest.tensors)
    entries[-1] = dataclasses.replace(entries[-1], hash="0" * 32)
    bad = dataclasses.replace(enc.manifest, tensors=tuple(entries))
    decoded = decode_version(bad, enc.pieces)
    assert set(decoded.updates) == {0, 1}  # both tensors get written before the hashes are compared
    live, torch_ops = _target(kind, old)
    before = _bits(live)
    with pytest.raises(CorruptError, match="does not match the manifest's hash"):
        swap_in_place(live, decoded, base_hash=bad.base_hash, torch_ops=torch_ops)
    assert _bits(live) == before
    assert not decoded.located  # positions from a failed apply are never reused
    # Not in place, the base is never written; a wrong base is refused before any write.
    with pytest.raises(CorruptError):
        apply_version(decoded, _numpy_backed(old), base_hash=bad.base_hash, torch_ops=torch_ops)
    with pytest.raises(BaseMismatchError, match="applies to v0"):
        swap_in_place(live, decode_version(enc.manifest, enc.pieces), torch_ops=torch_ops,
                      base_hash=weights_hash(new))
    assert _bits(live) == before


def test_full_snapshot_is_decoded_aside_then_copied_in(key, rl_step):
    old, new = _model_pair(rl_step)
    full = encode_full(new, model_id="m", version=3, key=key, piece_bytes=2048)
    decoded = decode_version(full.manifest, full.pieces)
    model = _Live(old)
    live = live_tensors(model)
    swap_in_place(live, decoded)
    assert _bits({n: live[n] for n in new}) == _bits(new) and model.head is model.embed
    # A corrupt full snapshot fails while decoding, before any live tensor is touched.
    entries = list(full.manifest.tensors)
    entries[0] = dataclasses.replace(entries[0], hash="0" * 32)
    with pytest.raises(CorruptError, match="does not match the manifest's hash"):
        decode_version(dataclasses.replace(full.manifest, tensors=tuple(entries)), full.pieces)
    # Weights that do not cover the live model are refused before any write.
    with pytest.raises(CorruptError, match="lack"):
        swap_in_place({**live, "extra": torch.zeros(3)}, decoded)


def test_known_digests_check_the_base_and_spare_untouched_tensors(key, rl_step, monkeypatch):
    """With the tensor digests of the manifest the base was verified against, the base check reads no
    tensor and a tensor the delta leaves alone is never hashed; digests of other weights are refused."""
    apply_module = importlib.import_module("deltamesh.delta.applier")  # the package exports `apply`, a function

    old, new = _model_pair(rl_step)
    old["norm"] = torch.ones(64, dtype=torch.bfloat16)
    new["norm"] = old["norm"].clone()  # untouched by the delta
    base = encode_full(old, model_id="m", version=0, key=key).manifest
    enc = encode_delta(old, new, model_id="m", version=1, base_version=0, key=key, piece_bytes=1024)
    digests = base.entries()
    hashed: list[int] = []
    real = apply_module.tensor_digest
    monkeypatch.setattr(apply_module, "tensor_digest", lambda t, grid=None: hashed.append(t.data_ptr()) or real(t, grid))

    live = _numpy_backed(old)
    before = _bits(live)
    wrong = {**digests, "embed": dataclasses.replace(digests["embed"], hash="0" * 32)}
    with pytest.raises(BaseMismatchError, match="applies to v0"):
        swap_in_place(live, decode_version(enc.manifest, enc.pieces), base_entries=wrong)
    assert _bits(live) == before and not hashed
    result = apply_version(decode_version(enc.manifest, enc.pieces), live, base_entries=digests, in_place=True)
    assert _bits(result) == _bits(new)
    assert live["norm"].data_ptr() not in hashed and not hashed  # nothing hashed outside the patched tensors
    # Without the digests, the untouched tensor is hashed to check the base.
    apply_version(decode_version(enc.manifest, enc.pieces), _numpy_backed(old))
    assert len(hashed) == 1
