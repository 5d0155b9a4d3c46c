"""Writing one tensor's decoded changes, and the undo record that makes an in-place apply atomic.

First each update's changes are located in the base (`locate_cpu` / `locate_torch`: positions of
changes coded by small-word rank are read off the base's words, all before any write). Then they are
written, by one of two paths chosen by where the target lives:

- `patch_cpu`: a tensor in CPU memory, through a zero-copy numpy view of its words (torch-allocated
  live parameters and numpy-allocated weights alike). In place: one compiled loop per update
  (`kernels.write_changes`: read, change and write each word, keeping the old and new), then one
  hash of the tensor. Into a copy: the changes are merged into one ascending list and written in one
  pass, chunk by chunk while each chunk is in cache (copy, hash the base if it still needs checking,
  write the changed words, hash the result), so the base is read once and the result written once.
- `patch_torch`: the same in torch ops on the tensor's own device (a GPU engine's live weights are
  never pulled to the host to be patched); hashing copies each tensor to the CPU.

Before any in-place write the overwritten words are kept in a `Rollback` (~10 bytes per changed
word: positions and old words), so the caller can put the target back bit for bit.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch
import xxhash

from .bitdiff import apply_changes
from .decoded_version import Located, empty_tensor
from .dtypes import is_float, np_words, word_view
from .errors import CorruptError
from .grid import words_digest
from .kernels import write_changes
from .manifest import TensorEntry
from .small_index import SmallWordIndex
from .tensor_updates import TensorUpdate, changes_torch
from .tensors import tensor_digest

PASS_CHUNK_BYTES = 1 << 20

Patched = tuple[torch.Tensor, str, "str | None"]
"""A patched tensor, the digest of its bytes, and the digest of its base when it was asked for."""


class Rollback:
    """Words overwritten in place (numpy arrays or torch tensors alike), restored newest first."""

    def __init__(self) -> None:
        self._kept: list[tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]] = []
        self._lock = threading.Lock()  # tensors are patched on several threads at once

    def keep(self, words: np.ndarray | torch.Tensor, positions: np.ndarray | torch.Tensor,
             old: np.ndarray | torch.Tensor | None = None) -> None:
        """Remember what `words[positions]` holds now (`old`, when the caller has read it already)."""
        old = words[positions] if old is None else old  # fancy indexing copies
        with self._lock:
            self._kept.append((words, positions, old))

    def restore(self) -> None:
        for words, positions, old in reversed(self._kept):
            if isinstance(words, np.ndarray):
                # Newest first within one record too: a position written twice (a corrupt delta) kept
                # its first write's result as its second old word, and numpy lets the last one win.
                words[positions[::-1]] = old[::-1]
            else:
                words[positions] = old  # the torch path keeps each old word before any write
        self._kept = []


def locate_cpu(updates: Sequence[TensorUpdate], words: np.ndarray, small_index: SmallWordIndex | None = None) -> Located:
    """Where each update writes, found in the base's unsigned `words`, or read off `small_index`."""
    ranked = [u for u in updates if u.small_ranks is not None]
    if small_index is None or not ranked:
        return Located(tuple(u.locate(words) for u in updates))
    bound = max(u.small_max for u in ranked)
    return Located(tuple(
        u.locate(words, None if u.small_ranks is None else
                 small_index.ranked(u.tensor, words, u.start, u.count, u.small_ranks, u.small_max, bound))
        for u in updates))


def locate_torch(updates: Sequence[TensorUpdate], words: torch.Tensor) -> Located:
    """`locate_cpu` in torch ops on the signed `words`' own device."""
    return Located(tuple(u.locate_torch(words) for u in updates))


def patch_cpu(entry: TensorEntry, updates: Sequence[TensorUpdate], located: Located, base: torch.Tensor, *,
              in_place: bool, rollback: Rollback, hash_base: bool,
              written: list[tuple[np.ndarray, np.ndarray]] | None = None, words: np.ndarray | None = None) -> Patched:
    """Write the located changes (numpy) into a CPU tensor or a copy of it, and hash the result. In
    place, each update's old and new words are appended to `written` when it is given. `words`: the
    base's `np_words`, when the caller has them."""
    src = np_words(base) if words is None else words
    floating = is_float(entry.dtype)
    if in_place:
        base_digest = words_digest(src, entry.shape, entry.grid) if hash_base else None
        for u, p in zip(updates, located.positions):
            old, new = write_changes(src, p, u.values, u.literal, floating)  # all or nothing
            rollback.keep(src, p, old)
            if written is not None:
                written.append((old, new))
        return base, words_digest(src, entry.shape, entry.grid), base_digest
    positions, values, literal = _merged(entry, updates, located)
    target = empty_tensor(entry.shape, base.dtype)
    dst = np_words(target)
    # A tensor hashed by tiles is hashed after the pass: its tiles are not the pass's chunks.
    streamed = entry.grid is None
    hasher_base = xxhash.xxh3_128() if hash_base and streamed else None
    hasher_out = xxhash.xxh3_128() if streamed else None
    step = max(1, PASS_CHUNK_BYTES // src.itemsize)
    starts = np.arange(0, src.size + step, step)
    bounds = np.searchsorted(positions, starts)
    for c, s in enumerate(starts[:-1]):
        e = min(s + step, src.size)
        if hasher_base is not None:
            hasher_base.update(src[s:e])
        np.copyto(dst[s:e], src[s:e])
        lo, hi = bounds[c], bounds[c + 1]
        if hi > lo:
            p = positions[lo:hi]
            dst[p] = apply_changes(dst[p], values[lo:hi], None if literal is None else literal[lo:hi], floating)
        if hasher_out is not None:
            hasher_out.update(dst[s:e])
    if not streamed:
        return (target, words_digest(dst, entry.shape, entry.grid),
                words_digest(src, entry.shape, entry.grid) if hash_base else None)
    return target, hasher_out.hexdigest(), None if hasher_base is None else hasher_base.hexdigest()


def patch_torch(entry: TensorEntry, updates: Sequence[TensorUpdate], located: Located, base: torch.Tensor, *,
                in_place: bool, rollback: Rollback, hash_base: bool) -> Patched:
    """Write the located changes (torch, on `base`'s device) into `base` or a copy of it, then hash it."""
    base_digest = tensor_digest(base, entry.grid) if hash_base else None
    target = base if in_place else base.detach().clone()
    dst = word_view(target.detach())
    for u, p in zip(updates, located.positions):
        if in_place:
            rollback.keep(dst, p)
        literal = None if u.literal is None else torch.from_numpy(u.literal).to(dst.device)
        dst[p] = changes_torch(dst[p], u.torch_values(dst.device), literal, entry.dtype)
    return target, tensor_digest(target, entry.grid), base_digest


def _merged(entry: TensorEntry, updates: Sequence[TensorUpdate],
            located: Located) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The tensor's changes as one list in ascending position order (for the chunked pass)."""
    positions = np.concatenate(located.positions)
    values = np.concatenate([u.values for u in updates])
    literal = None
    if any(u.literal is not None for u in updates):
        literal = np.concatenate([np.zeros(u.values.size, bool) if u.literal is None else u.literal for u in updates])
    if positions.size > 1 and not bool((positions[1:] > positions[:-1]).all()):
        order = np.argsort(positions, kind="stable")
        positions, values = positions[order], values[order]
        literal = None if literal is None else literal[order]
        if not bool((positions[1:] > positions[:-1]).all()):
            raise CorruptError(f"tensor {entry.name}: a word changed twice")
    return positions, values, literal
