"""The compiled loops (delta/_kernels.c) compute what plain numpy forms of the same jobs compute, and
refuse what is out of bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltamesh.delta import CorruptError, kernels, smallwords
from deltamesh.delta.bitdiff import apply_changes
from deltamesh.delta.patch import Rollback

WIDTHS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(WIDTHS)), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_write_changes_is_apply_changes_in_place(width, floating, literals, seed):
    rng = np.random.default_rng(seed)
    dtype = WIDTHS[width]
    words = rng.integers(0, np.iinfo(dtype).max, 500, dtype=dtype, endpoint=True)
    positions = np.sort(rng.choice(words.size, 120, replace=False)).astype(np.int64)
    values = rng.integers(0, np.iinfo(dtype).max, positions.size, dtype=dtype, endpoint=True)
    literal = rng.random(positions.size) < 0.3 if literals else None
    expected = words.copy()
    expected[positions] = apply_changes(expected[positions], values, literal, floating)
    before = words.copy()

    old, new = kernels.write_changes(words, positions, values, literal, floating)

    assert np.array_equal(words, expected)
    assert np.array_equal(old, before[positions]) and np.array_equal(new, expected[positions])


@pytest.mark.parametrize("bad", [-1, 500])
def test_write_changes_refuses_a_position_out_of_bounds_before_any_write(bad):
    words = np.arange(500, dtype=np.uint16)
    positions = np.array([3, 7, bad], dtype=np.int64)
    with pytest.raises(CorruptError):
        kernels.write_changes(words, positions, np.ones(3, np.uint16), None, True)
    assert np.array_equal(words, np.arange(500, dtype=np.uint16))


def test_a_word_written_twice_is_restored_to_its_first_old_word():
    """A corrupt delta may locate one word twice: the undo record then holds the first write's result
    as the second old word, and restoring must still give back the original."""
    words = np.arange(16, dtype=np.uint16)
    rollback = Rollback()
    positions = np.array([5, 9, 5], dtype=np.int64)
    old, _ = kernels.write_changes(words, positions, np.array([1, 2, 3], np.uint16), None, False)
    rollback.keep(words, positions, old)
    assert words[5] == 5 + 1 + 3
    rollback.restore()
    assert np.array_equal(words, np.arange(16, dtype=np.uint16))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0x3000, 0x3C00, 0x7FFF]))
def test_moved_small_positions_are_the_small_words_after_the_write(seed, bound):
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 0xFFFF, 2000, dtype=np.uint16, endpoint=True)
    small = np.flatnonzero(smallwords.is_small(words, bound)).astype(np.int32)
    where = rng.permutation(rng.choice(words.size, 300, replace=False)).astype(np.int64)  # any order
    new = rng.integers(0, 0xFFFF, where.size, dtype=np.uint16, endpoint=True)
    old = words[where].copy()
    words[where] = new

    moved = kernels.moved_small_positions(small, where, old, new, bound)

    assert moved.dtype == small.dtype
    assert np.array_equal(moved, np.flatnonzero(smallwords.is_small(words, bound)))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_ranked_positions_are_the_small_words_of_those_ranks(seed, sift):
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 0xFFFF, 3000, dtype=np.uint16, endpoint=True)
    small_max = 0x3800
    bound = 0x3C00 if sift else small_max  # an entry kept for a larger bound holds more words
    entry = np.flatnonzero(smallwords.is_small(words, bound))
    start, count = 400, 2000
    in_segment = int(smallwords.is_small(words[start : start + count], small_max).sum())
    ranks = np.sort(rng.choice(in_segment, min(50, in_segment), replace=False)).astype(np.int64)

    got = kernels.ranked_positions(entry, words, start, count, ranks, small_max, sift)

    assert np.array_equal(got, smallwords.small_positions(words, start, count, ranks, small_max))
    with pytest.raises(CorruptError):
        kernels.ranked_positions(entry, words, start, count, np.array([in_segment]), small_max, sift)


def test_change_locations_count_each_run_from_its_start_and_add_its_offset():
    # Runs of 2, 0, 1 and 2 changes; gaps 1, 0 | - | 300 (0xFF then 45) | 0, 2.
    gaps = np.array([1, 0, 255, 45, 0, 2], np.uint8)
    runs, offsets = np.array([2, 0, 1, 2]), np.array([100, 7, 0, 50])
    limits = np.array([10, 10, 400, 10])
    assert kernels.change_locations(gaps, runs, offsets, limits).tolist() == [101, 102, 300, 50, 53]
    with pytest.raises(CorruptError, match="past its segment"):
        kernels.change_locations(gaps, runs, offsets, np.array([10, 10, 300, 10]))
