"""Atomic apply to a safetensors directory: readers see the old version or the new one, never a mix.

The directory path is a symlink to a versioned sibling, `.NAME.vVERSION-TOKEN/`, which holds the
safetensors files, the version's side files (config, tokenizer: side_files.py; so the path is a model
directory `from_pretrained` loads) and `deltamesh-manifest.json` (the body of the last applied
manifest: which version this is and what it hashes to, so the next delta's base check costs nothing).
A new version is written into `.NAME.partial-TOKEN/`, fsynced, renamed to its versioned name, and
made current by renaming a fresh symlink over the path (atomic on POSIX), then the parent directory is
fsynced. A process killed at any point leaves the path on the old version; leftovers are removed by
the next apply, which holds `.NAME.lock` so two appliers never interleave. The previous version's directory
is kept until the apply after, so a reader that resolved the old symlink can finish reading it; an
older one is renamed aside before it is deleted, so a reader slower than that fails whole and starts
over (`read_weights`), never reading part of a version.

Versions come decoded (a pool decodes each once and applies it to its engine too) or as (manifest,
pieces), decoded here; either way they go through the one applier (applier.py), in place on the weights
read from the directory, or on the ones its writer held in memory since the last apply (`HeldWeights`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from .applier import apply_version
from .decoded_version import DecodedVersion, Step, as_decoded, manifest_of
from .errors import BaseMismatchError, CorruptError
from .manifest import Manifest
from .side_files import MANIFEST_FILE, place_side_files
from .storage import fsync_dir, read_weights, shard_layout, write_weights

log = logging.getLogger(__name__)


def dir_manifest(path: str | Path) -> Manifest | None:
    """The manifest of the version a directory holds, or None if it holds none applied by us."""
    file = Path(path).resolve() / MANIFEST_FILE
    try:
        body = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptError(f"{file}: {e}") from e
    return Manifest.from_body(body)


class HeldWeights:
    """The weights of the version a directory holds, kept in memory by the directory's one writer
    between applies (a `deltamesh pool sync` agent), so that the next delta patches them where they
    are. Read from the directory instead, the tensors are mapped copy-on-write and a real step, which
    moves a word in nearly every 4 KiB page, takes one fault per page to patch them (BENCHMARKS.md).
    They cost one model's memory. Held only while known to be the version the directory's current
    target holds; an apply that fails drops them. `adopt`: the writer gives its decoded versions to
    the directory alone (no engine shares them), so the tensors they wrote whole are held uncopied."""

    def __init__(self, *, adopt: bool = False) -> None:
        self.adopt = adopt
        self._target: str | None = None
        self._weights: dict[str, torch.Tensor] | None = None

    def take(self, target: Path) -> dict[str, torch.Tensor] | None:
        """The weights held for `target` (the directory's versioned folder), given up to the caller."""
        weights, self._weights = self._weights, None
        return weights if self._target == target.name else None

    def keep(self, target: Path, weights: Mapping[str, torch.Tensor], steps: list[DecodedVersion | Step], *,
             mapped: bool) -> None:
        """Hold `weights`, now `target`'s. `mapped`: they were read from the directory, and copied here
        once, so that they do not keep a removed version's files mapped (and on disk) for good."""
        # Tensors a version wrote whole belong to its DecodedVersion, which its caller may have given
        # an engine too: the next apply would patch them under it.
        shared = {id(t) for step in steps if isinstance(step, DecodedVersion) and not self.adopt
                  for t in step.whole.values()}
        self._target = target.name
        self._weights = {name: t.clone() if mapped or id(t) in shared else t for name, t in weights.items()}


def apply_to_dir(path: str | Path, steps: Iterable[DecodedVersion | Step], *,
                 held: HeldWeights | None = None) -> Manifest | None:
    """Apply a full snapshot and/or a chain of deltas (decoded versions, or verified manifests with
    their pieces) to the weights at `path`, atomically; returns the manifest of the version the path
    now holds. Decoded versions are only read, so the caller may apply them elsewhere too.

    The base check is against the directory's recorded manifest when there is one, else against the
    hash of the weights read from it. Tensors keep the directory's sharding. `held`: the directory's
    weights kept in memory between applies by its one writer (taken instead of reading the directory
    when they are of its current version; the new version's kept once it is in place).
    """
    path = Path(path).absolute()
    steps = list(steps)
    if not steps:
        return dir_manifest(path) if path.exists() else None
    parent, name = path.parent, path.name
    parent.mkdir(parents=True, exist_ok=True)
    with _locked(parent / f".{name}.lock"):
        _recover_original(path)
        _remove_leftovers(parent, name, keep=_current_target(path))
        current = path.resolve() if path.exists() else None
        weights, recorded, layout, mapped = None, None, None, False
        if current is not None:
            layout = shard_layout(current)
        if manifest_of(steps[0]).kind == "delta":
            if current is None:
                raise BaseMismatchError(f"{path}: holds no weights to apply a delta to")
            weights = held.take(current) if held is not None else None
            mapped = weights is None
            if mapped:
                weights = read_weights(current)
            recorded = dir_manifest(current)
        weights, shipped = _apply_steps(weights, steps, recorded)
        final = manifest_of(steps[-1])
        token = secrets.token_hex(4)
        partial = parent / f".{name}.partial-{token}"
        try:
            write_weights(partial, weights, layout=layout, fsync=True)
            place_side_files(partial, final, shipped, current)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # not left for the next apply: a refusal writes nothing
            raise
        with open(partial / MANIFEST_FILE, "wb") as f:
            f.write(final.body_bytes())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(partial)
        target = parent / f".{name}.v{final.version}-{token}"
        os.rename(partial, target)
        previous = _point(path, target, token)
        if held is not None:
            held.keep(target, weights, steps, mapped=mapped)
        log.info("%s now holds %s v%d", path, final.model_id, final.version)
        _remove_leftovers(parent, name, keep=target, previous=previous)
        return final


def _apply_steps(weights: dict[str, torch.Tensor] | None, steps: list[DecodedVersion | Step],
                 recorded: Manifest | None) -> tuple[Mapping[str, torch.Tensor], dict[str, bytes]]:
    """The chain applied in place, each step decoded only when it comes, and the side files its steps
    shipped (a later step's over an earlier one's). The tensor digests of the manifest the weights
    were verified against (`recorded`, then each step's) check the next step's base and spare hashing
    the tensors it leaves alone. Tensors a step writes whole belong to its `DecodedVersion`: a later
    step that would patch them in place gets a copy."""
    shipped: dict[str, bytes] = {}
    for k, step in enumerate(steps):
        version = as_decoded(step)
        shipped.update(version.files)
        weights = apply_version(version, weights, base_entries=None if recorded is None else recorded.entries(),
                                in_place=True)
        recorded = version.manifest
        if k + 1 < len(steps) and version.whole:
            shared = {id(t) for t in version.whole.values()}
            weights = {name: t.clone() if id(t) in shared else t for name, t in weights.items()}
    return weights, shipped


def _point(path: Path, target: Path, token: str) -> Path | None:
    """Make `path` a symlink to `target`; returns where the previous version now lives."""
    link = path.parent / f".{path.name}.link-{token}"
    os.symlink(target.name, link)
    previous = path.resolve() if path.exists() else None
    if previous is not None and not path.is_symlink():
        # A plain directory cannot be replaced atomically: move it aside as a version first. Until
        # the symlink lands (microseconds later) the path does not exist; from then on swaps are atomic.
        previous = path.parent / f".{path.name}.v-original-{token}"
        os.rename(path, previous)
        log.warning("%s was a plain directory; it now points to versioned copies", path)
    os.replace(link, path)
    fsync_dir(path.parent)
    return previous


def _recover_original(path: Path) -> None:
    """Undo a migration of a plain directory that was killed between its two renames."""
    if path.exists() or path.is_symlink():
        return
    originals = sorted(p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.v-original-"))
    if originals:
        os.rename(originals[-1], path)
        fsync_dir(path.parent)
        log.warning("%s restored from %s after an interrupted apply", path, originals[-1].name)


def _current_target(path: Path) -> Path | None:
    return path.resolve() if path.is_symlink() and path.exists() else None


def _remove_leftovers(parent: Path, name: str, keep: Path | None, previous: Path | None = None) -> None:
    """Remove partial writes, stray links and old versions of `name` (never `keep` or `previous`)."""
    spared = {p.name for p in (keep, previous) if p is not None}
    prefix = f".{name}."
    for entry in parent.iterdir():
        if not entry.name.startswith(prefix):
            continue
        kind = entry.name[len(prefix) :]
        if kind == "lock" or entry.name in spared:
            continue
        if kind.startswith("link-"):
            entry.unlink(missing_ok=True)
        elif kind.startswith(("partial-", "v", "removed-")) and entry.is_dir() and not entry.is_symlink():
            _remove_version(entry, parent / f"{prefix}removed-{secrets.token_hex(4)}")


def _remove_version(entry: Path, aside: Path) -> None:
    """Remove a version's directory by renaming it aside first: a reader still on its old path then
    fails whole and starts over on the current version (`read_weights`). Deleted in place, it would
    lose its index before its shards, and a reader between the two would find a few shards and no
    index: part of a version, read as if whole. A removal killed midway leaves `aside` for the next."""
    try:
        os.rename(entry, aside)
    except OSError:
        aside = entry
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
