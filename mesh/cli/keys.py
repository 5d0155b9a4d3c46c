"""`deltamesh keys generate --out PATH`: create a trainer's Ed25519 signing key pair.

Writes the private key to PATH (PEM, mode 0600) and the public key to PATH.pub, which gateways and
pools list as trusted. Refuses to overwrite an existing key unless --force is given.
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("keys", help="manage Ed25519 signing keys")
    sub = p.add_subparsers(title="keys commands", metavar="KEYS_COMMAND")
    gen = sub.add_parser("generate", help="write a new key pair: PATH (private) and PATH.pub")
    gen.add_argument("--out", required=True, help="path of the private key; the public key goes to PATH.pub")
    gen.add_argument("--force", action="store_true", help="overwrite an existing key")
    gen.set_defaults(run=run_generate)
    p.set_defaults(run=lambda args: _usage(p))


def _usage(parser: argparse.ArgumentParser) -> int:
    import sys

    parser.print_help(sys.stderr)
    return 2


def run_generate(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from deltamesh.delta import generate_key, key_id, save_keypair

    log = logging.getLogger(__name__)
    out = Path(args.out)
    public = out.with_name(out.name + ".pub")
    if not args.force and (out.exists() or public.exists()):
        log.error("%s or %s already exists; pass --force to overwrite", out, public)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    key = generate_key()
    save_keypair(key, out, public)
    print(f"key {key_id(key)}: private {out}, public {public}")
    return 0
