"""`deltamesh broker` (the dataflow broker service) and `deltamesh autoscale` (the rollout autoscaler).

Settings come from the `[broker]` / `[autoscale]` tables of `--config FILE` (see
mesh/broker/config.py and mesh/autoscale/config.py); flags given on the command line override them.
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("broker", help="run the dataflow broker (tasks out, trajectories in, batches out)")
    p.add_argument("--listen", default="127.0.0.1:8700", help="HOST:PORT to serve on (default 127.0.0.1:8700)")
    p.add_argument("--db", required=True, help="SQLite file of the broker's durable store")
    p.add_argument("--config", help="TOML file; its [broker] table holds the settings")
    p.add_argument("--model", action="append", dest="models", help="a model_id to serve (repeatable)")
    p.add_argument("--dataset", help="JSONL prompts to lease out (imported on first start)")
    p.add_argument("--durability", choices=("fsync", "process"),
                   help="fsync: acks survive power loss (default); process: acks survive a killed broker only")
    p.set_defaults(run=run_broker)

    a = commands.add_parser("autoscale", help="resize the rollout pool from the broker's balance report")
    a.add_argument("--config", help="TOML file; its [autoscale] table holds the settings")
    a.add_argument("--broker", help="broker URL (default http://127.0.0.1:8700)")
    a.add_argument("--launcher", choices=("local", "command"))
    a.add_argument("--interval", type=float, dest="interval_s", help="seconds between decisions")
    a.set_defaults(run=run_autoscale)


def run_broker(args: argparse.Namespace) -> int:
    import logging

    from deltamesh.config import ConfigError, load_config
    from deltamesh.http import parse_listen, serve
    from deltamesh.mesh.broker.config import BrokerConfig
    from deltamesh.mesh.broker.server import build_app
    from deltamesh.mesh.broker.store import StoreUnavailable
    from deltamesh.mesh.broker.tasks import DatasetError

    overrides = {"models": args.models, "tasks.dataset": args.dataset, "durability": args.durability}
    try:
        config = load_config(BrokerConfig, args.config, section="broker", overrides=overrides)
        host, port = parse_listen(args.listen)
        serve(build_app(config, args.db), host, port)
    except (ConfigError, DatasetError, StoreUnavailable, ValueError) as e:  # ValueError: unknown plug-in names
        logging.getLogger(__name__).error("%s", e)
        return 2
    return 0


def run_autoscale(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from deltamesh.config import ConfigError, load_config
    from deltamesh.broker_client import BrokerClient
    from deltamesh.mesh.autoscale.config import AutoscaleConfig
    from deltamesh.mesh.autoscale.launchers import CommandLauncher, Launcher, LocalLauncher
    from deltamesh.mesh.autoscale.loop import Autoscaler

    overrides = {"broker": args.broker, "launcher": args.launcher, "interval_s": args.interval_s}
    try:
        config = load_config(AutoscaleConfig, args.config, section="autoscale", overrides=overrides)
    except ConfigError as e:
        logging.getLogger(__name__).error("%s", e)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        launcher: Launcher
        if config.launcher == "local":
            launcher = LocalLauncher(config.command, broker=config.broker, stop_grace_s=config.stop_grace_s)
        else:
            launcher = CommandLauncher(config.command, initial=config.initial_pools, timeout_s=config.command_timeout_s)
        async with BrokerClient(config.broker, timeout_s=60) as broker:
            try:
                await Autoscaler(config, launcher, broker.balance).run(stop)
            finally:
                await launcher.close()

    asyncio.run(main())
    return 0
