"""Bit-level change detection between two versions of a tensor, and the code of how each word moved.

A word is mapped to an order-preserving integer key: for sign-magnitude dtypes (floats) the magnitude
bits of negative words are flipped, so that consecutive representable values have consecutive keys,
-0.0 and +0.0 are neighbours, and the map is a bijection on the word (NaN payloads survive). Integer
dtypes are their own key. The change of a word is the key difference modulo 2**bits, zigzagged so
that +-1 ulp becomes 2 or 1; since a changed word never has difference 0, the stored value is
zigzag - 1 (so +-1 ulp is 1 or 0); pieces code values below 15 and store any other change as its
new word (a literal). Everything works on unsigned numpy words, whose arithmetic wraps by definition;
`changed_words_torch` is the change scan in torch, on the signed word views of tensors on any device
(device_scan.py), and finds the same words (equality of words is a matter of bits either way).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

SCAN_CHUNK_BYTES = 1 << 21  # per array per step: both chunks and the mask stay in L2/L3


def scan_changes(old: np.ndarray, new: np.ndarray, hash_old=None, hash_new=None,
                 visit_old: Callable[[np.ndarray, int], None] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where two unsigned word arrays of the same size differ: (positions, old words, new words).

    Positions are ascending flat indices (int64). Compares 8 bytes at a time, then resolves which
    words inside a differing 8-byte block changed; chunked so each chunk is compared, hashed (into the
    optional xxhash objects `hash_old`, `hash_new`), shown to `visit_old(old words, index of the
    first)` and mined for changes while it is in cache, and no temporary as large as the arrays is
    ever allocated.
    """
    n, width = old.size, old.itemsize
    per = 8 // width
    body = n - n % per
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    if body:
        a = old[:body].view(np.uint64)
        b = new[:body].view(np.uint64)
        step = SCAN_CHUNK_BYTES // 8
        mask = np.empty(min(step, a.size), dtype=bool)
        for s in range(0, a.size, step):
            e = min(s + step, a.size)
            m = mask[: e - s]
            np.not_equal(a[s:e], b[s:e], out=m)
            if hash_old is not None:
                hash_old.update(a[s:e])
            if hash_new is not None:
                hash_new.update(b[s:e])
            if visit_old is not None:
                visit_old(a[s:e].view(old.dtype), s * per)
            blocks = np.flatnonzero(m)
            if not blocks.size:
                continue
            old_blocks = a[s:e][blocks]
            new_blocks = b[s:e][blocks]
            if per == 1:
                found.append((blocks + s, old_blocks, new_blocks))
                continue
            old_words = old_blocks.view(old.dtype)
            new_words = new_blocks.view(old.dtype)
            inner = np.flatnonzero(old_words != new_words)
            found.append(((blocks[inner // per] + s) * per + inner % per, old_words[inner], new_words[inner]))
    if body < n:
        if hash_old is not None:
            hash_old.update(old[body:])
        if hash_new is not None:
            hash_new.update(new[body:])
        if visit_old is not None:
            visit_old(old[body:], body)
        tail = np.flatnonzero(old[body:] != new[body:]) + body
        found.append((tail, old[tail], new[tail]))
    if not found:
        return np.empty(0, dtype=np.int64), old[:0].copy(), new[:0].copy()
    positions = np.concatenate([f[0] for f in found]).astype(np.int64, copy=False)
    return positions, np.concatenate([f[1] for f in found]), np.concatenate([f[2] for f in found])


def changed_words_torch(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`scan_changes` of two signed word views of the same size, in torch on their own device, where
    the results stay: (ascending int64 positions, old words, new words).

    Compares 8 bytes at a time where both views start 8-byte aligned, then resolves the words inside
    differing blocks; the callers pass chunks, so the mask is a chunk's, never the tensor's.
    """
    width = old.element_size()
    per = 8 // width
    n = old.numel()
    body = n - n % per if per > 1 and _aligned(old, per) and _aligned(new, per) else 0
    found = []
    if body:
        a, b = old[:body].view(torch.int64), new[:body].view(torch.int64)
        blocks = torch.nonzero(a != b).squeeze(1)
        old_words, new_words = a[blocks].view(old.dtype), b[blocks].view(old.dtype)
        inner = torch.nonzero(old_words != new_words).squeeze(1)
        found.append((blocks[inner // per] * per + inner % per, old_words[inner], new_words[inner]))
    rest = torch.nonzero(old[body:] != new[body:]).squeeze(1) + body
    found.append((rest, old[rest], new[rest]))
    return tuple(torch.cat(parts) for parts in zip(*found))


def _aligned(words: torch.Tensor, per: int) -> bool:
    # A view as 8-byte words must start on an 8-byte boundary (torch checks the offset, CUDA the address).
    return words.storage_offset() % per == 0 and words.data_ptr() % 8 == 0


def to_key(words: np.ndarray, is_float: bool) -> np.ndarray:
    """The order-preserving key of unsigned words (an involution: to_key(to_key(w)) == w)."""
    if not is_float:
        return words
    bits = words.itemsize * 8
    dtype = words.dtype.type
    magnitude = dtype((1 << (bits - 1)) - 1)
    return words ^ ((words >> dtype(bits - 1)) * magnitude)


def encode_moves(old: np.ndarray, new: np.ndarray, is_float: bool) -> np.ndarray:
    """Stored move values of changed words, zigzag(key(new) - key(old)) - 1, as unsigned words."""
    dtype = old.dtype.type
    bits = old.itemsize * 8
    d = to_key(new, is_float) - to_key(old, is_float)
    ones = dtype(np.iinfo(dtype).max)
    zig = (d << dtype(1)) ^ ((d >> dtype(bits - 1)) * ones)
    return zig - dtype(1)


def apply_changes(old: np.ndarray, values: np.ndarray, literal: np.ndarray | None, is_float: bool) -> np.ndarray:
    """New words from old words: key difference added, or (where `literal`) the value itself."""
    moved = to_key(to_key(old, is_float) + values, is_float)
    return moved if literal is None else np.where(literal, values, moved)
