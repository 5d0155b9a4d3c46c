"""`deltamesh links`: a gateway's links (upstreams, downstream gateways, pools) with RTT and throughput."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("links", help="show a gateway's links: RTT, throughput, errors")
    p.add_argument("--gateway", required=True, help="gateway URL")
    p.add_argument("--watch", action="store_true", help="keep the table updated in place")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between updates with --watch")
    p.add_argument("--json", action="store_true", help="print the gateway's JSON instead of a table")
    p.set_defaults(run=run)


def _rate(bps: float | None) -> str:
    if not bps:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def links_table(answer: dict):
    from rich.table import Table

    table = Table(title=f"links of region {answer['region']}")
    for col in ("peer", "role", "rtt p50 ms", "rtt p95 ms", "throughput", "bytes", "errors", "last transfer",
                "last error"):
        table.add_column(col, justify="left" if col in ("peer", "role", "last error") else "right")
    for link in answer["links"]:
        last = link["last_transfer_s"]
        table.add_row(
            link["peer"], link["role"], _ms(link["rtt_ms"]["p50"]), _ms(link["rtt_ms"]["p95"]),
            _rate(link["throughput_bps"]), f"{link['bytes_total']:,}",
            f"[red]{link['errors']}[/]" if link["errors"] else "0",
            "-" if last is None else f"{last:.1f}s ago", link["last_error"][:60],
        )
    return table


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import time
    import urllib.request

    from rich.console import Console
    from rich.live import Live

    url = f"{args.gateway.rstrip('/')}/v1/links"

    def fetch() -> dict:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    try:
        answer = fetch()
    except (OSError, ValueError) as e:
        logging.getLogger(__name__).error("cannot read links from %s: %s", args.gateway, e)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    if not args.watch:
        Console().print(links_table(answer))
        return 0
    try:
        # Refreshed only when new figures arrive: no render thread to race with Ctrl-C.
        with Live(links_table(answer), auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(links_table(fetch()), refresh=True)
                except (OSError, ValueError) as e:
                    live.console.print(f"[red]{e}[/]")
    except KeyboardInterrupt:
        return 0
