"""The transfer benchmark on a link you name: `transfer.py --mbit N --rtt-ms N --payload-mb N`.

An ad-hoc topology on the WAN emulator, built from the flags instead of a TOML file: an origin
region, one relay region across a link of the asked rate and RTT (the same both ways), and a pool
beside the relay on a LAN (at least 1 Gbit/s, twice the long link's rate when that is more; RTT
`--pool-rtt-ms`, default 0). `deltamesh`: the origin gateway gets the version published, the relay
gateway follows it (cut-through, `--connections` parallel fetches) and the pool pulls from the relay
as a pool agent does; the clock runs from the publish's start to the pool's last verified byte, as
in `relay_chain`. `single_stream`: the pool GETs the whole version from a plain file server at the
origin over one TCP connection, through the relay host (IP forwarding, the long link's delays
applied), as a client with no relays would. The figures are those of the other scenarios (seconds,
utilization of the long link, origin egress; transfer_scenarios.summarize), under the name `your_link`.
"""

from __future__ import annotations

import logging

from transfer_mesh import route_through, set_tcp_buffers
from transfer_runs import Sample, Scenario, Settings, check_link, scenario_json, steady_mbit, work_dir
from wan import Wan

log = logging.getLogger(__name__)

NAME = "your_link"
POOL_LINK_MIN_MBIT = 1000.0
POOL_CONNECTIONS = 4
"""Parallel piece fetches of a pool from its region's gateway (as in `fan_out`)."""


def pool_link_mbit(mbit: float) -> float:
    """The relay-to-pool LAN's rate: never the bottleneck of a run over the long link."""
    return max(POOL_LINK_MIN_MBIT, 2 * mbit)


def your_link(settings: Settings, mbit: float, rtt_ms: float) -> dict:
    with work_dir(settings) as work, Wan("txy") as wan:
        origin, relay, pool = wan.host("origin"), wan.host("regionA"), wan.host("pool")
        long = wan.link(origin, relay, mbit=mbit, rtt_ms=rtt_ms)
        lan = wan.link(relay, pool, mbit=pool_link_mbit(mbit), rtt_ms=settings.pool_rtt_ms or 0.0)
        link = check_link(wan, origin, relay, settings)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        route_through(pool, relay, origin)
        with Scenario(wan, settings, work, record=[long]) as run:
            gateway = run.mesh.gateway(origin, "origin")
            relayed = run.mesh.gateway(relay, "regionA", [gateway], relay_connections=settings.connections)
            files = run.mesh.file_server(origin, settings.payload / "version.bin") \
                if settings.runs("single_stream") else None
            samples: dict[str, list[Sample]] = {"deltamesh": [], "single_stream": []}
            for _ in range(settings.repeats_of(NAME)):
                for method in filter(settings.runs, samples):
                    batch = run.mesh.batch()
                    if method == "deltamesh":
                        version = run.next_version()
                        run.publish(origin, gateway, version, batch)
                        run.add_pull(batch, pool, relayed, version, connections=POOL_CONNECTIONS)
                        egress, name = (lambda: run.mesh.gateway_bytes_out(origin)), f"pull-{pool.name}"
                    else:
                        batch.add(pool, "get", "get", "--url", files)
                        egress, name = (lambda: run.mesh.file_bytes_out(origin)), "get"
                    seconds, results, out, wire = run.timed(batch, origin, egress)
                    extra = {"steady_mbit": steady_mbit(results[name])}
                    if "publish" in results:
                        extra["publish_seconds"] = results["publish"]["t_done"] - results["publish"]["t_start"]
                    samples[method].append(Sample(seconds, out, wire, extra,
                                                  link=run.record(run.t_released, run.t_released + seconds)))
                    log.info("%s %s: %.2fs", NAME, method, seconds)
        out = scenario_json(NAME, link, samples, settings)
        out["pool_link"] = {"mbit": lan.mbit_ab, "rtt_ms": lan.rtt_ms}
        return out
