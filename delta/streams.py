"""Byte streams of a piece: how gaps, change codes and escapes become bytes, and how bytes are packed.

The encoder's transforms are vectorized numpy; the gap and code decoders are compiled loops in
kernels.py, which validate what they read and raise `CorruptError` on anything inconsistent rather
than reading or writing out of bounds, as `decompress` here does. The layouts (docs/FORMAT.md):

* gaps: each gap g (unchanged words before the next change) is g // 255 bytes 0xFF then g % 255.
  The low byte of a geometric gap carries almost all of its entropy and 0xFF runs over long unchanged
  stretches cost zstd almost nothing, so zstd's Huffman stage gets within ~1% of the entropy bound.
* codes: one 4-bit code per change, two per byte (first in the low nibble): a move value 0..14, or
  15 for a literal (the new word is stored as is, in byte-plane streams).
* stored streams are zstd frames (codec 1) or raw bytes (codec 0), whichever is smaller.
"""

from __future__ import annotations

import numpy as np
import zstandard

from .errors import CorruptError

STORED, ZSTD = 0, 1
LITERAL = 15  # the code of a change stored as its new word


# -- gaps ----------------------------------------------------------------------------------------
def gaps_to_bytes(gaps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode non-negative gaps (int64) as the 0xFF-run byte stream.

    Returns the bytes and, for every gap, the index of its last byte (so the stream can be cut
    between any two gaps without re-encoding it).
    """
    if not gaps.size or int(gaps.max()) < 255:  # the common case: every gap fits one byte
        return gaps.astype(np.uint8), np.arange(gaps.size, dtype=np.int64)
    runs = gaps // 255
    ends = np.cumsum(runs + 1) - 1
    out = np.full(int(ends[-1]) + 1, 255, dtype=np.uint8)
    out[ends] = (gaps - runs * 255).astype(np.uint8)
    return out, ends


# -- change codes ------------------------------------------------------------------------------
def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes (uint8, each < 16) two per byte, low nibble first; odd tail padded with 0."""
    if codes.size % 2:
        codes = np.concatenate([codes, np.zeros(1, dtype=np.uint8)])
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).astype(np.uint8)


# -- stored streams ----------------------------------------------------------------------------
def compressor() -> zstandard.ZstdCompressor:
    """zstd tuned for these streams (measured on gap, code and exponent-plane bytes): level 1's
    fast strategy with 7-byte minimum matches spends less time on the spurious short matches of
    near-random bytes and leaves them to the Huffman stage, which is both faster and smaller than
    plain level 1 (higher levels are slower and no smaller)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        1, strategy=zstandard.STRATEGY_FAST, min_match=7, search_log=1, hash_log=12, window_log=17,
        write_content_size=True,
    )
    return zstandard.ZstdCompressor(compression_params=params)


def compress(raw: np.ndarray | bytes, compressor: zstandard.ZstdCompressor) -> tuple[int, bytes]:
    """(codec, stored bytes) of a raw stream: a zstd frame when that is smaller, else the raw bytes."""
    raw = memoryview(raw).cast("B") if not isinstance(raw, bytes) else raw
    if len(raw) == 0:
        return STORED, b""
    frame = compressor.compress(raw)
    if len(frame) < len(raw):
        return ZSTD, frame
    return STORED, bytes(raw)


def decompress(codec: int, stored: memoryview, raw_len: int) -> np.ndarray:
    """The raw bytes (uint8 array, possibly a view of `stored`) of a stream, exactly `raw_len` long."""
    if codec == STORED:
        if len(stored) != raw_len:
            raise CorruptError(f"stored stream is {len(stored)} bytes, header says {raw_len}")
        return np.frombuffer(stored, dtype=np.uint8)
    if codec != ZSTD:
        raise CorruptError(f"unknown stream codec {codec}")
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise CorruptError(f"bad zstd frame header: {e}") from e
    if declared != raw_len:
        # Checked before decompressing, so a frame cannot make us allocate more than the header allows.
        raise CorruptError(f"zstd frame declares {declared} bytes, header says {raw_len}")
    try:
        out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise CorruptError(f"zstd stream does not decode: {e}") from e
    if len(out) != raw_len:
        raise CorruptError(f"zstd stream decodes to {len(out)} bytes, header says {raw_len}")
    return np.frombuffer(out, dtype=np.uint8)
