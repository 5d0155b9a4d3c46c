"""Hot weight swap: write a new version into a live model's tensors in place, all or nothing.

A live model is seen as a name -> tensor map (`live_tensors`), the tensors sharing storage with the
module's parameters, so a write here is a write into the model that is serving. Two ways in:

- `decode_delta` then `write_delta_in_place`: every piece of a delta is verified and decoded first,
  off the serving path (a corrupt piece fails before any write); then each `TensorUpdate` writes
  only its changed words into a 1-D integer view of the live tensor. The old values of the words
  a write touches are kept first, so that when any resulting tensor's hash differs from the
  manifest the model is put back exactly as it was before the error is raised. Extra memory:
  ~10 bytes per changed word (positions and old words). `verify_base` checks the base before.
- `decode_full` then `copy_weights_in_place`: a full snapshot is decoded and verified off to the
  side, then copied in; weights read from a directory take the same copy.

These functions run on whatever device the model lives on; hashing copies a tensor to the CPU.
Callers make sure no forward pass runs meanwhile (the engine holds its step lock).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from deltamesh.delta import (
    Applier,
    BaseMismatchError,
    CorruptError,
    Manifest,
    TensorUpdate,
    decode_piece,
    tensor_digest,
    weights_hash,
    word_view,
)

log = logging.getLogger(__name__)

# safetensors dtype names of the torch dtypes a model may hold.
_SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class DecodedDelta:
    """A delta's pieces verified and decoded, grouped by the tensor they write to."""

    manifest: Manifest
    updates: dict[str, list[TensorUpdate]]


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
        dtype = _SAFETENSORS_DTYPES.get(t.dtype)
        if dtype != entry.dtype or tuple(t.shape) != tuple(entry.shape):
            raise CorruptError(
                f"tensor {entry.name!r}: model has {dtype} {tuple(t.shape)}, "
                f"manifest says {entry.dtype} {tuple(entry.shape)}"
            )


def check_coverage(live: Mapping[str, torch.Tensor], names: set[str]) -> None:
    """Raise CorruptError unless every live tensor is one of `names` or shares storage with one (tied)."""
    covered = {live[n].untyped_storage().data_ptr() for n in names if n in live}
    missing = [n for n, t in live.items() if n not in names and t.untyped_storage().data_ptr() not in covered]
    if missing:
        raise CorruptError(f"weights lack {len(missing)} tensors of the model, e.g. {missing[:3]}")


def decode_delta(manifest: Manifest, pieces: Sequence[bytes | memoryview]) -> DecodedDelta:
    """Verify and decode every piece of delta `manifest` (no live tensor is touched yet)."""
    if manifest.kind != "delta":
        raise CorruptError(f"expected a delta, got a {manifest.kind} manifest")
    if len(pieces) != len(manifest.pieces):
        raise CorruptError(f"{len(pieces)} pieces given, manifest has {len(manifest.pieces)}")
    by_tensor: dict[str, list[TensorUpdate]] = defaultdict(list)
    for index, data in enumerate(pieces):
        for update in decode_piece(manifest, index, data):
            by_tensor[update.tensor].append(update)
    return DecodedDelta(manifest, dict(by_tensor))


def write_delta_in_place(live: Mapping[str, torch.Tensor], delta: DecodedDelta) -> SwapStats:
    """Write a decoded delta into `live`; on any failure leave `live` bit-identical to before and raise.

    The caller has already checked that `live` holds the delta's base version (`verify_base`).
    """
    start = time.perf_counter()
    manifest = delta.manifest
    check_table(live, manifest)
    undo: list[tuple[torch.Tensor, torch.Tensor | slice, torch.Tensor]] = []
    try:
        changed_words = 0
        for name, updates in delta.updates.items():
            words = word_view(live[name])
            for update in updates:
                where = _written(update, words.device)
                undo.append((words, where, words[where].clone()))
                update.apply_to(words)
                changed_words += update.count if update.positions is None else len(update.positions)
        _verify_hashes(live, manifest)
    except BaseException:
        for words, where, old in reversed(undo):
            words[where] = old
        log.warning("%s v%s: in-place delta failed, model restored to v%s",
                    manifest.model_id, manifest.version, manifest.base_version)
        raise
    return SwapStats(len(delta.updates), changed_words, time.perf_counter() - start)


def decode_full(manifest: Manifest, pieces: Sequence[bytes | memoryview]) -> dict[str, torch.Tensor]:
    """Verify and decode full snapshot `manifest` off to the side (every tensor hash is checked)."""
    if manifest.kind != "full":
        raise CorruptError(f"expected a full snapshot, got a {manifest.kind} manifest")
    if len(pieces) != len(manifest.pieces):
        raise CorruptError(f"{len(pieces)} pieces given, manifest has {len(manifest.pieces)}")
    applier = Applier(manifest, None)
    for index, data in enumerate(pieces):
        applier.add_piece(index, data)
    return applier.finish()


def copy_weights_in_place(live: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
    """Copy verified `weights` into the live tensors; checks names, shapes and dtypes before any write."""
    for name, w in weights.items():
        t = live.get(name)
        if t is None:
            raise CorruptError(f"model has no tensor {name!r}")
        if t.dtype != w.dtype or t.shape != w.shape:
            raise CorruptError(f"tensor {name!r}: model has {t.dtype} {tuple(t.shape)}, got {w.dtype} {tuple(w.shape)}")
    check_coverage(live, set(weights))
    with torch.no_grad():
        for name, w in weights.items():
            live[name].copy_(w)


def verify_base(live: Mapping[str, torch.Tensor], manifest: Manifest, version: int, live_hash: str | None) -> str:
    """Raise BaseMismatchError unless delta `manifest` applies onto the live weights; return their hash.

    `live_hash` is the `weights_hash` of the live weights when known (they came with a manifest);
    otherwise it is computed from the live tensors named in the manifest (the table of a delta's
    base has the same names as its result), which reads the whole model once.
    """
    if manifest.base_version != version:
        raise BaseMismatchError(
            f"{manifest.model_id} v{manifest.version} is a delta from v{manifest.base_version}, "
            f"the engine serves v{version}"
        )
    if live_hash is None:
        check_table(live, manifest)
        live_hash = weights_hash({t.name: live[t.name] for t in manifest.tensors})
    if manifest.base_hash != live_hash:
        raise BaseMismatchError(
            f"{manifest.model_id} v{manifest.version}: its base v{manifest.base_version} has weights "
            f"{manifest.base_hash}, the engine serves {live_hash}"
        )
    return live_hash


def _written(update: TensorUpdate, device: torch.device) -> torch.Tensor | slice:
    """The words `update` will overwrite, as an index into the flat word view."""
    if update.positions is None:
        return slice(update.start, update.start + update.count)
    return torch.from_numpy(update.positions).to(device)


def _verify_hashes(live: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    for entry in manifest.tensors:
        if tensor_digest(live[entry.name]) != entry.hash:
            raise CorruptError(
                f"{manifest.model_id} v{manifest.version}: tensor {entry.name!r} does not hash to the "
                "manifest's result after the update (wrong base weights?)"
            )
