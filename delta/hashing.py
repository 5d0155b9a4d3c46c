"""The one hashing helper: the two digests a version is named by, as hex.

`piece_digest` (BLAKE3-256) names the bytes a version ships: its pieces and side files. Those bytes
come through relays nobody trusts, so the digest the trainer signs for them must be one that nobody
can find a second input for: a cryptographic hash. `digest` (xxh3-128, several times faster) names
what a receiver computes itself: each resulting tensor, the weights table, a cache's entity tag. A
tensor's bytes follow from authenticated pieces and a base the receiver already checked, so its hash
guards against faults (a wrong base in memory, an engine that took an update wrongly), not against an
attacker, and it is hashed on every swap, where speed is what counts. The hash of a tensor is over
its little-endian bytes in row-major order, so it is the same whatever produced the tensor (numpy,
torch, safetensors); the torch side (`tensor_digest`) lives in `tensors.py`, because this module is
part of what a gateway imports and a gateway host has no torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Iterable

import blake3
import xxhash

if TYPE_CHECKING:
    import numpy as np


def digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """xxh3-128 of a buffer, as 32 hex characters."""
    return xxhash.xxh3_128_hexdigest(_bytes_view(data))


def combine_digests(digests: Iterable[str]) -> str:
    """xxh3-128 of the concatenated 16-byte values of xxh3-128 hex digests: a tensor's hash from its
    tiles' (slices.py), computed by whoever holds the tile digests, without the tiles' bytes."""
    return xxhash.xxh3_128_hexdigest(b"".join(bytes.fromhex(d) for d in digests))


def piece_digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """BLAKE3-256 of a buffer, as 64 hex characters: what a signed manifest names a shipped piece by."""
    # One thread: pieces are hashed many at a time already (gateways and pools check them as they come).
    return blake3.blake3(_bytes_view(data), max_threads=1).hexdigest()


def _bytes_view(data: bytes | bytearray | memoryview | np.ndarray) -> bytes | bytearray | memoryview:
    # numpy is looked up, not imported: an array exists only where numpy was imported already, and a
    # gateway, which hashes bytes only, starts faster without it.
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(data, numpy.ndarray):
        return numpy.ascontiguousarray(data).view(numpy.uint8).reshape(-1)
    return data
