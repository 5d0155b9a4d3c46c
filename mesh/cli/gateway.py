"""`deltamesh gateway`: run a regional gateway (origin when it has no upstream, relay otherwise)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("gateway", help="run a regional weight gateway",
                            description="Run a regional gateway. Flags override the [gateway] table of --config.")
    p.add_argument("--config", help="TOML file with a [gateway] table (see GatewayConfig)")
    p.add_argument("--region", help="name of this gateway's region")
    p.add_argument("--listen", help="HOST:PORT to serve on")
    p.add_argument("--store", help="directory of the version store")
    p.add_argument("--upstream", action="append", dest="upstreams", metavar="URL",
                   help="upstream gateway URL (repeat for alternates, in order of preference)")
    p.add_argument("--advertise", help="this gateway's URL as upstreams should reach it (for link probes)")
    p.add_argument("--trusted-key", action="append", dest="trusted_keys", metavar="PEM",
                   help="trainer public key whose manifests are accepted (repeatable)")
    p.add_argument("--pool-token", action="append", dest="pool_tokens", metavar="TOKEN",
                   help="bearer token pools of this region register with (repeatable)")
    p.add_argument("--keep-deltas", type=int, help="retention: newest deltas kept per model")
    p.add_argument("--keep-fulls", type=int, help="retention: newest full snapshots kept per model")
    p.add_argument("--relay-connections", type=int, help="parallel piece fetches per relayed version")
    p.add_argument("--bandwidth-cap-mbps", type=float, help="cap per upstream link, megabits per second")
    p.add_argument("--link-delay-ms", type=float,
                   help="latency added to every request to an upstream (emulated in the application)")
    p.add_argument("--stall-timeout", type=float, dest="stall_timeout_s", help="seconds of silence before failover")
    p.add_argument("--piece-wait", type=float, dest="piece_wait_s", help="seconds a request waits for a pending piece")
    p.add_argument("--lease", type=float, dest="lease_s",
                   help="seconds a handed-out plan keeps its versions from garbage collection")
    p.add_argument("--heartbeat-timeout", type=float, dest="heartbeat_timeout_s",
                   help="seconds without heartbeat before a pool is down")
    p.add_argument("--probe-interval", type=float, dest="probe_interval_s", help="seconds between link probes")
    p.set_defaults(run=run)


OVERRIDES = ("region", "listen", "store", "upstreams", "advertise", "trusted_keys", "pool_tokens", "keep_deltas",
             "keep_fulls", "relay_connections", "bandwidth_cap_mbps", "link_delay_ms", "stall_timeout_s",
             "piece_wait_s", "heartbeat_timeout_s", "probe_interval_s", "lease_s")


def run(args: argparse.Namespace) -> int:
    import logging

    from deltamesh.config import ConfigError, load_config
    from deltamesh.gateway.config import GatewayConfig
    from deltamesh.gateway.server import run_gateway

    overrides = {name: vars(args)[name] for name in OVERRIDES}
    try:
        config = load_config(GatewayConfig, args.config, section="gateway", overrides=overrides)
    except ConfigError as e:
        logging.getLogger(__name__).error("%s", e)
        return 2
    run_gateway(config)
    return 0
