"""The gateway's version store: signed manifests and their pieces on disk, indexed in memory.

Layout: `ROOT/models/<model>/<version>/<kind>/manifest.json` (the signed envelope exactly as received)
and `.../pieces/<index>` (raw piece bytes). Files are written to a temporary name, fsynced and renamed,
so a crash leaves either the whole file or none; a restart re-indexes what is on disk and nothing has
to be uploaded again. A manifest is accepted only when the disk has room for it and all its pieces
(`deltamesh.gateway.server.disk`: otherwise DiskFullError, a 507, with nothing written or announced), so an
announced version can always be completed. A version is announced (the head moves, waiters wake) as
soon as its manifest is durable and its pieces' space reserved, and each piece becomes readable the
moment it has been written and verified, which is what lets relays forward a version while the rest
of it is still arriving. Pieces are hashed again on every read, so a piece corrupted on disk is
detected, dropped and reported instead of served.
Each entry notes the wall time at which its last piece was stored (`stored_at`, in version listings:
when the origin, or a relay, held the whole version; after a restart, the newest piece file's time).
Retention keeps the newest deltas and full snapshots (and always the newest complete full); garbage
collection skips anything that is being read, written, or promised to a transfer by a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from deltamesh.delta.errors import CorruptError, SignatureError
from deltamesh.delta.hashing import digest
from deltamesh.delta.keys import Ed25519PublicKey
from deltamesh.delta.manifest import MODEL_ID_RE, Manifest, load_manifest
from deltamesh.gateway.server.disk import DiskSpace, is_no_space, remove_leftovers, write_manifest
from deltamesh.gateway.server.ledger import ConflictError, VersionLedger
from deltamesh.gateway.server.staging import Staging, StagingIncomplete
from deltamesh.gateway.server.stored_version import KINDS, StoredVersion, read_checked
from deltamesh.signals import wait_event

log = logging.getLogger(__name__)


class VersionStore:
    """All versions a gateway holds, with async waits for new heads and for pieces to arrive."""

    def __init__(self, root: str | Path, trusted_keys: Iterable[Ed25519PublicKey], *,
                 disk_margin_bytes: int = 64 * 2**20, staging_max_bytes: int = 64 * 2**30,
                 staging_ttl_s: float = 600.0):
        self.root = Path(root)
        self.trusted_keys = list(trusted_keys)
        self.disk = DiskSpace(self.root, disk_margin_bytes)
        """Free space, reservations and the disk-full state: see `deltamesh.gateway.server.disk`."""
        self.staging = Staging(self.root / "staging", self.disk, max_bytes=staging_max_bytes, ttl_s=staging_ttl_s)
        self.ledger = VersionLedger(self.root / "ledger.jsonl")
        """(model, version) -> weights hash of everything ever accepted: see `deltamesh.gateway.server.ledger`."""
        self._models: dict[str, dict[tuple[int, str], StoredVersion]] = {}
        self._epoch = 0
        self._changed = asyncio.Event()
        self._closing = False
        self._manifest_lock = asyncio.Lock()
        self.on_piece_corrupt: list[Callable[[StoredVersion, int], None]] = []
        self.on_version_complete: list[Callable[[StoredVersion], None]] = []

    # -- loading ---------------------------------------------------------------------------------
    def load(self) -> int:
        """Index what is on disk (after a restart); returns how many versions were found."""
        models_dir = self.root / "models"
        models_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(models_dir)
        self.staging.load()
        self.ledger.load()
        found = 0
        for model_dir in sorted(models_dir.iterdir()):
            if not MODEL_ID_RE.match(model_dir.name):
                continue
            for version_dir in model_dir.iterdir():
                if not version_dir.name.isdigit():
                    continue
                for kind in KINDS:
                    entry = self._load_entry(model_dir.name, int(version_dir.name), kind, version_dir / kind)
                    if entry is not None:
                        self._models.setdefault(entry.model, {})[(entry.version, entry.kind)] = entry
                        self.ledger.record(entry.manifest)  # a crash may have come between the two writes
                        found += 1
        log.info("store %s: %d versions of %d models", self.root, found, len(self._models))
        return found

    def _load_entry(self, model: str, version: int, kind: str, path: Path) -> StoredVersion | None:
        try:
            raw = (path / "manifest.json").read_bytes()
        except FileNotFoundError:
            return None
        try:
            manifest = load_manifest(raw, self.trusted_keys)
        except CorruptError as e:
            log.warning("store: dropping unreadable manifest %s: %s", path, e)
            return None
        except SignatureError as e:  # signed by a key that is no longer trusted
            log.warning("store: ignoring %s: %s", path, e)
            return None
        if (manifest.model_id, manifest.version, manifest.kind) != (model, version, kind):
            log.warning("store: %s holds a manifest of another version; ignored", path)
            return None
        entry = StoredVersion(manifest, raw, path)
        pieces_dir = path / "pieces"
        pieces_dir.mkdir(exist_ok=True)
        for f in pieces_dir.iterdir():
            if not f.name.isdigit():
                f.unlink(missing_ok=True)  # a temp file from an interrupted write
                continue
            i = int(f.name)
            stat = f.stat()
            if i < len(manifest.pieces) and stat.st_size == manifest.pieces[i].length:
                entry.present.add(i)
                entry.stored_at = max(entry.stored_at or 0.0, stat.st_mtime)
        if entry.complete and not manifest.pieces:
            entry.stored_at = (path / "manifest.json").stat().st_mtime
        elif not entry.complete:
            entry.stored_at = None
        return entry

    # -- queries ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """A counter that grows whenever what this gateway serves changes: a new manifest stored, versions
        collected, or `touch` (so followers can long-poll)."""
        return self._epoch

    def models(self) -> list[str]:
        return sorted(self._models)

    def head(self, model: str) -> int | None:
        entries = self._models.get(model)
        return max(v for v, _ in entries) if entries else None

    def heads(self) -> dict[str, int]:
        return {m: v for m in self._models if (v := self.head(m)) is not None}

    def entries(self, model: str) -> list[StoredVersion]:
        return sorted(self._models.get(model, {}).values(), key=lambda e: (e.version, e.kind))

    def get(self, model: str, version: int, kind: str) -> StoredVersion | None:
        return self._models.get(model, {}).get((version, kind))

    # -- waiting ---------------------------------------------------------------------------------
    async def wait_change(self, since_epoch: int, timeout: float) -> int:
        """Wait until the epoch passes `since_epoch` (or `timeout`); return the epoch."""
        deadline = time.monotonic() + timeout
        while self._epoch <= since_epoch and not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await wait_event(self._changed, left)
        return self._epoch

    async def _wait_until(self, ready: Callable[[], bool], timeout: float) -> None:
        """Wait until `ready()` holds after a change of the store (or `timeout`, or shutdown)."""
        deadline = time.monotonic() + timeout
        while not ready() and not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self.wait_change(self._epoch, left)

    async def wait_head(self, model: str, after: int | None, timeout: float) -> int | None:
        """Wait until `model`'s head is newer than `after` (or `timeout`); return the head."""
        def newer() -> bool:
            head = self.head(model)
            return head is not None and (after is None or head > after)

        await self._wait_until(newer, timeout)
        return self.head(model)

    async def wait_version(self, model: str, version: int, kind: str, timeout: float) -> StoredVersion | None:
        """Wait (up to `timeout`) until `version`'s `kind` is announced here; None if it was not, or if
        a newer version of the model was announced first (then it is not coming: versions are published
        in order, each kind of one version right after the other)."""
        def settled() -> bool:
            head = self.head(model)
            return self.get(model, version, kind) is not None or (head is not None and head > version)

        await self._wait_until(settled, timeout)
        return self.get(model, version, kind)

    async def wait_entry(self, model: str, version: int, kind: str, timeout: float) -> StoredVersion | None:
        """Wait (up to `timeout`) until `version`'s `kind` is stored here, whatever the head (a relay
        fetching an older version on demand); None if it was not."""
        await self._wait_until(lambda: self.get(model, version, kind) is not None, timeout)
        return self.get(model, version, kind)

    async def wait_piece(self, entry: StoredVersion, index: int, timeout: float) -> bool:
        if index in entry.present or self._closing:
            return index in entry.present
        event = entry._arrivals.setdefault(index, asyncio.Event())
        await wait_event(event, timeout)
        return index in entry.present

    def close(self) -> None:
        """Release every waiter at once (on shutdown, so long polls do not hold the process up)."""
        self._closing = True
        self._changed.set()
        for entries in self._models.values():
            for entry in entries.values():
                for event in entry._arrivals.values():
                    event.set()

    def touch(self) -> None:
        """Move the epoch without a new manifest: what this gateway can serve changed otherwise (a
        relay learned of versions its upstream can serve it), and followers should list it again."""
        self._bump()

    def _bump(self) -> None:
        self._epoch += 1
        self._changed.set()
        self._changed = asyncio.Event()

    # -- writing ---------------------------------------------------------------------------------
    async def put_manifest(self, raw: bytes, *, published: bool = False,
                           staged: bool = False) -> tuple[StoredVersion, bool]:
        """Verify and store a signed manifest; returns (entry, whether it is new).

        Raises SignatureError (untrusted or bad signature), CorruptError (malformed) or
        ConflictError (a different manifest for the same version and kind is already stored, or
        another weights hash for the version was accepted before; `published`, from a publisher:
        also a version below the newest accepted, or a collected one sent again). `staged`: every piece
        is taken from `staging` (StagingIncomplete if one is not there) before the manifest is written,
        so it is announced whole. Nothing is written or announced for a refused one; the epoch stays.
        """
        manifest = load_manifest(raw, self.trusted_keys)
        async with self._manifest_lock:  # check, write and index as one step (manifests are rare)
            existing = self._same_as_stored(manifest)
            if existing is not None:
                return existing, False
            missing = self.staging.missing(manifest) if staged else []
            if missing:
                raise StagingIncomplete(missing)
            self.ledger.admit(manifest, published=published)
            path = self.root / "models" / manifest.model_id / str(manifest.version) / manifest.kind
            checked = await asyncio.to_thread(self.staging.claim, manifest, path / "pieces") if staged else {}
            await asyncio.to_thread(self._write_manifest, path, manifest, raw, self.reserved_bytes(), not staged)
            await asyncio.to_thread(self.ledger.record, manifest)
            entry = StoredVersion(manifest, raw, path)
            entry.present.update(checked)
            entry.checked.update(checked)
            self._models.setdefault(manifest.model_id, {})[(manifest.version, manifest.kind)] = entry
        self._bump()
        if entry.complete:
            self._completed(entry)
        return entry, True

    def _same_as_stored(self, manifest: Manifest) -> StoredVersion | None:
        existing = self.get(manifest.model_id, manifest.version, manifest.kind)
        if existing is not None and (existing.manifest.weights_hash != manifest.weights_hash
                                     or existing.manifest.pieces != manifest.pieces):
            raise ConflictError(
                f"{manifest.model_id} v{manifest.version} {manifest.kind} is already stored with other contents")
        return existing

    async def put_piece(self, entry: StoredVersion, index: int, data: bytes, *, verified: bool = False) -> bool:
        """Verify and store one piece; returns False if it was already present. Raises CorruptError.

        `verified`: the caller checked `data` against this manifest already (a relay's fetcher does
        for every piece it hands over), so the signed digest is not computed twice."""
        if not verified:
            entry.manifest.check_piece(index, data)
        if index in entry.present:
            return False
        try:
            await asyncio.to_thread(self._write_piece, entry, index, data)
        except FileNotFoundError:
            return False  # collected meanwhile (only possible for an entry nobody marked as in use)
        if self.get(entry.model, entry.version, entry.kind) is not entry:
            return False
        entry.checked[index] = digest(data)
        entry.present.add(index)
        event = entry._arrivals.pop(index, None)
        if event is not None:
            event.set()
        if entry.complete:
            self._completed(entry)
        return True

    def _completed(self, entry: StoredVersion) -> None:
        entry.stored_at = time.time()
        for callback in self.on_version_complete:
            callback(entry)

    # -- disk space (see deltamesh.gateway.server.disk) ---------------------------------------------------
    def reserved_bytes(self) -> int:
        """Disk space promised to the pieces of versions still arriving (in whole blocks)."""
        block = self.disk.block_bytes()
        return sum(self.disk.on_disk((e.manifest.pieces[i].length for i in e.missing), block)
                   for entries in self._models.values() for e in entries.values() if not e.complete)

    def disk_state(self) -> dict:
        """Free and reserved bytes and whether the disk is full, for status answers and metrics."""
        try:
            reserved = self.reserved_bytes()
        except OSError:
            reserved = 0
        return self.disk.describe(reserved)

    def _write_manifest(self, path: Path, manifest: Manifest, raw: bytes, reserved: int, pieces: bool = True) -> None:
        """(In a worker thread.) Reserve room for the manifest and (`pieces`: they are not on disk yet)
        every piece, then write the manifest; DiskFullError, leaving nothing behind, when they do not fit."""
        what = f"{manifest.model_id} v{manifest.version} {manifest.kind}"
        need = self.disk.on_disk([len(raw), *(p.length for p in manifest.pieces if pieces)], self.disk.block_bytes())
        self.disk.reserve(need, reserved, what)
        try:
            write_manifest(path, raw)
        except OSError as e:
            if is_no_space(e):
                self.disk.refused(f"writing the manifest of {what}: {e}", need)
            raise

    def _write_piece(self, entry: StoredVersion, index: int, data: bytes) -> None:
        """(In a worker thread.) Write a piece whose room its manifest reserved, unless the disk has
        filled up since (another writer): then DiskFullError, leaving no temporary file."""
        self.disk.write_file(entry.piece_path(index), data,
                             f"piece {index} of {entry.model} v{entry.version} {entry.kind}")

    async def read_piece(self, entry: StoredVersion, index: int) -> bytes:
        """Read a present piece and check it against the manifest.

        A piece that fails the check is removed from disk and from `present`, the corruption
        callbacks run (a relay refetches it), and CorruptError is raised.
        """
        path = entry.piece_path(index)
        try:
            return await asyncio.to_thread(read_checked, path, entry, index)
        except (CorruptError, FileNotFoundError) as e:
            log.error("store: piece %d of %s v%d %s is damaged on disk (%s); dropped",
                      index, entry.model, entry.version, entry.kind, e)
            entry.present.discard(index)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            for callback in self.on_piece_corrupt:
                callback(entry, index)
            raise CorruptError(f"piece {index} of {entry.model} v{entry.version} {entry.kind} was damaged on disk") from e

    # -- leases and garbage collection -------------------------------------------------------------
    def lease(self, entries: Iterable[StoredVersion], seconds: float) -> None:
        until = time.monotonic() + seconds
        for e in entries:
            e.lease_until = max(e.lease_until, until)

    @contextlib.contextmanager
    def using(self, entry: StoredVersion) -> Iterator[StoredVersion]:
        """Mark `entry` as in use (being read or written) so garbage collection leaves it alone."""
        entry.readers += 1
        try:
            yield entry
        finally:
            entry.readers -= 1

    def collect(self, keep_deltas: int, keep_fulls: int) -> list[StoredVersion]:
        """Delete versions beyond retention that nobody is using; returns what was deleted.

        The newest complete full snapshot of a model is kept even beyond `keep_fulls` (newer ones may
        still be arriving): without it a relay could serve no first pull from its own store."""
        now = time.monotonic()
        removed = []
        self.staging.expire()
        for model, entries in self._models.items():
            head = self.head(model)
            anchor = max((e for e in entries.values() if e.kind == "full" and e.complete),
                         key=lambda e: e.version, default=None)
            for kind, keep in (("delta", keep_deltas), ("full", keep_fulls)):
                of_kind = sorted((e for e in entries.values() if e.kind == kind), key=lambda e: -e.version)
                for e in of_kind[keep:]:
                    if e.readers or e.lease_until > now or e.version == head or e is anchor:
                        continue
                    del entries[(e.version, e.kind)]
                    shutil.rmtree(e.path, ignore_errors=True)
                    with contextlib.suppress(OSError):
                        e.path.parent.rmdir()  # the version directory, once both kinds are gone
                    removed.append(e)
        for e in removed:
            log.info("store: collected %s v%d %s", e.model, e.version, e.kind)
        if removed:
            self._bump()  # followers list again: relays plan with what this gateway can still serve
        return removed

