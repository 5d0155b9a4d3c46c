"""`deltamesh tokens add|revoke|list`: the scoped bearer tokens of a broker or gateway (docs/SECURITY.md).

A tokens file stores each token's SHA-256 with its holder's name, role and model ids; `add` prints the
new token once (nothing else keeps it), `revoke` removes a holder's tokens. Servers re-read the file
when it changes, so neither needs a restart.
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import command_group
    from deltamesh.tokens import ROLES

    sub = command_group(commands, "tokens", help="add, revoke and list the bearer tokens of a broker or gateway")
    add = sub.add_parser("add", help="add a token and print it (once)")
    add.add_argument("--file", required=True, metavar="TOML", help="the tokens file (created if missing)")
    add.add_argument("--name", required=True, help="the holder: a pool's name, a trainer's, a gateway's region...")
    add.add_argument("--role", required=True, choices=ROLES, help="what the holder may do")
    add.add_argument("--model", action="append", default=[], metavar="ID",
                     help="a model id the holder may act for (once per id; none: every model)")
    add.set_defaults(run=run_add)
    revoke = sub.add_parser("revoke", help="remove every token of a holder")
    revoke.add_argument("--file", required=True, metavar="TOML", help="the tokens file")
    revoke.add_argument("--name", required=True, help="the holder whose tokens go")
    revoke.add_argument("--role", choices=ROLES, help="only the holder's tokens of this role")
    revoke.set_defaults(run=run_revoke)
    ls = sub.add_parser("list", help="list the holders of a tokens file (never the tokens)")
    ls.add_argument("--file", required=True, metavar="TOML", help="the tokens file")
    ls.set_defaults(run=run_list)


def run_add(args: argparse.Namespace) -> int:
    from deltamesh.mesh.cli import failed
    from deltamesh.tokens import TokenError, TokenSpec, add_token

    try:
        print(add_token(args.file, TokenSpec(args.name, args.role, args.model)))
    except (TokenError, OSError) as e:
        return failed(e, 1)
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from deltamesh.mesh.cli import failed
    from deltamesh.tokens import TokenError, revoke_token

    try:
        gone = revoke_token(args.file, args.name, args.role)
    except (TokenError, OSError) as e:
        return failed(e, 1)
    if not gone:
        return failed(f"{args.file} holds no token of {args.name}", 1)
    print(f"revoked {gone} token(s) of {args.name}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from deltamesh.mesh.cli import failed
    from deltamesh.tokens import TokenError, TokenStore

    try:
        store = TokenStore(args.file)
    except TokenError as e:
        return failed(e, 1)
    for who in store.identities():
        print(f"{who.role:8} {who.name}  models: {', '.join(who.models) or 'all'}")
    return 0
