"""`deltamesh pool sync`: keep a safetensors directory at a gateway's head, as a rollout pool would."""

from __future__ import annotations

import argparse
import contextlib
from typing import AsyncIterator


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command
    from deltamesh.mesh.pool.sync_config import PoolSyncConfig

    p = config_command(
        pool_commands, "sync", PoolSyncConfig, run, help="follow a gateway and keep a weights directory at its head",
        description="Register a pool with its region's gateway, follow the head of its model, and apply every "
                    "new version atomically to DIR (a safetensors directory any engine can load). --gateway, "
                    "--name, --dir and --trusted-key are required, and the pool's token (--token-file PATH "
                    "or $DELTAMESH_TOKEN) unless a client certificate identifies the pool.")
    p.add_argument("--once", action="store_true",
                   help="sync to the current head and exit (7 when the gateways are behind a version known "
                        "to exist: a frozen or stale relay; docs/CLI.md)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from deltamesh.http import HttpError
    from deltamesh.mesh.cli import command_config, failed, stop_on_signals
    from deltamesh.mesh.cli.exits import Exit, describe, exit_code
    from deltamesh.mesh.cli.progress import transfer_progress
    from deltamesh.mesh.pool.sync_config import PoolSyncConfig
    from deltamesh.mesh.pool.weight_sync import CredentialsError, SyncError, WeightSync
    from deltamesh.signals import until_stopped

    config = command_config(args, PoolSyncConfig)

    async def main() -> int:
        stop = stop_on_signals(f"pool {config.name}")
        async with WeightSync(config, hold_weights=True) as sync:
            progress.watch(sync)  # a bar on a terminal, else a line every few seconds (docs/CLI.md)
            if args.once:
                try:
                    # Registering first checks the pool's token and name before anything is downloaded.
                    await sync.authenticate()
                except (SyncError, HttpError) as e:
                    return failed(e, exit_code(e, 1))
                try:
                    await until_stopped(sync.sync_once(), stop)  # an apply under way completes (it is atomic)
                    if sync.watch.behind(sync.version) is not None and not stop.is_set():
                        # A relay a moment behind its upstream catches up within a stall timeout; the
                        # gateways below what is known are asked last meanwhile.
                        sync.watch.flag_lagging(sync.version)
                        await until_stopped(sync.sync_once(config.stall_timeout_s), stop)
                    if stop.is_set():
                        await sync.deregister()
                        return stop.exit_code
                    await sync.heartbeat()  # reports where the pool now is
                except (SyncError, HttpError, OSError) as e:  # OSError: the directory's disk (full)
                    await sync.deregister()  # a pool that did not sync is not left listed
                    return failed(describe(e), exit_code(e, 1))
                print(f"{sync.model} v{sync.version}")
                behind = sync.watch.behind(sync.version)
                if behind is not None:
                    logging.getLogger(__name__).warning("pool %s: stopped at v%s, behind: %s", config.name,
                                                        sync.version, behind)
                    return int(Exit.STALE)
                return 0
            try:
                async with metrics_served(sync, config.metrics_listen):
                    await sync.run(stop)  # deregisters from its gateway once stopped
            except CredentialsError as e:
                return failed(e, exit_code(e, 2))
            return stop.exit_code  # 130/143 after a signal

    with transfer_progress() as progress:
        return asyncio.run(main())


@contextlib.asynccontextmanager
async def metrics_served(sync, listen: str) -> AsyncIterator[None]:
    """Serve `/metrics` and `/healthz` of `sync` on `listen` while the block runs; nothing when empty."""
    if not listen:
        yield
        return
    import logging

    from deltamesh.http import serving
    from deltamesh.mesh.pool.sync_metrics import sync_registry
    from deltamesh.metrics import status_app

    app = status_app(sync_registry(sync), lambda: {"model": sync.model, "version": sync.version, "head": sync.head,
                                                   "state": sync.state, "last_error": sync.last_error,
                                                   "refusals": dict(sync.book.refusals),
                                                   "gateways": sync.book.describe()})
    async with serving(app, listen) as url:
        logging.getLogger(__name__).info("pool %s: metrics at %s/metrics", sync.config.name, url)
        yield
