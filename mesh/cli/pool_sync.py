"""`deltamesh pool sync`: keep a safetensors directory at a gateway's head, as a rollout pool would."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.config_flags import add_config_flags
    from deltamesh.gateway.config import PoolSyncConfig

    p = pool_commands.add_parser(
        "sync", help="follow a gateway and keep a weights directory at its head",
        description="Register a pool with its region's gateway, follow the head of its model, and apply every "
                    "new version atomically to DIR (a safetensors directory any engine can load). --gateway, "
                    "--token, --name, --dir and --trusted-key are required.")
    p.add_argument("--once", action="store_true", help="sync to the current head and exit")
    add_config_flags(p, PoolSyncConfig)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from deltamesh.config import ConfigError, load_config
    from deltamesh.config_flags import config_overrides
    from deltamesh.gateway.config import PoolSyncConfig
    from deltamesh.http import HttpError
    from deltamesh.gateway.weight_sync import SyncError, WeightSync

    log = logging.getLogger(__name__)
    try:
        config = load_config(PoolSyncConfig, overrides=config_overrides(args, PoolSyncConfig))
    except ConfigError as e:
        log.error("%s", e)
        return 2

    async def main() -> int:
        async with WeightSync(config) as sync:
            if args.once:
                try:
                    await sync.sync_once()
                    await sync.heartbeat()  # registers the pool and reports where it now is
                except (SyncError, HttpError) as e:
                    log.error("%s", e)
                    return 1
                print(f"{sync.model} v{sync.version}")
                return 0
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await sync.run(stop)
            return 0

    return asyncio.run(main())
