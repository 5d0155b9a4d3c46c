"""Encoding a version: a bit-diff delta against the previous version, or a full snapshot.

Both produce an `Encoded`: the signed manifest and its pieces. A delta carries, for every tensor
whose dtype and shape are unchanged, where its words changed (by position, or by rank among the
base's small words: smallwords.py) and how (bitdiff.py, streams.py); tensors that are new or changed
dtype/shape travel as full segments. Pieces hold whole segments and are cut near `piece_bytes` of
payload so they can be relayed, verified and applied one by one. Side files (config, tokenizer:
side_files.py) go as raw pieces of their own after the tensors' pieces: all of them in a full
snapshot, only those changed since the base in a delta. Output is a pure function of the inputs
(plus the manifest's creation time).

A process holding the whole model encodes it as one part (parts.py) and assembles the manifest from
that part alone (assemble.py): the same code path as a version encoded by many trainer ranks, each
its own rows, which `manifest_of_parts` signs once from their descriptions. `cuts` (pool layouts:
layouts.py) cut tensors where pool ranks' shares end, so each pool rank can fetch and check its share
alone; without cuts, a version of one part is written in format 3.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import torch

from .assemble import Assembled, assemble
from .cuts import Cuts, TensorSpec
from .dtypes import dtype_name
from .errors import CodecError
from .hashing import piece_digest
from .keys import Ed25519PrivateKey
from .manifest import FileEntry, Kind, Manifest, PieceEntry, format_for, table_hash
from .parallel import thread_map
from .parts import Part, encode_part
from .piece import CODEC
from .tensors import cpu_tensor, tensor_entry

PIECE_BYTES = 4 << 20


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


def table_of(weights: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The version's tensor table of whole weights, sorted by name."""
    return [TensorSpec(name, dtype_name(weights[name]), tuple(weights[name].shape)) for name in sorted(weights)]


def encode_full(
    weights: Mapping[str, torch.Tensor], *, model_id: str, version: int, key: Ed25519PrivateKey | None,
    piece_bytes: int = PIECE_BYTES, files: Mapping[str, bytes] | None = None,
    hashes: Mapping[str, str] | None = None, cuts: Mapping[str, Cuts] | None = None,
) -> Encoded:
    """A full snapshot of `weights`: every tensor, byte planes entropy-coded, and every side file
    (`files`, name -> bytes).

    `hashes` (name -> tensor digest: the table of a delta to the same weights, say) spares hashing
    those tensors again (tensors of one tile only). Without `key` the manifest is left unsigned
    (`Encoded.signed`).
    """
    _check_piece_bytes(piece_bytes)
    table = table_of(weights)
    known = {name: (h,) for name, h in (hashes or {}).items() if not (cuts or {}).get(name)}
    part = encode_part(table, weights, cuts=cuts, piece_bytes=piece_bytes, known=known)
    return _whole_version(table, part, model_id, version, None, None, files or {}, {}, key)


def encode_delta(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, model_id: str, version: int,
    base_version: int, key: Ed25519PrivateKey | None, base_hash: str | None = None, piece_bytes: int = PIECE_BYTES,
    files: Mapping[str, bytes] | None = None, base_files: Mapping[str, str] | None = None,
    cuts: Mapping[str, Cuts] | None = None, device_passes: bool = False,
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
    table = table_of(new)
    part = encode_part(table, new, base=old, cuts=cuts, piece_bytes=piece_bytes, hash_base=base_hash is None,
                       device_passes=device_passes)
    return _whole_version(table, part, model_id, version, base_version, base_hash, files or {}, base_files or {},
                          key, old)


def _whole_version(table: list[TensorSpec], part: Part, model_id: str, version: int, base_version: int | None,
                   base_hash: str | None, files: Mapping[str, bytes], base_files: Mapping[str, str],
                   key: Ed25519PrivateKey | None, old: Mapping[str, torch.Tensor] | None = None) -> Encoded:
    assembled = assemble(table, [part.describe()])
    if base_version is not None and base_hash is None:
        base_hash = _base_hash(assembled, old or {})
    manifest = manifest_of_parts(assembled, model_id=model_id, version=version, base_version=base_version,
                                 base_hash=base_hash, files=files, base_files=base_files)
    return _encoded(manifest, [p.data for p in part.pieces] + shipped_files(manifest, files), key)


def _base_hash(assembled: Assembled, old: Mapping[str, torch.Tensor]) -> str:
    """`weights_hash` of the base: its tiles as the scan hashed them, and the tensors it has that the
    new version drops hashed whole."""
    base = {e.name: e for e in assembled.base_tensors or ()}
    rest = [name for name in old if name not in base]
    base.update(zip(rest, thread_map(lambda name: tensor_entry(name, cpu_tensor(old[name])), rest)))
    return table_hash(base.values())


def manifest_of_parts(assembled: Assembled, *, model_id: str, version: int, base_version: int | None,
                      base_hash: str | None, files: Mapping[str, bytes],
                      base_files: Mapping[str, str] | None = None, kind: Kind | None = None) -> Manifest:
    """The unsigned manifest of an assembled version, its side files' pieces listed after the parts'
    pieces (those whose digest `base_files` lists are not shipped again)."""
    table = list(assembled.pieces)
    listed = []
    for name in sorted(files):
        h = piece_digest(files[name])
        if (base_files or {}).get(name) == h:
            listed.append(FileEntry(name, len(files[name]), h, None))  # the receiver holds it already
            continue
        listed.append(FileEntry(name, len(files[name]), h, len(table)))
        table.append(PieceEntry(len(files[name]), h, (), () if assembled.in_parts else None))
    return Manifest(
        model_id=model_id, version=version, base_version=base_version,
        kind=kind or ("full" if base_version is None else "delta"), codec=CODEC,
        tensors=assembled.tensors, pieces=tuple(table), base_hash=base_hash, files=tuple(listed),
        format_version=format_for(assembled.tensors, table),
    )


def shipped_files(manifest: Manifest, files: Mapping[str, bytes]) -> list[bytes]:
    """The side files' pieces, in the manifest's piece order (after the tensors' pieces)."""
    return [bytes(files[f.name]) for f in sorted(manifest.file_pieces().values(), key=lambda f: f.piece)]


def _encoded(manifest: Manifest, pieces: list[bytes], key: Ed25519PrivateKey | None) -> Encoded:
    unsigned = Encoded(manifest, b"", pieces)
    return unsigned if key is None else unsigned.signed(key)


def _check_piece_bytes(piece_bytes: int) -> None:
    if not isinstance(piece_bytes, int) or piece_bytes < 16:
        raise CodecError(f"piece_bytes must be an integer >= 16, got {piece_bytes!r}")
