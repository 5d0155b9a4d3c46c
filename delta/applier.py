"""The one applier: a decoded version written onto weights in memory, all or nothing.

`apply_version(decoded, base)` moves `base` (name -> tensor, on the CPU or any device) to a
`DecodedVersion` (decoded_version.py): a delta's base must be the one it was made from (its `base_hash`
equals the base weights' `weights_hash`), each changed tensor's changes are located in the base (or
taken from an earlier apply of the same decoded version whose results hashed right) and written
(patch.py: numpy on CPU memory, torch ops elsewhere), and every resulting tensor is checked against
the manifest's hash.
By default the base is left untouched and changed tensors are new copies; with `in_place=True`
changed words are written straight into the base tensors (a live engine's weights, or weights read
from disk), and any failure restores them bit for bit before the error is raised. Tensors a version
writes whole are the decoded version's own (never written to afterwards by this module).

`Applier` is the same for pieces that arrive one by one (verified and decoded as they come, applied
at `finish()`); `apply` takes (manifest, pieces) at once.
"""

from __future__ import annotations

import logging
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np
import torch

from .decoded_version import DecodedVersion, Located, VersionDecoder, decode_version
from .dtypes import dtype_name, np_words, torch_dtype, word_view
from .errors import BaseMismatchError, CodecError, CorruptError
from .manifest import Manifest, TensorEntry, table_hash
from .parallel import thread_map
from .patch import Patched, Rollback, locate_cpu, locate_torch, patch_cpu, patch_torch
from .slices import Grid
from .small_index import SmallWordIndex
from .tensors import tensor_digest, tensor_entry

log = logging.getLogger(__name__)

CheckBase = Literal["first", "last"]
_Indexed = tuple[SmallWordIndex, dict[int, list[tuple[np.ndarray, np.ndarray]]]]
"""The small-word index an in-place apply reads and moves, and the words it overwrote and wrote, by
tensor and update."""


def apply_version(
    version: DecodedVersion, base: Mapping[str, torch.Tensor] | None = None, *, base_hash: str | None = None,
    base_entries: Mapping[str, TensorEntry] | None = None, in_place: bool = False, check_base: CheckBase = "last",
    torch_ops: bool = False, small_index: SmallWordIndex | None = None,
) -> dict[str, torch.Tensor]:
    """The weights of `version`, applied onto `base` (a delta's; a full snapshot needs none).

    `base_hash`: the `weights_hash` of `base` when the caller knows it (it came with a manifest), so
    the base is not hashed at all. `base_entries`, better: the table entry of every base tensor by name,
    as the verified manifest of the version `base` holds lists them (`Manifest.entries()`); their
    `weights_hash` (with the base's names, dtypes and shapes) is the base check, and a tensor the delta
    leaves alone is then neither copied nor hashed, if the delta hashes it as the base's manifest did
    (the same grid or none: a version built in parts names a tensor by its tiles; entries that do not
    cover every base tensor are not used). Otherwise `check_base` says when the base is hashed: "first"
    before any write, "last" in the same pass that applies the changes (cheaper). `torch_ops` patches
    CPU tensors with torch ops too (the path every other device takes). `small_index`: the
    caller's `SmallWordIndex` of CPU weights it applies version after version to in place, which
    spares the pass over each touched tensor's words that locating changes by small-word rank takes,
    and is moved to the result (small_index.py). A wrong base raises `BaseMismatchError`, a wrong
    result `CorruptError`; either way `base` is as it was.
    """
    target = _Target(version.manifest, base, base_hash=base_hash, base_entries=base_entries, in_place=in_place,
                     check_base=check_base)
    index = small_index if in_place and version.kind == "delta" and not torch_ops else None
    if index is None:
        return target.apply(version, torch_ops=torch_ops)
    if index.weights_hash != version.manifest.base_hash:
        index.clear()
    try:
        result = target.apply(version, small_index=index)
    except CorruptError:
        index.clear()
        if target.kept_located:
            raise  # nothing was read off the index
        # Positions read off an index that did not describe the base fail the result hashes: the
        # words themselves decide.
        log.warning("%s v%d: result hashes failed with positions read off the small-word index; "
                    "locating from the weights themselves", version.manifest.model_id, version.manifest.version)
        return target.apply(version)
    except BaseException:
        index.clear()
        raise
    index.moved_to(version.manifest.weights_hash)
    return result


