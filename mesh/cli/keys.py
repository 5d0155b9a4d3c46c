"""`deltamesh keys generate --out PATH`: create a trainer's Ed25519 signing key pair.

Writes the private key to PATH (PEM, mode 0600) and the public key to PATH.pub, which gateways and
pools list as trusted. Refuses to overwrite an existing key unless --force is given.
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import command_group

    sub = command_group(commands, "keys", help="manage Ed25519 signing keys")
    gen = sub.add_parser("generate", help="write a new key pair: PATH (private) and PATH.pub")
    gen.add_argument("--out", required=True, help="path of the private key; the public key goes to PATH.pub")
    gen.add_argument("--force", action="store_true", help="overwrite an existing key")
    gen.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deltamesh.delta import generate_key, key_id, save_keypair
    from deltamesh.mesh.cli import failed

    out = Path(args.out)
    public = out.with_name(out.name + ".pub")
    if not args.force and (out.exists() or public.exists()):
        return failed(f"{out} or {public} already exists; pass --force to overwrite", 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    key = generate_key()
    save_keypair(key, out, public)
    print(f"key {key_id(key)}: private {out}, public {public}")
    return 0
