"""The newest signed head statement of each model a gateway serves, kept on disk beside its store.

The origin takes statements from the trainer (`PUT /v1/models/{model}/statement`), a relay mirrors its
upstreams' (`deltamesh.gateway.server.statement_mirror`), and both serve them to pools and downstream
gateways (`GET`). A statement is verified against the trusted keys before it is kept, and only the
newest one per model is kept: one issued no later than the kept one, or naming an older version, is
refused (`StatementConflict`, a 409), so nobody can walk a gateway's statement back. It must also agree
with the ledger (one weights hash per version): at the origin it must name a version the origin
accepted, with that version's hash; a relay, which may learn of a statement before the version itself
arrives, checks the hash only for versions it knows. A new statement moves the store's epoch, so
followers (relays, their mirrors) pick it up at once. Files: ROOT/statements/MODEL.json, each replaced
atomically.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from deltamesh.delta.errors import CodecError
from deltamesh.delta.hashing import digest
from deltamesh.delta.keys import Ed25519PublicKey
from deltamesh.delta.manifest import MODEL_ID_RE
from deltamesh.delta.statement import HeadStatement, load_statement
from deltamesh.gateway.server.ledger import VersionLedger

log = logging.getLogger(__name__)


class StatementConflict(Exception):
    """A statement that is not newer than the kept one, or contradicts the ledger (HTTP 409)."""


class NotNewer(StatementConflict):
    """A statement issued no later than the kept one, or naming an older version."""


@dataclass(frozen=True)
class StoredStatement:
    statement: HeadStatement
    raw: bytes
    """The signed envelope exactly as the trainer made it (served as is: nobody re-serializes)."""

    @property
    def etag(self) -> str:
        return f'"{digest(self.raw)}"'


class StatementStore:
    def __init__(self, root: str | Path, trusted_keys: Iterable[Ed25519PublicKey], ledger: VersionLedger,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.dir = Path(root) / "statements"
        self.trusted_keys = list(trusted_keys)
        self.ledger = ledger
        self.on_change = on_change
        self._kept: dict[str, StoredStatement] = {}
        self._lock = asyncio.Lock()

    def load(self) -> int:
        """Read the kept statements (after a restart); unreadable or no longer trusted ones are dropped."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.dir.glob("*.json")):
            model = path.stem
            if not MODEL_ID_RE.match(model):
                continue
            try:
                raw = path.read_bytes()
                statement = load_statement(raw, self.trusted_keys, model=model)
            except (OSError, CodecError) as e:
                log.warning("statements: dropping %s: %s", path, e)
                path.unlink(missing_ok=True)
                continue
            self._kept[model] = StoredStatement(statement, raw)
        return len(self._kept)

    def get(self, model: str) -> StoredStatement | None:
        return self._kept.get(model)

    async def put(self, raw: bytes, *, published: bool, model: str | None = None) -> bool:
        """Verify and keep a statement; True if it is new, False if it is the one already kept. Raises
        SignatureError or CorruptError (not a valid statement, or about another model than `model`) and
        StatementConflict. `published`: from the trainer (the origin), whose ledger must hold the version."""
        statement = load_statement(raw, self.trusted_keys, model=model)
        async with self._lock:  # check and write as one step (statements are rare)
            kept = self._kept.get(statement.model_id)
            if kept is not None and kept.raw == raw:
                return False
            self._check(statement, kept, published)
            await asyncio.to_thread(self._write, statement.model_id, raw)
            self._kept[statement.model_id] = StoredStatement(statement, raw)
        self.on_change()
        return True

    def _check(self, s: HeadStatement, kept: StoredStatement | None, published: bool) -> None:
        if kept is not None and not s.supersedes(kept.statement):
            k = kept.statement
            raise NotNewer(f"{s.model_id}: this statement (v{s.version}, issued {s.issued_ms}) is not newer "
                                    f"than the one kept (v{k.version}, issued {k.issued_ms})")
        accepted = self.ledger.weights_hash(s.model_id, s.version)
        if accepted is None and published:
            raise StatementConflict(f"{s.model_id} v{s.version} was not published here: publish the version first")
        if accepted is not None and accepted != s.weights_hash:
            raise StatementConflict(f"{s.model_id} v{s.version} was accepted with weights hash {accepted}; the "
                                    f"statement names {s.weights_hash}: a version has exactly one")

    def _write(self, model: str, raw: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{model}.json"
        tmp = self.dir / f".{model}.json.tmp"
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
