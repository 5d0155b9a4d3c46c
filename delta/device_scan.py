"""One tensor of a delta compared with its base in torch, on the tensor's own device.

encode.py takes this path for a tensor that lives on a GPU (any device but the CPU), and for CPU
tensors when asked (`encode_delta(..., device_passes=True)`, which is how tests hold it bit for bit
to the numpy path). The passes that read every word run where the words are, at that device's memory
bandwidth, chunk by chunk so that no temporary is as large as the tensor: the word compare and the
positions of the changed words, with the gather of their old and new words
(`bitdiff.changed_words_torch`); the magnitude histogram of the base's strided sample
(`smallwords.MagnitudeSample.add_torch`); and, once the host has chosen the small-word bound from that
histogram and the changed words, how many small words of the base precede each change
(`smallwords.small_words_before_torch`). Only these sparse results cross to the host, where the
entropy coding stays (piece_writer.py). What still reads the whole tensor on the host is its xxh3-128
digest (docs/FORMAT.md): xxh3 has no GPU implementation, so the new words (and the base's, when its
digest is wanted) stream to the host in chunks and are hashed there while the device scans
(streamed_hash.py). On a GPU that copy over the host link, not the device's memory, bounds the scan;
what it saves is the host's passes over the words and a host copy of either version. The changes
found, the bound chosen and the counts are those of `bitdiff.scan_changes` and `TensorChanges.of`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .bitdiff import changed_words_torch
from .dtypes import dtype_name, is_float, np_words, word_view
from .piece_writer import TensorChanges
from .smallwords import MagnitudeSample, sample_stride, small_max_of_sample, small_words_before_torch
from .streamed_hash import StreamedDigest

# Per version per step on a GPU: launches and waits stay few (~60 chunks per GB), and the pinned host buffers
# the digests stream through stay small (two per digest per scanning thread: 256 MiB at 8 threads).
GPU_CHUNK_BYTES = 16 << 20
CPU_CHUNK_BYTES = 2 << 20  # on the CPU: both chunks and the mask stay in cache, as in bitdiff.scan_changes


@dataclass(frozen=True)
class DeviceScan:
    """What the scan of one tensor sends to the host: its changes, ready to cut into pieces (None when
    no word changed), and the digests of its new and its base's bytes, each when it was asked for."""

    changes: TensorChanges | None
    digest: str | None
    base_digest: str | None


def on_device(*tensors: torch.Tensor) -> bool:
    """Whether any of `tensors` lives off the CPU (and so is scanned where it lives)."""
    return any(t.device.type != "cpu" for t in tensors)


def scan_on_device(tensor: int, base: torch.Tensor, new: torch.Tensor, *, hash_new: bool = True, hash_base: bool,
                   offset: int = 0, small_words: bool = True, chunk_bytes: int | None = None) -> DeviceScan:
    """Compare tensor number `tensor` of a version, `new`, with its `base` (same dtype and shape) on
    the device `new` lives on (or `base`, if `new` is on the CPU; the other is moved there).

    `hash_new`, `hash_base`: take the digest of the new words, of the base's. `offset`: the element
    of the whole tensor that the words held start at (changes are named by whole-tensor positions);
    `small_words`: whether changes may be located by rank among small words (as `TensorChanges.of`).
    `chunk_bytes`: bytes of each version read per step (default by device).
    """
    device = new.device if new.device.type != "cpu" else base.device
    a = word_view(base.detach().to(device).contiguous())
    b = word_view(new.detach().to(device).contiguous())
    width = b.element_size()
    chunk = chunk_bytes or (CPU_CHUNK_BYTES if device.type == "cpu" else GPU_CHUNK_BYTES)
    step = max(1, chunk // 8) * (8 // width)  # words, in whole 8-byte blocks so they compare 8 bytes at a time
    held = min(step, b.numel()) * width  # a small tensor needs no chunk-sized host buffers
    new_digest = StreamedDigest(device, held) if hash_new else None
    base_digest = StreamedDigest(device, held) if hash_base else None
    hashed = [(digest, words) for digest, words in ((new_digest, b), (base_digest, a)) if digest is not None]
    found = []
    for s in range(0, b.numel(), step):
        for digest, words in hashed:
            digest.feed(words[s : s + step])
        positions, old_words, new_words = changed_words_torch(a[s : s + step], b[s : s + step])
        if positions.numel():
            found.append((positions + s, old_words, new_words))
    changes = None
    if found:
        positions, old_words, new_words = (torch.cat(parts) for parts in zip(*found))
        changes = _changes(tensor, a, positions, old_words, new_words, is_float(dtype_name(new)), small_words,
                           offset, step)
    return DeviceScan(changes, None if new_digest is None else new_digest.hexdigest(),
                      None if base_digest is None else base_digest.hexdigest())


def _changes(tensor: int, base: torch.Tensor, positions: torch.Tensor, old_words: torch.Tensor,
             new_words: torch.Tensor, floating: bool, small_words: bool, offset: int,
             chunk_words: int) -> TensorChanges:
    old_host, new_host = np_words(old_words.cpu()), np_words(new_words.cpu())
    small_max, words_before = None, None
    if floating and small_words:
        n = base.numel()
        sample = MagnitudeSample(base.element_size(), sample_stride(n))
        sample.add_torch(base)
        small_max = small_max_of_sample(n, old_host, sample)
        if small_max is not None:
            # Counted in the words held; only the stored positions are named from the tensor's start.
            words_before = small_words_before_torch(base, positions, small_max, chunk_words).cpu().numpy()
    host_positions: np.ndarray = positions.cpu().numpy() + offset
    return TensorChanges.coded(tensor, host_positions, old_host, new_host, floating, small_max, words_before)
