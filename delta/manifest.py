"""The signed manifest: what a version is, which pieces carry it, and what the result must hash to.

A manifest describes one encoded version of one model: a full snapshot, or a delta from a base
version. Its body is canonical JSON (sorted keys, no spaces, integers and strings only), signed with
the trainer's Ed25519 key. On the wire and on disk it travels as the signed envelope

    {"body": "<body JSON as a string>", "key_id": "<16 hex>", "signature": "<128 hex>"}

so that the signed bytes are exactly the bytes that were sent: nobody re-serializes before checking.
The byte layout of pieces is the codec's (see docs/FORMAT.md); the manifest only records each
piece's length, digest and which tensors it writes to. From format 2 it also lists the version's side
files (config, tokenizer: side_files.py), each with its size, digest and the piece that carries its
bytes (none in a delta that leaves it unchanged). From format 3 pieces and side files are named by
BLAKE3-256 (`hashing.piece_digest`), a cryptographic hash, so that the signature binds their bytes;
formats 1 and 2 (xxh3-128) are still read. Format 4 adds what a version built in parts needs (slices.py):
a hash grid per tensor and the element spans of each piece; a version without either is written in
format 3, so readers of format 3 keep reading what they can.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from deltamesh.peer_json import parse_json

from .envelope import canonical_json, open_sealed, seal, unseal
from .errors import CodecError, CorruptError
from .hashing import digest, piece_digest
from .keys import Ed25519PrivateKey, Ed25519PublicKey
from .side_files import MAX_SIDE_FILE_BYTES, MAX_SIDE_FILES, MAX_SIDE_TOTAL_BYTES, side_file_problem
from .slices import MAX_SPANS, MAX_TILES, Grid, Span, check_grid, check_spans, spans_body, spans_from_body

FORMAT_VERSION = 3
"""The format this codec writes for a version without grids or spans."""
PARTS_FORMAT = 4
"""The format of a version with a hash grid on some tensor or spans on some piece (slices.py)."""
READABLE_FORMATS = (1, 2, 3, 4)
"""The formats it reads: 4 is 3 with grids and spans, 2 is 3 with xxh3-128 piece and side-file
digests, 1 is 2 without side files."""
Kind = Literal["delta", "full"]
MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

# Bounds on what a manifest may declare. Readers size buffers and plans from these numbers, so a
# manifest (even a signed one: a buggy or compromised trainer) declaring a tensor of 2^60 elements
# must be refused before anything is allocated. They sit far above any real model: the largest
# tensor of today's open models is a few GiB, and a 1T-parameter model is 2 TiB in bf16.
MAX_NDIM = 16
"""Most dimensions of one tensor."""
MAX_TENSOR_BYTES = 2**36
"""Largest tensor (64 GiB)."""
MAX_TOTAL_BYTES = 2**42
"""Largest sum of all tensors of one version, and of all its pieces (4 TiB)."""
MAX_PIECE_BYTES = 2**32
"""Largest single piece (4 GiB; gateways refuse far smaller ones by their own setting)."""

# Element sizes of the dtypes the codec carries, by safetensors name.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
# The sign-magnitude ones (their words need the order-preserving key of `bitdiff.py`). Here, not in
# `dtypes.py`, because the piece layer checks against it and a gateway imports that without torch.
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the resulting weights: name, safetensors dtype, shape, digest of its bytes (or, with a
    `grid`, of its tiles' digests)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str
    grid: Grid | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class PieceEntry:
    """One piece: its byte length, its digest, the indices of the tensors it writes to, and (format 4)
    the element ranges of those tensors its segments lie in."""

    length: int
    hash: str
    tensors: tuple[int, ...]
    spans: tuple[Span, ...] | None = None


@dataclass(frozen=True)
class FileEntry:
    """One side file of the resulting model directory: its name, byte size and digest, and the index of
    the piece that carries its bytes (None in a delta: the same bytes as at the base)."""

    name: str
    size: int
    hash: str
    piece: int | None


@dataclass(frozen=True)
class Manifest:
    model_id: str
    version: int
    base_version: int | None
    kind: Kind
    codec: str
    tensors: tuple[TensorEntry, ...]
    pieces: tuple[PieceEntry, ...]
    base_hash: str | None = None
    """`weights_hash` of the base version (deltas only): a delta applies to exactly those weights."""
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    format_version: int = FORMAT_VERSION
    files: tuple[FileEntry, ...] = ()
    """Side files of the resulting model directory, sorted by name (format 2)."""

    def __post_init__(self) -> None:
        _validate(self)

    # -- derived facts -------------------------------------------------------------------------
    @property
    def weights_hash(self) -> str:
        """Digest of the resulting tensor table: the identity of this version's weights."""
        return table_hash(self.tensors)

    @property
    def payload_bytes(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def model_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def entries(self) -> dict[str, TensorEntry]:
        """The tensor table by name."""
        return {t.name: t for t in self.tensors}

    def tensor_index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    def file_pieces(self) -> dict[int, FileEntry]:
        """piece index -> the side file whose raw bytes it is (every other piece is a codec piece)."""
        return {f.piece: f for f in self.files if f.piece is not None}

    def check_piece(self, index: int, data: bytes | memoryview) -> None:
        """Raise CorruptError unless `data` is exactly piece `index`."""
        if not 0 <= index < len(self.pieces):
            raise CorruptError(f"piece {index} out of range (manifest has {len(self.pieces)})")
        entry = self.pieces[index]
        if len(data) != entry.length:
            raise CorruptError(f"piece {index}: {len(data)} bytes, manifest says {entry.length}")
        if self.content_digest(data) != entry.hash:
            raise CorruptError(f"piece {index}: hash mismatch")

    def content_digest(self, data: bytes | memoryview) -> str:
        """The digest this manifest names a piece or side file by (BLAKE3-256 from format 3)."""
        return piece_digest(data) if self.format_version >= 3 else digest(data)

    # -- (de)serialization ---------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        body = {
            "format_version": self.format_version,
            "model_id": self.model_id,
            "version": self.version,
            "base_version": self.base_version,
            "kind": self.kind,
            "codec": self.codec,
            "base_hash": self.base_hash,
            "created_ms": self.created_ms,
            "tensors": [[t.name, t.dtype, list(t.shape), t.hash] + ([t.grid.body()] if t.grid else [])
                        for t in self.tensors],
            "pieces": [[p.length, p.hash, list(p.tensors)] + ([spans_body(p.spans)] if p.spans is not None else [])
                       for p in self.pieces],
        }
        if self.format_version >= 2:  # a format 1 body re-serializes to exactly what was signed
            body["files"] = [[f.name, f.size, f.hash, f.piece] for f in self.files]
        return body

    def body_bytes(self) -> bytes:
        return canonical_json(self.body())

    def signed(self, key: Ed25519PrivateKey) -> bytes:
        """The signed envelope of this manifest, as stored and sent."""
        return seal(key, self.body_bytes())

    @classmethod
    def from_body(cls, body: bytes) -> "Manifest":
        try:
            b = parse_json(body)
            if b["format_version"] not in READABLE_FORMATS:  # before any other field: a later format may differ
                raise CorruptError(f"invalid manifest: format_version {b['format_version']!r:.40}, this codec "
                                   f"reads {', '.join(map(str, READABLE_FORMATS))}")
            files = b["files"] if b["format_version"] >= 2 else []
            return cls(
                model_id=b["model_id"],
                version=b["version"],
                base_version=b["base_version"],
                kind=b["kind"],
                codec=b["codec"],
                base_hash=b["base_hash"],
                created_ms=b["created_ms"],
                format_version=b["format_version"],
                tensors=tuple(_tensor_entry(*t) for t in b["tensors"]),
                pieces=tuple(_piece_entry(*p) for p in b["pieces"]),
                files=tuple(FileEntry(n, s, h, p) for n, s, h, p in files),
            )
        except CodecError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptError(f"malformed manifest body: {type(e).__name__}: {e}") from e


