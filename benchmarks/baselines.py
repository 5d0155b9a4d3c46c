"""Baseline weight-sync codecs, re-implemented from their published descriptions, to benchmark against.

Each baseline turns (old, new) bf16 weights into a list of byte blobs and applies those blobs to the
old weights, bit-exactly. Both sides already know the tensor names, order, dtypes and shapes (they
hold the old version), so the blobs carry only what each method sends per update:

- `astraflow` (arXiv 2605.15565): the flat index of every changed word across the whole model,
  uint32 (uint64 once the model has 2^32 elements or more), then the new bf16 values; no compression.
- `slime`: per tensor, the XOR of old and new words, compressed with zstd level 1.
- `pulse` (arXiv 2602.03839): per tensor, the gaps between changed indices in the smallest unsigned
  integer type that holds the largest gap, then the new values, compressed with zstd (level 3, its
  default). Layout before compression: u8 type code (0..3 = u8/u16/u32/u64), u64 count, gaps, values.
- `full`: the new weights as raw bf16 safetensors bytes.

Apply works on copies: the old weights are never modified.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import safetensors.torch
import torch
import zstandard

Weights = Mapping[str, torch.Tensor]
Blobs = Sequence[bytes]

GAP_TYPES = (np.uint8, np.uint16, np.uint32, np.uint64)
PULSE_HEADER = struct.Struct("<BQ")
SLIME_ZSTD_LEVEL = 1
PULSE_ZSTD_LEVEL = 3


@dataclass(frozen=True)
class Codec:
    """A weight-sync method: `encode(old, new)` gives the blobs it sends, `apply(old, blobs)` the new weights."""

    name: str
    summary: str
    encode: Callable[[Weights, Weights], list[bytes]]
    apply: Callable[[Weights, Blobs], dict[str, torch.Tensor]]
    prepare: Callable[[Weights], None] | None = None
    """Untimed set-up on the old weights before a measurement (what a sender already knows)."""
    apply_in_place: Callable[[dict[str, torch.Tensor], Blobs], dict[str, torch.Tensor]] | None = None
    """Applies into the given weights themselves (a receiver's live copy), where the method has it."""
    apply_next: Callable[[Weights, Weights, Blobs, int], tuple[float, float, bool]] | None = None
    """`(old, new, blobs, repeats)`: median wall and CPU seconds of the in-place apply of `blobs` (old
    -> new) by a receiver that applied the version before in place too (state it keeps across
    versions counts), and whether every result was exact."""


def words(t: torch.Tensor) -> torch.Tensor:
    """A flat int16 view of a contiguous 2-byte tensor (bf16): the words the codecs compare."""
    if t.element_size() != 2 or not t.is_contiguous():
        raise ValueError(f"baselines take contiguous 2-byte tensors, got {t.dtype}")
    return t.view(torch.int16).reshape(-1)


def readonly_words(data: bytes | memoryview, dtype: torch.dtype = torch.int16) -> torch.Tensor:
    """A zero-copy tensor over immutable bytes; callers only read it."""
    if len(data) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we never write to it
        return torch.frombuffer(data, dtype=dtype)


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """int64 positions of the words that differ between two tensors of the same shape."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"tensor changed shape or dtype: {old.dtype}{list(old.shape)} -> {new.dtype}{list(new.shape)}")
    return torch.nonzero(words(old) != words(new)).reshape(-1)


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


# -- astraflow -------------------------------------------------------------------------------------

def _index_type(old: Weights) -> type:
    total = sum(t.numel() for t in old.values())
    return np.uint32 if total < 2**32 else np.uint64


def astraflow_encode(old: Weights, new: Weights) -> list[bytes]:
    index_type = _index_type(old)
    indices, values, offset = [], [], 0
    for name, o in old.items():
        pos = changed_positions(o, new[name])
        indices.append((pos + offset).numpy().astype(index_type))
        values.append(words(new[name])[pos].numpy())
        offset += o.numel()
    return [np.concatenate(indices).tobytes(), np.concatenate(values).tobytes()]


def astraflow_apply(old: Weights, blobs: Blobs) -> dict[str, torch.Tensor]:
    index_blob, value_blob = blobs
    indices = np.frombuffer(index_blob, dtype=_index_type(old)).astype(np.int64)
    values = readonly_words(value_blob)
    if len(indices) != len(values):
        raise ValueError("astraflow: index and value counts differ")
    out, offset = {}, 0
    for name, o in old.items():
        lo, hi = np.searchsorted(indices, [offset, offset + o.numel()])
        result = fresh_copy(o)
        words(result)[torch.from_numpy(indices[lo:hi] - offset)] = values[lo:hi]
        out[name] = result
        offset += o.numel()
    return out


# -- slime -----------------------------------------------------------------------------------------

def slime_encode(old: Weights, new: Weights) -> list[bytes]:
    compressor = zstandard.ZstdCompressor(level=SLIME_ZSTD_LEVEL)
    return [compressor.compress(torch.bitwise_xor(words(o), words(new[name])).numpy()) for name, o in old.items()]


def slime_apply(old: Weights, blobs: Blobs) -> dict[str, torch.Tensor]:
    decompressor = zstandard.ZstdDecompressor()
    out = {}
    for (name, o), blob in zip(old.items(), blobs, strict=True):
        xor = readonly_words(decompressor.decompress(blob))
        result = torch.empty_like(o, memory_format=torch.contiguous_format)
        torch.bitwise_xor(words(o), xor, out=words(result))
        out[name] = result
    return out


# -- pulse -----------------------------------------------------------------------------------------

def pulse_encode(old: Weights, new: Weights) -> list[bytes]:
    compressor = zstandard.ZstdCompressor(level=PULSE_ZSTD_LEVEL)
    blobs = []
    for name, o in old.items():
        pos = changed_positions(o, new[name])
        gaps = torch.diff(pos, prepend=torch.zeros(1, dtype=torch.int64)).numpy()
        largest = int(gaps.max()) if len(gaps) else 0
        code = next(i for i, t in enumerate(GAP_TYPES) if largest <= np.iinfo(t).max)
        raw = b"".join((
            PULSE_HEADER.pack(code, len(gaps)),
            gaps.astype(GAP_TYPES[code]).tobytes(),
            words(new[name])[pos].numpy().tobytes(),
        ))
        blobs.append(compressor.compress(raw))
    return blobs


def pulse_apply(old: Weights, blobs: Blobs) -> dict[str, torch.Tensor]:
    decompressor = zstandard.ZstdDecompressor()
    out = {}
    for (name, o), blob in zip(old.items(), blobs, strict=True):
        raw = memoryview(decompressor.decompress(blob))
        code, count = PULSE_HEADER.unpack_from(raw)
        gap_type = GAP_TYPES[code]
        gaps_end = PULSE_HEADER.size + count * np.dtype(gap_type).itemsize
        if len(raw) != gaps_end + 2 * count:
            raise ValueError(f"pulse: {name}: payload length does not match its count")
        positions = np.cumsum(np.frombuffer(raw[PULSE_HEADER.size:gaps_end], dtype=gap_type), dtype=np.int64)
        result = fresh_copy(o)
        words(result)[torch.from_numpy(positions)] = readonly_words(raw[gaps_end:])
        out[name] = result
    return out


# -- full ------------------------------------------------------------------------------------------

def full_encode(old: Weights, new: Weights) -> list[bytes]:
    return [safetensors.torch.save(dict(new))]


def full_apply(old: Weights, blobs: Blobs) -> dict[str, torch.Tensor]:
    (blob,) = blobs
    loaded = safetensors.torch.load(blob)
    return {name: loaded[name] for name in old}


BASELINES: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec("astraflow", "uint32/64 flat index + raw bf16 value, uncompressed", astraflow_encode, astraflow_apply),
        Codec("slime", "XOR of old and new, zstd-1, per tensor", slime_encode, slime_apply),
        Codec("pulse", "gap-encoded indices (smallest int type) + values, zstd-3, per tensor",
              pulse_encode, pulse_apply),
        Codec("full", "raw bf16 safetensors", full_encode, full_apply),
    )
}


def encoded_size(blobs: Blobs) -> int:
    return sum(len(b) for b in blobs)
