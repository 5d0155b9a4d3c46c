"""A version in parts: the hash grid of a tensor and the element spans of a piece (format 4).

A version built where the weights are (each trainer rank encoding the rows of each tensor it holds)
cannot name a tensor by one hash of all its bytes: no process holds them all. Nor can a pool rank
that holds a tensor-parallel slice check its share against such a hash. So a tensor may carry a
`Grid`: its rows (dim 0) cut into bands, and for tensors of two or more dimensions its dim 1 cut
into bands too; every tile (a row band by a column band, with every further dimension whole) has
its own xxh3-128, of the tile's bytes in row-major order, and the tensor's hash in the table is the
xxh3-128 of its tiles' 16-byte digests in row-major tile order (`hashing.combine_digests`), so the
version's `weights_hash` binds every tile. A process holding whole tiles checks them alone.

A piece may carry `spans`: for each tensor it writes, the element range `[start, stop)` its segments
lie in. Every segment of the piece lies inside its tensor's span (the decoder refuses one that does not), so a pool rank picks
the pieces that cover its share from the signed manifest before fetching any. Both are optional: a
version without them is written in format 3 (docs/FORMAT.md). This module is pure data and checks
(no numpy, no torch): a gateway reads manifests with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import CorruptError
from .hashing import combine_digests

MAX_BANDS = 1 << 16
"""Most bands along one dimension of one tensor's grid."""
MAX_TILES = 1 << 22
"""Most tiles over all grids of one manifest (16 bytes of digest each: 64 MiB of table at most)."""
MAX_SPANS = 1 << 22
"""Most spans over all pieces of one manifest."""
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Grid:
    """Bands of a tensor's dim 0 (`rows`) and dim 1 (`cols`, empty for a 1-D tensor) as bounds from 0 to
    the dimension's size, and the digest of each tile, row-major over (row band, column band)."""

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    tiles: tuple[str, ...]

    @property
    def col_bands(self) -> int:
        return max(1, len(self.cols) - 1)

    def tile_index(self, row_band: int, col_band: int) -> int:
        return row_band * self.col_bands + col_band

    def combined(self) -> str:
        """The tensor's hash in the manifest's table: the digest of its tiles' digests."""
        return combine_digests(self.tiles)

    def body(self) -> list:
        return [list(self.rows), list(self.cols), list(self.tiles)]

    @classmethod
    def from_body(cls, raw: Any) -> "Grid":
        rows, cols, tiles = raw
        return cls(tuple(rows), tuple(cols), tuple(tiles))


@dataclass(frozen=True)
class Span:
    """Elements [start, stop) of tensor `tensor` (an index into the manifest's table)."""

    tensor: int
    start: int
    stop: int

    def body(self) -> list[int]:
        return [self.tensor, self.start, self.stop]


def spans_body(spans: Sequence[Span]) -> list[list[int]]:
    return [s.body() for s in spans]


def spans_from_body(raw: Any) -> tuple[Span, ...]:
    return tuple(Span(t, a, b) for t, a, b in raw)


def check_grid(name: str, shape: Sequence[int], digest: str, grid: Grid, bad: Callable[[str], CorruptError]) -> int:
    """Raise `bad(...)` unless `grid` is a well-formed grid of a tensor of `shape` hashing to `digest`;
    returns its number of tiles."""
    where = f"tensor {name!r}: grid"
    if len(shape) == 0:
        raise bad(f"{where} of a 0-d tensor")
    _check_bounds(where + " rows", grid.rows, shape[0], bad)
    if len(shape) == 1:
        if grid.cols:
            raise bad(f"{where} cuts dim 1 of a 1-d tensor")
    else:
        _check_bounds(where + " cols", grid.cols, shape[1], bad)
    tiles = (len(grid.rows) - 1) * grid.col_bands
    if tiles < 2:
        raise bad(f"{where} of one tile (a whole tensor has a plain hash)")
    if len(grid.tiles) != tiles or not all(isinstance(h, str) and _HEX32.match(h) for h in grid.tiles):
        raise bad(f"{where}: {tiles} tiles need as many digests of 32 hex characters")
    if grid.combined() != digest:
        raise bad(f"{where}: its tiles do not hash to the tensor's hash")
    return tiles


def _check_bounds(where: str, bounds: Sequence[int], size: int, bad: Callable[[str], CorruptError]) -> None:
    if not 2 <= len(bounds) <= MAX_BANDS + 1 or not all(_is_int(b) for b in bounds):
        raise bad(f"{where}: bounds must be 2 to {MAX_BANDS + 1} integers")
    if bounds[0] != 0 or bounds[-1] != size or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise bad(f"{where}: bounds must rise strictly from 0 to {size}")


def check_spans(index: int, tensors: Sequence[int], spans: Sequence[Span], numel: Callable[[int], int],
                bad: Callable[[str], CorruptError]) -> None:
    """Raise `bad(...)` unless `spans` name, in order, one non-empty range inside each tensor that piece
    `index` writes (`tensors`, ascending)."""
    if [s.tensor for s in spans] != sorted(tensors):
        raise bad(f"piece {index}: spans must name each tensor it writes once, in order")
    for s in spans:
        if not (_is_int(s.start) and _is_int(s.stop)) or not 0 <= s.start < s.stop <= numel(s.tensor):
            raise bad(f"piece {index}: span [{s.start}, {s.stop}) outside tensor {s.tensor}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
