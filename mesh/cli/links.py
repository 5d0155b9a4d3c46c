"""`deltamesh links`: a gateway's links (upstreams, downstream gateways, pools) with RTT and throughput.

The full table has nine columns and needs well over 80 characters. Where it does not fit (an
80-column terminal, or output to a pipe or file, which rich lays out at $COLUMNS or 80 columns), a
compact table takes its place instead of cells wrapped a few letters at a time: one line per link
with the median RTT, rate, bytes in kB/MB/GB, errors and age, and each link's last error listed
under it. `--json` has every figure.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from deltamesh.config import http_url
from deltamesh.config_flags import flag
from deltamesh.tls import TlsSettings, check_token_transport


@dataclass
class LinksConfig:
    """Which gateway to ask, and how often with --watch."""

    gateway: str = field(default="", metadata=flag(metavar="URL"))
    """Base URL of the gateway whose links are shown."""
    token: str = field(default="", metadata=flag("--token", secret_env="DELTAMESH_TOKEN"))
    """An admin token of the gateway (GET /v1/links is for admins); empty with an admin client
    certificate (tls cert, common name admin/NAME) or an anonymous gateway."""
    interval_s: float = 1.0
    """Seconds between updates with --watch."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS towards the gateway: `--ca` verifies an https:// gateway, `cert` is presented when it asks."""

    def __post_init__(self) -> None:
        self.gateway = http_url(self.gateway, "gateway")
        if self.token:
            check_token_transport(self.gateway, self.tls.insecure)
        if not self.interval_s > 0:
            raise ValueError("interval_s must be > 0")


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command

    p = config_command(commands, "links", LinksConfig, run, help="show a gateway's links: RTT, throughput, errors",
                       description="Show a gateway's links. The full table needs a wide terminal (or COLUMNS); "
                                   "narrower output gets a compact one. --json has every figure.")
    p.add_argument("--watch", action="store_true", help="keep the table updated in place")
    p.add_argument("--json", action="store_true", help="print the gateway's JSON instead of a table")


def _scaled(value: float, unit: str) -> str:
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def _rate(bps: float | None) -> str:
    return _scaled(bps, "B/s") if bps else "-"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def _errors(link: dict) -> str:
    return f"[red]{link['errors']}[/]" if link["errors"] else "0"


def _full_table(answer: dict):
    from rich.table import Table

    table = Table(title=f"links of region {answer['region']}")
    for col in ("peer", "role", "rtt p50 ms", "rtt p95 ms", "throughput", "bytes", "errors", "last transfer",
                "last error"):
        table.add_column(col, justify="left" if col in ("peer", "role", "last error") else "right")
    for link in answer["links"]:
        table.add_row(
            link["peer"], link["role"], _ms(link["rtt_ms"]["p50"]), _ms(link["rtt_ms"]["p95"]),
            _rate(link["throughput_bps"]), f"{link['bytes_total']:,}", _errors(link), _ago(link["last_transfer_s"]),
            link["last_error"][:60],
        )
    return table


def _compact_table(answer: dict):
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    # No vertical rules and one space between columns: the longest rows (a URL peer, a downstream
    # link, GB/s rates) then fit in 80 columns. Only the peer may wrap; numbers never do.
    table = Table(title=f"links of region {answer['region']}", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, collapse_padding=True)
    for col in ("peer", "role", "rtt ms", "rate", "bytes", "err", "last"):
        table.add_column(col, justify="left" if col in ("peer", "role") else "right",
                         no_wrap=col != "peer", overflow="fold")
    for link in answer["links"]:
        table.add_row(link["peer"], link["role"], _ms(link["rtt_ms"]["p50"]), _rate(link["throughput_bps"]),
                      _scaled(link["bytes_total"], "B"), _errors(link), _ago(link["last_transfer_s"]))
    errors = [Text(f"{link['peer']}: {link['last_error']}") for link in answer["links"] if link["last_error"]]
    if not errors:
        return table
    return Group(table, Text("last errors:"), *errors)


def links_table(answer: dict, console):
    """The links as `console` can show them: the full table when it fits its width, else the compact one."""
    full = _full_table(answer)
    unbounded = console.options.update_width(1_000_000)  # a measure is capped at the width it is given
    return full if console.measure(full, options=unbounded).maximum <= console.width else _compact_table(answer)


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console
    from rich.live import Live

    from deltamesh.gateway_client import GatewayClient, call_once
    from deltamesh.http import HttpError
    from deltamesh.mesh.cli import command_config, failed
    from deltamesh.mesh.cli.exits import exit_code

    config = command_config(args, LinksConfig)

    def fetch() -> dict:
        return call_once(config.gateway, GatewayClient.links, token=config.token, tls=config.tls)

    try:
        answer = fetch()
    except HttpError as e:
        return failed(f"cannot read links from {config.gateway}: {e}", exit_code(e, 1))
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    console = Console()
    if not args.watch:
        console.print(links_table(answer, console))
        return 0
    try:
        # Refreshed only when new figures arrive: no render thread to race with Ctrl-C.
        with Live(links_table(answer, console), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(config.interval_s)
                try:
                    live.update(links_table(fetch(), console), refresh=True)
                except HttpError as e:
                    live.console.print(f"[red]{e}[/]")
    except KeyboardInterrupt:
        return 0
