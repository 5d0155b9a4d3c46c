"""Hot swap: decoded updates written in place into a live tensor's word view, CPU and (if present) CUDA.

An update must write only the changed words: words it does not cover keep whatever they held, even
garbage, which is how the tests tell "wrote the changes" from "rewrote the tensor".
"""

from __future__ import annotations

import pytest
import torch

from deltamesh.delta import CodecError, decode_piece, encode_delta, encode_full, word_view

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
