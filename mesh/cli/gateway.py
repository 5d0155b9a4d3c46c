"""`deltamesh gateway`: run a regional gateway (origin when it has no upstream, relay otherwise)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.gateway.config import GatewayConfig
    from deltamesh.mesh.cli import config_command

    config_command(commands, "gateway", GatewayConfig, run, section="gateway", help="run a regional weight gateway",
                   description="Run a regional gateway.")


def run(args: argparse.Namespace) -> int:
    from deltamesh.gateway.config import GatewayConfig
    from deltamesh.gateway.server.app import run_gateway
    from deltamesh.mesh.cli import command_config, failed

    config = command_config(args, GatewayConfig, "gateway")
    try:
        return run_gateway(config)  # 130/143 once a signal stopped it
    except ValueError as e:  # no credentials, a bad tokens file or TLS files
        return failed(e)
