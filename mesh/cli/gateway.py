"""`deltamesh gateway`: run a regional gateway (origin when it has no upstream, relay otherwise)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.config_flags import add_config_flags
    from deltamesh.gateway.config import GatewayConfig

    p = commands.add_parser("gateway", help="run a regional weight gateway",
                            description="Run a regional gateway. Flags override the [gateway] table of --config "
                                        "(docs/CONFIG.md).")
    p.add_argument("--config", metavar="FILE", help="TOML file with a [gateway] table")
    add_config_flags(p, GatewayConfig, section="gateway")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from deltamesh.config import ConfigError, load_config
    from deltamesh.config_flags import config_overrides
    from deltamesh.gateway.config import GatewayConfig
    from deltamesh.gateway.server import run_gateway

    try:
        config = load_config(GatewayConfig, args.config, section="gateway",
                             overrides=config_overrides(args, GatewayConfig))
        run_gateway(config)
    except (ConfigError, ValueError) as e:  # ValueError: no credentials, a bad tokens file or TLS files
        logging.getLogger(__name__).error("%s", e)
        return 2
    return 0