def _tensor_entry(name, dtype, shape, digest, grid=None) -> TensorEntry:
    return TensorEntry(name, dtype, tuple(shape), digest, None if grid is None else Grid.from_body(grid))


def _piece_entry(length, digest, tensors, spans=None) -> PieceEntry:
    return PieceEntry(length, digest, tuple(tensors), None if spans is None else spans_from_body(spans))


def format_for(tensors: Iterable[TensorEntry], pieces: Iterable[PieceEntry]) -> int:
    """The format a manifest of these tensors and pieces is written in: 4 only when it needs it."""
    parts = any(t.grid is not None for t in tensors) or any(p.spans is not None for p in pieces)
    return PARTS_FORMAT if parts else FORMAT_VERSION


class NamedByManifest:
    """Mixed into what holds one version's `manifest` (decoded, stored, ...), so it answers to the
    version's model, number and kind as the manifest says, without copies that could disagree."""

    manifest: Manifest

    @property
    def model(self) -> str:
        return self.manifest.model_id

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def kind(self) -> Kind:
        return self.manifest.kind


def table_hash(entries: Iterable[TensorEntry]) -> str:
    """Digest of a tensor table, in name order: equal for equal weights whatever order they came in."""
    table = sorted([t.name, t.dtype, list(t.shape), t.hash] for t in entries)
    return digest(json.dumps(table, separators=(",", ":")).encode())