class _Target:
    """The weights one manifest applies to, what is known of their hash, and the writes into them."""

    def __init__(self, manifest: Manifest, base: Mapping[str, torch.Tensor] | None, *, base_hash: str | None,
                 in_place: bool, check_base: CheckBase, base_entries: Mapping[str, TensorEntry] | None = None) -> None:
        if check_base not in ("first", "last"):
            raise ValueError(f"check_base must be 'first' or 'last', not {check_base!r}")
        self.manifest = manifest
        self.in_place = in_place
        self.tensors: dict[str, torch.Tensor] = {}
        self.digests: dict[str, str] = {}
        self.grids: dict[str, Grid] = {}
        self.known = False  # the base was checked against the entries of its manifest
        self.check_last = False
        self.kept_located = True  # whether every change was located without a small-word index
        if manifest.kind != "delta":
            return  # a full snapshot replaces everything: no base to check or write into
        if base is None:
            raise BaseMismatchError(f"{manifest.model_id} v{manifest.version} is a delta and needs its base")
        self.tensors = {name: _usable(name, t, in_place) for name, t in base.items()}
        # The base is hashed as the result is: a version built in parts follows one built the same way.
        self.grids = {e.name: e.grid for e in manifest.tensors if e.grid is not None}
        if base_entries is not None and self.tensors.keys() <= base_entries.keys():
            # Known digests are only taken once they hash to the delta's base: the check costs no read.
            self.check(table_hash([tensor_entry(n, t, base_entries[n].hash) for n, t in self.tensors.items()]))
            self.known = True
            self.digests = {name: base_entries[name].hash for name in self.tensors
                            if base_entries[name].grid == self.grids.get(name)}
        if base_hash is not None:
            self.check(base_hash)
        elif self.known:
            pass  # checked against the known digests above
        elif check_base == "first":
            self.check(self.hash())
        else:
            self.check_last = True

    def check(self, base_hash: str) -> None:
        m = self.manifest
        if base_hash != m.base_hash:
            raise BaseMismatchError(
                f"{m.model_id} v{m.version} applies to v{m.base_version} (weights {m.base_hash}), "
                f"not to weights {base_hash}"
            )

    def hash(self) -> str:
        """`weights_hash` of the base, reusing the digests taken so far."""
        thread_map(self.digest, list(self.tensors))
        return table_hash([tensor_entry(name, t, self.digest(name)) for name, t in self.tensors.items()])

    def digest(self, name: str) -> str:
        if name not in self.digests:
            t, grid = self.tensors[name], self.grids.get(name)
            fits = grid is not None and t.dim() >= 1 and t.shape[0] == grid.rows[-1] and (
                not grid.cols or (t.dim() >= 2 and t.shape[1] == grid.cols[-1]))
            self.digests[name] = tensor_digest(t, grid if fits else None)
        return self.digests[name]

    def apply(self, version: DecodedVersion, *, torch_ops: bool = False,
              small_index: SmallWordIndex | None = None) -> dict[str, torch.Tensor]:
        """Write `version` (decoded from this target's manifest); see `apply_version`."""
        rollback = Rollback()
        entries = self.manifest.tensors
        located: dict[int, Located] = {}
        written: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # old and new words, for the index
        self.kept_located = True
        indexed = None if small_index is None else (small_index, written)
        try:
            # Every tensor is written and hashed on all cores: the kernels that locate and write the
            # changes release the GIL as the hashes do.
            done = thread_map(lambda i: self._result_of(version, i, rollback, torch_ops, located, indexed),
                              range(len(entries)))
            if self.check_last:
                self.check(self.hash())
            wrong = [e.name for e, (_, digest) in zip(entries, done) if digest != e.hash]
            if wrong:
                raise CorruptError(f"result does not match the manifest's hash for tensor(s) {wrong[:4]}")
        except CodecError as e:
            rollback.restore()
            if self.check_last and not isinstance(e, BaseMismatchError):
                # A wrong base can make a patch fail before its hash is known: name the real cause.
                self.check(self.hash())
            raise
        except BaseException:
            rollback.restore()
            raise
        for i, where in located.items():  # right, as the result hashes show: the next target reuses them
            version.located.setdefault(i, where)
        if small_index is not None:
            try:
                # One thread: each move is a short kernel call between bookkeeping that holds the GIL,
                # and measured on threads it was slower.
                for i, words in written.items():
                    small_index.move(entries[i].name, located[i], words)
            except Exception:
                small_index.clear()  # the version is written: an index not moved along is only dropped
        return {e.name: t for e, (t, _) in zip(entries, done)}

    def _result_of(self, version: DecodedVersion, i: int, rollback: Rollback, torch_ops: bool,
                   located: dict[int, Located], indexed: _Indexed | None) -> tuple[torch.Tensor, str]:
        """Tensor `i` of the result and the digest of its bytes."""
        entry = self.manifest.tensors[i]
        if i in version.updates:
            target, digest, base_digest = self._patch(entry, i, version, rollback, torch_ops, located, indexed)
            if base_digest is not None:
                self.digests[entry.name] = base_digest
            return target, digest
        if i in version.whole:
            return version.whole[i], entry.hash  # checked when it was decoded
        base = self.tensors.get(entry.name)
        if base is not None and dtype_name(base) == entry.dtype and tuple(base.shape) == entry.shape:
            return base, self.digest(entry.name)
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype)), entry.hash
        raise CorruptError(f"tensor {entry.name}: no piece writes it and the base does not have it")

    def _patch(self, entry: TensorEntry, i: int, version: DecodedVersion, rollback: Rollback, torch_ops: bool,
               located: dict[int, Located], indexed: _Indexed | None) -> Patched:
        base = self.tensors.get(entry.name)
        if base is None or dtype_name(base) != entry.dtype or tuple(base.shape) != entry.shape:
            raise BaseMismatchError(
                f"tensor {entry.name}: the base has no {entry.dtype}{list(entry.shape)} tensor to change")
        updates = version.updates[i]
        for a, b in zip(updates, updates[1:]):
            if b.start < a.start + a.count:
                raise CorruptError(f"tensor {entry.name}: overlapping segments")
        known = version.located.get(i)
        hash_base = self.check_last and entry.name not in self.digests
        if torch_ops or base.device.type != "cpu":
            where = known.to(base.device) if known else locate_torch(updates, word_view(base))
            patched = patch_torch(entry, updates, where, base, in_place=self.in_place, rollback=rollback,
                                  hash_base=hash_base)
        else:
            small_index, written = indexed if indexed is not None else (None, None)
            if known is None and small_index is not None:
                self.kept_located = False
            words = np_words(base)
            where = known.numpy() if known else locate_cpu(updates, words, small_index)
            patched = patch_cpu(entry, updates, where, base, in_place=self.in_place, rollback=rollback,
                                hash_base=hash_base, written=None if written is None else written.setdefault(i, []),
                                words=words)
        located[i] = where
        return patched


