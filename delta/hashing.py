"""The one hashing helper: xxh3-128 digests (hex) of byte buffers and numpy arrays.

xxh3-128 is not a cryptographic hash; integrity against an attacker comes from the Ed25519 signature
on the manifest that carries these digests. The hash of a tensor is over its little-endian bytes in
row-major order, so it is the same whatever produced the tensor (numpy, torch, safetensors); the
torch side (`tensor_digest`) lives in `tensors.py`, because this module is part of what a gateway
imports and a gateway host has no torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import numpy as np


def digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """xxh3-128 of a buffer, as 32 hex characters."""
    # numpy is looked up, not imported: an array exists only where numpy was imported already, and a
    # gateway, which hashes bytes only, starts faster without it.
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(data, numpy.ndarray):
        data = numpy.ascontiguousarray(data).view(numpy.uint8).reshape(-1)
    return xxhash.xxh3_128_hexdigest(data)