def load_manifest(data: bytes, trusted: Iterable[Ed25519PublicKey]) -> Manifest:
    """Parse a signed manifest, verifying its signature against the trusted keys first."""
    return Manifest.from_body(open_sealed(data, trusted, "manifest"))


def load_manifest_unverified(data: bytes) -> tuple[Manifest, str]:
    """Parse a signed manifest without checking the signature (for tools that only display it).

    Returns the manifest and the id of the key that claims to have signed it. Never apply weights
    from a manifest loaded this way.
    """
    body, signer, _ = unseal(data, "manifest")
    return Manifest.from_body(body), signer


def _validate(m: Manifest) -> None:
    def bad(msg: str) -> CorruptError:
        return CorruptError(f"invalid manifest: {msg}")

    if not _is_int(m.format_version) or m.format_version not in READABLE_FORMATS:
        raise bad(f"format_version {m.format_version!r}, this codec reads {', '.join(map(str, READABLE_FORMATS))}")
    if not isinstance(m.model_id, str) or not MODEL_ID_RE.match(m.model_id):
        raise bad(f"model_id {m.model_id!r} must match {MODEL_ID_RE.pattern}")
    if not _is_int(m.version) or m.version < 0:
        raise bad(f"version {m.version!r} must be an integer >= 0")
    if m.kind == "full":
        if m.base_version is not None or m.base_hash is not None:
            raise bad("a full snapshot has no base")
    elif m.kind == "delta":
        if not _is_int(m.base_version) or not 0 <= m.base_version < m.version:
            raise bad(f"delta base_version {m.base_version!r} must be an integer in [0, {m.version})")
        if not isinstance(m.base_hash, str) or not _HEX32.match(m.base_hash):
            raise bad("delta needs base_hash of 32 hex characters")
    else:
        raise bad(f"kind {m.kind!r} must be 'delta' or 'full'")
    if not isinstance(m.codec, str) or not m.codec:
        raise bad("codec must be a non-empty string")
    if not _is_int(m.created_ms):
        raise bad("created_ms must be an integer")
    parts = m.format_version >= PARTS_FORMAT
    names, total, tiles = set(), 0, 0
    for t in m.tensors:
        if not isinstance(t.name, str) or not t.name or t.name in names:
            raise bad(f"tensor name {t.name!r} empty or repeated")
        names.add(t.name)
        if t.dtype not in DTYPE_SIZES:
            raise bad(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        if len(t.shape) > MAX_NDIM or not all(_is_int(d) and d >= 0 for d in t.shape):
            raise bad(f"tensor {t.name!r}: bad shape {t.shape[:MAX_NDIM + 1]!r} (at most {MAX_NDIM} sizes >= 0)")
        if t.nbytes > MAX_TENSOR_BYTES:
            raise bad(f"tensor {t.name!r}: shape {t.shape!r} is {t.nbytes} bytes, over the limit of {MAX_TENSOR_BYTES}")
        total += t.nbytes
        if not isinstance(t.hash, str) or not _HEX32.match(t.hash):
            raise bad(f"tensor {t.name!r}: bad hash")
        if t.grid is not None:
            if not parts:
                raise bad(f"tensor {t.name!r}: a hash grid needs format {PARTS_FORMAT}")
            tiles += check_grid(t.name, t.shape, t.hash, t.grid, bad)
            if tiles > MAX_TILES:
                raise bad(f"over {MAX_TILES} grid tiles")
    if total > MAX_TOTAL_BYTES:
        raise bad(f"tensors total {total} bytes, over the limit of {MAX_TOTAL_BYTES}")
    payload, content_hex, spans = 0, _content_hex(m), 0
    for i, p in enumerate(m.pieces):
        if not _is_int(p.length) or not 0 <= p.length <= MAX_PIECE_BYTES:
            raise bad(f"piece {i}: bad length {p.length!r} (at most {MAX_PIECE_BYTES})")
        payload += p.length
        if not isinstance(p.hash, str) or not content_hex.match(p.hash):
            raise bad(f"piece {i}: bad hash")
        if not all(_is_int(t) and 0 <= t < len(m.tensors) for t in p.tensors):
            raise bad(f"piece {i}: tensor index out of range")
        if p.spans is not None:
            if not parts:
                raise bad(f"piece {i}: spans need format {PARTS_FORMAT}")
            spans += len(p.spans)
            if spans > MAX_SPANS:
                raise bad(f"over {MAX_SPANS} piece spans")
            check_spans(i, p.tensors, p.spans, lambda k: m.tensors[k].numel, bad)
    if payload > MAX_TOTAL_BYTES:
        raise bad(f"pieces total {payload} bytes, over the limit of {MAX_TOTAL_BYTES}")
    _validate_files(m, bad)


def _validate_files(m: Manifest, bad) -> None:
    """Side files: plain, sorted, unique names within the bounds; each carried by a piece of its own
    (exactly its bytes, writing no tensor) or, in a delta only, by none."""
    if m.format_version < 2 and m.files:
        raise bad("a format 1 manifest has no side files")
    if len(m.files) > MAX_SIDE_FILES:
        raise bad(f"{len(m.files)} side files, over the limit of {MAX_SIDE_FILES}")
    names = [f.name for f in m.files]
    for name in names:
        problem = side_file_problem(name)
        if problem:
            raise bad(f"side file {problem}")
    if names != sorted(set(names)):
        raise bad("side file names must be sorted and unique")
    total, carriers, content_hex = 0, set(), _content_hex(m)
    for f in m.files:
        if not _is_int(f.size) or not 0 <= f.size <= MAX_SIDE_FILE_BYTES:
            raise bad(f"side file {f.name}: bad size {f.size!r} (at most {MAX_SIDE_FILE_BYTES})")
        total += f.size
        if not isinstance(f.hash, str) or not content_hex.match(f.hash):
            raise bad(f"side file {f.name}: bad hash")
        if f.piece is None:
            if m.kind != "delta":
                raise bad(f"side file {f.name}: a full snapshot ships every side file")
            continue
        if not _is_int(f.piece) or not 0 <= f.piece < len(m.pieces) or f.piece in carriers:
            raise bad(f"side file {f.name}: piece {f.piece!r} out of range or shared")
        carriers.add(f.piece)
        p = m.pieces[f.piece]
        if p.tensors or p.length != f.size or p.hash != f.hash:
            raise bad(f"side file {f.name}: piece {f.piece} is not exactly its bytes")
    if total > MAX_SIDE_TOTAL_BYTES:
        raise bad(f"side files total {total} bytes, over the limit of {MAX_SIDE_TOTAL_BYTES}")


def _content_hex(m: Manifest) -> re.Pattern:
    """How a piece's or side file's digest is written: BLAKE3-256 from format 3, xxh3-128 before."""
    return _HEX64 if m.format_version >= 3 else _HEX32


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
