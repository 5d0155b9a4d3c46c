"""Building pieces on the encode side: delta pieces cut from per-tensor changes, and full pieces.

A tensor's changes are turned into stream material once, in `TensorChanges.of` (which runs per
tensor, in parallel); cutting them into pieces then only slices and concatenates. Delta pieces
are cut by number of changes, using the bytes per change measured on the pieces made so far, so
they stay near `piece_bytes` whatever the change density. Full pieces hold whole tensors, or
ranges of big ones, of about `piece_bytes` before compression.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import streams
from .parallel import thread_map
from .piece import KIND_DELTA, KIND_FULL, Segment, pack_piece

FIRST_BYTES_PER_CHANGE = 1.25  # starting guess for cutting delta pieces; refined as pieces are made
ESCAPE = streams.NIBBLE_ESCAPE


@dataclass(frozen=True)
class BuiltPiece:
    data: bytes
    tensors: tuple[int, ...]
    """Indices of the tensors the piece writes (for its manifest entry)."""


def build_piece(kind: int, segments: list[Segment], raws: list[np.ndarray]) -> BuiltPiece:
    compressor = streams.compressor()
    stored = []
    for raw in raws:
        codec, data = streams.compress(raw, compressor)
        stored.append((codec, raw.size, data))
    return BuiltPiece(pack_piece(kind, segments, stored), tuple(sorted({s.tensor for s in segments})))


@dataclass(frozen=True)
class TensorChanges:
    """The changed words of one tensor, ready to be cut into segments."""

    tensor: int
    positions: np.ndarray
    """Ascending flat indices (int64)."""
    codes: np.ndarray
    """The 4-bit code of each change (uint8)."""
    escapes: np.ndarray
    """move - 15 of each change whose code is the escape, in order (uint64)."""
    gap_bytes: np.ndarray
    """The gap stream of all changes, the first gap counted from -1."""
    gap_ends: np.ndarray
    """Index in `gap_bytes` of the last byte of each change's gap."""

    @classmethod
    def of(cls, tensor: int, positions: np.ndarray, moves: np.ndarray) -> "TensorChanges":
        codes = np.minimum(moves, ESCAPE).astype(np.uint8)
        escapes = moves[codes == ESCAPE].astype(np.uint64) - np.uint64(ESCAPE)
        gap_bytes, gap_ends = streams.gaps_to_bytes(np.diff(positions, prepend=-1) - 1)
        return cls(tensor, positions, codes, escapes, gap_bytes, gap_ends)

    @property
    def count(self) -> int:
        return self.positions.size


@dataclass(frozen=True)
class _Cut:
    changes: TensorChanges
    lo: int
    hi: int
    escapes_before: int


def delta_pieces(all_changes: list[TensorChanges], piece_bytes: int) -> list[BuiltPiece]:
    pieces: list[BuiltPiece] = []
    made_bytes, made_changes = 0, 0
    pending: list[_Cut] = []
    room = int(piece_bytes / FIRST_BYTES_PER_CHANGE)
    for changes in all_changes:
        at, escapes_before = 0, 0
        while at < changes.count:
            take = min(room, changes.count - at)
            pending.append(_Cut(changes, at, at + take, escapes_before))
            escapes_before += int(np.count_nonzero(changes.codes[at : at + take] == ESCAPE))
            at += take
            room -= take
            if room == 0:
                piece = _delta_piece(pending)
                pieces.append(piece)
                made_bytes += len(piece.data)
                made_changes += sum(c.hi - c.lo for c in pending)
                pending = []
                room = max(1, int(piece_bytes * made_changes / made_bytes))
    if pending:
        pieces.append(_delta_piece(pending))
    return pieces


def _delta_piece(cuts: list[_Cut]) -> BuiltPiece:
    segments, gaps, codes, escapes = [], [], [], []
    zero = np.zeros(1, dtype=np.uint8)
    for cut in cuts:
        c = cut.changes
        start = int(c.positions[cut.lo])
        segments.append(Segment(c.tensor, start, int(c.positions[cut.hi - 1]) - start + 1, cut.hi - cut.lo))
        # The segment starts at its first change, whose gap is therefore 0; the rest are unchanged.
        gaps += [zero, c.gap_bytes[c.gap_ends[cut.lo] + 1 : c.gap_ends[cut.hi - 1] + 1]]
        part = c.codes[cut.lo : cut.hi]
        codes.append(part)
        n_escapes = int(np.count_nonzero(part == ESCAPE))
        escapes.append(c.escapes[cut.escapes_before : cut.escapes_before + n_escapes])
    raws = [
        np.concatenate(gaps),
        streams.pack_nibbles(np.concatenate(codes)),
        streams.varints_to_bytes(np.concatenate(escapes)),
    ]
    return build_piece(KIND_DELTA, segments, raws)


def full_pieces(words: list[np.ndarray], which: list[int], piece_bytes: int) -> list[BuiltPiece]:
    plans: list[list[Segment]] = []
    current: list[Segment] = []
    room = piece_bytes
    for i in which:
        width = words[i].itemsize
        per_segment = max(1, piece_bytes // width)
        for start in range(0, words[i].size, per_segment):
            count = min(per_segment, words[i].size - start)
            if current and count * width > room:
                plans.append(current)
                current, room = [], piece_bytes
            current.append(Segment(i, start, count))
            room -= count * width
    if current:
        plans.append(current)
    return thread_map(lambda plan: _full_piece(plan, words), plans)


def _full_piece(segments: list[Segment], words: list[np.ndarray]) -> BuiltPiece:
    raws = []
    for s in segments:
        chunk = words[s.tensor][s.start : s.start + s.count]
        raws += byte_planes(chunk)
    return build_piece(KIND_FULL, segments, raws)


def byte_planes(words: np.ndarray) -> list[np.ndarray]:
    """Byte k of every word, for k = 0 (least significant) .. width - 1, each contiguous."""
    width = words.itemsize
    if width == 1:
        return [words.view(np.uint8)]
    planes = words.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(planes[:, k]) for k in range(width)]
