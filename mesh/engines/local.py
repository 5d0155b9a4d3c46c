"""Helpers shared by the in-process engines (transformers, vLLM): what both answer the same way
(`LocalEngine`), reading a model directory's weights checked against its manifest, checking prompts,
and the end-of-sequence token ids of a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from deltamesh.delta import BaseMismatchError, CorruptError, Manifest, dir_manifest, read_weights, tensor_digest
from deltamesh.mesh.engines.base import EngineError, TokenizedEngine


class LocalEngine(TokenizedEngine):
    """What the in-process engines add alike: in-place updates, and the served weights' hash (kept in
    `_weights_hash`)."""

    _weights_hash: str | None

    @property
    def weights_hash(self) -> str | None:
        """`weights_hash` of the served weights: known when they came with a manifest or after the
        first delta (which computes it to check the delta's base); None before."""
        return self._weights_hash

    @property
    def supports_in_place(self) -> bool:
        return True


def check_engine_settings(model_id: str, max_batch: int, version: int | None) -> None:
    """ValueError naming the first of the settings every in-process engine config has that is wrong."""
    if not model_id:
        raise ValueError("model_id must be set")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if version is not None and version < 0:
        raise ValueError(f"version must be >= 0, got {version}")


def read_verified(path: Path, version: int) -> tuple[dict[str, torch.Tensor], Manifest | None]:
    """The weights of a model directory, checked against its manifest when it has one."""
    if not path.is_dir():
        raise EngineError(f"{path} is not a model directory")
    manifest = dir_manifest(path)
    weights = read_weights(path)
    if manifest is None:
        return weights, None
    if manifest.version != version:
        raise BaseMismatchError(f"{path} holds v{manifest.version}, v{version} was asked for")
    expected = {t.name: t for t in manifest.tensors}
    if set(expected) != set(weights):
        raise CorruptError(f"{path}: tensors differ from its manifest")
    for name, w in weights.items():
        if tensor_digest(w, expected[name].grid) != expected[name].hash:
            raise CorruptError(f"{path}: tensor {name!r} does not match its manifest")
    return weights, manifest


def eos_ids(*sources: Any) -> tuple[int, ...]:
    """The distinct token ids among `sources` (each an id, a list of ids or None), in order: e.g. the
    tokenizer's `eos_token_id` and the generation config's, which may differ."""
    ids: list[int] = []
    for source in sources:
        for t in source if isinstance(source, (list, tuple)) else [source]:
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)


def checked_prompts(prompts: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    """`prompts` as lists of ints; ValueError for an empty prompt or a token outside [0, vocab)."""
    out = [[int(t) for t in p] for p in prompts]
    for p in out:
        if not p:
            raise ValueError("every prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt token out of range [0, {vocab})")
    return out
