"""Assembling one version's manifest from the parts its processes encoded (parts.py).

Every process (trainer rank) encodes the rows it holds and describes its part in a few bytes per
piece and per tile (`Part.describe`); one process, rank 0, gathers the descriptions and builds the
tensor table and the piece table here, then signs one manifest over them (encode.py): no process
ever holds the whole model. A tensor whose rows several parts hold, or which pool layouts cut, gets a
hash grid (slices.py) whose bands are the union of the parts' bands and whose tiles are theirs, in
row order; a tensor of one tile keeps a plain hash. The pieces are the parts' pieces, part after part,
so part k uploads its own pieces at the indices starting at `offsets[k]`. The parts must hold every
row of every tensor exactly once, with the same column bounds: anything else is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .cuts import TensorSpec
from .errors import CodecError
from .hashing import digest
from .manifest import PieceEntry, TensorEntry
from .slices import Grid, Span


@dataclass(frozen=True)
class Assembled:
    tensors: tuple[TensorEntry, ...]
    pieces: tuple[PieceEntry, ...]
    offsets: tuple[int, ...]
    """The index in `pieces` of each part's first piece."""
    base_tensors: tuple[TensorEntry, ...] | None = None
    """The base's table, when every part hashed its base tiles."""

    @property
    def in_parts(self) -> bool:
        return any(t.grid is not None for t in self.tensors) or any(p.spans is not None for p in self.pieces)


def assemble(table: Sequence[TensorSpec], parts: Sequence[dict[str, Any]]) -> Assembled:
    """The tables of the version whose tensors are `table`, from the parts' descriptions in part order.
    Pieces carry spans when the version has more than one part or was cut for pool layouts."""
    holders: dict[int, list[tuple[list[int], list[int], list[str], list[str] | None]]] = {}
    for k, part in enumerate(parts):
        try:
            for held in part["held"]:
                index, bands, cols, tiles = held[:4]
                base_tiles = part["base"].get(str(index)) if "base" in part else None
                if not 0 <= index < len(table):
                    raise CodecError(f"part {k}: tensor {index} is not in the version's table")
                holders.setdefault(index, []).append((list(bands), list(cols), list(tiles), base_tiles))
        except (KeyError, TypeError, ValueError) as e:
            raise CodecError(f"part {k}: malformed description: {type(e).__name__}: {e}") from e
    tensors, bases = [], []
    for index, spec in enumerate(table):
        entry, base = _entry(spec, sorted(holders.get(index, []), key=lambda h: h[0][0] if h[0] else 0))
        tensors.append(entry)
        bases.append(base)
    # Pieces a pool rank may fetch alone carry their spans: those of parts, or of a version cut for pools.
    spanned = len(parts) > 1 or any(part.get("cut") for part in parts) or any(t.grid is not None for t in tensors)
    pieces, offsets = [], []
    for part in parts:
        offsets.append(len(pieces))
        for length, piece_hash, written, spans in part["pieces"]:
            pieces.append(PieceEntry(length, piece_hash, tuple(written),
                                     tuple(Span(*s) for s in spans) if spanned else None))
    base_tensors = tuple(bases) if all(b is not None for b in bases) else None
    return Assembled(tuple(tensors), tuple(pieces), tuple(offsets), base_tensors)


def _entry(spec: TensorSpec, holders: list) -> tuple[TensorEntry, TensorEntry | None]:
    """The table entry of one tensor from the (bands, cols, tiles, base tiles) of the parts holding it."""
    rows = spec.rows
    if not holders:
        if spec.shape and rows == 0:  # no rows: no part holds any, and it has no bytes
            return TensorEntry(spec.name, spec.dtype, spec.shape, digest(b"")), None
        raise CodecError(f"tensor {spec.name}: no part holds it")
    bounds, tiles, base_tiles = [0], [], []
    cols = holders[0][1]
    for bands, held_cols, held_tiles, held_base in holders:
        if bands[0] != bounds[-1]:
            raise CodecError(f"tensor {spec.name}: rows {bounds[-1]}..{bands[0]} held by no part, or twice")
        if held_cols != cols:
            raise CodecError(f"tensor {spec.name}: parts cut its columns differently")
        bounds += bands[1:]
        tiles += held_tiles
        base_tiles = None if base_tiles is None or held_base is None else base_tiles + list(held_base)
    if bounds[-1] != rows:
        raise CodecError(f"tensor {spec.name}: parts hold rows up to {bounds[-1]} of {rows}")
    return _gridded(spec, bounds, cols, tiles), (None if base_tiles is None else _gridded(spec, bounds, cols, base_tiles))


def _gridded(spec: TensorSpec, rows: list[int], cols: list[int], tiles: list[str]) -> TensorEntry:
    if len(tiles) == 1:
        return TensorEntry(spec.name, spec.dtype, spec.shape, tiles[0])
    if len(spec.shape) >= 2 and not cols:
        cols = [0, spec.shape[1]]
    grid = Grid(tuple(rows), tuple(cols), tuple(tiles))
    return TensorEntry(spec.name, spec.dtype, spec.shape, grid.combined(), grid)
