"""Coding where small weights changed: positions counted among the base's small-magnitude words only.

An optimizer step of size ~lr changes a bf16 word when lr is a sizable fraction of its spacing, which
is proportional to its magnitude: changes crowd into the small weights (and weights that are exactly
zero change almost always). Since the receiver holds the base, a segment may split its changes in
two groups at a magnitude bound `small_max` chosen by the encoder: changes of words whose base
magnitude is <= small_max are located by their rank among such words of the segment (dense, so
cheap gaps), the others by plain position. The decoder recomputes the same set of small words from
the base. Only sign-magnitude (float) dtypes use this; magnitude = word without its sign bit.

Everything is chunked: neither side ever materializes an index of all small words.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import CorruptError

CHUNK_WORDS = 1 << 20
SAMPLE_STRIDE = 61  # base words sampled to estimate how many small words each bound admits ...
SAMPLE_WORDS = 1 << 14  # ... but no more than about this many per tensor: the histogram is as good
MIN_SMALL_WORDS = 4096  # tensors smaller than this locate all changes by plain position


def sample_stride(n: int) -> int:
    """The sampling stride for a tensor of `n` words."""
    return max(SAMPLE_STRIDE, n // SAMPLE_WORDS)


def magnitude_mask(width: int) -> int:
    return (1 << (width * 8 - 1)) - 1


def _class_shift(width: int) -> int:
    # Classes are the top 8 bits of the magnitude: the exponent of bf16 and fp32.
    return max(0, width * 8 - 9)


@dataclass
class MagnitudeSample:
    """Histogram of the magnitude classes of every `stride`-th base word, built chunk by chunk
    (`add`) so it can ride along another pass over the base while each chunk is in cache."""

    width: int
    stride: int = SAMPLE_STRIDE
    counts: np.ndarray = field(init=False)
    size: int = 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(_classes(self.width), dtype=np.int64)

    def add(self, chunk: np.ndarray, first: int) -> None:
        """Count the sampled words of `chunk`, the base's words from index `first` on."""
        offset = -first % self.stride
        if offset < chunk.size:
            self.add_words(chunk[offset :: self.stride])

    def add_words(self, sample: np.ndarray) -> None:
        dtype = sample.dtype.type
        shift, mask = dtype(_class_shift(self.width)), dtype(magnitude_mask(self.width))
        self.counts += np.bincount((sample & mask) >> shift, minlength=self.counts.size)
        self.size += sample.size

    def add_torch(self, words: torch.Tensor) -> None:
        """Count every `stride`-th word of a whole tensor's signed word view on its own device; only
        the histogram comes to the host. (Masking the sign bit off makes the signed words' classes
        the unsigned words' classes.)"""
        sample = words[:: self.stride]
        classes = ((sample & magnitude_mask(self.width)) >> _class_shift(self.width)).long()
        self.counts += torch.bincount(classes, minlength=self.counts.size).cpu().numpy()
        self.size += sample.numel()


def _classes(width: int) -> int:
    return (magnitude_mask(width) >> _class_shift(width)) + 1


def choose_small_max(base: np.ndarray, changed_base: np.ndarray, sample: MagnitudeSample | None = None) -> int | None:
    """The magnitude bound that minimizes the estimated position cost, or None if plain gaps win.

    `base` are the tensor's unsigned base words, `changed_base` the base words that changed, `sample`
    the base's `MagnitudeSample` if already taken (else it is taken here).
    """
    if changed_base.size == 0 or base.size < MIN_SMALL_WORDS:
        return None
    if sample is None:
        sample = MagnitudeSample(base.itemsize, sample_stride(base.size))
        sample.add_words(base[:: sample.stride])
    return small_max_of_sample(base.size, changed_base, sample)


def small_max_of_sample(n: int, changed_base: np.ndarray, sample: MagnitudeSample) -> int | None:
    """`choose_small_max` for a base of `n` words known only by its `sample` (the base itself may be
    on another device)."""
    width, k = changed_base.itemsize, changed_base.size
    if k == 0 or n < MIN_SMALL_WORDS:
        return None
    dtype = changed_base.dtype.type
    shift, mask = dtype(_class_shift(width)), dtype(magnitude_mask(width))
    classes = _classes(width)
    words_le = np.cumsum(sample.counts) * (n / max(1, sample.size))
    changes_le = np.cumsum(np.bincount((changed_base & mask) >> shift, minlength=classes))
    # Small words in the index space are at least the small changes themselves.
    space = np.maximum(words_le, changes_le).astype(np.float64)
    cost = _gap_bits(changes_le, space) + _gap_bits(k - changes_le, np.full(classes, float(n)))
    best = int(np.argmin(cost))
    if cost[best] >= 0.9 * _gap_bits(np.array([k]), np.array([float(n)]))[0]:
        return None
    return ((best + 1) << int(shift)) - 1


