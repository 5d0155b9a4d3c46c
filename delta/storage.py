"""Safetensors directories: read and write weights as transformers lays them out.

A directory holds either one `model.safetensors`, or shards listed by `model.safetensors.index.json`
(`{"metadata": {"total_size": N}, "weight_map": {name: file}}`). Writing goes straight from each
tensor's memory to the file (no serialized copy of the model), optionally fsynced, following a given
name -> file layout so that a directory keeps its sharding from version to version.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .dtypes import dtype_name
from .errors import CodecError, CorruptError
from .tensors import cpu_tensor, tensor_bytes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 << 30
READ_ATTEMPTS = 3


def shard_layout(directory: str | Path) -> dict[str, str] | None:
    """name -> file of a sharded directory, or None for a single-file (or empty) one."""
    index = Path(directory) / INDEX_FILE
    if not index.exists():
        return None
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise TypeError("weight_map must map names to file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptError(f"{index}: {type(e).__name__}: {e}") from e
    for file in set(weight_map.values()):
        if Path(file).name != file:
            raise CorruptError(f"{index}: shard {file!r} is not a plain file name")
    return weight_map


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors directory.

    A symlink to one (as `apply_to_dir` keeps) is resolved once, so the read is of one version even
    if the link moves meanwhile; if that version's directory is removed before the read is done
    (a reader slower than two applies), the read starts over on the current version.
    """
    for _ in range(READ_ATTEMPTS - 1):
        root = Path(directory).resolve()
        try:
            return _read_root(root)
        except CodecError:
            if root.exists():
                raise
    return _read_root(Path(directory).resolve())


def weight_files(root: Path) -> list[str]:
    """The safetensors files of directory `root` (resolved), by its index when it has one."""
    layout = shard_layout(root)
    if layout is not None:
        files = sorted(set(layout.values()))
    elif (root / SINGLE_FILE).exists():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise CodecError(f"{root}: no safetensors weights found")
    return files


def _read_root(root: Path) -> dict[str, torch.Tensor]:
    layout = shard_layout(root)
    files = weight_files(root)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            part = load_file(root / file)
        except (OSError, SafetensorError, RuntimeError) as e:  # safetensors reports open errors as RuntimeError
            raise CorruptError(f"{root / file}: {e}") from e
        repeated = weights.keys() & part.keys()
        if repeated:
            raise CorruptError(f"{root / file}: tensors also in another shard: {sorted(repeated)[:4]}")
        weights.update(part)
    if layout is not None and set(layout) != set(weights):
        raise CorruptError(f"{root}: shards do not hold exactly the tensors of {INDEX_FILE}")
    return weights


def write_weights(
    directory: str | Path, weights: Mapping[str, torch.Tensor], *,
    max_shard_bytes: int = MAX_SHARD_BYTES, layout: Mapping[str, str] | None = None, fsync: bool = False,
) -> None:
    """Write weights into `directory` (created if needed) as one file or as shards with an index.

    `layout` (name -> file) keeps an existing sharding; tensors it does not name go to its last
    file. Without it, tensors fill shards of at most `max_shard_bytes` in name order.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {name: cpu_tensor(weights[name]) for name in sorted(weights)}
    files = _assign_files(tensors, max_shard_bytes, layout)
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        _write_file(root / file, {n: tensors[n] for n in names}, fsync)
    if set(by_file) != {SINGLE_FILE}:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": files}
        _write_bytes(root / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode(), fsync)
    if fsync:
        fsync_dir(root)


def _assign_files(
    tensors: Mapping[str, torch.Tensor], max_shard_bytes: int, layout: Mapping[str, str] | None
) -> dict[str, str]:
    if layout:
        last = sorted(set(layout.values()))[-1]
        return {name: layout.get(name, last) for name in tensors}
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {name: SINGLE_FILE for name in groups[0]}
    n = len(groups)
    return {name: f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k, g in enumerate(groups) for name in g}


def _write_file(path: Path, tensors: Mapping[str, torch.Tensor], fsync: bool) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t), "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(memoryview(tensor_bytes(t)))
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _write_bytes(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
