"""The byte layout of one piece: header, segment table, stream table, stream bytes (docs/FORMAT.md).

A piece is self-contained: it names the tensors and element ranges it writes (segments) and carries
the streams that say what to write there. This module only packs and parses that frame, validating
every length and range against the manifest before anything is decompressed, so a hostile piece
can neither read past its end nor make the decoder allocate more than its segments justify.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import CorruptError
from .manifest import DTYPE_SIZES, FLOAT_DTYPES, Manifest

MAGIC = b"DMPC"
PIECE_FORMAT = 1
KIND_FULL, KIND_DELTA = 1, 2
CODEC = "deltamesh-bitdiff-1"
"""`Manifest.codec` of everything this codec writes."""

HEADER = struct.Struct("<4sHBBII")  # magic, format, kind, reserved, n_segments, n_streams
SEGMENT = struct.Struct("<IBBHQQQQQ")  # tensor, mode, 2 reserved, start, count, changed, small, small_max
STREAM = struct.Struct("<B7sQQ")  # codec, reserved, raw_len, stored_len
MAX_WIDTH = 8
DELTA_STREAMS = 2 + MAX_WIDTH  # gaps, codes, then byte planes 0..7 of literal words
MODE_PLAIN, MODE_SMALL = 0, 1


@dataclass(frozen=True)
class Segment:
    """A (tensor, element range) a piece writes. Delta pieces: `changed` words changed, of which the
    last `small` are located among words of base magnitude <= `small_max` (mode MODE_SMALL)."""

    tensor: int
    start: int
    count: int
    changed: int = 0
    small: int = 0
    small_max: int = 0

    @property
    def mode(self) -> int:
        return MODE_SMALL if self.small else MODE_PLAIN


@dataclass(frozen=True)
class StreamRef:
    codec: int
    raw_len: int
    offset: int
    stored_len: int


@dataclass(frozen=True)
class ParsedPiece:
    kind: int
    segments: tuple[Segment, ...]
    streams: tuple[StreamRef, ...]


def pack_piece(kind: int, segments: list[Segment], streams: list[tuple[int, int, bytes]]) -> bytes:
    """Assemble a piece from its segments and (codec, raw_len, stored bytes) streams."""
    parts = [HEADER.pack(MAGIC, PIECE_FORMAT, kind, 0, len(segments), len(streams))]
    parts += [SEGMENT.pack(s.tensor, s.mode, 0, 0, s.start, s.count, s.changed, s.small, s.small_max) for s in segments]
    parts += [STREAM.pack(codec, bytes(7), raw_len, len(data)) for codec, raw_len, data in streams]
    parts += [data for _, _, data in streams]
    return b"".join(parts)


def parse_piece(manifest: Manifest, index: int, data: bytes | memoryview) -> ParsedPiece:
    """Parse and validate the frame of piece `index` (not its streams' contents)."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise CorruptError(f"piece {index}: {len(view)} bytes, shorter than its header")
    magic, fmt, kind, reserved, n_segments, n_streams = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptError(f"piece {index}: bad magic {bytes(magic)!r}")
    if fmt != PIECE_FORMAT or reserved:
        raise CorruptError(f"piece {index}: piece format {fmt}, this codec reads {PIECE_FORMAT}")
    if kind not in (KIND_FULL, KIND_DELTA):
        raise CorruptError(f"piece {index}: unknown kind {kind}")
    if kind == KIND_DELTA and manifest.kind != "delta":
        raise CorruptError(f"piece {index}: delta piece in a full snapshot")
    tables = HEADER.size + n_segments * SEGMENT.size + n_streams * STREAM.size
    if tables > len(view):
        raise CorruptError(f"piece {index}: tables need {tables} bytes, piece has {len(view)}")
    entry = manifest.pieces[index] if index < len(manifest.pieces) else None
    declared = set(entry.tensors) if entry is not None else set()
    # A piece with spans (format 4) writes only inside them: a pool rank fetched it for those alone.
    spans = {s.tensor: (s.start, s.stop) for s in entry.spans} if entry is not None and entry.spans else None
    segments = []
    pos = HEADER.size
    for _ in range(n_segments):
        fields = SEGMENT.unpack_from(view, pos)
        pos += SEGMENT.size
        segment = _check_segment(manifest, index, declared, kind, *fields)
        if spans is not None and not spans[segment.tensor][0] <= segment.start < segment.start + segment.count <= spans[segment.tensor][1]:
            raise CorruptError(f"piece {index}, tensor {segment.tensor}: range [{segment.start}, "
                               f"{segment.start + segment.count}) outside the piece's span in the manifest")
        segments.append(segment)
    expected_streams = DELTA_STREAMS if kind == KIND_DELTA else sum(
        DTYPE_SIZES[manifest.tensors[s.tensor].dtype] for s in segments
    )
    if n_streams != expected_streams:
        raise CorruptError(f"piece {index}: {n_streams} streams, its segments need {expected_streams}")
    streams = []
    offset = tables
    for _ in range(n_streams):
        codec, reserved, raw_len, stored_len = STREAM.unpack_from(view, pos)
        pos += STREAM.size
        if any(reserved):
            raise CorruptError(f"piece {index}: reserved stream bytes are not zero")
        streams.append(StreamRef(codec, raw_len, offset, stored_len))
        offset += stored_len
    if offset != len(view):
        raise CorruptError(f"piece {index}: streams end at byte {offset}, piece has {len(view)}")
    return ParsedPiece(kind, tuple(segments), tuple(streams))


def _check_segment(
    manifest: Manifest, index: int, declared: set[int], kind: int, tensor: int, mode: int, reserved1: int,
    reserved2: int, start: int, count: int, changed: int, small: int, small_max: int,
) -> Segment:
    where = f"piece {index}, tensor {tensor}"
    if tensor >= len(manifest.tensors) or tensor not in declared:
        raise CorruptError(f"{where}: tensor not declared for this piece in the manifest")
    entry = manifest.tensors[tensor]
    if reserved1 or reserved2 or count == 0 or start + count > entry.numel:
        raise CorruptError(f"{where}: range [{start}, {start + count}) outside its {entry.numel} elements")
    if kind == KIND_FULL and (mode or changed or small or small_max):
        raise CorruptError(f"{where}: full segment with change fields")
    if kind == KIND_DELTA and not 0 < changed <= count:
        raise CorruptError(f"{where}: {changed} changes in {count} elements")
    if mode == MODE_PLAIN and (small or small_max):
        raise CorruptError(f"{where}: plain segment with small-word fields")
    if mode == MODE_SMALL:
        limit = (1 << (DTYPE_SIZES[entry.dtype] * 8 - 1)) - 1
        if entry.dtype not in FLOAT_DTYPES or not 0 < small <= changed or small_max > limit:
            raise CorruptError(f"{where}: bad small-word fields ({small} of {changed}, bound {small_max})")
    elif mode != MODE_PLAIN:
        raise CorruptError(f"{where}: unknown segment mode {mode}")
    return Segment(tensor, start, count, changed, small, small_max)
