"""`deltamesh publish`: publish a safetensors directory as the next version of a model, with progress."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command
    from deltamesh.trainer.publish_config import PublishConfig

    p = config_command(
        commands, "publish", PublishConfig, run, help="publish weights to an origin gateway",
        description="Encode WEIGHTS_DIR against the previously published version (kept in --state), sign it "
                    "and upload it. A full snapshot is published too every --full-every versions, and "
                    "instead of a delta when there is no matching previous version. --gateway, --model and "
                    "--key are required.")
    p.add_argument("weights_dir", metavar="WEIGHTS_DIR", help="safetensors directory (single file or sharded)")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from deltamesh.cache import cache_dir
    from deltamesh.delta import load_private_key
    from deltamesh.delta.errors import CodecError
    from deltamesh.http import HttpError
    from deltamesh.mesh.cli import command_config, failed
    from deltamesh.mesh.cli.exits import exit_code
    from deltamesh.trainer.publish_config import PublishConfig
    from deltamesh.trainer.publisher import Publisher, PublishState, publish_dir

    config = command_config(args, PublishConfig)
    key = load_private_key(config.key)  # a KeyFileError stops the command here, as one line (exit code 2)
    state = PublishState(config.state or cache_dir("publish", config.model))
    console = Console(stderr=True)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as progress:  # no bar left above a failure's one line
        task = progress.add_task("encoding", total=None)

        def on_encoded(enc) -> None:
            progress.update(task, description=f"v{enc.manifest.version} {enc.manifest.kind}",
                            total=enc.manifest.payload_bytes, completed=0)

        publisher = Publisher.from_settings(config.publish_settings(), key,
                                            on_progress=lambda n: progress.advance(task, n), on_encoded=on_encoded)
        try:
            result = asyncio.run(publish_dir(publisher, args.weights_dir, state, config.version))
        except (HttpError, CodecError, RuntimeError, OSError, ValueError) as e:
            return failed(f"publish failed: {e}", exit_code(e, 1))
    kinds = ", ".join(f"{m.kind} {m.payload_bytes} bytes" for m in result.manifests)
    print(f"published {config.model} v{result.version}: {kinds}")
    return 0
