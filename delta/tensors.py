"""Weights as the codec sees them: name -> contiguous CPU tensor, their table entries and their hash.

`weights_hash(weights)` is the identity of a set of weights; it equals `Manifest.weights_hash` of
the manifest that produced them, so a delta's `base_hash` can be checked against weights in memory.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from .dtypes import dtype_name
from .errors import CodecError
from .hashing import digest as bytes_digest
from .manifest import TensorEntry, table_hash
from .parallel import thread_map


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
    """xxh3-128 of a tensor's raw bytes, as 32 hex characters (`hashing.digest` of `tensor_bytes`)."""
    return bytes_digest(tensor_bytes(t))


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """`tensor_digest` of each tensor by name, hashed on every core (xxhash releases the GIL)."""
    names = list(tensors)
    return dict(zip(names, thread_map(lambda name: tensor_digest(tensors[name]), names)))


def cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor detached, on the CPU and contiguous (copies only when one of those is needed)."""
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(t).__name__}")
    return t.detach().cpu().contiguous()


def tensor_entry(name: str, t: torch.Tensor, digest: str | None = None) -> TensorEntry:
    return TensorEntry(name, dtype_name(t), tuple(t.shape), digest or tensor_digest(t))


def tensor_table(weights: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    names = sorted(weights)
    digests = tensor_digests({name: cpu_tensor(weights[name]) for name in names})
    return [tensor_entry(name, weights[name], digests[name]) for name in names]


def weights_hash(weights: Mapping[str, torch.Tensor]) -> str:
    """Digest of the weights' tensor table (names, dtypes, shapes, hashes of every tensor's bytes)."""
    return table_hash(tensor_table(weights))
