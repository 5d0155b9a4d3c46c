"""Decoding a piece into tensor updates, and writing an update into live words (CPU or GPU).

`decode_piece` verifies the piece against the manifest, then turns each of its segments into a
`TensorUpdate`: for a delta segment, the flat positions of the changed words and their key
differences; for a full segment, the new words of an element range. An update writes only those
words, in place, into a 1-D word view of a tensor, which is how engines hot-swap weights without a
second copy of the model. Every count and range is validated before use (see piece.py), so corrupt
input raises `CorruptError` and never writes out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import streams
from .bitdiff import apply_moves, fits_width, key_deltas
from .dtypes import NP_SWORDS, NP_UWORDS, WORD_DTYPES, is_float
from .errors import CodecError, CorruptError
from .manifest import DTYPE_SIZES, Manifest
from .piece import CODEC, KIND_DELTA, ParsedPiece, parse_piece


@dataclass(frozen=True, eq=False)
class TensorUpdate:
    """What one segment of a piece writes into one tensor."""

    tensor: str
    """Name of the tensor, as in the manifest."""
    index: int
    """Index of the tensor in `manifest.tensors`."""
    dtype: str
    numel: int
    start: int
    count: int
    positions: np.ndarray | None
    """Ascending flat indices (int64) of the changed words; None when the whole range is written."""
    values: np.ndarray
    """Delta: key differences (unsigned words) at `positions`; full: the new words of the range."""

    @property
    def is_full(self) -> bool:
        return self.positions is None

    def write_words(self, words: np.ndarray) -> np.ndarray | None:
        """Write into a CPU tensor's unsigned words (`dtypes.np_words`); returns the words replaced
        at `positions` (delta updates), so the caller can undo the write."""
        if self.positions is None:
            words[self.start : self.start + self.count] = self.values
            return None
        old = words[self.positions]
        words[self.positions] = apply_moves(old, self.values, is_float(self.dtype))
        return old

    def apply_to(self, flat_words: torch.Tensor) -> None:
        """Write the changed words in place into `flat_words`: the 1-D, contiguous view of a live
        tensor of this update's element width (see `dtypes.word_view`), on any device."""
        width = DTYPE_SIZES[self.dtype]
        if flat_words.dim() != 1 or not flat_words.is_contiguous():
            raise CodecError("apply_to needs a 1-D contiguous view of the tensor's words")
        if flat_words.element_size() != width or flat_words.numel() != self.numel:
            raise CodecError(
                f"{self.tensor}: target has {flat_words.numel()} words of {flat_words.element_size()} bytes, "
                f"update is for {self.numel} of {width}"
            )
        flat = flat_words.detach().view(WORD_DTYPES[width])
        if flat.device.type == "cpu":
            self.write_words(flat.numpy().view(NP_UWORDS[width]))
            return
        values = torch.from_numpy(self.values.view(NP_SWORDS[width])).to(flat.device)
        if self.positions is None:
            flat[self.start : self.start + self.count].copy_(values)
            return
        positions = torch.from_numpy(self.positions).to(flat.device)
        old = flat[positions]
        if is_float(self.dtype):
            flat[positions] = _torch_key(_torch_key(old, width) + values, width)
        else:
            flat[positions] = old + values


def _torch_key(words: torch.Tensor, width: int) -> torch.Tensor:
    # Same involution as bitdiff.to_key, on signed words: the arithmetic shift smears the sign bit.
    return words ^ ((words >> (width * 8 - 1)) & ((1 << (width * 8 - 1)) - 1))


def decode_piece(manifest: Manifest, index: int, data: bytes | memoryview) -> list[TensorUpdate]:
    """Verify piece `index` against the (already verified) manifest and decode its segments."""
    manifest.check_piece(index, data)
    return decode_checked(manifest, index, data)


