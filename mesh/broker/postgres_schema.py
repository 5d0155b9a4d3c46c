"""The broker's tables on PostgreSQL and the migrations that create and upgrade them.

The database records its schema version in `broker_schema` (one row). `MIGRATIONS[i]` brings a
database from version i to i + 1; `apply_migrations` runs the missing ones in one transaction under
a transaction-scoped advisory lock, so two brokers starting at once neither race nor half-migrate,
and it refuses a database whose version is newer than this code knows (a newer deltamesh wrote it).
Migrations only ever append: a released step is never edited, a change is a new step.

Version 1 holds the broker's records (the same columns as SqliteStore, under `broker_` names), the
leadership lease `broker_leader` (no row until a broker takes it; leadership.py) and the API tokens
`broker_tokens` with their change counter `broker_tokens_version`. Payloads are stored out of line
uncompressed (STORAGE EXTERNAL): their tokens and logprobs barely compress and the rest is zstd already,
so TOAST compression would only cost CPU.
"""

from __future__ import annotations

import psycopg

from deltamesh.mesh.broker.store_interface import StoreUnavailable

UNAVAILABLE = (psycopg.OperationalError, psycopg.InterfaceError, psycopg.errors.ReadOnlySqlTransaction,
               psycopg.errors.IdleInTransactionSessionTimeout)
"""Errors that mean the database cannot commit now (unreachable, restarting, disk full, a read-only
replica, our idle transaction cut off): StoreUnavailable, and the next call reconnects."""
MIGRATION_LOCK = 0x646D_6272_6D69  # pg_advisory_xact_lock key: ascii "dmbrmi", deltamesh broker migration

