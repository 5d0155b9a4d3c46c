"""Applying an encoded version to weights in memory, piece by piece as pieces arrive, never half-way.

`Applier` checks the base (a delta's `base_hash` must equal the base weights' `weights_hash`),
verifies and decodes each piece as it is added (any order), and at `finish()` writes the changes
and checks every resulting tensor against the manifest's hash. Deltas are written in one pass per
tensor, chunk by chunk while each chunk is in cache: copy (unless in place), hash the base if it
still needs checking, write the changed words, hash the result. So a whole apply reads the base
once and writes the result once.

By default the base is left untouched and changed tensors are new copies. With `in_place=True`
changed words are written straight into the base tensors (no copy of the model); the overwritten
words are kept, so a failed `finish()` or an `abort()` restores the base exactly.
"""

from __future__ import annotations

import threading
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np
import torch
import xxhash

from .bitdiff import apply_changes
from .decode import TensorUpdate, decode_checked
from .dtypes import dtype_name, is_float, np_words, torch_dtype
from .errors import BaseMismatchError, CodecError, CorruptError
from .hashing import tensor_digest
from .manifest import Manifest, TensorEntry, table_hash
from .parallel import thread_map
from .piece import CODEC
from .tensors import cpu_tensor, tensor_entry

PASS_CHUNK_BYTES = 1 << 20


