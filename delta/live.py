"""Applying a decoded version to a live model's tensors, where an engine serves from them.

A live model is seen as a name -> tensor map (`live_tensors`) whose tensors share storage with the
module's parameters and buffers, on whatever device the model lives, so a write here is a write into
the model that is serving. `swap_in_place` moves it to a `DecodedVersion`: a delta goes through the
one applier (applier.py) in place, writing only its changed words and restoring every one of them if
any resulting tensor's hash differs from the manifest; a full snapshot, decoded and checked off to
the side, is copied in after the names, dtypes and shapes are checked. `copy_in` is that copy for
weights read from a directory. Callers make sure no forward pass runs meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from .applier import apply_version
from .decoded_version import DecodedVersion
from .dtypes import DTYPE_NAMES
from .errors import CorruptError
from .manifest import Manifest, TensorEntry
from .small_index import SmallWordIndex
from .tensors import weights_hash


@dataclass(frozen=True)
class SwapStats:
    """What one in-place update did (for logs and metrics)."""

    tensors_written: int
    words_changed: int
    seconds: float


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor for every persistent weight of `model`, sharing storage with the live module."""
    return {name: t.detach() for name, t in model.state_dict().items()}


def check_table(live: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """Raise CorruptError unless every tensor of `manifest` exists live with the same dtype and shape."""
    for entry in manifest.tensors:
        t = live.get(entry.name)
        if t is None:
            raise CorruptError(f"{manifest.model_id} v{manifest.version}: model has no tensor {entry.name!r}")
        dtype = DTYPE_NAMES.get(t.dtype)
        if dtype != entry.dtype or tuple(t.shape) != tuple(entry.shape):
            raise CorruptError(
                f"tensor {entry.name!r}: model has {dtype} {tuple(t.shape)}, "
                f"manifest says {entry.dtype} {tuple(entry.shape)}"
            )


def live_hash(live: Mapping[str, torch.Tensor], manifest: Manifest) -> str:
    """`weights_hash` of the live tensors that delta `manifest` names (the table of a delta's base has
    the same names as its result; tied duplicates the model holds under other names are left out).
    Reads the whole model once."""
    check_table(live, manifest)
    return weights_hash({t.name: live[t.name] for t in manifest.tensors},
                        {t.name: t.grid for t in manifest.tensors if t.grid is not None})


def swap_in_place(live: Mapping[str, torch.Tensor], version: DecodedVersion, *, base_hash: str | None = None,
                  base_entries: Mapping[str, TensorEntry] | None = None, torch_ops: bool = False,
                  small_index: SmallWordIndex | None = None) -> SwapStats:
    """Move the live tensors to `version`; on any failure leave them bit-identical to before and raise.

    `base_hash` is the `weights_hash` of what the live tensors hold (`live_hash`), which a delta's
    base must match; None hashes them first. `base_entries` (the tensor entries of the manifest the live
    tensors were verified against) make that check free and spare hashing the tensors a delta leaves
    alone. `torch_ops` and `small_index` (the caller's, kept for these live tensors) as in
    `apply_version`.
    """
    start = time.perf_counter()
    manifest = version.manifest
    check_table(live, manifest)
    if version.kind == "full":
        copy_in(live, {manifest.tensors[i].name: t for i, t in version.whole.items()})
        written = sum(t.numel() for t in version.whole.values())
        return SwapStats(len(version.whole), written, time.perf_counter() - start)
    if version.whole:
        # A tensor the delta adds has no live storage to go to: the model would not serve it.
        raise CorruptError(f"{manifest.model_id} v{manifest.version} adds tensors the live model lacks")
    targets = {e.name: live[e.name] for e in manifest.tensors}
    apply_version(version, targets, base_hash=base_hash, base_entries=base_entries, in_place=True,
                  check_base="first", torch_ops=torch_ops, small_index=small_index)
    return SwapStats(len(version.updates), version.changed_words, time.perf_counter() - start)


def copy_in(live: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
    """Copy verified `weights` into the live tensors; checks names, shapes, dtypes and that they cover
    the model before any write."""
    for name, w in weights.items():
        t = live.get(name)
        if t is None:
            raise CorruptError(f"model has no tensor {name!r}")
        if t.dtype != w.dtype or t.shape != w.shape:
            raise CorruptError(f"tensor {name!r}: model has {t.dtype} {tuple(t.shape)}, got {w.dtype} {tuple(w.shape)}")
    _check_coverage(live, set(weights))
    with torch.no_grad():
        for name, w in weights.items():
            live[name].copy_(w)


def _check_coverage(live: Mapping[str, torch.Tensor], names: set[str]) -> None:
    """Raise CorruptError unless every live tensor is one of `names` or shares storage with one (tied)."""
    covered = {live[n].untyped_storage().data_ptr() for n in names if n in live}
    missing = [n for n, t in live.items() if n not in names and t.untyped_storage().data_ptr() not in covered]
    if missing:
        raise CorruptError(f"weights lack {len(missing)} tensors of the model, e.g. {missing[:3]}")
