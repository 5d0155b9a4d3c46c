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
from .grid import words_digest
from .hashing import digest as bytes_digest
from .manifest import TensorEntry, table_hash
from .parallel import thread_map
from .slices import Grid


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 view of a CPU tensor's bytes (a copy only if it is not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def tensor_digest(t: torch.Tensor, grid: Grid | None = None) -> str:
    """xxh3-128 of a tensor's raw bytes, as 32 hex characters (`hashing.digest` of `tensor_bytes`), or
    with a hash `grid` (slices.py) the digest of its tiles' digests: its hash in a manifest's table."""
    if grid is None:
        return bytes_digest(tensor_bytes(t))
    return words_digest(tensor_bytes(t), tuple(t.shape), grid)


def tensor_digests(tensors: Mapping[str, torch.Tensor], grids: Mapping[str, Grid] | None = None) -> dict[str, str]:
    """`tensor_digest` of each tensor by name (by its grid in `grids`, if it has one), hashed on every
    core (xxhash releases the GIL)."""
    names, grids = list(tensors), grids or {}
    return dict(zip(names, thread_map(lambda name: tensor_digest(tensors[name], grids.get(name)), names)))


def cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor detached, on the CPU and contiguous (copies only when one of those is needed)."""
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(t).__name__}")
    return t.detach().cpu().contiguous()


def tensor_entry(name: str, t: torch.Tensor, digest: str | None = None, grid: Grid | None = None) -> TensorEntry:
    return TensorEntry(name, dtype_name(t), tuple(t.shape), digest or tensor_digest(t, grid), grid)


def tensor_table(weights: Mapping[str, torch.Tensor], grids: Mapping[str, Grid] | None = None) -> list[TensorEntry]:
    names, grids = sorted(weights), grids or {}
    digests = tensor_digests({name: cpu_tensor(weights[name]) for name in names}, grids)
    return [tensor_entry(name, weights[name], digests[name], grids.get(name)) for name in names]


def weights_hash(weights: Mapping[str, torch.Tensor], grids: Mapping[str, Grid] | None = None) -> str:
    """Digest of the weights' tensor table (names, dtypes, shapes, hashes of every tensor's bytes, by the
    tiles of its grid in `grids` for a tensor that has one)."""
    return table_hash(tensor_table(weights, grids))
