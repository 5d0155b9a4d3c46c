"""Disk space as a first-class state of a gateway's store: room is reserved before anything is accepted.

A manifest is accepted only when the filesystem has room for it and for every piece it declares
(rounded up to the filesystem's blocks), beyond what the versions still arriving have already been
promised and beyond a safety margin; a piece only when its bytes fit. What does not fit is refused
with `DiskFullError` (HTTP 507 at the routes) before anything is written or announced, and a write
that still runs out of space (another process filled the disk) removes what it started. The state
(`full`, free and reserved bytes) is reported in the gateway's health answer and metrics, and clears
on its own once a later reservation succeeds or the space has come back. `remove_leftovers` deletes
what a crash or a failed write left in the store's tree, at start.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
TEMP_SUFFIX = ".tmp"


class DiskFullError(Exception):
    """The store has no room for what was offered; nothing of it was kept."""


def is_no_space(e: OSError) -> bool:
    return e.errno in NO_SPACE


@dataclass
class DiskSpace:
    """Free-space checks of one store directory, and whether the last one failed."""

    root: Path
    margin_bytes: int
    """Kept free beyond every reservation: directories, inodes, logs, and what the estimate misses."""
    full: bool = False
    """True from a refusal until a later reservation succeeds or the space it lacked is free again."""
    short_of: int = field(default=0, repr=False)
    last_error: str = ""

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def block_bytes(self) -> int:
        return max(1, os.statvfs(self.root).f_frsize)

    def on_disk(self, sizes: Iterable[int], block: int) -> int:
        """What files of these sizes take on disk: each rounded up to whole blocks."""
        return sum(-(-n // block) * block for n in sizes)

    def reserve(self, need: int, reserved: int, what: str) -> None:
        """Raise DiskFullError unless `need` more bytes fit beside the `reserved` ones and the margin."""
        free = self.free_bytes()
        if free - reserved < need + self.margin_bytes:
            self.refused(f"no room for {what}: {need} bytes needed, {free} free, {reserved} promised to "
                         f"versions still arriving, {self.margin_bytes} kept as margin", need)
        self.full = False

    def write_file(self, path: Path, data: bytes, what: str) -> None:
        """(In a worker thread.) Write `path` whole (`write_atomic`), unless the disk has no room for it:
        then DiskFullError, leaving no temporary file. `what` names it in the refusal."""
        need = self.on_disk([len(data)], self.block_bytes())
        free = self.free_bytes()
        if free < need:
            self.refused(f"no room for {what}: {need} bytes needed, {free} free", need)
        try:
            write_atomic(path, data)
        except OSError as e:
            if is_no_space(e):
                self.refused(f"writing {what}: {e}", need)
            raise

    def refused(self, reason: str, need: int) -> None:
        """Record a refusal for lack of space and raise it as DiskFullError."""
        if not self.full:
            log.warning("store %s: disk full: %s", self.root, reason)
        self.full, self.short_of, self.last_error = True, need, reason
        raise DiskFullError(reason)

    def describe(self, reserved: int) -> dict:
        """The state for status answers and metrics; clears `full` once the space refused is free again."""
        try:
            free = self.free_bytes()
        except OSError as e:
            return {"full": self.full, "free_bytes": None, "reserved_bytes": reserved, "error": str(e)}
        if self.full and free - reserved >= self.short_of + self.margin_bytes:
            self.full = False
        return {"full": self.full, "free_bytes": free, "reserved_bytes": reserved,
                "margin_bytes": self.margin_bytes, "last_error": self.last_error if self.full else ""}


def remove_leftovers(models_dir: Path) -> int:
    """Delete temporary files of interrupted writes, and version directories whose manifest never made
    it to disk, under `models_dir` (at start, before anything writes); returns how many were removed."""
    removed = 0
    for kind_dir in models_dir.glob("*/*/*"):
        if not (kind_dir.is_dir() and kind_dir.parent.name.isdigit() and kind_dir.name in ("delta", "full")):
            continue
        if not (kind_dir / "manifest.json").exists():
            shutil.rmtree(kind_dir, ignore_errors=True)
            removed += 1
            continue
        for d in (kind_dir, kind_dir / "pieces"):
            for f in d.glob(f".*{TEMP_SUFFIX}"):
                f.unlink(missing_ok=True)
                removed += 1
    for version_dir in models_dir.glob("*/*"):
        if version_dir.name.isdigit() and version_dir.is_dir() and not any(version_dir.iterdir()):
            version_dir.rmdir()
    if removed:
        log.info("store %s: removed %d leftovers of interrupted writes", models_dir.parent, removed)
    return removed


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary name, fsynced, then renamed; the temporary file
    is removed when anything fails (a full disk most of all), so failures leave nothing behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(data)}{TEMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_manifest(path: Path, raw: bytes) -> None:
    """Create a version's directory with its manifest, durably; on failure remove the directory again."""
    try:
        (path / "pieces").mkdir(parents=True, exist_ok=True)
        write_atomic(path / "manifest.json", raw)
        # Make the new directories themselves durable, so a restart finds the manifest.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # the version's directory, unless its other kind is there
        raise
