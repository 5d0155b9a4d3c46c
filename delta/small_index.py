"""Where each tensor's small words are, kept across versions by a holder of weights that takes one delta after another.

A delta locates most of its changes by rank among the base's small words (smallwords.py). Finding
them costs a pass over every word of each tensor the delta touches, about 1 ns per word on a CPU
core: half of a pool's in-place apply of a real SmolLM2 delta, for finding ~1% of the words. Between
two versions only the changed words move, and a changed word can only join or leave the small words
at its own position. So a pool that applies version after version to the same weights keeps, per
tensor, the ascending positions of the words whose magnitude is at most a bound (`SmallWordIndex`),
builds a tensor's entry in the pass it would have made anyway, and moves every entry along with each
version it applies, at a cost in the changed words. A segment whose `small_max` the bound covers then
reads its small words off the entry: no pass over the tensor.

An index describes the weights of one `weights_hash` (`weights_hash`); the applier (applier.py) uses it
only for a delta whose `base_hash` is that, and moves it to the delta's result only once every result
tensor has hashed right. It never decides what is written without that check: positions read from an
index that does not describe the base make the result hashes fail, and the applier then clears the
index and locates again from the words themselves. Memory: 4 bytes per small word (8 for tensors past
2**31 words), about 1-2% of the words for a real optimizer step's bounds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .kernels import moved_small_positions, ranked_positions
from .smallwords import CHUNK_WORDS, is_small

if TYPE_CHECKING:
    from .decoded_version import Located


@dataclass(frozen=True)
class _Entry:
    bound: int
    positions: np.ndarray
    """Ascending flat indices of the tensor's words of magnitude <= bound."""


class SmallWordIndex:
    """Per-tensor positions of small words of the weights whose `weights_hash` is `weights_hash`."""

    def __init__(self) -> None:
        self.weights_hash: str | None = None
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()  # tensors are located and moved on several threads at once

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self.weights_hash = None
            self._entries = {}

    def entry(self, name: str) -> tuple[int, np.ndarray] | None:
        """Tensor `name`'s bound and the ascending positions of its words up to it, if it has an entry."""
        entry = self._entries.get(name)
        return None if entry is None else (entry.bound, entry.positions)

    def ranked(self, name: str, words: np.ndarray, start: int, count: int, ranks: np.ndarray, small_max: int,
               bound: int) -> np.ndarray:
        """Positions of the small words of rank `ranks` (ascending) among the words of [start, start +
        count) of tensor `name` (its unsigned `words`) whose magnitude is at most `small_max`: read off
        the entry when its bound covers `small_max`, else off one made in a pass over the whole tensor,
        for magnitudes up to `bound` (>= small_max: the largest any segment of the tensor asks for)."""
        entry = self._entries.get(name)
        if entry is None or entry.bound < small_max:
            entry = _Entry(bound, _all_small(words, bound))
            with self._lock:
                self._entries[name] = entry
        return ranked_positions(entry.positions, words, start, count, ranks, small_max, entry.bound > small_max)

    def move(self, name: str, located: Located, written: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Carry tensor `name`'s entry over the write at `located` (numpy positions, per update) of
        `written` (per update, its old and new words in the same order): a word joins or leaves the
        small words only where it changed, so only those that did are searched for or inserted."""
        entry = self._entries.get(name)
        if entry is None:
            return
        positions = moved_small_positions(entry.positions, _joined(located.positions),
                                          _joined([old for old, _ in written]), _joined([new for _, new in written]),
                                          entry.bound)
        with self._lock:
            self._entries[name] = _Entry(entry.bound, positions)

    def moved_to(self, weights_hash: str) -> None:
        """The weights are now those of `weights_hash` (every entry has been moved)."""
        self.weights_hash = weights_hash


def _all_small(words: np.ndarray, small_max: int) -> np.ndarray:
    """Ascending positions of every word of magnitude <= small_max, a chunk at a time."""
    dtype = np.int32 if words.size < 2**31 else np.int64
    found = [np.flatnonzero(is_small(words[s : s + CHUNK_WORDS], small_max)).astype(dtype) + dtype(s)
             for s in range(0, words.size, CHUNK_WORDS)]
    return np.concatenate(found) if found else np.empty(0, dtype=dtype)


def _joined(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
