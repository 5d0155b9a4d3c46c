"""The signed head statement: the trainer's word on which version of a model is its newest, and when.

A signature on a manifest proves that the trainer made that version, not that it is still the
newest: a relay that stops forwarding (a freeze) keeps serving old, validly signed versions. So the
trainer also signs, after each version and then every so often, a small statement: model id,
version, that version's `weights_hash`, and the time it was issued. A pool that reads a statement
newer than its gateway's head, or one that is too old, knows that gateway is behind (TUF's
timestamp role plays the same part). Its envelope is the manifest's (docs/FORMAT.md, section 5): the
body's exact bytes are signed with the same Ed25519 key, and a `type` field keeps a statement from
ever being read as a manifest or the other way round.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Iterable

from deltamesh.peer_json import parse_json

from .envelope import canonical_json, open_sealed, seal
from .errors import CodecError, CorruptError
from .keys import Ed25519PrivateKey, Ed25519PublicKey
from .manifest import MODEL_ID_RE

STATEMENT_FORMAT_VERSION = 1
STATEMENT_TYPE = "deltamesh-head"
MAX_STATEMENT_BYTES = 4096
"""Largest envelope a reader accepts: a real one is about 400 bytes."""
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


class StaleStatementError(CodecError):
    """A validly signed statement that is older than the reader accepts."""


@dataclass(frozen=True)
class HeadStatement:
    """The trainer's statement that `version` (with weights `weights_hash`) is the newest of `model_id`,
    as of `issued_ms` (milliseconds since the Unix epoch, the trainer's clock)."""

    model_id: str
    version: int
    weights_hash: str
    issued_ms: int
    format_version: int = STATEMENT_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != STATEMENT_FORMAT_VERSION:
            raise CorruptError(f"head statement format_version {self.format_version!r}, this reader knows "
                               f"{STATEMENT_FORMAT_VERSION}")
        if not isinstance(self.model_id, str) or not MODEL_ID_RE.match(self.model_id):
            raise CorruptError(f"head statement model_id {self.model_id!r:.80} must match {MODEL_ID_RE.pattern}")
        for name in ("version", "issued_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CorruptError(f"head statement {name} {value!r:.40} must be an integer >= 0")
        if not isinstance(self.weights_hash, str) or not _HEX32.match(self.weights_hash):
            raise CorruptError("head statement weights_hash must be 32 hex characters")

    def age_s(self, now: float | None = None) -> float:
        """Seconds since it was issued (negative when the trainer's clock runs ahead of this one)."""
        return (time.time() if now is None else now) - self.issued_ms / 1000

    def body(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "type": STATEMENT_TYPE, "model_id": self.model_id,
                "version": self.version, "weights_hash": self.weights_hash, "issued_ms": self.issued_ms}

    def body_bytes(self) -> bytes:
        return canonical_json(self.body())

    def signed(self, key: Ed25519PrivateKey) -> bytes:
        """The signed envelope, as uploaded, stored and served."""
        return seal(key, self.body_bytes())

    def supersedes(self, other: "HeadStatement") -> bool:
        """Whether this statement replaces `other`: issued later, and not for an older version."""
        return self.issued_ms > other.issued_ms and self.version >= other.version


def sign_statement(key: Ed25519PrivateKey, model_id: str, version: int, weights_hash: str,
                   issued_ms: int | None = None) -> bytes:
    """A signed head statement issued now (or at `issued_ms`)."""
    issued = int(time.time() * 1000) if issued_ms is None else issued_ms
    return HeadStatement(model_id, version, weights_hash, issued).signed(key)


def load_statement(data: bytes, trusted: Iterable[Ed25519PublicKey], *, model: str | None = None) -> HeadStatement:
    """Parse a signed head statement, verifying its signature against the trusted keys first; with
    `model`, also that it speaks of that model. Raises SignatureError or CorruptError."""
    if len(data) > MAX_STATEMENT_BYTES:
        raise CorruptError(f"head statement of {len(data)} bytes exceeds {MAX_STATEMENT_BYTES}")
    statement = _from_body(open_sealed(data, trusted, "head statement"))
    if model is not None and statement.model_id != model:
        raise CorruptError(f"head statement is about {statement.model_id}, not {model}")
    return statement


def check_fresh(statement: HeadStatement, max_age_s: float, now: float | None = None) -> None:
    """Raise StaleStatementError if `statement` was issued more than `max_age_s` ago (0: any age)."""
    if max_age_s > 0 and statement.age_s(now) > max_age_s:
        raise StaleStatementError(f"head statement of {statement.model_id} v{statement.version} was issued "
                                  f"{statement.age_s(now):.0f}s ago, over the {max_age_s:g}s accepted")


def _from_body(body: bytes) -> HeadStatement:
    try:
        b = parse_json(body)
        if b["format_version"] != STATEMENT_FORMAT_VERSION:  # before any other field: a later format may differ
            raise CorruptError(f"head statement format_version {b['format_version']!r:.40}, this reader knows "
                               f"{STATEMENT_FORMAT_VERSION}")
        if b["type"] != STATEMENT_TYPE:
            raise ValueError(f"type {b['type']!r:.40} is not {STATEMENT_TYPE!r}")
        return HeadStatement(model_id=b["model_id"], version=b["version"], weights_hash=b["weights_hash"],
                             issued_ms=b["issued_ms"], format_version=b["format_version"])
    except CodecError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptError(f"malformed head statement body: {type(e).__name__}: {e}") from e