def _gap_bits(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Estimated bits to code k positions among n (binary entropy, plus a little per position)."""
    p = np.clip(k / np.maximum(n, 1), 1e-12, 1 - 1e-12)
    h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return np.where(k > 0, n * h + 0.1 * k, 0.0)


def is_small(words: np.ndarray, small_max: int) -> np.ndarray:
    dtype = words.dtype.type
    return (words & dtype(magnitude_mask(words.itemsize))) <= dtype(small_max)


def small_words_before(words: np.ndarray, positions: np.ndarray, small_max: int) -> np.ndarray:
    """For each of the ascending `positions`, how many small words of `words` precede it.

    Each chunk's small-word mask is packed to bits and popcounted per 64 words, so the cost is one
    pass over the words plus work per position, never an index of every small word.
    """
    out = np.empty(positions.size, dtype=np.int64)
    seen, done = 0, 0
    for s in range(0, words.size, CHUNK_WORDS):
        if done == positions.size:
            break
        e = min(s + CHUNK_WORDS, words.size)
        upto = int(np.searchsorted(positions, e, side="left"))
        bits = np.packbits(is_small(words[s:e], small_max), bitorder="little")
        blocks = np.zeros((bits.size + 7) // 8 * 8, dtype=np.uint8)
        blocks[: bits.size] = bits
        blocks64 = blocks.view("<u8")
        counts = np.bitwise_count(blocks64)
        if upto > done:
            local = positions[done:upto] - s
            block = local >> 6
            before = np.cumsum(counts, dtype=np.int64) - counts  # small words before each block
            below = (np.uint64(1) << (local & 63).astype(np.uint64)) - np.uint64(1)
            out[done:upto] = seen + before[block] + np.bitwise_count(blocks64[block] & below)
        seen += int(counts.sum(dtype=np.int64))
        done = upto
    return out


def small_words_before_torch(words: torch.Tensor, positions: torch.Tensor, small_max: int,
                             chunk_words: int = CHUNK_WORDS) -> torch.Tensor:
    """`small_words_before` on a signed word view and ascending int64 `positions`, both on the words'
    device, where the result (int64) stays: a chunk's small-word mask is summed cumulatively and read
    at the positions inside it, so the temporaries are a chunk's, never the tensor's."""
    out = torch.empty_like(positions)
    total = positions.numel()
    if total == 0:
        return out
    n = words.numel()
    starts = torch.arange(0, n, chunk_words, dtype=torch.int64, device=positions.device)
    bounds = torch.searchsorted(positions, starts).tolist() + [total]  # the one wait for the device
    seen = torch.zeros((), dtype=torch.int64, device=words.device)
    mask = magnitude_mask(words.element_size())
    for c, s in enumerate(range(0, n, chunk_words)):
        lo, hi = bounds[c], bounds[c + 1]
        if lo == total:
            break
        small = (words[s : s + chunk_words] & mask) <= small_max
        if hi == lo:
            seen += small.sum()
            continue
        upto = torch.cumsum(small, 0, dtype=torch.int32)  # small words up to and including each word
        local = positions[lo:hi] - s
        # Widened before `seen` is added: a 0-d int64 does not widen an int32 tensor in torch's promotion.
        out[lo:hi] = (upto[local] - small[local].to(torch.int32)).to(torch.int64) + seen
        seen += upto[-1]
    return out


def small_positions(words: np.ndarray, start: int, count: int, ranks: np.ndarray, small_max: int) -> np.ndarray:
    """Absolute positions of the small words of rank `ranks` (ascending) in [start, start + count)."""
    out = np.empty(ranks.size, dtype=np.int64)
    seen, done = 0, 0
    for s in range(start, start + count, CHUNK_WORDS):
        if done == ranks.size:
            break
        e = min(s + CHUNK_WORDS, start + count)
        found = np.flatnonzero(is_small(words[s:e], small_max))
        upto = int(np.searchsorted(ranks, seen + found.size, side="left"))
        out[done:upto] = found[ranks[done:upto] - seen] + s
        seen += found.size
        done = upto
    if done != ranks.size:
        raise CorruptError(f"rank {int(ranks[done])} beyond the {seen} small words of its segment")
    return out


def small_positions_torch(flat: torch.Tensor, start: int, count: int, ranks: torch.Tensor, small_max: int) -> torch.Tensor:
    """`small_positions` on a live signed word view, on its own device."""
    mask = (flat[start : start + count] & magnitude_mask(flat.element_size())) <= small_max
    found = torch.nonzero(mask).squeeze(1)
    if ranks.numel() and int(ranks[-1]) >= found.numel():
        raise CorruptError(f"rank {int(ranks[-1])} beyond the {found.numel()} small words of its segment")
    return found[ranks] + start
