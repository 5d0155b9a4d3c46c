"""`deltamesh pools`: a table of the pools registered with a gateway, their versions and staleness."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("pools", help="list the pools registered with a gateway")
    p.add_argument("--gateway", required=True, help="gateway URL")
    p.add_argument("--json", action="store_true", help="print the gateway's JSON instead of a table")
    p.set_defaults(run=run)


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
    import logging

    from rich.console import Console

    from deltamesh.gateway_client import GatewayClient, call_once
    from deltamesh.http import HttpError

    try:
        answer = call_once(args.gateway, GatewayClient.pools)
    except HttpError as e:
        logging.getLogger(__name__).error("cannot read pools from %s: %s", args.gateway, e)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        Console().print(pools_table(answer))
    return 0
