"""`deltamesh publish`: publish a safetensors directory as the next version of a model, with progress."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "publish", help="publish weights to an origin gateway",
        description="Encode WEIGHTS_DIR against the previously published version (kept in --state), sign it "
                    "and upload it. A full snapshot is published too every --full-every versions, and "
                    "instead of a delta when there is no matching previous version.")
    p.add_argument("weights_dir", metavar="WEIGHTS_DIR", help="safetensors directory (single file or sharded)")
    p.add_argument("--gateway", required=True, help="origin gateway URL")
    p.add_argument("--model", required=True, help="model id")
    p.add_argument("--key", required=True, help="trainer's Ed25519 private key (PEM)")
    p.add_argument("--version", type=int, help="version number (default: one after the gateway's head)")
    p.add_argument("--full-every", type=int, default=10, help="also publish a full snapshot every N versions")
    p.add_argument("--piece-mib", type=float, default=4.0, help="piece size in MiB")
    p.add_argument("--connections", type=int, default=4, help="parallel uploads")
    p.add_argument("--state", help="directory keeping the last published weights "
                                   "(default: $XDG_CACHE_HOME/deltamesh/publish/MODEL)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from deltamesh.delta import load_private_key
    from deltamesh.delta.errors import CodecError
    from deltamesh.http import HttpError
    from deltamesh.gateway.publisher import Publisher, PublishState, publish_dir

    log = logging.getLogger(__name__)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    state = PublishState(args.state or cache / "deltamesh" / "publish" / args.model)
    console = Console(stderr=True)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("encoding", total=None)

        def on_encoded(enc) -> None:
            progress.update(task, description=f"v{enc.manifest.version} {enc.manifest.kind}",
                            total=enc.manifest.payload_bytes, completed=0)

        publisher = Publisher(args.gateway, load_private_key(args.key), args.model, full_every=args.full_every,
                              piece_bytes=int(args.piece_mib * 1024 * 1024), connections=args.connections,
                              on_progress=lambda n: progress.advance(task, n), on_encoded=on_encoded)
        try:
            result = asyncio.run(publish_dir(publisher, args.weights_dir, state, args.version))
        except (HttpError, CodecError, RuntimeError, OSError, ValueError) as e:
            log.error("publish failed: %s", e)
            return 1
    kinds = ", ".join(f"{m.kind} {m.payload_bytes} bytes" for m in result.manifests)
    print(f"published {args.model} v{result.version}: {kinds}")
    return 0
