"""Building pieces on the encode side: delta pieces cut from per-tensor changes, and full pieces.

A tensor's changes are turned into stream material once, in `TensorChanges.of` (which runs per
tensor, in parallel); cutting them into pieces then only slices and concatenates. Delta pieces
are cut by number of changes, using the bytes per change measured on the pieces made so far, so
they stay near `piece_bytes` whatever the change density. Full pieces hold whole tensors, or
ranges of big ones, of about `piece_bytes` before compression. A tensor held in part (a trainer
rank's rows) is given with its element `offset` in the whole tensor, so segments name whole-tensor
element ranges; `bands` (element bounds) cut its segments where a pool rank's share ends, so that no
segment, and so no piece, crosses into another share (a version in parts: slices.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from . import smallwords, streams
from .bitdiff import encode_moves
from .hashing import piece_digest
from .parallel import thread_map
from .piece import DELTA_STREAMS, HEADER, KIND_DELTA, KIND_FULL, MAX_WIDTH, STREAM, Segment, pack_piece

FIRST_BYTES_PER_CHANGE = 1.0  # starting guess for cutting delta pieces; refined as pieces are made
LITERAL = streams.LITERAL
DELTA_OVERHEAD = HEADER.size + DELTA_STREAMS * STREAM.size  # bytes of a delta piece before its segments


@dataclass(frozen=True)
class BuiltPiece:
    data: bytes
    tensors: tuple[int, ...]
    """Indices of the tensors the piece writes (for its manifest entry)."""
    spans: tuple[tuple[int, int, int], ...] = ()
    """Per tensor it writes, (index, first element, end) of the range its segments lie in."""
    digest: str = ""
    """Its content digest (`hashing.piece_digest`), taken where it is built (on the encoder's threads)."""


def build_piece(kind: int, segments: list[Segment], raws: list[np.ndarray]) -> BuiltPiece:
    compressor = streams.compressor()
    stored = []
    for raw in raws:
        codec, data = streams.compress(raw, compressor)
        stored.append((codec, raw.size, data))
    ranges: dict[int, tuple[int, int]] = {}
    for s in segments:
        lo, hi = ranges.get(s.tensor, (s.start, s.start + s.count))
        ranges[s.tensor] = (min(lo, s.start), max(hi, s.start + s.count))
    spans = tuple((t, lo, hi) for t, (lo, hi) in sorted(ranges.items()))
    data = pack_piece(kind, segments, stored)
    return BuiltPiece(data, tuple(sorted(ranges)), spans, piece_digest(data))


@dataclass(frozen=True)
class Group:
    """Changes of one tensor located the same way: by position, or by rank among small words."""

    locations: np.ndarray
    """Ascending positions or ranks (int64), counted from the tensor's start."""
    codes: np.ndarray
    """The 4-bit code of each change (uint8): move value, or LITERAL."""
    literals: np.ndarray
    """New words of the LITERAL changes, in order."""
    literals_before: np.ndarray
    """Number of literals among the first k changes, for k = 0 .. len (int64)."""
    gap_bytes: np.ndarray
    """The gap stream of all `locations`, the first gap counted from -1."""
    gap_ends: np.ndarray
    """Index in `gap_bytes` of the last byte of each change's gap."""

    @classmethod
    def of(cls, locations: np.ndarray, moves: np.ndarray, new_words: np.ndarray) -> "Group":
        codes = np.minimum(moves, LITERAL).astype(np.uint8)
        literal = codes == LITERAL
        literals_before = np.concatenate([[0], np.cumsum(literal, dtype=np.int64)])
        gap_bytes, gap_ends = streams.gaps_to_bytes(_gaps(locations))
        return cls(locations, codes, new_words[literal], literals_before, gap_bytes, gap_ends)

    def gaps(self, lo: int, hi: int, origin: int) -> list[np.ndarray]:
        """Gap bytes of changes lo..hi-1 counted from `origin` - 1 (only the first gap changes)."""
        first, _ = streams.gaps_to_bytes(self.locations[lo : lo + 1] - origin)
        return [first, self.gap_bytes[self.gap_ends[lo] + 1 : self.gap_ends[hi - 1] + 1]]


def _gaps(locations: np.ndarray) -> np.ndarray:
    """Unchanged words before each of the ascending `locations`, the first counted from -1."""
    gaps = np.empty_like(locations)
    if locations.size:
        gaps[0] = locations[0]
        np.subtract(locations[1:], locations[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


@dataclass(frozen=True)
class TensorChanges:
    """The changed words of one tensor, ready to be cut into segments of consecutive changes."""

    tensor: int
    positions: np.ndarray
    """Ascending flat indices of all changes (int64)."""
    small_before: np.ndarray | None
    """For each change k = 0 .. len: how many of the first k changes are small (None: no small group)."""
    small_words_before: np.ndarray | None
    """For each change, how many small words of the base precede its position."""
    small_max: int
    plain: Group
    small: Group | None

    @classmethod
    def of(cls, tensor: int, base: np.ndarray, positions: np.ndarray, old: np.ndarray, new: np.ndarray,
           floating: bool, sample: smallwords.MagnitudeSample | None = None, *, offset: int = 0,
           small_words: bool = True) -> "TensorChanges":
        """`sample`: the base's magnitude sample if the scan already took it. `base` and `positions` are
        of the words held, which start at element `offset` of the tensor. `small_words`: whether
        changes may be located by rank among small words (a receiver that holds only some columns of
        each row cannot count them: slices.py)."""
        small_max = smallwords.choose_small_max(base, old, sample) if floating and small_words else None
        words_before = None if small_max is None else smallwords.small_words_before(base, positions, small_max)
        return cls.coded(tensor, positions + offset, old, new, floating, small_max, words_before)

    @classmethod
    def coded(cls, tensor: int, positions: np.ndarray, old: np.ndarray, new: np.ndarray, floating: bool,
              small_max: int | None, words_before: np.ndarray | None) -> "TensorChanges":
        """`of`, with the small-word bound (None: none) and the base's small words before each change
        (`smallwords.small_words_before`, counted in the words held) already found, by a scan that did
        not hold the base here; `positions` are whole-tensor element positions."""
        moves = encode_moves(old, new, floating)
        if small_max is None:
            return cls(tensor, positions, None, None, 0, Group.of(positions, moves, new), None)
        is_small = smallwords.is_small(old, small_max)
        small_before = np.concatenate([[0], np.cumsum(is_small, dtype=np.int64)])
        plain, small = ~is_small, is_small
        return cls(
            tensor, positions, small_before, words_before, small_max,
            Group.of(positions[plain], moves[plain], new[plain]),
            Group.of(words_before[small], moves[small], new[small]),
        )

    @property
    def count(self) -> int:
        return self.positions.size

    def segment(self, lo: int, hi: int) -> tuple[Segment, list[tuple[Group, int, int, int]]]:
        """Segment of changes lo..hi-1 and, per group, (group, first, end, origin) to take from it."""
        start = int(self.positions[lo])
        count = int(self.positions[hi - 1]) - start + 1
        if self.small is None:
            return Segment(self.tensor, start, count, hi - lo), [(self.plain, lo, hi, start)]
        s_lo, s_hi = int(self.small_before[lo]), int(self.small_before[hi])
        p_lo, p_hi = lo - s_lo, hi - s_hi
        segment = Segment(self.tensor, start, count, hi - lo, s_hi - s_lo, self.small_max if s_hi > s_lo else 0)
        # Ranks of small words count from the segment's start.
        return segment, [(self.plain, p_lo, p_hi, start), (self.small, s_lo, s_hi, int(self.small_words_before[lo]))]


class DeltaPieceCutter:
    """Cuts the changes of the tensors it is given, in order, into delta pieces as it goes (so a
    tensor's change lists can be dropped once its pieces are built)."""

    def __init__(self, piece_bytes: int) -> None:
        self.pieces: list[BuiltPiece] = []
        self._payload = max(1, piece_bytes - DELTA_OVERHEAD)  # what the changes themselves may take
        self._room = max(1, int(self._payload / FIRST_BYTES_PER_CHANGE))
        self._pending: list[tuple[TensorChanges, int, int]] = []
        self._made_bytes, self._made_changes = 0, 0

    def add(self, changes: TensorChanges, lo: int = 0, hi: int | None = None) -> None:
        """Cut changes lo..hi-1 (default: all) of `changes` into the pieces being made."""
        at, end = lo, changes.count if hi is None else hi
        while at < end:
            take = min(self._room, end - at)
            self._pending.append((changes, at, at + take))
            at += take
            self._room -= take
            if self._room == 0:
                self._flush()

    def finish(self) -> list[BuiltPiece]:
        if self._pending:
            self._flush()
        return self.pieces

    def _flush(self) -> None:
        piece = _delta_piece(self._pending)
        self.pieces.append(piece)
        self._made_bytes += max(1, len(piece.data) - DELTA_OVERHEAD)
        self._made_changes += sum(hi - lo for _, lo, hi in self._pending)
        self._pending = []
        self._room = max(1, int(self._payload * self._made_changes / self._made_bytes))


def _delta_piece(cuts: list[tuple[TensorChanges, int, int]]) -> BuiltPiece:
    segments, gaps, codes = [], [], []
    literals: list[list[np.ndarray]] = [[] for _ in range(MAX_WIDTH)]
    for changes, lo, hi in cuts:
        segment, parts = changes.segment(lo, hi)
        segments.append(segment)
        for group, first, end, origin in parts:
            if end == first:
                continue
            gaps += group.gaps(first, end, origin)
            codes.append(group.codes[first:end])
            words = group.literals[group.literals_before[first] : group.literals_before[end]]
            for k, plane in enumerate(byte_planes(words)):
                literals[k].append(plane)
    raws = [np.concatenate(gaps), streams.pack_nibbles(np.concatenate(codes))]
    raws += [np.concatenate(planes) if planes else np.empty(0, dtype=np.uint8) for planes in literals]
    return build_piece(KIND_DELTA, segments, raws)


def full_pieces(words: Sequence[np.ndarray] | Mapping[int, np.ndarray], which: list[int], piece_bytes: int,
                ranges: Sequence[Sequence[tuple[int, int]]] | None = None, offsets: Sequence[int] | None = None
                ) -> list[BuiltPiece]:
    """Full pieces of the tensors `which` (indices into the table, and keys of `words`: each tensor's
    words held). `ranges`:
    per tensor of `which`, the (first, end) element ranges of the words held that no segment may cross
    (default: all of them); `offsets`: per tensor, the element of the whole tensor the words held
    start at (default 0)."""
    plans: list[list[Segment]] = []
    current: list[Segment] = []
    room = piece_bytes
    for k, i in enumerate(which):
        width = words[i].itemsize
        per_segment = max(1, piece_bytes // width)
        offset = 0 if offsets is None else offsets[k]
        for lo, hi in ([(0, words[i].size)] if ranges is None else ranges[k]):
            for start in range(lo, hi, per_segment):
                count = min(per_segment, hi - start)
                if current and count * width > room:
                    plans.append(current)
                    current, room = [], piece_bytes
                current.append(Segment(i, start + offset, count))
                room -= count * width
    if current:
        plans.append(current)
    held = {i: 0 if offsets is None else offsets[k] for k, i in enumerate(which)}
    return thread_map(lambda plan: _full_piece(plan, words, held), plans)


def _full_piece(segments: list[Segment], words: Sequence[np.ndarray] | Mapping[int, np.ndarray],
                offsets: dict[int, int]) -> BuiltPiece:
    raws = []
    for s in segments:
        start = s.start - offsets[s.tensor]
        raws += byte_planes(words[s.tensor][start : start + s.count])
    return build_piece(KIND_FULL, segments, raws)


def byte_planes(words: np.ndarray) -> list[np.ndarray]:
    """Byte k of every word, for k = 0 (least significant) .. width - 1, each contiguous."""
    width = words.itemsize
    if width == 1 or words.size == 0:
        return [words.view(np.uint8)] if width == 1 else [np.empty(0, dtype=np.uint8)] * width
    planes = words.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(planes[:, k]) for k in range(width)]
