"""`deltamesh tokens add|revoke|list`: the scoped bearer tokens of a broker or gateway (docs/SECURITY.md).

The tokens live in a tokens file (`--file`), or for brokers on PostgreSQL in their database (`--db`,
so that every broker of the database, active or standby, applies a change within a second). Either
stores each token's SHA-256 with its holder's name, role and model ids; `add` gives the new token
once (nothing else keeps it): written to `--out FILE`, readable by its owner only (0600), where the
holder's `--token-file` reads it, or printed; `revoke` removes a holder's tokens. Servers re-read the file, and
brokers the database, when it changes, so neither needs a restart. Who may change them: whoever may
write the file, or the database's broker_tokens table with the DSN's credentials.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import command_group
    from deltamesh.tokens import ROLES

    sub = command_group(commands, "tokens", help="add, revoke and list the bearer tokens of a broker or gateway")
    add = sub.add_parser("add", help="add a token and write it to --out FILE (mode 0600) or print it (once)")
    _where(add, "the tokens file (created if missing)")
    add.add_argument("--name", required=True, help="the holder: a pool's name, a trainer's, a gateway's region...")
    add.add_argument("--role", required=True, choices=ROLES, help="what the holder may do")
    add.add_argument("--model", action="append", default=[], metavar="ID",
                     help="a model id the holder may act for (once per id; none: every model)")
    add.add_argument("--out", metavar="FILE",
                     help="write the token to this new file, readable by you only (0600), instead of printing "
                          "it; the holder reads it with --token-file FILE. Refused if FILE exists")
    add.set_defaults(run=run_add)
    revoke = sub.add_parser("revoke", help="remove every token of a holder")
    _where(revoke, "the tokens file")
    revoke.add_argument("--name", required=True, help="the holder whose tokens go")
    revoke.add_argument("--role", choices=ROLES, help="only the holder's tokens of this role")
    revoke.set_defaults(run=run_revoke)
    ls = sub.add_parser("list", help="list the holders of a tokens file or broker database (never the tokens)")
    _where(ls, "the tokens file")
    ls.set_defaults(run=run_list)


def _where(parser: argparse.ArgumentParser, file_help: str) -> None:
    """Where the tokens are: a file (`--file`) or a broker database (`--db`), exactly one."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--file", metavar="TOML", help=file_help)
    where.add_argument("--db", metavar="DSN",
                       help="instead of a file: the tokens of brokers on PostgreSQL, in their database "
                            "(postgresql://USER@HOST/DB; every broker of it applies a change within a second). "
                            "Adding and revoking need write access to its broker_tokens table")


def _target(args: argparse.Namespace) -> str:
    if not args.db:
        return str(args.file)
    from deltamesh.mesh.broker.postgres_tokens import describe

    return describe(args.db)


def run_add(args: argparse.Namespace) -> int:
    from deltamesh.mesh.cli import failed
    from deltamesh.tokens import TokenError, TokenSpec, add_token, save_token

    spec = TokenSpec(args.name, args.role, args.model)
    out = Path(args.out) if args.out else None
    if out is not None and (out.exists() or not out.parent.is_dir()):
        why = "exists (a token is shown once: remove it or name another file)" if out.exists() else "has no folder"
        return failed(f"--out {out} {why}", 2)
    try:
        if args.db:
            from deltamesh.mesh.broker.postgres_tokens import add_db_token

            token = add_db_token(args.db, spec)
        else:
            token = add_token(args.file, spec)
        if out is None:
            print(token)
            return 0
        save_token(out, token)
    except (TokenError, OSError) as e:
        return failed(e, 1)
    print(f"the token of {args.role} {args.name} is in {out} (readable by you only)")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from deltamesh.mesh.cli import failed
    from deltamesh.tokens import TokenError, revoke_token

    try:
        if args.db:
            from deltamesh.mesh.broker.postgres_tokens import revoke_db_tokens

            gone = revoke_db_tokens(args.db, args.name, args.role)
        else:
            gone = revoke_token(args.file, args.name, args.role)
    except (TokenError, OSError) as e:
        return failed(e, 1)
    if not gone:
        return failed(f"{_target(args)} holds no token of {args.name}", 1)
    print(f"revoked {gone} token(s) of {args.name}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from deltamesh.mesh.cli import failed
    from deltamesh.tokens import TokenError, TokenStore

    try:
        if args.db:
            from deltamesh.mesh.broker.postgres_tokens import db_identities

            holders = db_identities(args.db)
        else:
            holders = TokenStore(args.file).identities()
    except TokenError as e:
        return failed(e, 1)
    for who in holders:
        print(f"{who.role:8} {who.name}  models: {', '.join(who.models) or 'all'}")
    return 0
