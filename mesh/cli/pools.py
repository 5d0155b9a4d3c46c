"""`deltamesh pools`: a table of the pools registered with a gateway, their versions and staleness."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from deltamesh.config import http_url
from deltamesh.config_flags import flag
from deltamesh.tls import TlsSettings, check_token_transport


@dataclass
class PoolsConfig:
    """Which gateway to ask."""

    gateway: str = field(default="", metadata=flag(metavar="URL"))
    """Base URL of the gateway whose registered pools are listed."""
    token: str = field(default="", metadata=flag("--token", secret_env="DELTAMESH_TOKEN"))
    """An admin token of the gateway (GET /v1/pools is for admins); empty with an admin client
    certificate (tls cert, common name admin/NAME) or an anonymous gateway."""

    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS towards the gateway: `--ca` verifies an https:// gateway, `cert` is presented when it asks."""

    def __post_init__(self) -> None:
        self.gateway = http_url(self.gateway, "gateway")
        if self.token:
            check_token_transport(self.gateway, self.tls.insecure)


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command

    p = config_command(commands, "pools", PoolsConfig, run, help="list the pools registered with a gateway")
    p.add_argument("--json", action="store_true", help="print the gateway's JSON instead of a table")


def pools_table(answer: dict):
    from rich.table import Table

    table = Table(title=f"pools of region {answer['region']}")
    for col in ("pool", "model", "version", "behind", "state", "up", "last seen", "gpus", "engine", "tier",
                "endpoint"):
        table.add_column(col, justify="right" if col in ("version", "behind", "gpus", "last seen") else "left")
    for p in answer["pools"]:
        behind = p["versions_behind"]
        table.add_row(
            p["name"], p["model"], "-" if p["version"] is None else str(p["version"]),
            "-" if behind is None else (f"[yellow]{behind}[/]" if behind else "0"),
            p["state"], "[green]up[/]" if p["up"] else "[red]down[/]", f"{p['last_seen_s']:.1f}s",
            str(p["gpus"]), p["engine"], p["tier"], p["endpoint"],
        )
    return table


def run(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from deltamesh.gateway_client import GatewayClient, call_once
    from deltamesh.http import HttpError
    from deltamesh.mesh.cli import command_config, failed
    from deltamesh.mesh.cli.exits import exit_code

    config = command_config(args, PoolsConfig)
    try:
        answer = call_once(config.gateway, GatewayClient.pools, token=config.token, tls=config.tls)
    except HttpError as e:
        return failed(f"cannot read pools from {config.gateway}: {e}", exit_code(e, 1))
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        Console().print(pools_table(answer))
    return 0
