"""A version decoded once: its pieces verified and decoded, ready to be applied to any number of targets.

A rollout pool applies each version twice, to its engine's live tensors and to its synced directory,
so it is decoded once here and the `DecodedVersion` is handed to both (applier.py writes it). A delta's
segments stay as immutable `TensorUpdate`s grouped by tensor: where some changes land depends on the
base's own words (small-word ranks, see smallwords.py), so they are resolved by the first apply, and
once that apply's results have hashed right their `Located` positions are kept for the next target
(a target with another base fails its result hashes either way). Tensors that a version writes whole
(every tensor of a full snapshot, a tensor new in a delta) are decoded off to the side into fresh
tensors and checked against the manifest's hashes here, so a corrupt full snapshot fails before any
target is touched.

Side files (side_files.py) are not decoded: the pieces that carry them are checked against the
manifest like any other and kept as bytes (`files`), for the directory the version is persisted to.

`VersionDecoder` takes pieces as they arrive, in any order, verifying and decoding them on all cores;
`decode_version` decodes a version whose pieces are all at hand.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from .dtypes import np_words, torch_dtype
from .errors import CodecError, CorruptError
from .manifest import Manifest, NamedByManifest
from .parallel import thread_map
from .piece import CODEC
from .tensor_updates import TensorUpdate, decode_checked
from .tensors import tensor_digest

Step = tuple[Manifest, Sequence[bytes]]
"""A version as it travels: its verified manifest and its pieces (bytes)."""


@dataclass(frozen=True)
class Located:
    """Where one tensor's updates write in its base: per update, in order, the flat positions of its
    changes in `values` order. numpy arrays, or torch tensors on the device whose path located them."""

    positions: tuple[np.ndarray | torch.Tensor, ...]

    def numpy(self) -> "Located":
        return Located(tuple(p if isinstance(p, np.ndarray) else p.cpu().numpy() for p in self.positions))

    def to(self, device: torch.device) -> "Located":
        return Located(tuple(torch.as_tensor(p, device=device) for p in self.positions))


@dataclass(frozen=True, eq=False)
class DecodedVersion(NamedByManifest):
    """One version's pieces, verified and decoded; apply it as often as needed (only `located` grows)."""

    manifest: Manifest
    updates: Mapping[int, tuple[TensorUpdate, ...]]
    """Delta segments by tensor index (manifest order), each tensor's in ascending element order."""
    whole: Mapping[int, torch.Tensor]
    """Tensors written whole, by tensor index, checked against the manifest: every tensor of a full
    snapshot with elements, or a tensor a delta adds."""
    located: dict[int, Located] = field(default_factory=dict, repr=False)
    """Where the delta's changes land, by tensor index, as found by an apply whose results hashed right."""
    files: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    """The side files this version ships (checked against the manifest), by name; a delta leaves out
    those unchanged since its base."""

    @property
    def changed_words(self) -> int:
        """Words a delta's segments change (for logs)."""
        return sum(u.values.size for updates in self.updates.values() for u in updates)


def decode_version(manifest: Manifest, pieces: Sequence[bytes | memoryview]) -> DecodedVersion:
    """Verify and decode every piece of `manifest` (pieces in manifest order); see `DecodedVersion`."""
    if len(pieces) != len(manifest.pieces):
        raise CodecError(f"{len(pieces)} pieces given, manifest has {len(manifest.pieces)}")
    decoder = VersionDecoder(manifest)
    decoder.add_pieces(enumerate(pieces))
    return decoder.result()


def as_decoded(version: DecodedVersion | Step) -> DecodedVersion:
    """`version` itself when decoded already, else its (manifest, pieces) decoded now."""
    if isinstance(version, DecodedVersion):
        return version
    manifest, pieces = version
    return decode_version(manifest, pieces)


def manifest_of(version: DecodedVersion | Step) -> Manifest:
    return version.manifest if isinstance(version, DecodedVersion) else version[0]


