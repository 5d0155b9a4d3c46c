"""One stored version of a gateway: a (model, version, kind)'s manifest and which of its pieces are on disk.

The version store (store.py) keeps one `StoredVersion` per entry; routes and relays read it to serve
pieces as they arrive (each missing piece has an event a reader can wait on), to describe a version in
listings, and to answer conditional requests (`manifest_etag`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

from deltamesh.delta.errors import CorruptError
from deltamesh.delta.hashing import digest
from deltamesh.delta.manifest import Manifest, NamedByManifest

KINDS = ("delta", "full")


@dataclass(eq=False)
class StoredVersion(NamedByManifest):
    """One (model, version, kind) in the store: its manifest and which of its pieces are on disk."""

    manifest: Manifest
    manifest_bytes: bytes
    path: Path
    present: set[int] = field(default_factory=set)
    readers: int = 0
    lease_until: float = 0.0
    created: float = field(default_factory=time.monotonic)
    stored_at: float | None = None
    """Wall time (`time.time()`) at which the last piece was stored: this gateway holds the whole version."""
    _arrivals: dict[int, asyncio.Event] = field(default_factory=dict, repr=False)
    checked: dict[int, str] = field(default_factory=dict, repr=False)
    """Piece index -> the xxh3-128 of its bytes once this gateway checked them against the manifest's
    (BLAKE3) digest: a later read from its own disk, which can rot but is no relay's to forge, is
    checked at xxh3's speed."""

    @property
    def complete(self) -> bool:
        return len(self.present) == len(self.manifest.pieces)

    @property
    def missing(self) -> list[int]:
        return [i for i in range(len(self.manifest.pieces)) if i not in self.present]

    def piece_path(self, index: int) -> Path:
        return self.path / "pieces" / str(index)

    @functools.cached_property
    def manifest_etag(self) -> str:
        """The manifest's HTTP validator: its envelope's digest, quoted."""
        return f'"{digest(self.manifest_bytes)}"'

    def describe(self) -> dict:
        m = self.manifest
        return {
            "version": m.version, "kind": m.kind, "base_version": m.base_version,
            "payload_bytes": m.payload_bytes, "pieces": len(m.pieces), "present": len(self.present),
            "complete": self.complete, "weights_hash": m.weights_hash, "stored_at": self.stored_at,
        }


def read_checked(path: Path, entry: StoredVersion, index: int) -> bytes:
    """A piece read back from disk, checked (off the event loop: hashing is most of the cost) against
    what this gateway verified when it stored it, or, the first time after a restart, the manifest."""
    data = path.read_bytes()
    known = entry.checked.get(index)
    if known is None:
        entry.manifest.check_piece(index, data)
        entry.checked[index] = digest(data)
    elif digest(data) != known:
        raise CorruptError(f"piece {index}: not the bytes stored")
    return data
