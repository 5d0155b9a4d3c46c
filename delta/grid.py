"""Hashing a tensor, or a slice of one, by the tiles of a hash grid (slices.py), on the CPU.

`tile_digests` hashes the tiles of an array laid out as a tensor (or as the rows and columns of one
that a rank holds); `words_digest` is a whole tensor's digest as the manifest's table names it:
plain xxh3-128 of its bytes without a grid, the digest of its tiles' digests with one. A tile whose
column band is the whole of dim 1 is a contiguous range of the tensor's bytes and is hashed in place;
any other is copied out row-major first (a column band of a row-major tensor is strided).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .hashing import combine_digests, digest
from .slices import Grid


def tile_digests(words: np.ndarray, shape: Sequence[int], rows: Sequence[int], cols: Sequence[int],
                 *, row_offset: int = 0, col_offset: int = 0) -> list[str]:
    """Digests of the tiles cut by bounds `rows` (dim 0) and `cols` (dim 1; empty for 1-D) from the
    array `words` holds (any dtype, flat or shaped, row-major with dims `shape`), row-major over tiles.
    The array may be a slice of a larger tensor: its dim 0 starts at the tensor's row `row_offset`
    and its dim 1 at column `col_offset`, and the bounds are the tensor's."""
    flat = words.reshape(-1)
    if len(shape) == 0:
        raise ValueError("a 0-d tensor has no tiles")
    row = flat.size // shape[0] if shape[0] else 0  # elements per row of dim 0
    out = []
    for r0, r1 in zip(rows, rows[1:]):
        a, b = r0 - row_offset, r1 - row_offset
        if a < 0 or b > shape[0]:
            raise ValueError(f"row band [{r0}, {r1}) outside the rows held [{row_offset}, {row_offset + shape[0]})")
        if len(cols) < 2 or (cols[0] - col_offset == 0 and cols[-1] - col_offset == shape[1] and len(cols) == 2):
            out.append(digest(flat[a * row : b * row]))
            continue
        shaped = flat.reshape(shape[0], shape[1], -1)
        for c0, c1 in zip(cols, cols[1:]):
            x, y = c0 - col_offset, c1 - col_offset
            if x < 0 or y > shape[1]:
                raise ValueError(f"column band [{c0}, {c1}) outside the columns held")
            out.append(digest(np.ascontiguousarray(shaped[a:b, x:y])))
    return out


def words_digest(words: np.ndarray, shape: Sequence[int], grid: Grid | None) -> str:
    """A whole tensor's digest as a manifest's table names it (see the module docstring)."""
    if grid is None:
        return digest(words)
    return combine_digests(tile_digests(words, shape, grid.rows, grid.cols))
