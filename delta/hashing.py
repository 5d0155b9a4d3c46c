"""The one hashing helper: xxh3-128 digests (hex) of byte buffers and of tensors' raw bytes.

xxh3-128 is not a cryptographic hash; integrity against an attacker comes from the Ed25519 signature
on the manifest that carries these digests. The hash of a tensor is over its little-endian bytes in
row-major order, so it is the same whatever produced the tensor (numpy, torch, safetensors).
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash


def digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """xxh3-128 of a buffer, as 32 hex characters."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return xxhash.xxh3_128_hexdigest(data)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 view of a CPU tensor's bytes (a copy only if it is not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's raw bytes, as 32 hex characters."""
    return digest(tensor_bytes(t))
