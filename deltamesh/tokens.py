"""Scoped bearer tokens: who a caller is (a name), what it may do (a role) and for which model ids.

A tokens file (TOML, one `[[token]]` table per token) stores only each token's SHA-256, never the
token: `name`, `role` (`pool`, `trainer`, `admin`, `metrics`, `gateway`), `sha256`, and optionally
`models` (the model ids the holder may act for; empty: all). Tokens are 256-bit random strings, so a
plain hash is enough to make the file useless to a reader. `TokenStore.authenticate` compares the
presented token's hash with every entry in constant time, and picks up changes to the file (added or
revoked tokens) without a restart: it re-reads the file when its modification time or size changed,
and `reload()` forces it (SIGHUP). A file that does not parse keeps the previous table and logs why,
so a half-edited file never opens or closes the door by accident.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

ROLES = ("pool", "trainer", "admin", "metrics", "gateway")
TOKEN_PREFIX = "dm_"


class TokenError(ValueError):
    """A tokens file or entry that does not fit the layout; says which and why."""


@dataclass(frozen=True)
class Identity:
    """An authenticated caller."""

    name: str
    role: str
    models: tuple[str, ...] = ()

    def may_use(self, model_id: str) -> bool:
        return not self.models or model_id in self.models


@dataclass(frozen=True)
class _Entry:
    identity: Identity
    digest: bytes


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer ...` header, or None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() or None if scheme == "Bearer" else None


def parse_tokens(text: str, where: str = "tokens file") -> list[_Entry]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TokenError(f"{where}: {e}") from e
    entries = []
    for i, item in enumerate(data.get("token", [])):
        if not isinstance(item, dict):
            raise TokenError(f"{where}: token #{i} is not a table")
        name, role, digest = item.get("name"), item.get("role"), item.get("sha256")
        models = item.get("models", [])
        if not isinstance(name, str) or not name:
            raise TokenError(f"{where}: token #{i} needs a name")
        if role not in ROLES:
            raise TokenError(f"{where}: token {name!r} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise TokenError(f"{where}: token {name!r} needs sha256, 64 lowercase hex digits")
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise TokenError(f"{where}: token {name!r}: models must be a list of model ids")
        entries.append(_Entry(Identity(name, role, tuple(models)), bytes.fromhex(digest)))
    unknown = set(data) - {"token"}
    if unknown:
        raise TokenError(f"{where}: unknown tables {sorted(unknown)} (only [[token]])")
    return entries


class TokenStore:
    """The tokens of a file, re-read when it changes. Thread-safe; `authenticate` is cheap (a stat)."""

    def __init__(self, path: str | Path | None = None, entries: Iterable[_Entry] = ()) -> None:
        self.path = Path(path) if path else None
        self._entries: list[_Entry] = list(entries)
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()
        if self.path is not None:
            self.reload(strict=True)

    def reload(self, *, strict: bool = False) -> None:
        """Read the file again. `strict`: raise on a bad file (start-up) instead of keeping the old table."""
        if self.path is None:
            return
        try:
            stat = self.path.stat()
            entries = parse_tokens(self.path.read_text(), str(self.path))
        except (OSError, TokenError) as e:
            if strict:
                raise TokenError(str(e)) from e
            log.error("tokens file %s not reloaded, the previous tokens stay in force: %s", self.path, e)
            return
        with self._lock:
            self._entries, self._stamp = entries, (stat.st_mtime_ns, stat.st_size)
        log.info("tokens file %s: %d tokens", self.path, len(entries))

    def _reload_if_changed(self) -> None:
        if self.path is None:
            return
        try:
            stat = self.path.stat()
        except OSError:
            return
        if (stat.st_mtime_ns, stat.st_size) != self._stamp:
            self.reload()

    def authenticate(self, token: str | None) -> Identity | None:
        """Whose token this is, or None. Every entry is compared, so timing says nothing of near misses."""
        if not token:
            return None
        self._reload_if_changed()
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        with self._lock:
            for entry in self._entries:
                if hmac.compare_digest(digest, entry.digest) and found is None:
                    found = entry.identity
        return found

    def identities(self) -> list[Identity]:
        """Who holds tokens, in file order (the tokens themselves are not known here)."""
        with self._lock:
            return [e.identity for e in self._entries]


@dataclass
class TokenSpec:
    """A token to add to a file."""

    name: str
    role: str
    models: list[str] = field(default_factory=list)


def add_token(path: str | Path, spec: TokenSpec) -> str:
    """Append a new token for `spec` to the tokens file at `path` (created if missing); returns the
    token, which is shown once and stored nowhere. The file is replaced atomically, mode 0600."""
    if spec.role not in ROLES:
        raise TokenError(f"role {spec.role!r}; roles are {', '.join(ROLES)}")
    path = Path(path)
    entries = parse_tokens(path.read_text(), str(path)) if path.exists() else []
    token = new_token()
    entries.append(_Entry(Identity(spec.name, spec.role, tuple(spec.models)), hashlib.sha256(token.encode()).digest()))
    _write(path, entries)
    return token


def revoke_token(path: str | Path, name: str, role: str | None = None) -> int:
    """Remove every token of `name` (and `role`, if given) from the file; returns how many went."""
    path = Path(path)
    entries = parse_tokens(path.read_text(), str(path))
    kept = [e for e in entries if not (e.identity.name == name and (role is None or e.identity.role == role))]
    _write(path, kept)
    return len(entries) - len(kept)


def _write(path: Path, entries: list[_Entry]) -> None:
    text = tomli_w.dumps({"token": [
        {"name": e.identity.name, "role": e.identity.role, "sha256": e.digest.hex(), "models": list(e.identity.models)}
        for e in entries
    ]})
    parse_tokens(text, str(path))
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
