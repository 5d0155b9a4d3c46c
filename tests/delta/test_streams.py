"""The byte streams of a piece: gap and code transforms round-trip, and bad bytes are refused."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltamesh.delta import CorruptError, kernels, streams


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**20), max_size=60))
def test_gaps_round_trip(gaps):
    g = np.array(gaps, dtype=np.int64)
    data, ends = streams.gaps_to_bytes(g)
    assert ends.tolist() == [int(e) for e in np.cumsum([x // 255 + 1 for x in gaps]) - 1]
    assert data.size == sum(x // 255 + 1 for x in gaps)
    # Decoded as one run of changes: each change's offset is the gaps before it plus the changes.
    where = kernels.change_locations(data, np.array([len(gaps)]), np.array([0]), np.array([2**62]))
    assert where.tolist() == (np.cumsum(g + 1) - 1).tolist()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 15), max_size=41), st.sampled_from([1, 2, 4, 8]))
def test_nibbles_round_trip_into_key_moves(codes, width):
    c = np.array(codes, dtype=np.uint8)
    packed = streams.pack_nibbles(c)
    kernels.check_codes(packed, len(codes))
    values, literal, literals = kernels.key_moves(packed, 0, len(codes), width)
    assert literal.tolist() == [x == 15 for x in codes] and literals == codes.count(15)
    # A stored code v is zigzag(key difference) - 1: +1 ulp is 1, -1 ulp is 0, and so on.
    ones = (1 << (8 * width)) - 1
    moves = [((x + 1) >> 1) ^ (ones if (x + 1) & 1 else 0) for x in codes]
    assert [int(v) for v, lit in zip(values, literal) if not lit] == [m for m, x in zip(moves, codes) if x != 15]


@pytest.mark.parametrize(
    "call",
    [
        lambda: _gaps_of_one_run([255, 255], 1),  # run never ends
        lambda: _gaps_of_one_run([3, 4], 1),  # a gap too many
        lambda: _gaps_of_one_run([3], 2),  # a gap too few
        lambda: _gaps_of_one_run([3, 255], 1),  # trailing bytes
        lambda: _gaps_of_one_run([3, 4], 2, limit=8),  # the second change at offset 8, past its segment
        lambda: kernels.check_codes(np.array([0x12], np.uint8), 1),  # padding not zero
        lambda: kernels.check_codes(np.array([0x02], np.uint8), 3),  # too short
        lambda: kernels.check_codes(np.array([0x02, 0x01], np.uint8), 2),  # too long
        lambda: streams.decompress(7, memoryview(b"abc"), 3),  # unknown codec
        lambda: streams.decompress(streams.STORED, memoryview(b"abc"), 4),
        lambda: streams.decompress(streams.ZSTD, memoryview(b"\x00" * 8), 4),  # not a frame
        lambda: streams.decompress(streams.ZSTD, memoryview(zstandard.compress(b"x" * 100)), 10**12),
        lambda: streams.decompress(streams.ZSTD, memoryview(zstandard.compress(b"x" * 100)[:-3]), 100),
    ],
)
def test_bad_stream_bytes_are_corrupt(call):
    with pytest.raises(CorruptError):
        call()


def _gaps_of_one_run(data: list[int], changes: int, limit: int = 2**62) -> np.ndarray:
    return kernels.change_locations(np.array(data, np.uint8), np.array([changes]), np.array([0]), np.array([limit]))
