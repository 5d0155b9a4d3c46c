"""`deltamesh broker migrate --db URL`: create or upgrade the broker's tables in a PostgreSQL database.

A broker migrates its database itself when it starts; this command does it ahead of time (for example
with an owner role the brokers do not run as) and says which schema version it found and left. It is
safe to run again, and beside running brokers: migrations take an advisory lock and run in one
transaction. An SQLite file needs no command: SqliteStore upgrades it when it opens it.
"""

from __future__ import annotations

import argparse


def register(broker: argparse.ArgumentParser) -> None:
    """Add `migrate` under the `deltamesh broker` command's parser."""
    sub = broker.add_subparsers(title="broker commands", metavar="BROKER_COMMAND")
    parser = sub.add_parser("migrate", help="create or upgrade the broker's tables in a PostgreSQL database",
                            description="Create or upgrade the broker's tables in a PostgreSQL database; "
                                        "prints the schema version found and the one left.")
    parser.add_argument("--db", required=True, metavar="URL",
                        help="the database, e.g. postgresql://user@host/dbname")
    parser.set_defaults(run=run_migrate)


def run_migrate(args: argparse.Namespace) -> int:
    import psycopg

    from deltamesh.mesh.broker.backends import check_db, is_postgres
    from deltamesh.mesh.broker.postgres_schema import migrate
    from deltamesh.mesh.broker.store_interface import StoreUnavailable
    from deltamesh.mesh.cli import failed

    if not is_postgres(args.db):
        return failed(f"--db must be a postgresql:// URL (an SQLite file is upgraded when a broker opens it), "
                      f"got {args.db!r}")
    try:
        check_db(args.db)
        before, after = migrate(args.db)
    except (StoreUnavailable, ValueError, psycopg.Error) as e:
        return failed(e, 1 if isinstance(e, StoreUnavailable) else 2)
    change = "already current" if before == after else "migrated"
    print(f"broker schema: version {before} -> {after} ({change})")
    return 0
