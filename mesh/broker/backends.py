"""Which backend a broker's `db` setting names: a PostgreSQL URL or the path of an SQLite file.

Kept apart from both stores so that a broker on SQLite never imports psycopg, and one on PostgreSQL
never needs a writable directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the broker's config checks `db` with this module: it stays light to import
    from deltamesh.mesh.broker.store_interface import BrokerStore, LeaderTerm

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(db: str) -> bool:
    """Whether `db` is a PostgreSQL URL (postgresql:// or postgres://) rather than an SQLite path."""
    return str(db).startswith(POSTGRES_SCHEMES)


def check_db(db: str) -> None:
    """ValueError when `db` is a PostgreSQL URL that libpq cannot parse (a path is checked on opening)."""
    if is_postgres(db):
        from psycopg import conninfo

        try:
            conninfo.conninfo_to_dict(db)
        except Exception as e:  # psycopg.ProgrammingError, with libpq's own words
            raise ValueError(f"db is not a valid PostgreSQL URL: {e}") from None


def open_store(db: str, *, durability: str, term: LeaderTerm | None = None) -> BrokerStore:
    """The store at `db`: PostgresStore for a URL (fenced by `term` when given), SqliteStore for a path.
    SQLite has one writer by construction, so a term means nothing there and is refused."""
    if is_postgres(db):
        from deltamesh.mesh.broker.postgres_store import PostgresStore

        return PostgresStore(str(db), durability=durability, term=term)
    if term is not None:
        raise ValueError("a leadership term needs a PostgreSQL store; an SQLite file has one broker")
    from deltamesh.mesh.broker.sqlite_store import SqliteStore

    return SqliteStore(db, durability=durability)
