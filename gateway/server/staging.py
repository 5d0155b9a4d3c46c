"""Pieces a version built in parts uploads before its manifest exists, so it is never announced half-done.

A trainer whose ranks each encode their own rows uploads each rank's pieces from that rank, in
parallel, before rank 0 has signed the manifest (it needs every rank's description first). An origin
that announced the version at its manifest, as it does for a publisher that sends the manifest
first, would show pools a version whose missing pieces might never come: a rank that dies
mid-upload. So those pieces go to the origin's staging area first (`PUT .../staged/{digest}`, trainer
role, scoped to the model), named by their BLAKE3 digest, which the origin checks on arrival; rank 0
then sends the manifest with `?staged=1`, and the origin accepts it only if every one of its pieces is
staged, moves them into the version (before the manifest is written: the manifest is the commit
point) and announces the version whole. A piece staged and not claimed within `ttl_s` is deleted, and
a restart empties the staging area (a publisher retries its whole version).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from deltamesh.delta.errors import CorruptError
from deltamesh.delta.hashing import digest, piece_digest
from deltamesh.delta.manifest import Manifest
from deltamesh.gateway.server.disk import DiskSpace

log = logging.getLogger(__name__)


class StagingFullError(Exception):
    """The staging area holds as many bytes as it may (a 507, like a full disk)."""


class StagingIncomplete(Exception):
    """A manifest sent to be claimed from staging names pieces that are not staged."""

    def __init__(self, missing: list[int]) -> None:
        super().__init__(f"{len(missing)} of its pieces are not staged, e.g. {missing[:8]}")
        self.missing = missing


@dataclass
class _Staged:
    path: Path
    length: int
    checked: str
    """xxh3-128 of the bytes, for the store's later read-back checks."""
    at: float


class Staging:
    """The staged pieces of one gateway's store, by (model, BLAKE3 digest)."""

    def __init__(self, root: Path, disk: DiskSpace, *, max_bytes: int, ttl_s: float) -> None:
        self.root = root
        self.disk = disk
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._pieces: dict[tuple[str, str], _Staged] = {}

    @property
    def bytes(self) -> int:
        return sum(s.length for s in self._pieces.values())

    def load(self) -> None:
        """Start empty: pieces staged before a restart are dropped (their publisher sends them again)."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)

    def staged(self) -> list[tuple[str, str]]:
        """(model, digest) of every staged piece, sorted."""
        return sorted(self._pieces)

    def has(self, model: str, piece_hash: str, length: int) -> bool:
        staged = self._pieces.get((model, piece_hash))
        return staged is not None and staged.length == length

    async def put(self, model: str, piece_hash: str, data: bytes) -> bool:
        """Check `data` against its claimed digest and keep it; False if it was staged already.
        CorruptError for bytes that are not that digest's; StagingFullError or DiskFullError when there
        is no room."""
        if (model, piece_hash) in self._pieces:
            return False
        if await asyncio.to_thread(piece_digest, data) != piece_hash:
            raise CorruptError("the piece's bytes do not hash to the digest it was staged under")
        if self.bytes + len(data) > self.max_bytes:
            raise StagingFullError(f"staging holds {self.bytes} bytes; {len(data)} more would pass its "
                                   f"limit of {self.max_bytes}")
        path = self.root / model / piece_hash
        await asyncio.to_thread(self._write, path, data)
        self._pieces[(model, piece_hash)] = _Staged(path, len(data), await asyncio.to_thread(digest, data),
                                                    time.monotonic())
        return True

    def _write(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.disk.write_file(path, data, f"a staged piece of {len(data)} bytes")

    def missing(self, manifest: Manifest) -> list[int]:
        """Indices of the manifest's pieces not staged."""
        return [i for i, p in enumerate(manifest.pieces) if not self.has(manifest.model_id, p.hash, p.length)]

    def claim(self, manifest: Manifest, pieces_dir: Path) -> dict[int, str]:
        """(In a worker thread.) Move every piece of `manifest` from staging into `pieces_dir` (a piece
        named twice is linked), durably; returns each piece's xxh3-128. The caller checked `missing`."""
        pieces_dir.mkdir(parents=True, exist_ok=True)
        checked, used = {}, set()
        for i, p in enumerate(manifest.pieces):
            staged = self._pieces[(manifest.model_id, p.hash)]
            os.link(staged.path, pieces_dir / str(i))
            checked[i] = staged.checked
            used.add((manifest.model_id, p.hash))
        fd = os.open(pieces_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for key in used:
            self._pieces.pop(key).path.unlink(missing_ok=True)
        return checked

    def expire(self) -> int:
        """Delete pieces staged longer than `ttl_s` ago and never claimed; returns how many."""
        now = time.monotonic()
        old = [key for key, s in self._pieces.items() if now - s.at > self.ttl_s]
        for key in old:
            self._pieces.pop(key).path.unlink(missing_ok=True)
        if old:
            log.info("staging: dropped %d unclaimed pieces older than %.0f s", len(old), self.ttl_s)
        return len(old)
