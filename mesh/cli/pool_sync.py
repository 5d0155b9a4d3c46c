"""`deltamesh pool sync`: keep a safetensors directory at a gateway's head, as a rollout pool would."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.gateway.config import PoolSyncConfig
    from deltamesh.mesh.cli import config_command

    p = config_command(
        pool_commands, "sync", PoolSyncConfig, run, help="follow a gateway and keep a weights directory at its head",
        description="Register a pool with its region's gateway, follow the head of its model, and apply every "
                    "new version atomically to DIR (a safetensors directory any engine can load). --gateway, "
                    "--token, --name, --dir and --trusted-key are required.")
    p.add_argument("--once", action="store_true", help="sync to the current head and exit")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from deltamesh.gateway.config import PoolSyncConfig
    from deltamesh.gateway.weight_sync import CredentialsError, SyncError, WeightSync
    from deltamesh.http import HttpError
    from deltamesh.mesh.cli import command_config, failed, stop_on_signals

    config = command_config(args, PoolSyncConfig)

    async def main() -> int:
        async with WeightSync(config) as sync:
            if args.once:
                try:
                    await sync.sync_once()
                    await sync.heartbeat()  # registers the pool and reports where it now is
                except (SyncError, HttpError) as e:
                    return failed(e, 1)
                print(f"{sync.model} v{sync.version}")
                return 0
            try:
                await sync.run(stop_on_signals())  # deregisters from its gateway once stopped
            except CredentialsError as e:
                return failed(e, 2)
            return 0

    return asyncio.run(main())
