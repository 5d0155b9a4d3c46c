"""`deltamesh broker` (the dataflow broker service) and `deltamesh autoscale` (the rollout autoscaler).

Settings come from the `[broker]` / `[autoscale]` tables of `--config FILE` (see
mesh/broker/config.py and mesh/autoscale/config.py); the flags, derived from those dataclasses, override
them (docs/CONFIG.md).
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.autoscale.config import AutoscaleConfig
    from deltamesh.mesh.broker.config import BrokerConfig
    from deltamesh.mesh.cli import broker_migrate, config_command

    broker = config_command(commands, "broker", BrokerConfig, run_broker, section="broker",
                            help="run the dataflow broker (tasks out, trajectories in, batches out)",
                            description="Run the dataflow broker.")
    broker_migrate.register(broker)  # `deltamesh broker migrate --db URL`
    config_command(commands, "autoscale", AutoscaleConfig, run_autoscale, section="autoscale",
                   help="resize the rollout pool from the broker's balance report",
                   description="Run the autoscaler.")


def run_broker(args: argparse.Namespace) -> int:
    from deltamesh.http import parse_listen, serve
    from deltamesh.mesh.broker.config import BrokerConfig
    from deltamesh.mesh.broker.server import build_app, connection_guard
    from deltamesh.mesh.broker.store_interface import StoreUnavailable
    from deltamesh.mesh.broker.tasks import DatasetError
    from deltamesh.mesh.cli import command_config, failed
    from deltamesh.tls import server_context

    config = command_config(args, BrokerConfig, "broker")
    try:
        host, port = parse_listen(config.listen)
        app = build_app(config, config.db)
        app.on_startup.append(_reload_tokens_on_sighup)
        return serve(app, host, port, ssl_context=server_context(config.tls), what="broker",
                     guard=connection_guard(config, app))  # 130/143: stopped
    except (DatasetError, StoreUnavailable, ValueError) as e:  # ValueError: unknown plug-in names, TLS
        return failed(e)


async def _reload_tokens_on_sighup(app) -> None:
    """`kill -HUP` makes the broker re-read its tokens file at once (it also notices changes itself)."""
    import asyncio
    import signal

    from deltamesh.mesh.broker.server import TOKENS_KEY

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, app[TOKENS_KEY].reload)


def run_autoscale(args: argparse.Namespace) -> int:
    import asyncio

    from deltamesh.broker_client import BrokerClient
    from deltamesh.mesh.autoscale.config import AutoscaleConfig
    from deltamesh.mesh.autoscale.launchers import CommandLauncher, Launcher, LocalLauncher
    from deltamesh.mesh.autoscale.loop import Autoscaler
    from deltamesh.mesh.cli import command_config, stop_on_signals

    config = command_config(args, AutoscaleConfig, "autoscale")

    async def main() -> int:
        stop = stop_on_signals("autoscaler")
        launcher: Launcher
        if config.launcher == "local":
            launcher = LocalLauncher(config.command, broker=config.broker, stop_grace_s=config.stop_grace_s)
        else:
            launcher = CommandLauncher(config.command, initial=config.initial_pools, timeout_s=config.command_timeout_s)
        async with BrokerClient(config.broker, token=config.broker_token, timeout_s=60) as broker:
            try:
                await Autoscaler(config, launcher, broker.balance).run(stop)
            finally:
                await launcher.close()
        return stop.exit_code  # 130/143 after a signal

    return asyncio.run(main())