class VersionDecoder:
    """Collects one version's pieces as they arrive and turns them into a `DecodedVersion`."""

    def __init__(self, manifest: Manifest) -> None:
        if manifest.codec != CODEC:
            raise CorruptError(f"manifest codec {manifest.codec!r}, this decoder reads {CODEC!r}")
        self.manifest = manifest
        self._whole: dict[int, torch.Tensor] = {}
        self._deltas: dict[int, list[TensorUpdate]] = {}
        self._file_pieces = manifest.file_pieces()
        self._files: dict[str, bytes] = {}
        self._pending = set(range(len(manifest.pieces)))
        self._lock = threading.Lock()

    @property
    def missing(self) -> list[int]:
        """Indices of the pieces not added yet."""
        return sorted(self._pending)

    def add_pieces(self, pieces: Iterable[tuple[int, bytes | memoryview]]) -> None:
        """Add (index, data) pieces, verifying and decoding them on all cores. Every good piece is
        taken; if any is bad, the first error (in the given order) is raised afterwards."""
        pieces = list(pieces)
        indices = [index for index, _ in pieces]
        for k, index in enumerate(indices):
            if 0 <= index < len(self.manifest.pieces) and (index not in self._pending or index in indices[:k]):
                raise CodecError(f"piece {index} was already added")
        errors = [e for e in thread_map(self._take, pieces) if e is not None]
        if errors:
            raise errors[0]

    def result(self) -> DecodedVersion:
        """The decoded version once every piece is in; tensors written whole are checked here."""
        m = self.manifest
        if self._pending:
            raise CodecError(f"{len(self._pending)} of {len(m.pieces)} pieces missing: {self.missing[:8]}")
        if m.kind == "full":
            for i, entry in enumerate(m.tensors):
                if i not in self._whole and entry.numel == 0:
                    self._whole[i] = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
                elif i not in self._whole:
                    raise CorruptError(f"tensor {entry.name}: no piece writes it")
        whole = sorted(self._whole)
        digests = thread_map(lambda i: tensor_digest(self._whole[i], m.tensors[i].grid), whole)
        wrong = [m.tensors[i].name for i, d in zip(whole, digests) if d != m.tensors[i].hash]
        if wrong:
            raise CorruptError(f"result does not match the manifest's hash for tensor(s) {wrong[:4]}")
        updates = {i: tuple(sorted(us, key=lambda u: u.start)) for i, us in sorted(self._deltas.items())}
        return DecodedVersion(m, updates, {i: self._whole[i] for i in whole}, files=dict(self._files))

    def _take(self, piece: tuple[int, bytes | memoryview]) -> CodecError | None:
        index, data = piece
        try:
            self.manifest.check_piece(index, data)
            if index in self._file_pieces:  # raw bytes, checked above: nothing to decode
                with self._lock:
                    self._files[self._file_pieces[index].name] = bytes(data)
                    self._pending.discard(index)
                return None
            updates = decode_checked(self.manifest, index, data)
            with self._lock:  # checks and bookkeeping are serialized; the writes below are not
                for u in updates:
                    if (u.index in self._deltas) if u.is_full else (u.index in self._whole):
                        raise CorruptError(f"tensor {u.tensor}: both full and delta segments")
                targets = [self._whole_target(u) if u.is_full else None for u in updates]
                for u in updates:
                    if not u.is_full:
                        self._deltas.setdefault(u.index, []).append(u)
        except CodecError as e:
            return e
        for u, target in zip(updates, targets):
            if target is not None:
                u.write_words(np_words(target))  # disjoint ranges of a fresh tensor
        with self._lock:
            self._pending.discard(index)
        return None

    def _whole_target(self, u: TensorUpdate) -> torch.Tensor:
        if u.index not in self._whole:
            entry = self.manifest.tensors[u.index]
            self._whole[u.index] = empty_tensor(entry.shape, torch_dtype(entry.dtype))
        return self._whole[u.index]


def empty_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory numpy allocated: numpy asks the kernel for huge
    pages on large buffers, which makes first-touch page faults of a fresh model copy far cheaper."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.empty(numel * itemsize, dtype=np.uint8))
    return raw.view(dtype).reshape(tuple(shape))
