"""The store's ledger: every (model, version) it ever accepted and that version's one weights hash, on disk.

TUF's checklist for a repository of versions: no rollback (an old version offered as new), no
freeze replay (an old signed manifest sent again), no mix-and-match (two different weights under
one version number). Signatures alone stop none of these, since an old manifest still carries a
valid signature. So a store keeps, in `ROOT/ledger.jsonl`, one line per (model, version, kind) it
has accepted, with the version's weights hash, and keeps it through garbage collection and
restarts. `admit` refuses (ConflictError subclasses, a 409 at the HTTP edge) a second weights hash
for a version, whatever the kind, and for a publish also a version below the newest ever accepted
and a kind of a version that was accepted before and has since been collected. Refusals happen
before anything is written or announced. Lines are appended and fsynced; a line torn by a crash is
dropped when the ledger is loaded.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from deltamesh.delta.manifest import Manifest

log = logging.getLogger(__name__)


class ConflictError(Exception):
    """A manifest that contradicts what the store holds or once accepted (HTTP 409)."""


class RollbackError(ConflictError):
    """A published version below the newest the store ever accepted for its model."""


class ReplayError(ConflictError):
    """A published (version, kind) the store accepted before and has since collected."""


@dataclass
class _Accepted:
    weights_hash: str
    kinds: set[str] = field(default_factory=set)


class VersionLedger:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._models: dict[str, dict[int, _Accepted]] = {}

    def load(self) -> int:
        """Read the ledger (after a restart); returns how many lines it holds."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return 0
        kept: list[str] = []
        for line in text.splitlines():
            try:
                item = json.loads(line)
                model, version, kind, digest = item["model"], int(item["version"]), item["kind"], item["weights_hash"]
            except (ValueError, KeyError, TypeError):
                log.warning("ledger %s: dropping a torn line %r", self.path, line[:80])
                continue
            self._note(model, version, kind, digest)
            kept.append(line)
        if len(kept) != len(text.splitlines()) or (text and not text.endswith("\n")):
            _rewrite(self.path, "".join(f"{line}\n" for line in kept))
        return len(kept)

    def top(self, model: str) -> int | None:
        """The newest version of `model` ever accepted."""
        versions = self._models.get(model)
        return max(versions) if versions else None

    def weights_hash(self, model: str, version: int) -> str | None:
        seen = self._models.get(model, {}).get(version)
        return seen.weights_hash if seen is not None else None

    def admit(self, manifest: Manifest, *, published: bool) -> None:
        """Raise a ConflictError subclass unless `manifest` may be stored (it is not stored already).
        `published`: it comes from a publisher (the origin), so rollbacks and replays are refused too;
        a relay mirrors older versions on demand, and its upstream made those checks."""
        m = manifest
        seen = self._models.get(m.model_id, {}).get(m.version)
        if seen is not None and seen.weights_hash != m.weights_hash:
            raise ConflictError(f"{m.model_id} v{m.version} was accepted with weights hash {seen.weights_hash}; "
                                f"this {m.kind} carries {m.weights_hash}: a version has exactly one")
        if not published:
            return
        top = self.top(m.model_id)
        if top is not None and m.version < top:
            raise RollbackError(f"{m.model_id} v{m.version} is below the newest version accepted, v{top}: "
                                "versions only move forward")
        if seen is not None and m.kind in seen.kinds:
            raise ReplayError(f"{m.model_id} v{m.version} {m.kind} was accepted before and has since been "
                              "collected: an old manifest is not published again")

    def record(self, manifest: Manifest) -> None:
        """Remember that `manifest` was accepted (durably, before it is announced). Blocking: fsyncs."""
        m = manifest
        seen = self._models.get(m.model_id, {}).get(m.version)
        if seen is not None and m.kind in seen.kinds:
            return
        line = json.dumps({"model": m.model_id, "version": m.version, "kind": m.kind,
                           "weights_hash": m.weights_hash}, sort_keys=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._note(m.model_id, m.version, m.kind, m.weights_hash)

    def _note(self, model: str, version: int, kind: str, digest: str) -> None:
        seen = self._models.setdefault(model, {}).setdefault(version, _Accepted(digest))
        seen.kinds.add(kind)


def _rewrite(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
