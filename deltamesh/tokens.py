"""Scoped bearer tokens: who a caller is (a name), what it may do (a role) and for which model ids.

A tokens file (TOML, one `[[token]]` table per token) stores only each token's SHA-256, never the
token: `name`, `role` (`pool`, `trainer`, `admin`, `metrics`, `gateway`), `sha256`, and optionally
`models` (the model ids the holder may act for; empty: all). Tokens are 256-bit random strings, so a
plain hash is enough to make the file useless to a reader. `TokenStore.authenticate` compares the
presented token's hash with every entry in constant time, and picks up changes to the file (added or
revoked tokens) without a restart: it re-reads the file when its modification time or size changed,
and `reload()` forces it (SIGHUP). A file that does not parse keeps the previous table and logs why,
so a half-edited file never opens or closes the door by accident.

The entries may come from another `TokenSource` instead of a file (the brokers' PostgreSQL table,
`deltamesh.mesh.broker.postgres_tokens`, so that a revocation holds on every replica): a source
loads its entries with a stamp, and tells its current stamp cheaply. A source that is slow to ask
(over the network) is refreshed by a background thread every `refresh_s`, so `authenticate`, called
on a server's event loop for every request, only ever reads memory.
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
from typing import Hashable, Iterable, Protocol

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
class TokenEntry:
    """One stored token: its holder and its SHA-256 (the token itself is never stored)."""

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


def make_entry(name: object, role: object, digest: object, models: object, where: str, index: int) -> TokenEntry:
    """One entry from its stored fields (`digest`: the token's SHA-256 in lowercase hex), checked;
    TokenError naming `where` and the entry if a field does not fit."""
    if not isinstance(name, str) or not name:
        raise TokenError(f"{where}: token #{index} needs a name")
    if role not in ROLES:
        raise TokenError(f"{where}: token {name!r} has role {role!r}; roles are {', '.join(ROLES)}")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise TokenError(f"{where}: token {name!r} needs sha256, 64 lowercase hex digits")
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise TokenError(f"{where}: token {name!r}: models must be a list of model ids")
    return TokenEntry(Identity(name, str(role), tuple(models)), bytes.fromhex(digest))


def parse_tokens(text: str, where: str = "tokens file") -> list[TokenEntry]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TokenError(f"{where}: {e}") from e
    entries = []
    for i, item in enumerate(data.get("token", [])):
        if not isinstance(item, dict):
            raise TokenError(f"{where}: token #{i} is not a table")
        entries.append(make_entry(item.get("name"), item.get("role"), item.get("sha256"), item.get("models", []),
                                  where, i))
    unknown = set(data) - {"token"}
    if unknown:
        raise TokenError(f"{where}: unknown tables {sorted(unknown)} (only [[token]])")
    return entries


class TokenSource(Protocol):
    """Where a `TokenStore`'s entries come from. Both methods raise OSError or TokenError when the
    source cannot be read."""

    where: str
    """What to call the source in messages (never a secret)."""

    def stamp(self) -> Hashable:
        """Cheap: a value that changes whenever the entries may have changed."""
        ...

    def load(self) -> tuple[Hashable, list[TokenEntry]]:
        """The entries, with a stamp no newer than them (so a change made meanwhile is seen next time)."""
        ...


class FileTokens:
    """A tokens file as a `TokenSource`: its stamp is its modification time and size."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)

    def stamp(self) -> Hashable:
        stat = self.path.stat()
        return stat.st_mtime_ns, stat.st_size

    def load(self) -> tuple[Hashable, list[TokenEntry]]:
        stamp = self.stamp()
        return stamp, parse_tokens(self.path.read_text(), self.where)


class TokenStore:
    """The tokens of a file (`path`) or another `source`, reloaded when they change. Thread-safe.

    Without `refresh_s`, `authenticate` checks the source's stamp itself (for a file, a stat). With
    it, a background thread checks every `refresh_s` seconds and `authenticate` reads memory only;
    `close()` stops that thread."""

    def __init__(self, path: str | Path | None = None, entries: Iterable[TokenEntry] = (), *,
                 source: TokenSource | None = None, refresh_s: float | None = None) -> None:
        if path and source is not None:
            raise ValueError("a TokenStore reads a tokens file or another source, not both")
        self.path = Path(path) if path else None
        self.source: TokenSource | None = FileTokens(path) if path else source
        self._entries: list[TokenEntry] = list(entries)
        self._stamp: Hashable = None
        self._lock = threading.Lock()
        self._failure = ""  # the last reload's error, logged once rather than on every retry
        self._wake = threading.Event()
        self._closed = False
        self._refresher: threading.Thread | None = None
        if self.source is None:
            return
        self.reload(strict=True)
        if refresh_s is not None:
            self._refresher = threading.Thread(target=self._refresh_every, args=(refresh_s,), daemon=True,
                                               name=f"tokens-refresh {self.source.where}")
            self._refresher.start()

    def reload(self, *, strict: bool = False) -> None:
        """Read the source again. `strict`: raise on a bad source (start-up) instead of keeping the old
        table. With a background refresher the read happens there, at once (never on the caller's loop)."""
        if self.source is None:
            return
        if self._refresher is not None and not strict:
            self._stamp = None  # differs from any stamp: the refresher reads everything
            self._wake.set()
            return
        self._load(strict)

    def refresh(self) -> None:
        """Reload if the source's stamp changed; a source that cannot be read keeps the tokens in force."""
        if self.source is None:
            return
        try:
            stamp = self.source.stamp()
        except (OSError, TokenError) as e:
            if not isinstance(self.source, FileTokens):  # a file being replaced vanishes for a moment
                self._failed(e)
            return
        if stamp != self._stamp:
            self._load(strict=False)
        else:
            self._failure = ""

    def _load(self, strict: bool) -> None:
        assert self.source is not None
        try:
            stamp, entries = self.source.load()
        except (OSError, TokenError) as e:
            if strict:
                raise TokenError(str(e)) from e
            self._failed(e)
            return
        with self._lock:
            self._entries, self._stamp, self._failure = entries, stamp, ""
        log.info("tokens of %s: %d tokens", self.source.where, len(entries))

    def _failed(self, error: Exception) -> None:
        if str(error) != self._failure:  # once per failure, not once per request or refresh
            self._failure = str(error)
            log.error("tokens of %s not reloaded, the previous tokens stay in force: %s",
                      self.source.where if self.source is not None else "-", error)

    def _refresh_every(self, every_s: float) -> None:
        while not self._closed:
            self._wake.wait(every_s)
            self._wake.clear()
            if not self._closed:
                self.refresh()

    def close(self) -> None:
        """Stop the background refresher (if any) and close the source if it can be closed."""
        self._closed = True
        self._wake.set()
        if self._refresher is not None:
            self._refresher.join(timeout=5)
        close = getattr(self.source, "close", None)
        if close is not None:
            close()

    def authenticate(self, token: str | None) -> Identity | None:
        """Whose token this is, or None. Every entry is compared, so timing says nothing of near misses."""
        if not token:
            return None
        if self._refresher is None:
            self.refresh()
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        with self._lock:
            for entry in self._entries:
                if hmac.compare_digest(digest, entry.digest) and found is None:
                    found = entry.identity
        return found

    def identities(self) -> list[Identity]:
        """Who holds tokens, in the source's order (the tokens themselves are not known here)."""
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
    path = Path(path)
    token, entry = issue_token(spec, str(path))
    entries = parse_tokens(path.read_text(), str(path)) if path.exists() else []
    _write(path, [*entries, entry])
    return token


def issue_token(spec: TokenSpec, where: str) -> tuple[str, TokenEntry]:
    """A new token for `spec` and its entry to store; TokenError naming `where` if `spec` does not fit."""
    token = new_token()
    return token, make_entry(spec.name, spec.role, token_digest(token), list(spec.models), where, 0)


def save_token(path: str | Path, token: str, *, replace: bool = False) -> None:
    """Write `token` to the file at `path`, readable by its owner only (0600 from the moment it exists,
    whatever the umask), where a `--token-file` flag reads it. FileExistsError when the file exists and
    not `replace`: a token is shown once, and another one there would be lost."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a replaced file keeps its old mode otherwise
        f.write(token + "\n")


def revoke_token(path: str | Path, name: str, role: str | None = None) -> int:
    """Remove every token of `name` (and `role`, if given) from the file; returns how many went."""
    path = Path(path)
    entries = parse_tokens(path.read_text(), str(path))
    kept = [e for e in entries if not (e.identity.name == name and (role is None or e.identity.role == role))]
    _write(path, kept)
    return len(entries) - len(kept)


def _write(path: Path, entries: list[TokenEntry]) -> None:
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