MIGRATIONS: list[list[str]] = [
    [  # 1: the broker's records, the leadership lease and the API tokens
        "CREATE TABLE broker_models(model_id TEXT PRIMARY KEY, version BIGINT NOT NULL)",
        "CREATE TABLE broker_cursor(id SMALLINT PRIMARY KEY CHECK (id = 1), epoch BIGINT NOT NULL, "
        "position BIGINT NOT NULL)",
        "INSERT INTO broker_cursor VALUES (1, 0, 0)",
        "CREATE TABLE broker_tasks(seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, task_id TEXT UNIQUE NOT NULL, "
        "prompt TEXT NOT NULL, metadata TEXT NOT NULL, n_samples INTEGER, model_ids TEXT)",
        "CREATE TABLE broker_leases(lease_no BIGINT PRIMARY KEY, lease_id TEXT UNIQUE NOT NULL, task_id TEXT NOT NULL, "
        "epoch BIGINT NOT NULL, pool TEXT NOT NULL, region TEXT NOT NULL, model_ids TEXT NOT NULL, "
        "n_samples INTEGER NOT NULL, issued_at DOUBLE PRECISION NOT NULL, deadline DOUBLE PRECISION NOT NULL, "
        "state TEXT NOT NULL)",
        "CREATE INDEX broker_leases_state ON broker_leases(state)",
        "CREATE TABLE broker_groups(model_id TEXT NOT NULL, group_id TEXT NOT NULL, task_id TEXT NOT NULL, "
        "size INTEGER NOT NULL, count INTEGER NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', "
        "seq BIGINT, batch_no BIGINT, min_version BIGINT, max_version BIGINT, reward_min DOUBLE PRECISION, "
        "reward_max DOUBLE PRECISION, reward_mean DOUBLE PRECISION, PRIMARY KEY (model_id, group_id))",
        "CREATE INDEX broker_groups_state ON broker_groups(state, seq)",
        "CREATE INDEX broker_groups_group ON broker_groups(group_id)",
        "CREATE INDEX broker_groups_seq ON broker_groups(seq)",  # the next seq is MAX(seq) + 1, read per commit
        "CREATE INDEX broker_groups_delivered ON broker_groups(batch_no) WHERE state = 'delivered'",
        # ord keeps submission order within a group, as SQLite's rowid does.
        "CREATE TABLE broker_trajectories(id TEXT PRIMARY KEY, ord BIGINT GENERATED ALWAYS AS IDENTITY, "
        "model_id TEXT NOT NULL, group_id TEXT NOT NULL, task_id TEXT NOT NULL, reward DOUBLE PRECISION NOT NULL, "
        "min_version BIGINT NOT NULL, max_version BIGINT NOT NULL, n_tokens INTEGER NOT NULL, pool TEXT NOT NULL, "
        "region TEXT NOT NULL, meta TEXT NOT NULL, payload BYTEA, digest TEXT)",
        "ALTER TABLE broker_trajectories ALTER COLUMN payload SET STORAGE EXTERNAL",
        "CREATE INDEX broker_trajectories_group ON broker_trajectories(model_id, group_id, ord)",
        "CREATE TABLE broker_batches(batch_no BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        "batch_id TEXT UNIQUE NOT NULL, model_id TEXT NOT NULL, version BIGINT NOT NULL, "
        "served_at DOUBLE PRECISION NOT NULL, n_groups INTEGER NOT NULL, state TEXT NOT NULL, "
        "settled_at DOUBLE PRECISION)",
        "CREATE TABLE broker_leader(id SMALLINT PRIMARY KEY CHECK (id = 1), holder TEXT NOT NULL, url TEXT NOT NULL, "
        "epoch BIGINT NOT NULL, expires_at TIMESTAMPTZ NOT NULL)",
        "CREATE TABLE broker_tokens(sha256 TEXT PRIMARY KEY, name TEXT NOT NULL, role TEXT NOT NULL, "
        "models TEXT NOT NULL DEFAULT '', added_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        "CREATE TABLE broker_tokens_version(id SMALLINT PRIMARY KEY CHECK (id = 1), version BIGINT NOT NULL)",
        "INSERT INTO broker_tokens_version VALUES (1, 0)",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)


class SchemaTooNew(StoreUnavailable):
    """The database was migrated by a newer deltamesh than this one; nothing was changed."""


def schema_version(conn: psycopg.Connection) -> int:
    """The broker schema version of the database (0: none yet)."""
    if not conn.execute("SELECT to_regclass('broker_schema') IS NOT NULL").fetchone()[0]:
        return 0
    row = conn.execute("SELECT version FROM broker_schema WHERE id = 1").fetchone()
    return 0 if row is None else row[0]


def known(found: int) -> int:
    """`found`, a schema version this code can use or migrate; SchemaTooNew for a newer one."""
    if found > SCHEMA_VERSION:
        raise SchemaTooNew(f"the database has broker schema version {found}, newer than this deltamesh knows "
                           f"({SCHEMA_VERSION}); run a deltamesh as new as the one that migrated it")
    return found


def apply_migrations(conn: psycopg.Connection) -> tuple[int, int]:
    """Bring the database of autocommit connection `conn` to SCHEMA_VERSION; (from, to) versions."""
    found = known(schema_version(conn))
    if found == SCHEMA_VERSION:  # the usual case writes nothing: a broker's role may lack CREATE
        return found, found
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        # Read again, now that no one else migrates; through the table, not to_regclass, whose catalog
        # snapshot may predate the migration that this one waited for.
        conn.execute("CREATE TABLE IF NOT EXISTS broker_schema(id SMALLINT PRIMARY KEY CHECK (id = 1), "
                     "version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM broker_schema WHERE id = 1").fetchone()
        found = known(0 if row is None else row[0])
        for step in MIGRATIONS[found:]:
            for statement in step:
                conn.execute(statement)
        conn.execute("INSERT INTO broker_schema VALUES (1, %s) ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                     (SCHEMA_VERSION,))
    return found, SCHEMA_VERSION


def migrate(dsn: str) -> tuple[int, int]:
    """Create or upgrade the broker's tables in the database at `dsn`; (from, to) schema versions.
    Safe to run again and from several brokers at once. StoreUnavailable when the server cannot be
    reached, SchemaTooNew when the database is newer than this code."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            return apply_migrations(conn)
    except UNAVAILABLE as e:
        raise StoreUnavailable(f"cannot migrate the broker's database: {e}") from e