class Applier:
    """Applies one manifest's pieces to `base` (None for a full snapshot).

    `base_hash`: the `weights_hash` of `base` when the caller knows it (e.g. from the manifest that
    produced it), so the base is not hashed at all. Otherwise `check_base` says when it is hashed:
    "first" (default) refuses a wrong base right away, before any piece is added; "last" hashes it
    during `finish()` in the same pass that applies the changes (cheaper when all pieces are at hand).
    """

    def __init__(
        self, manifest: Manifest, base: Mapping[str, torch.Tensor] | None = None, *,
        base_hash: str | None = None, in_place: bool = False, check_base: Literal["first", "last"] = "first",
    ) -> None:
        if manifest.codec != CODEC:
            raise CorruptError(f"manifest codec {manifest.codec!r}, this decoder reads {CODEC!r}")
        if check_base not in ("first", "last"):
            raise ValueError(f"check_base must be 'first' or 'last', not {check_base!r}")
        self.manifest = manifest
        self.in_place = in_place
        self._base: dict[str, torch.Tensor] = {}
        self._base_digests: dict[str, str] = {}
        self._check_base_last = False
        if manifest.kind == "delta":
            if base is None:
                raise BaseMismatchError(f"{manifest.model_id} v{manifest.version} is a delta and needs its base")
            self._base = {name: cpu_tensor(t) for name, t in base.items()}
            if base_hash is not None:
                self._check_base_hash(base_hash)
            elif check_base == "first":
                entries = [tensor_entry(name, t) for name, t in self._base.items()]
                self._base_digests = {e.name: e.hash for e in entries}
                self._check_base_hash(table_hash(entries))
            else:
                self._check_base_last = True
        self._full: dict[int, torch.Tensor] = {}
        self._deltas: dict[int, list[TensorUpdate]] = {}
        self._undo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending = set(range(len(manifest.pieces)))
        self._lock = threading.Lock()
        self._closed = False

    @property
    def missing(self) -> list[int]:
        """Indices of the pieces not added yet."""
        return sorted(self._pending)

    def add_piece(self, index: int, data: bytes | memoryview) -> None:
        """Verify and decode piece `index`; a bad piece raises and changes nothing."""
        self.add_pieces([(index, data)])

    def add_pieces(self, pieces: Iterable[tuple[int, bytes | memoryview]]) -> None:
        """Add several (index, data) pieces, verifying and decoding them on all cores. Every good
        piece is taken; if any is bad, the first error (in the given order) is raised afterwards."""
        self._check_open()
        pieces = list(pieces)
        indices = [index for index, _ in pieces]
        for k, index in enumerate(indices):
            if 0 <= index < len(self.manifest.pieces) and (index not in self._pending or index in indices[:k]):
                raise CodecError(f"piece {index} was already added")
        errors = [e for e in thread_map(self._take, pieces) if e is not None]
        if errors:
            raise errors[0]

    def _take(self, piece: tuple[int, bytes | memoryview]) -> CodecError | None:
        index, data = piece
        try:
            self.manifest.check_piece(index, data)
            updates = decode_checked(self.manifest, index, data)
            with self._lock:  # checks and bookkeeping are serialized; the writes below are not
                for u in updates:
                    self._check_update(u)
                targets = [self._full_target(u) if u.is_full else None for u in updates]
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

    def finish(self) -> dict[str, torch.Tensor]:
        """The resulting weights, every tensor checked against the manifest. On any failure nothing
        of the base has changed (in place: it is restored) and the error is raised."""
        self._check_open()
        try:
            result = self._finish()
        except CodecError as e:
            self.abort()
            if self._check_base_last and not isinstance(e, BaseMismatchError):
                # A wrong base can make decoding fail before its hash is known: name the real cause.
                self._check_base_hash(self._hash_base())
            raise
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._undo = []
        return result

    def abort(self) -> None:
        """Give up: undo every in-place write (in reverse order) and close."""
        for words, positions, replaced in reversed(self._undo):
            words[positions] = replaced
        self._undo = []
        self._closed = True

    # -- internals -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CodecError("this Applier has already finished or been aborted")

    def _check_base_hash(self, base_hash: str) -> None:
        m = self.manifest
        if base_hash != m.base_hash:
            raise BaseMismatchError(
                f"{m.model_id} v{m.version} applies to v{m.base_version} (weights {m.base_hash}), "
                f"not to weights {base_hash}"
            )

    def _check_update(self, u: TensorUpdate) -> None:
        entry = self.manifest.tensors[u.index]
        if u.is_full:
            if u.index in self._deltas:
                raise CorruptError(f"tensor {u.tensor}: both full and delta segments")
            return
        if u.index in self._full:
            raise CorruptError(f"tensor {u.tensor}: both full and delta segments")
        base = self._base.get(u.tensor)
        if base is None or dtype_name(base) != entry.dtype or tuple(base.shape) != entry.shape:
            raise BaseMismatchError(f"tensor {u.tensor}: the base has no {entry.dtype}{list(entry.shape)} tensor to change")

    def _full_target(self, u: TensorUpdate) -> torch.Tensor:
        if u.index not in self._full:
            entry = self.manifest.tensors[u.index]
            self._full[u.index] = empty_tensor(entry.shape, torch_dtype(entry.dtype))
        return self._full[u.index]

    def _finish(self) -> dict[str, torch.Tensor]:
        if self._pending:
            raise CodecError(f"{len(self._pending)} of {len(self.manifest.pieces)} pieces missing: {self.missing[:8]}")
        entries = self.manifest.tensors
        done = thread_map(self._result_of, range(len(entries)))
        if self._check_base_last:
            self._check_base_hash(self._hash_base())
        wrong = [e.name for e, (_, digest) in zip(entries, done) if digest != e.hash]
        if wrong:
            raise CorruptError(f"result does not match the manifest's hash for tensor(s) {wrong[:4]}")
        return {e.name: t for e, (t, _) in zip(entries, done)}

    def _result_of(self, i: int) -> tuple[torch.Tensor, str]:
        """Tensor `i` of the result and the digest of its bytes."""
        entry = self.manifest.tensors[i]
        if i in self._deltas:
            return self._rebuild(i, entry)
        if i in self._full:
            return self._full[i], tensor_digest(self._full[i])
        t = self._untouched(entry)
        return t, (self._base_digest(entry.name) if entry.name in self._base else tensor_digest(t))

    def _hash_base(self) -> str:
        """`weights_hash` of the base, reusing the digests taken during the apply pass."""
        thread_map(self._base_digest, list(self._base))
        return table_hash([tensor_entry(name, t, self._base_digest(name)) for name, t in self._base.items()])

    def _base_digest(self, name: str) -> str:
        if name not in self._base_digests:
            self._base_digests[name] = tensor_digest(self._base[name])
        return self._base_digests[name]

    def _untouched(self, entry: TensorEntry) -> torch.Tensor:
        base = self._base.get(entry.name)
        if base is not None and dtype_name(base) == entry.dtype and tuple(base.shape) == entry.shape:
            return base
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        raise CorruptError(f"tensor {entry.name}: no piece writes it and the base does not have it")

    def _rebuild(self, i: int, entry: TensorEntry) -> tuple[torch.Tensor, str]:
        """Copy (unless in place), patch and hash one tensor in a single chunked pass."""
        updates = sorted(self._deltas[i], key=lambda u: u.start)
        for a, b in zip(updates, updates[1:]):
            if b.start < a.start + a.count:
                raise CorruptError(f"tensor {entry.name}: overlapping segments")
        base = self._base[entry.name]
        src = np_words(base)
        positions = np.concatenate([u.locate(src) for u in updates])  # before anything is written
        values = np.concatenate([u.values for u in updates])
        literal = None
        if any(u.literal is not None for u in updates):
            literal = np.concatenate([np.zeros(u.values.size, bool) if u.literal is None else u.literal for u in updates])
        if positions.size > 1 and not bool((positions[1:] > positions[:-1]).all()):
            order = np.argsort(positions, kind="stable")
            positions, values = positions[order], values[order]
            literal = None if literal is None else literal[order]
            if not bool((positions[1:] > positions[:-1]).all()):
                raise CorruptError(f"tensor {entry.name}: a word changed twice")
        if self.in_place:
            target, dst = base, src
            self._undo.append((dst, positions, dst[positions]))
        else:
            target = empty_tensor(entry.shape, base.dtype)
            dst = np_words(target)
        hash_base = xxhash.xxh3_128() if self._check_base_last else None
        hash_out = xxhash.xxh3_128()
        floating = is_float(entry.dtype)
        step = max(1, PASS_CHUNK_BYTES // src.itemsize)
        starts = np.arange(0, src.size + step, step)
        bounds = np.searchsorted(positions, starts)
        for c, s in enumerate(starts[:-1]):
            e = min(s + step, src.size)
            if hash_base is not None:
                hash_base.update(src[s:e])
            if dst is not src:
                np.copyto(dst[s:e], src[s:e])
            lo, hi = bounds[c], bounds[c + 1]
            if hi > lo:
                p = positions[lo:hi]
                dst[p] = apply_changes(dst[p], values[lo:hi], None if literal is None else literal[lo:hi], floating)
            hash_out.update(dst[s:e])
        if hash_base is not None:
            self._base_digests[entry.name] = hash_base.hexdigest()
        return target, hash_out.hexdigest()


def empty_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory numpy allocated: numpy asks the kernel for huge
    pages on large buffers, which makes first-touch page faults of a fresh model copy far cheaper."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.empty(numel * itemsize, dtype=np.uint8))
    return raw.view(dtype).reshape(tuple(shape))


def apply(
    weights: Mapping[str, torch.Tensor] | None, manifest: Manifest, pieces: Sequence[bytes], *,
    base_hash: str | None = None, in_place: bool = False,
) -> dict[str, torch.Tensor]:
    """Apply a whole encoded version to `weights` (None for a full snapshot); see `Applier`.

    The base is checked in the same pass that applies the changes; a wrong base raises
    `BaseMismatchError` and leaves `weights` as they were.
    """
    if len(pieces) != len(manifest.pieces):
        raise CodecError(f"{len(pieces)} pieces given, manifest has {len(manifest.pieces)}")
    applier = Applier(manifest, weights, base_hash=base_hash, in_place=in_place, check_base="last")
    try:
        applier.add_pieces(enumerate(pieces))
    except BaseException:
        applier.abort()
        raise
    return applier.finish()


def apply_chain(
    weights: Mapping[str, torch.Tensor] | None, steps: Iterable[tuple[Manifest, Sequence[bytes]]], *,
    base_hash: str | None = None, in_place: bool = False,
) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """Apply versions one after another; returns the final weights and their `weights_hash`."""
    for manifest, pieces in steps:
        weights = apply(weights, manifest, pieces, base_hash=base_hash, in_place=in_place)
        base_hash = manifest.weights_hash
    return (dict(weights) if weights is not None else None), base_hash
