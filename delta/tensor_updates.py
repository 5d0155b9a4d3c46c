"""Decoding a piece into tensor updates, and the word-level writes of one update (CPU or any device).

`decode_piece` verifies the piece against the manifest, then turns each of its segments into a
`TensorUpdate`: for a delta segment, where the changed words are (flat positions, and ranks among
the base's small words that are resolved against the base when applied) and what they become (key
differences, or literal new words); for a full segment, the new words of an element range. Updates
are immutable: one decoded version can be applied to several targets (decoded_version.py). The whole-version
applier with rollback is applier.py; the methods here are its per-update building blocks, in numpy for
CPU words and in torch ops for words on any device. Every count and range is validated before use
(see piece.py), so corrupt input raises `CorruptError` and never writes out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import smallwords, streams
from .bitdiff import apply_changes
from .dtypes import NP_SWORDS, NP_UWORDS, WORD_DTYPES, is_float
from .errors import CodecError, CorruptError
from .kernels import change_locations, check_codes, key_moves
from .manifest import DTYPE_SIZES, Manifest
from .piece import CODEC, KIND_DELTA, MAX_WIDTH, ParsedPiece, parse_piece


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
    """Flat indices (int64, ascending) of the changes located by position; None for a full range."""
    values: np.ndarray
    """Per change (those at `positions`, then those at `small_ranks`): the key difference, or the new
    word where `literal`. For a full range: its new words."""
    literal: np.ndarray | None = None
    """Which changes carry their new word (bool), None if none do."""
    small_ranks: np.ndarray | None = None
    """Ranks of the other changes among the words of [start, start + count) whose base magnitude is
    at most `small_max` (see smallwords.py): found from the base itself when applied."""
    small_max: int = 0

    @property
    def is_full(self) -> bool:
        return self.positions is None

    def locate(self, words: np.ndarray, ranked: np.ndarray | None = None) -> np.ndarray:
        """Flat indices of every change, in `values` order, given the tensor's base words (numpy);
        `ranked`, when known (read off a `SmallWordIndex`), are the positions of the changes located
        by small-word rank, so that the words need not be searched for them."""
        if self.small_ranks is None:
            return self.positions
        if ranked is None:
            ranked = smallwords.small_positions(words, self.start, self.count, self.small_ranks, self.small_max)
        return np.concatenate([self.positions, ranked])

    def write_words(self, words: np.ndarray) -> None:
        """Write into a CPU tensor's unsigned words (`dtypes.np_words`) holding the base."""
        if self.positions is None:
            words[self.start : self.start + self.count] = self.values
            return
        positions = self.locate(words)
        words[positions] = apply_changes(words[positions], self.values, self.literal, is_float(self.dtype))

    def apply_to(self, flat_words: torch.Tensor) -> None:
        """Write the changed words in place into `flat_words`: the 1-D, contiguous view of a live
        tensor holding the base (see `dtypes.word_view`), of this update's element width, on any
        device. Only the changed words are written."""
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
        else:
            self.apply_torch(flat)

    def apply_torch(self, flat: torch.Tensor) -> None:
        """The device path of `apply_to`, in torch ops on `flat`'s own device (any device, CPU
        included); `flat` is the signed word view. Torch integer addition wraps like the numpy path."""
        values = self.torch_values(flat.device)
        if self.positions is None:
            flat[self.start : self.start + self.count].copy_(values)
            return
        positions = self.locate_torch(flat)
        literal = None if self.literal is None else torch.from_numpy(self.literal).to(flat.device)
        flat[positions] = changes_torch(flat[positions], values, literal, self.dtype)

    def torch_values(self, device: torch.device) -> torch.Tensor:
        """`values` as signed words on `device` (the view torch arithmetic wraps on)."""
        return torch.from_numpy(self.values.view(NP_SWORDS[DTYPE_SIZES[self.dtype]])).to(device)

    def locate_torch(self, flat: torch.Tensor) -> torch.Tensor:
        """`locate` on a signed word view holding the base, on its own device."""
        positions = torch.from_numpy(self.positions).to(flat.device)
        if self.small_ranks is None:
            return positions
        ranks = torch.from_numpy(self.small_ranks).to(flat.device)
        small = smallwords.small_positions_torch(flat, self.start, self.count, ranks, self.small_max)
        return torch.cat([positions, small])


def changes_torch(old: torch.Tensor, values: torch.Tensor, literal: torch.Tensor | None, dtype: str) -> torch.Tensor:
    """`bitdiff.apply_changes` in torch ops on signed words: the new words of the changes at `old`."""
    width = DTYPE_SIZES[dtype]
    new = _torch_key(_torch_key(old, width) + values, width) if is_float(dtype) else old + values
    return new if literal is None else torch.where(literal, values, new)


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
    total = sum(s.changed for s in segments)
    gap_limit = sum(s.changed + s.count // 255 for s in segments)
    # Runs of changes: per segment, those located by position, then those located by small-word rank.
    runs = np.array([n for s in segments for n in (s.changed - s.small, s.small)], dtype=np.int64)
    offsets = np.array([o for s in segments for o in (s.start, 0)], dtype=np.int64)
    limits = np.array([s.count for s in segments for _ in (0, 1)], dtype=np.int64)
    gaps = _stream(parsed, 0, view, gap_limit, index)
    codes = _stream(parsed, 1, view, (total + 1) // 2, index)
    try:
        locations = change_locations(gaps, runs, offsets, limits)
        check_codes(codes, total)
    except CorruptError as e:
        raise CorruptError(f"piece {index}: {e}") from None
    widths = [DTYPE_SIZES[manifest.tensors[s.tensor].dtype] for s in segments]
    firsts = np.cumsum([0] + [s.changed for s in segments])
    # Per segment: its changes' key differences, which of them are literals, and how many.
    changes = [key_moves(codes, int(first), s.changed, w) for s, w, first in zip(segments, widths, firsts)]
    planes = []
    for k in range(MAX_WIDTH):
        expected = sum(n for (_, _, n), w in zip(changes, widths) if w > k)
        plane = _stream(parsed, 2 + k, view, expected, index)
        if plane.size != expected:
            raise CorruptError(f"piece {index}: literal plane {k} has {plane.size} bytes, codes need {expected}")
        planes.append(plane)
    taken = [0] * MAX_WIDTH

    updates = []
    for s, width, first, (values, seg_literal, n_literal) in zip(segments, widths, firsts, changes):
        entry = manifest.tensors[s.tensor]
        if n_literal:
            words = np.empty((n_literal, width), dtype=np.uint8)
            for k in range(width):
                words[:, k] = planes[k][taken[k] : taken[k] + n_literal]
                taken[k] += n_literal
            values[seg_literal] = words.reshape(-1).view(NP_UWORDS[width])
        plain = s.changed - s.small
        updates.append(TensorUpdate(
            entry.name, s.tensor, entry.dtype, entry.numel, s.start, s.count,
            locations[first : first + plain], values, seg_literal if n_literal else None,
            locations[first + plain : first + s.changed] if s.small else None, s.small_max,
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
