"""`deltamesh bench link`: measure the link from here to a real remote gateway, without root.

It reports the RTT (p50/p95 of small requests), the throughput of ranged piece reads over one
connection and over `--connections` in parallel, and the time a pool here would take to fetch the
gateway's current head version whole (delta and full, where stored): a rich table, or one JSON object
with `--json`. The measuring is `deltamesh.gateway.fetch.link_bench` (no torch: it runs from the slim
gateway install). It reads only what a pool reads; its first request is authenticated, so a refused
token ends it (exit 4) before anything is downloaded. It writes no file. `deltamesh bench soak` is
bench_soak.py's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from deltamesh.config import http_url
from deltamesh.config_flags import flag
from deltamesh.tls import TlsSettings, check_token_transport


@dataclass
class BenchLinkConfig:
    """Which gateway to measure, and how much to read from it."""

    gateway: str = field(default="", metadata=flag(metavar="URL"))
    """Base URL of the gateway to measure."""
    token: str = field(default="", metadata=flag("--token", secret_env="DELTAMESH_TOKEN"))
    """A token of the gateway that may read weights: a pool's (what a pool would see), a downstream
    gateway's or an admin's; empty with such a client certificate (tls cert) or an anonymous gateway."""
    model: str = ""
    """Model id to measure with; empty: the one model the gateway serves (it must name one if several)."""
    connections: int = 8
    """Parallel connections of the parallel throughput figure and of the head fetch."""
    rtt_samples: int = 20
    """Small requests the RTT percentiles are taken from."""
    sample_mb: float = 64.0
    """Most megabytes (1e6) each throughput figure reads (less when the stored version is smaller)."""
    range_mb: float = 4.0
    """Size of one ranged read, in MiB (a piece is split into ranges of at most this)."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS towards the gateway: `--ca` verifies an https:// gateway, `cert` is presented when it asks."""

    def __post_init__(self) -> None:
        self.gateway = http_url(self.gateway, "gateway")
        if self.token:
            check_token_transport(self.gateway, self.tls.insecure)
        if self.connections < 1 or self.rtt_samples < 1:
            raise ValueError("connections and rtt_samples must be >= 1")
        if not (self.sample_mb > 0 and self.range_mb > 0):
            raise ValueError("sample_mb and range_mb must be > 0")


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import bench_soak, command_group, config_command

    sub = command_group(commands, "bench", help="measure this machine's link to a gateway, or soak a mesh under faults")
    p = config_command(sub, "link", BenchLinkConfig, run,
                       help="RTT, throughput (1 and N connections) and head fetch time to a remote gateway",
                       description="Measure the link to a remote gateway with the requests a pool makes "
                                   "(no root needed). --json prints every figure.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench_soak.register(sub)


def _ms(v: float) -> str:
    return f"{v:.1f} ms"


def _rate(figure: dict) -> str:
    return "-" if figure["mbit_per_s"] is None else f"{figure['mbit_per_s']:.1f} Mbit/s"


def bench_table(result: dict):
    """The figures of `measure_link` as one rich table."""
    from rich.table import Table

    table = Table(title=f"link to {result['gateway']} (region {result['region']}, model {result['model']})")
    for col, justify in (("figure", "left"), ("value", "right"), ("detail", "left")):
        table.add_column(col, justify=justify)
    rtt = result["rtt_ms"]
    table.add_row("RTT p50", _ms(rtt["p50"]), f"{rtt['samples']} small requests on one connection")
    table.add_row("RTT p95", _ms(rtt["p95"]), f"first request (with connect) {_ms(result['first_request_ms'])}")
    tp = result["throughput"]
    for key in ("one", "parallel"):
        f = tp[key]
        table.add_row(f"throughput, {f['connections']} conn.", _rate(f),
                      f"{f['bytes'] / 1e6:.1f} MB in {f['seconds']:.2f} s, ranged reads of v{tp['version']} "
                      f"{tp['kind']}")
    head = result["head"]
    for kind, f in head["kinds"].items():
        base = f" from v{f['base_version']}" if f["base_version"] is not None else ""
        table.add_row(f"head v{head['version']} {kind}{base}", f"{f['seconds']:.2f} s",
                      f"{f['bytes'] / 1e6:.2f} MB, {f['pieces']} pieces, {_rate(f)}")
    return table


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from rich.console import Console

    from deltamesh.gateway.fetch.link_bench import BenchError, LinkBenchSettings, measure_link
    from deltamesh.mesh.cli import command_config, failed
    from deltamesh.mesh.cli.exits import Exit

    config = command_config(args, BenchLinkConfig)
    settings = LinkBenchSettings(gateway=config.gateway, token=config.token, model=config.model,
                                 connections=config.connections, rtt_samples=config.rtt_samples,
                                 sample_bytes=int(config.sample_mb * 1e6),
                                 range_bytes=int(config.range_mb * 1024 * 1024), tls=config.tls)
    try:
        result = asyncio.run(measure_link(settings))
    except BenchError as e:
        return failed(e, Exit.FAILED)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        Console().print(bench_table(result))
    return 0
