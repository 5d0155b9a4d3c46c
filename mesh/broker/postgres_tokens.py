"""The brokers' API tokens in their PostgreSQL database, so that a token added or revoked holds on
every broker of that database (active and standby) within about a second.

`broker_tokens` holds one row per token, as a tokens file does: its SHA-256 (never the token), the
holder's name and role, and the model ids it may act for (comma-separated; empty: all).
`broker_tokens_version` counts the changes: `add_db_token` and `revoke_db_tokens` bump it in the same
transaction as their change, so `PostgresTokens.stamp` (one indexed row) tells a broker whether to
read the table again. A broker refreshes from a background thread (`TokenStore(refresh_s=)`, made by
`deltamesh.mesh.broker.auth_tokens.broker_token_store`), never on its event loop; a database it
cannot reach keeps the tokens it last read in force.

Who may add or revoke: whoever may write these two tables with the DSN's credentials (`deltamesh
tokens add --db DSN`); a broker only reads them.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

from deltamesh.mesh.broker.postgres_schema import migrate
from deltamesh.mesh.broker.store_interface import StoreUnavailable
from deltamesh.tokens import Identity, TokenEntry, TokenError, TokenSpec, issue_token, make_entry

T = TypeVar("T")

REFRESH_S = 1.0
"""How often a broker asks its database whether the tokens changed: a revocation holds within this."""
CONNECT_TIMEOUT_S = 5


def describe(dsn: str) -> str:
    """The database of `dsn` for messages, without its password."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "the broker database"
    host, port, db = parts.get("host", "localhost"), parts.get("port", "5432"), parts.get("dbname", "")
    return f"broker_tokens of postgresql://{host}:{port}/{db}"


class PostgresTokens:
    """`broker_tokens` of the database at `dsn` as a `deltamesh.tokens.TokenSource`. One connection,
    opened on first use and again after a failure; safe to call from several threads."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.where = describe(dsn)
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()

    def stamp(self) -> Hashable:
        return self._query(lambda conn: _version(conn))

    def load(self) -> tuple[Hashable, list[TokenEntry]]:
        def read(conn: psycopg.Connection) -> tuple[Hashable, list[TokenEntry]]:
            # The stamp first: a change committed between the two reads shows in the rows, and its
            # newer stamp makes the next check read them again (never the other way round).
            version = _version(conn)
            rows = conn.execute("SELECT name, role, sha256, models FROM broker_tokens ORDER BY added_at, sha256")
            return version, [make_entry(name, role, digest, _models(models), self.where, i)
                             for i, (name, role, digest, models) in enumerate(rows.fetchall())]

        return self._query(read)

    def _query(self, read: Callable[[psycopg.Connection], T]) -> T:
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
                return read(self._conn)
            except psycopg.Error as e:
                self._drop()
                raise TokenError(f"{self.where}: {type(e).__name__}: {e}") from e

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def add_db_token(dsn: str, spec: TokenSpec) -> str:
    """Add a new token for `spec` to the database at `dsn` (its tables created if missing); returns the
    token, which is shown once and stored nowhere. TokenError if `spec` does not fit or the database
    refuses (unreachable, or no privilege on broker_tokens: nothing changed)."""
    token, entry = issue_token(spec, describe(dsn))
    row = (entry.digest.hex(), entry.identity.name, entry.identity.role, ",".join(entry.identity.models))
    _change(dsn, lambda conn: conn.execute(
        "INSERT INTO broker_tokens (sha256, name, role, models) VALUES (%s, %s, %s, %s)", row), create=True)
    return token


def revoke_db_tokens(dsn: str, name: str, role: str | None = None) -> int:
    """Remove every token of `name` (and `role`, if given) from the database at `dsn`; how many went.
    TokenError if the database refuses (nothing changed)."""
    return _change(dsn, lambda conn: conn.execute(
        "DELETE FROM broker_tokens WHERE name = %s AND (%s::text IS NULL OR role = %s)", (name, role, role)))


def db_identities(dsn: str) -> list[Identity]:
    """Who holds tokens in the database at `dsn`, oldest first (the tokens themselves are not known)."""
    source = PostgresTokens(dsn)
    try:
        return [entry.identity for entry in source.load()[1]]
    finally:
        source.close()


def _change(dsn: str, change: Callable[[psycopg.Connection], psycopg.Cursor], *, create: bool = False) -> int:
    """`change(conn)` and, if it changed rows, a bump of broker_tokens_version in one transaction, so
    that the brokers see both or neither; the rows it changed. `create`: make the tables first if they are missing."""
    try:
        try:
            return _bumped(dsn, change)
        except psycopg.errors.UndefinedTable:
            if not create:
                raise
            migrate(dsn)  # a database that no broker has started on yet
            return _bumped(dsn, change)
    except (psycopg.Error, StoreUnavailable) as e:
        raise TokenError(f"{describe(dsn)}: {type(e).__name__}: {e}") from e


def _bumped(dsn: str, change: Callable[[psycopg.Connection], psycopg.Cursor]) -> int:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as conn, conn.transaction():
        changed = change(conn).rowcount
        if changed:
            conn.execute("UPDATE broker_tokens_version SET version = version + 1 WHERE id = 1")
        return changed


def _version(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT version FROM broker_tokens_version WHERE id = 1").fetchone()
    if row is None:
        raise TokenError("broker_tokens_version has no row: the database was not migrated by a broker")
    return row[0]


def _models(text: str) -> list[str]:
    return [m for m in text.split(",") if m]