def decode_checked(manifest: Manifest, index: int, data: bytes | memoryview) -> list[TensorUpdate]:
    """Decode a piece whose bytes were already checked against the manifest."""
    if manifest.codec != CODEC:
        raise CorruptError(f"manifest codec {manifest.codec!r}, this decoder reads {CODEC!r}")
    view = memoryview(data).cast("B")
    parsed = parse_piece(manifest, index, view)
    if parsed.kind == KIND_DELTA:
        return _decode_delta(manifest, index, parsed, view)
    return _decode_full(manifest, index, parsed, view)


def _stream(parsed: ParsedPiece, k: int, view: memoryview, limit: int, index: int) -> np.ndarray:
    ref = parsed.streams[k]
    if ref.raw_len > limit:
        raise CorruptError(f"piece {index}: stream {k} claims {ref.raw_len} bytes, segments allow {limit}")
    return streams.decompress(ref.codec, view[ref.offset : ref.offset + ref.stored_len], ref.raw_len)


def _decode_delta(manifest: Manifest, index: int, parsed: ParsedPiece, view: memoryview) -> list[TensorUpdate]:
    segments = parsed.segments
    changed = np.array([s.changed for s in segments], dtype=np.int64)
    total = int(changed.sum())
    gap_limit = sum(s.changed + s.count // 255 for s in segments)
    gaps = streams.bytes_to_gaps(_stream(parsed, 0, view, gap_limit, index), total)
    codes = streams.unpack_nibbles(_stream(parsed, 1, view, (total + 1) // 2, index), total)
    escaped = codes == streams.NIBBLE_ESCAPE
    n_escapes = int(escaped.sum())
    escapes = streams.bytes_to_varints(_stream(parsed, 2, view, n_escapes * streams.MAX_VARINT_BYTES, index), n_escapes)
    if n_escapes and escapes.max() > np.uint64(np.iinfo(np.uint64).max - streams.NIBBLE_ESCAPE):
        raise CorruptError(f"piece {index}: escaped move overflows 64 bits")
    moves = codes.astype(np.uint64)
    moves[escaped] = escapes + np.uint64(streams.NIBBLE_ESCAPE)

    # Positions restart at every segment: cumulative sum of (gap + 1), minus where the segment began.
    ends = np.cumsum(changed)
    steps = np.cumsum(gaps + 1)
    before = np.concatenate([[0], steps[ends[:-1] - 1]]) if total else np.zeros(0, dtype=np.int64)
    updates = []
    for k, s in enumerate(segments):
        lo, hi = int(ends[k] - s.changed), int(ends[k])
        rel = steps[lo:hi] - before[k] - 1
        if rel[-1] >= s.count:
            raise CorruptError(f"piece {index}: change at offset {int(rel[-1])} past its segment of {s.count}")
        entry = manifest.tensors[s.tensor]
        width = DTYPE_SIZES[entry.dtype]
        seg_moves = moves[lo:hi]
        if not fits_width(seg_moves, width):
            raise CorruptError(f"piece {index}: move too large for {entry.dtype} in {entry.name}")
        updates.append(TensorUpdate(
            entry.name, s.tensor, entry.dtype, entry.numel, s.start, s.count,
            rel + s.start, key_deltas(seg_moves, width),
        ))
    return updates


def _decode_full(manifest: Manifest, index: int, parsed: ParsedPiece, view: memoryview) -> list[TensorUpdate]:
    updates = []
    k = 0
    for s in parsed.segments:
        entry = manifest.tensors[s.tensor]
        width = DTYPE_SIZES[entry.dtype]
        words = np.empty((s.count, width), dtype=np.uint8)
        for plane in range(width):
            ref = parsed.streams[k]
            if ref.raw_len != s.count:
                raise CorruptError(f"piece {index}: plane of {ref.raw_len} bytes for {s.count} elements")
            words[:, plane] = _stream(parsed, k, view, s.count, index)
            k += 1
        updates.append(TensorUpdate(
            entry.name, s.tensor, entry.dtype, entry.numel, s.start, s.count,
            None, words.reshape(-1).view(NP_UWORDS[width]),
        ))
    return updates
