"""Encoding a version: a bit-diff delta against the previous version, or a full snapshot.

Both produce an `Encoded`: the signed manifest and its pieces. A delta carries, for every tensor
whose dtype and shape are unchanged, where its words changed (by position, or by rank among the
base's small words: smallwords.py) and how (bitdiff.py, streams.py); tensors that are new or changed
dtype/shape travel as full segments. Tensors are scanned in parallel, one per core. Pieces hold whole
segments and are cut near `piece_bytes` of payload so they can be relayed, verified and applied one
by one. Side files (config, tokenizer: side_files.py) go as raw pieces of their own after the
tensors' pieces: all of them in a full snapshot, only those changed since the base in a delta. Output
is a pure function of the inputs (plus the manifest's creation time).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np
import torch
import xxhash

from .bitdiff import scan_changes
from .device_scan import on_device, scan_on_device
from .dtypes import dtype_name, is_float, np_words
from .errors import CodecError
from .hashing import piece_digest
from .keys import Ed25519PrivateKey
from .manifest import FileEntry, Manifest, PieceEntry, TensorEntry, table_hash
from .parallel import thread_map, thread_stream
from .piece import CODEC
from .piece_writer import BuiltPiece, DeltaPieceCutter, TensorChanges, full_pieces
from .smallwords import MagnitudeSample, sample_stride
from .tensors import cpu_tensor, tensor_entry

PIECE_BYTES = 4 << 20
SCAN_AHEAD_BYTES = 256 << 20  # tensor bytes scanned ahead of cutting their changes into pieces ...
SCAN_AHEAD_LARGEST = 3  # ... or this many times the largest tensor, so it never stalls the other cores


@dataclass(frozen=True)
class Encoded:
    """One encoded version: the manifest, its signed envelope (as sent and stored), and its pieces.
    Encoded without a key, the envelope is empty until `signed` makes it."""

    manifest: Manifest
    manifest_bytes: bytes
    pieces: list[bytes]

    def signed(self, key: Ed25519PrivateKey) -> "Encoded":
        """This version with its manifest signed by `key` (a publisher times signing on its own)."""
        return replace(self, manifest_bytes=self.manifest.signed(key))


def encode_full(
    weights: Mapping[str, torch.Tensor], *, model_id: str, version: int, key: Ed25519PrivateKey | None,
    piece_bytes: int = PIECE_BYTES, files: Mapping[str, bytes] | None = None,
    hashes: Mapping[str, str] | None = None,
) -> Encoded:
    """A full snapshot of `weights`: every tensor, byte planes entropy-coded, and every side file
    (`files`, name -> bytes).

    `hashes` (name -> tensor digest: the table of a delta to the same weights, say) spares hashing
    those tensors again. Without `key` the manifest is left unsigned (`Encoded.signed`).
    """
    _check_piece_bytes(piece_bytes)
    tensors = {name: cpu_tensor(weights[name]) for name in sorted(weights)}
    known = hashes or {}
    entries = thread_map(lambda item: tensor_entry(*item, known.get(item[0])), list(tensors.items()))
    words = [np_words(t) for t in tensors.values()]
    pieces = full_pieces(words, list(range(len(entries))), piece_bytes)
    manifest = _manifest(model_id, version, None, "full", entries, pieces, None, files or {}, {})
    return _encoded(manifest, [p.data for p in pieces] + _shipped(manifest, files or {}), key)


def encode_delta(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, model_id: str, version: int,
    base_version: int, key: Ed25519PrivateKey | None, base_hash: str | None = None, piece_bytes: int = PIECE_BYTES,
    files: Mapping[str, bytes] | None = None, base_files: Mapping[str, str] | None = None,
    device_passes: bool = False,
) -> Encoded:
    """The delta that turns `old` (version `base_version`) into `new` (version `version`).

    `base_hash` is `weights_hash(old)` when the caller knows it (e.g. from old's manifest), which
    saves hashing `old` again. `files` are the new version's side files (name -> bytes); those whose
    digest `base_files` (name -> digest: the base version's, from its manifest) already lists are not
    shipped again. Without `base_files` every side file is shipped. Without `key` the manifest is
    left unsigned (`Encoded.signed`). A tensor on a device other than the CPU is compared with its
    base there (device_scan.py); `device_passes` takes that torch path for CPU tensors too. Either
    way the output is the same.
    """
    _check_piece_bytes(piece_bytes)
    names = sorted(new)
    entries: list[TensorEntry] = []
    words: list[np.ndarray] = []
    full: list[int] = []
    base_entries: dict[str, TensorEntry] = {}
    cutter = DeltaPieceCutter(piece_bytes)
    # Tensors are scanned in order with a bounded number ahead, and their changes cut into pieces as
    # they come, so the change lists of only a few tensors are held at once.
    sizes = [new[name].numel() * new[name].element_size() for name in names]
    ahead = max(SCAN_AHEAD_BYTES, SCAN_AHEAD_LARGEST * max(sizes, default=0))
    scans = thread_stream(
        lambda i: _scan(i, old.get(names[i]), new[names[i]], names[i], base_hash is None, device_passes),
        range(len(names)), ahead, weight=lambda i: sizes[i])
    for i, scan in enumerate(scans):
        entries.append(scan.entry)
        words.append(scan.words)
        if scan.full:
            full.append(i)
        if scan.base_entry is not None:
            base_entries[scan.entry.name] = scan.base_entry
        if scan.changes is not None:
            cutter.add(scan.changes)
    if base_hash is None:
        rest = [name for name in old if name not in base_entries]
        base_entries.update(zip(rest, thread_map(lambda name: tensor_entry(name, cpu_tensor(old[name])), rest)))
        base_hash = table_hash(base_entries.values())
    pieces = cutter.finish() + full_pieces(words, full, piece_bytes)
    manifest = _manifest(model_id, version, base_version, "delta", entries, pieces, base_hash, files or {},
                         base_files or {})
    return _encoded(manifest, [p.data for p in pieces] + _shipped(manifest, files or {}), key)


@dataclass(frozen=True)
class _Scan:
    """One tensor of the new version compared with its base."""

    entry: TensorEntry
    words: np.ndarray | None
    """The new words, kept for a tensor written whole."""
    full: bool
    changes: TensorChanges | None = None
    base_entry: TensorEntry | None = None


def _scan(i: int, base: torch.Tensor | None, t: torch.Tensor, name: str, hash_base: bool,
          device_passes: bool) -> _Scan:
    if base is None or base.dtype != t.dtype or tuple(base.shape) != tuple(t.shape):
        t = cpu_tensor(t)
        return _Scan(tensor_entry(name, t), np_words(t), full=True)
    if device_passes or on_device(base, t):
        scan = scan_on_device(i, base, t, hash_base=hash_base)
        entry = TensorEntry(name, dtype_name(t), tuple(t.shape), scan.digest)
        base_entry = None if scan.base_digest is None else replace(entry, hash=scan.base_digest)
        return _Scan(entry, None, False, scan.changes, base_entry)
    t, base = cpu_tensor(t), cpu_tensor(base)
    w = np_words(t)
    # Hashing rides along with the scan while each chunk is in cache (the base only if needed).
    hash_new, hash_old = xxhash.xxh3_128(), (xxhash.xxh3_128() if hash_base else None)
    floating = is_float(dtype_name(t))
    # The base's magnitude sample (for coding changes of small words) is taken in the same pass.
    sample = MagnitudeSample(w.itemsize, sample_stride(w.size)) if floating else None
    positions, old_words, new_words = scan_changes(
        np_words(base), w, hash_old, hash_new, sample.add if sample is not None else None)
    changes = None
    if positions.size:
        changes = TensorChanges.of(i, np_words(base), positions, old_words, new_words, floating, sample)
    base_entry = tensor_entry(name, base, hash_old.hexdigest()) if hash_old is not None else None
    return _Scan(tensor_entry(name, t, hash_new.hexdigest()), w, False, changes, base_entry)


def _encoded(manifest: Manifest, pieces: list[bytes], key: Ed25519PrivateKey | None) -> Encoded:
    unsigned = Encoded(manifest, b"", pieces)
    return unsigned if key is None else unsigned.signed(key)


def _check_piece_bytes(piece_bytes: int) -> None:
    if not isinstance(piece_bytes, int) or piece_bytes < 16:
        raise CodecError(f"piece_bytes must be an integer >= 16, got {piece_bytes!r}")


def _manifest(model_id, version, base_version, kind, entries, pieces: list[BuiltPiece], base_hash,
              files: Mapping[str, bytes], base_files: Mapping[str, str]) -> Manifest:
    table = [PieceEntry(len(p.data), piece_digest(p.data), p.tensors) for p in pieces]
    listed = []
    for name in sorted(files):
        h = piece_digest(files[name])
        if base_files.get(name) == h:
            listed.append(FileEntry(name, len(files[name]), h, None))  # the receiver holds it already
            continue
        listed.append(FileEntry(name, len(files[name]), h, len(table)))
        table.append(PieceEntry(len(files[name]), h, ()))
    return Manifest(
        model_id=model_id, version=version, base_version=base_version, kind=kind, codec=CODEC,
        tensors=tuple(entries), pieces=tuple(table), base_hash=base_hash, files=tuple(listed),
    )


def _shipped(manifest: Manifest, files: Mapping[str, bytes]) -> list[bytes]:
    """The side files' pieces, in the manifest's piece order (after the tensors' pieces)."""
    return [bytes(files[f.name]) for f in sorted(manifest.file_pieces().values(), key=lambda f: f.piece)]
