"""The byte streams of a piece: gap and code transforms round-trip, and bad bytes are refused."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltamesh.delta import CorruptError
from deltamesh.delta import streams

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**20), max_size=60))
def test_gaps_round_trip(gaps):
    g = np.array(gaps, dtype=np.int64)
    data, ends = streams.gaps_to_bytes(g)
    assert ends.tolist() == [int(e) for e in np.cumsum([x // 255 + 1 for x in gaps]) - 1]
    assert data.size == sum(x // 255 + 1 for x in gaps)
    assert streams.bytes_to_gaps(data, len(gaps)).tolist() == gaps


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 15), max_size=41))
def test_nibbles_round_trip(codes):
    c = np.array(codes, dtype=np.uint8)
    assert streams.unpack_nibbles(streams.pack_nibbles(c), len(codes)).tolist() == codes


@pytest.mark.parametrize(
    "call",
    [
        lambda: streams.bytes_to_gaps(np.array([255, 255], np.uint8), 1),  # run never ends
        lambda: streams.bytes_to_gaps(np.array([3, 4], np.uint8), 1),  # a gap too many
        lambda: streams.bytes_to_gaps(np.array([3, 255], np.uint8), 1),  # trailing bytes
        lambda: streams.unpack_nibbles(np.array([0x12], np.uint8), 1),  # padding not zero
        lambda: streams.unpack_nibbles(np.array([0x02], np.uint8), 3),  # too short
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
