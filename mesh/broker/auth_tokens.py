"""Where a broker's API tokens come from: its tokens file, or the `broker_tokens` table of its
PostgreSQL database (shared by the active broker and its standbys, so that a revocation holds on
every one of them; see postgres_tokens.py). Apart from both so that a broker on SQLite never
imports psycopg.
"""

from __future__ import annotations

from pathlib import Path

from deltamesh.mesh.broker.backends import is_postgres
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.tokens import TokenStore


def broker_token_store(config: BrokerConfig, db: str | Path | None = None) -> TokenStore:
    """The tokens a broker checks callers against: its `tokens_file` if it names one; else, on a
    PostgreSQL `db` (default `config.db`), that database's `broker_tokens`, re-read within about a
    second of a change by a background thread (the tables are created first if missing; `close()`
    the store on shut-down); an empty store for an `anonymous` broker.

    TokenError if the tokens cannot be read at start-up, StoreUnavailable if the database cannot be
    reached, ValueError if the broker has no source of tokens and is not anonymous."""
    where = str(config.db if db is None else db)
    if config.tokens_file:
        return TokenStore(config.tokens_file)
    if config.anonymous:
        return TokenStore()
    if not is_postgres(where):
        raise ValueError("the broker needs a tokens file (tokens_file; `deltamesh tokens add`), a PostgreSQL db "
                         "(its tokens are managed with `deltamesh tokens add --db`), or anonymous = true for a "
                         "broker that no one else can reach")
    from deltamesh.mesh.broker.postgres_schema import migrate
    from deltamesh.mesh.broker.postgres_tokens import REFRESH_S, PostgresTokens

    migrate(where)
    return TokenStore(source=PostgresTokens(where), refresh_s=REFRESH_S)