def _usable(name: str, t: torch.Tensor, in_place: bool) -> torch.Tensor:
    """`t` detached and contiguous, on its own device; in place it must be so already (a copy would
    not be the target)."""
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"tensor {name}: expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.is_contiguous():
        return t
    if in_place:
        raise CodecError(f"tensor {name}: an in-place target must be contiguous")
    return t.contiguous()


class Applier:
    """Applies one manifest's pieces, added as they arrive (any order), to `base` (None for a full
    snapshot). Arguments as `apply_version`, except that `check_base` defaults to "first": a wrong
    base is refused right away, before any piece is added."""

    def __init__(
        self, manifest: Manifest, base: Mapping[str, torch.Tensor] | None = None, *,
        base_hash: str | None = None, base_entries: Mapping[str, TensorEntry] | None = None, in_place: bool = False,
        check_base: CheckBase = "first",
    ) -> None:
        self.manifest = manifest
        self._decoder = VersionDecoder(manifest)
        self._target = _Target(manifest, base, base_hash=base_hash, base_entries=base_entries, in_place=in_place,
                               check_base=check_base)
        self._closed = False

    @property
    def missing(self) -> list[int]:
        """Indices of the pieces not added yet."""
        return self._decoder.missing

    def add_piece(self, index: int, data: bytes | memoryview) -> None:
        """Verify and decode piece `index`; a bad piece raises and changes nothing."""
        self.add_pieces([(index, data)])

    def add_pieces(self, pieces: Iterable[tuple[int, bytes | memoryview]]) -> None:
        """Add several (index, data) pieces, verifying and decoding them on all cores. Every good
        piece is taken; if any is bad, the first error (in the given order) is raised afterwards."""
        self._check_open()
        self._decoder.add_pieces(pieces)

    def finish(self) -> dict[str, torch.Tensor]:
        """The resulting weights, every tensor checked against the manifest. On any failure nothing
        of the base has changed (in place: it is restored) and the error is raised."""
        self._check_open()
        self._closed = True
        return self._target.apply(self._decoder.result())

    def abort(self) -> None:
        """Give up (nothing is written before `finish`)."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CodecError("this Applier has already finished or been aborted")


def apply(
    weights: Mapping[str, torch.Tensor] | None, manifest: Manifest, pieces: Sequence[bytes], *,
    base_hash: str | None = None, in_place: bool = False, small_index: SmallWordIndex | None = None,
) -> dict[str, torch.Tensor]:
    """Decode and apply a whole encoded version to `weights` (None for a full snapshot); the base is
    checked in the same pass that applies the changes. See `apply_version`."""
    return apply_version(decode_version(manifest, pieces), weights, base_hash=base_hash, in_place=in_place,
                         small_index=small_index)
