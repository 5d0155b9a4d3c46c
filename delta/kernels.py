"""Compiled loops for the codec's per-change bookkeeping, where numpy would pass over the changes many times.

A real optimizer step is about a million scattered word changes. Four jobs on them cost a pool more
in numpy calls than in bytes: turning a piece's gap and code bytes into change locations and key
differences (a dozen array passes), reading the changes located by small-word rank off a tensor's
small-word index (a search, a filter, a gather), moving that index along with the changes (a
membership test, a sort, a delete and an insert per tensor, holding the GIL between them), and
writing the changed words (a gather, two key maps, a choice and a scatter, latency-bound on the
scattered cache lines, which the loop prefetches). Each is one loop in `_kernels.c`, a C extension
built with the package, which releases the GIL. What they
compute is specified by docs/FORMAT.md (gaps and codes) and small_index.py (the index); tests check
each against a plain numpy form of the same computation.

The C loops check every offset they read from a piece against its limit, and every position against
the array it indexes. The functions here check what the loops cannot: dtypes and sizes.
"""

from __future__ import annotations

import numpy as np

from .dtypes import NP_UWORDS
from .errors import CorruptError

try:
    from . import _kernels
except ImportError as e:  # the build skips the extension where it cannot compile it (setup.py)
    raise ImportError(
        "deltamesh's codec extension (delta/_kernels.c) is not built: reinstall deltamesh where a C compiler "
        "and the Python headers are present (for example Debian's gcc and python3-dev)") from e


def change_locations(gaps: np.ndarray, runs: np.ndarray, offsets: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Where the changes of a delta piece are, from its gap stream `gaps` (uint8, docs/FORMAT.md).

    The changes come in runs of `runs[k]` changes, each counted from where its run begins: entry j is
    change j's offset in its run plus its run's `offsets[k]`. An offset must stay below its run's
    `limits[k]` (the segment's length). Raises `CorruptError` on a gap stream that holds another
    number of gaps than the runs, ends inside a gap, or puts a change past its segment."""
    bounds = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum(runs, out=bounds[1:])
    out = np.empty(int(bounds[-1]), dtype=np.int64)
    limits = np.ascontiguousarray(limits, dtype=np.int64)
    status, where, value = _kernels.locations(np.ascontiguousarray(gaps, dtype=np.uint8), bounds,
                                              np.ascontiguousarray(offsets, dtype=np.int64), limits, out)
    if status == 2:
        raise CorruptError(f"change at offset {value} past its segment of {int(limits[where])}")
    if status == 1 and where != out.size:
        raise CorruptError(f"gap stream holds {where} gaps, segments need {out.size}")
    if status == 1:
        raise CorruptError("gap stream has trailing bytes")
    return out


def check_codes(codes: np.ndarray, count: int) -> None:
    """`CorruptError` unless the packed 4-bit `codes` (two per byte, low nibble first) hold exactly
    `count` codes, an odd count's padding nibble being 0."""
    if codes.size != (count + 1) // 2:
        raise CorruptError(f"code stream has {codes.size} bytes, {count} codes need {(count + 1) // 2}")
    if count % 2 and codes[-1] >> 4:
        raise CorruptError("code stream padding is not zero")


def key_moves(codes: np.ndarray, first: int, count: int, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The key differences (unsigned words of `width` bytes) of codes `first` to `first + count` of
    the packed 4-bit `codes` (stored value = zigzag(key difference) - 1, docs/FORMAT.md), which of
    them are literals (code 15: their value is to be filled with the stored word), and how many."""
    values = np.empty(count, dtype=NP_UWORDS[width])
    literal = np.empty(count, dtype=np.bool_)
    literals = _kernels.moves(np.ascontiguousarray(codes, dtype=np.uint8), first, values, literal.view(np.uint8))
    return values, literal, literals


def moved_small_positions(positions: np.ndarray, where: np.ndarray, old: np.ndarray, new: np.ndarray,
                          bound: int) -> np.ndarray:
    """Ascending `positions` (int32 or int64) of a tensor's words of magnitude <= `bound`, carried over
    the write of the `new` words over the `old` (unsigned, one per change) at `where` (int64, any
    order): the positions of words that were small and no longer are leave, those of words that
    became small join (small_index.py)."""
    out = np.empty(positions.size + where.size, dtype=positions.dtype)
    count = _kernels.moved(np.ascontiguousarray(positions), np.ascontiguousarray(where, dtype=np.int64),
                           np.ascontiguousarray(old), np.ascontiguousarray(new, dtype=old.dtype), bound, out)
    return out[:count]


def ranked_positions(small: np.ndarray, words: np.ndarray, start: int, count: int, ranks: np.ndarray,
                     small_max: int, sift: bool) -> np.ndarray:
    """Positions (int64) of the words of rank `ranks` (strictly ascending) among the small words of
    [start, start + count) of a tensor's unsigned `words`, read off `small`, the ascending positions
    of its words up to a magnitude bound; `sift` when that bound is above `small_max`, so that words
    above `small_max` are skipped. A rank beyond the segment's small words raises `CorruptError`."""
    out = np.empty(ranks.size, dtype=np.int64)
    taken = _kernels.ranked(np.ascontiguousarray(small), np.ascontiguousarray(words), start, start + count,
                            np.ascontiguousarray(ranks, dtype=np.int64), small_max, sift, out)
    if taken != ranks.size:
        raise CorruptError(f"rank {int(ranks[taken])} is beyond the small words of its segment")
    return out


def write_changes(words: np.ndarray, positions: np.ndarray, values: np.ndarray, literal: np.ndarray | None,
                  floating: bool) -> tuple[np.ndarray, np.ndarray]:
    """Write the changes at `positions` (int64) of unsigned `words` in place: where `literal`, the
    value itself, else the key difference added (`bitdiff.apply_changes`). Returns the old words and
    the new, in `positions` order. A position out of bounds raises `CorruptError` before any write; a
    position given twice is written twice (its second old word is its first new one)."""
    old = np.empty(positions.size, dtype=words.dtype)
    new = np.empty(positions.size, dtype=words.dtype)
    flags = _NO_LITERAL if literal is None else literal.view(np.uint8)
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    if _kernels.write(words, positions, np.ascontiguousarray(values, dtype=words.dtype), flags, floating, old, new) < 0:
        raise CorruptError(f"a change lies outside the tensor's {words.size} words")
    return old, new


_NO_LITERAL = np.zeros(0, dtype=np.uint8)
