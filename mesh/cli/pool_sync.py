"""`deltamesh pool sync`: keep a safetensors directory at a gateway's head, as a rollout pool would."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = pool_commands.add_parser(
        "sync", help="follow a gateway and keep a weights directory at its head",
        description="Register a pool with its region's gateway, follow the head of its model, and apply every "
                    "new version atomically to DIR (a safetensors directory any engine can load).")
    p.add_argument("--gateway", action="append", required=True, metavar="URL",
                   help="region gateway URL; repeat to add alternates, in order of preference")
    p.add_argument("--token", required=True, help="the region's pool token")
    p.add_argument("--name", required=True, help="pool name")
    p.add_argument("--dir", required=True, help="weights directory to keep up to date")
    p.add_argument("--trusted-key", action="append", required=True, metavar="PEM",
                   help="trainer public key whose signatures are accepted (repeatable)")
    p.add_argument("--model", default="", help="model id (default: the one the gateway serves)")
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--engine", default="none")
    p.add_argument("--tier", default="")
    p.add_argument("--endpoint", default="", help="the pool's engine endpoint (probed for RTT)")
    p.add_argument("--connections", type=int, default=4, help="parallel piece fetches")
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between heartbeats")
    p.add_argument("--stall-timeout", type=float, default=20.0, help="seconds of silence before failing over")
    p.add_argument("--full-every", type=int, default=0,
                   help="take a full snapshot after this many deltas in a row (0: by bytes only)")
    p.add_argument("--once", action="store_true", help="sync to the current head and exit")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from deltamesh.gateway.config import PoolSyncConfig
    from deltamesh.http import HttpError
    from deltamesh.gateway.weight_sync import SyncError, WeightSync

    log = logging.getLogger(__name__)
    try:
        config = PoolSyncConfig(
            gateways=args.gateway, token=args.token, name=args.name, dir=args.dir, trusted_keys=args.trusted_key,
            model=args.model, gpus=args.gpus, engine=args.engine, tier=args.tier, endpoint=args.endpoint,
            connections=args.connections, heartbeat_s=args.heartbeat, stall_timeout_s=args.stall_timeout,
            full_every=args.full_every)
    except ValueError as e:
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
