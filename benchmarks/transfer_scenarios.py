"""The network scenarios of the transfer benchmark, each running deltamesh and its baselines through
the same emulated links in one run (the long-link ones are in transfer_long_link.py).

* `relay_chain`: origin -> regionA -> regionB. `deltamesh`: regionA's gateway relays cut-through and
  regionB's puller fetches from it as soon as it announces the version. `store_and_forward`: the same,
  but regionB starts only once regionA holds the whole version (shardcast-style relaying, without its
  polling interval). `direct`: regionB pulls straight from the origin over an extra link whose rate
  is the chain's bottleneck and whose RTT is the sum of both hops. Rounds alternate the methods; each
  round's two hops over one (`two_hops_over_one_runs`) pairs its deltamesh run with its direct one.
  `relay_chain_loss_*`: the same chain (without store-and-forward) with every long link losing
  packets at the first rate of `--loss`, each way.
* `fan_out`: origin -> 3 regions -> 4 pools each. `deltamesh`: one relay gateway per region, every
  pool pulls from its region's gateway; `one_pool_seconds` is the same with a single pool pulling.
  `astraflow`: every pool GETs its own copy from a file server at the origin, one TCP stream each,
  the server sending to one pool at a time (as AstraFlow's sender does); pools reach the origin
  through their region host by IP forwarding, so they share the region's long link.

Times run from the instant every process is released (see transfer_agent.py) to the last byte
verified. The release starts the version's upload to the origin gateway (on the origin's loopback),
so deltamesh's times include publishing, while the baselines' file is already in place. Each run
carries the record of what the long links did meanwhile (transfer_runs.Scenario.record).
"""

from __future__ import annotations

import logging
import statistics

from transfer_long_link import long_link, lossy_link
from transfer_mesh import GATEWAY_PORT, route_through, set_tcp_buffers
from transfer_runs import Sample, Scenario, Settings, build_topology, check_link, scenario_json, work_dir
from wan import Host, Wan

log = logging.getLogger(__name__)

REGIONS = ("regionA", "regionB", "regionC")
DIRECT_PORT = 8601
TWO_HOPS_TARGET = 1.15


def relay_chain(settings: Settings) -> dict:
    return _relay_chain(settings, None)


def lossy_relay_chain(settings: Settings) -> dict:
    return _relay_chain(settings, settings.loss_rates[0])


def _relay_chain(settings: Settings, loss: float | None) -> dict:
    with work_dir(settings) as work, Wan("txc") as wan:
        build_topology(wan, "relay_chain", settings.rtt_scale, loss=loss)
        origin, a, b = wan.hosts["origin"], wan.hosts["regionA"], wan.hosts["regionB"]
        hops = [origin.link_to(a), a.link_to(b)]
        # The direct path: as fast as the chain's slowest hop, as long as both hops together.
        direct = wan.link(origin, b, mbit=min(h.mbit_ab for h in hops), rtt_ms=sum(h.rtt_ms for h in hops), loss=loss)
        link = check_link(wan, a, b, settings)
        link["hops"] = [{"mbit": h.mbit_ab, "rtt_ms": h.rtt_ms} for h in hops]
        link["mbit"] = min(h.mbit_ab for h in hops)
        link["rtt_ms"] = sum(h.rtt_ms for h in hops)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        connections = settings.connections if loss is None else settings.loss_connections
        methods = ("deltamesh", "direct") + (("store_and_forward",) if loss is None else ())
        plan = {m: settings.repeats_of(m) for m in methods if settings.runs(m)}
        with Scenario(wan, settings, work, record=[*hops, direct]) as run:
            gateway = run.mesh.gateway(origin, "origin")
            relay = run.mesh.gateway(a, "regionA", [gateway], relay_connections=connections)
            # A second origin gateway that regionA does not follow, so a direct pull is the only copy sent.
            lone = run.mesh.gateway(origin, "origin-direct", port=DIRECT_PORT)
            samples: dict[str, list[Sample]] = {m: [] for m in plan}
            for k in range(max(plan.values())):
                for method in (m for m in plan if plan[m] > k):
                    version = run.next_version()
                    batch = run.mesh.batch()
                    port = DIRECT_PORT if method == "direct" else GATEWAY_PORT
                    run.publish(origin, lone if method == "direct" else gateway, version, batch)
                    run.add_pull(batch, b, lone if method == "direct" else relay, version, connections=connections,
                                 after_complete=method == "store_and_forward")
                    seconds, results, egress, wire = run.timed(
                        batch, origin, lambda: run.mesh.gateway_bytes_out(origin, port))
                    pull, published = results[f"pull-{b.name}"], results["publish"]
                    samples[method].append(Sample(seconds, egress, wire, {
                        "publish_seconds": published["t_done"] - published["t_start"],
                        "start_seconds": pull["t_fetch"] - pull["t_go"]},
                        link=run.record(published["t_start"], pull["t_done"])))
                    log.info("relay_chain %s: %.2fs", method, seconds)
        name = "relay_chain" if loss is None else f"relay_chain_loss_{loss * 100:g}pct"
        out = scenario_json(name, link, samples, settings)
        out["connections"] = connections
        out.update(two_hops(out["methods"]))
        return out


def two_hops(methods: dict) -> dict:
    """Two hops over one: of the medians, and round by round (each method's k-th run against direct's)."""
    direct = methods.get("direct")
    if not direct:
        return {}
    out = {"two_hops_over_one": {m: round(methods[m]["seconds"] / direct["seconds"], 3)
                                 for m in ("deltamesh", "store_and_forward") if m in methods}}
    if "deltamesh" in methods:
        runs = [round(d / r, 3) for d, r in zip(methods["deltamesh"]["runs"], direct["runs"])]
        out["two_hops_over_one_runs"] = runs
        out["two_hops_within_target"] = sum(1 for r in runs if r <= TWO_HOPS_TARGET)
    return out


def fan_out(settings: Settings, pools_per_region: int = 4) -> dict:
    with work_dir(settings) as work, Wan("txf") as wan:
        build_topology(wan, "fanout", settings.rtt_scale, settings.pool_rtt_ms)
        origin = wan.hosts["origin"]
        pools = [wan.hosts[f"pool{r[-1]}{i}"] for r in REGIONS for i in range(1, pools_per_region + 1)]
        link = check_link(wan, origin, wan.hosts["regionA"], settings)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        for pool in pools:
            route_through(pool, wan.hosts[f"region{pool.name[4]}"], origin)
        long_links = [origin.link_to(wan.hosts[r]) for r in REGIONS]
        with Scenario(wan, settings, work, record=long_links) as run:
            gateway = run.mesh.gateway(origin, "origin")
            relays = {r: run.mesh.gateway(run.host(r), r, [gateway], relay_connections=settings.connections)
                      for r in REGIONS}
            files = run.mesh.file_server(origin, settings.payload / "version.bin", serial=True)
            samples: dict[str, list[Sample]] = {"deltamesh": [], "astraflow": []}
            one_pool: list[float] = []

            def deltamesh_run(members: list[Host]) -> tuple[float, dict, int, int]:
                version = run.next_version()
                batch = run.mesh.batch()
                run.publish(origin, gateway, version, batch)
                for pool in members:
                    run.add_pull(batch, pool, relays[f"region{pool.name[4]}"], version, connections=4)
                return run.timed(batch, origin, lambda: run.mesh.gateway_bytes_out(origin))

            for repeat in range(settings.repeats_of("fan_out")):
                seconds, results, egress, wire = deltamesh_run(pools)
                published = results["publish"]
                first = min(r["t_done"] for n, r in results.items() if n != "publish") - published["t_start"]
                samples["deltamesh"].append(Sample(seconds, egress, wire, {
                    "first_pool_seconds": first, "publish_seconds": published["t_done"] - published["t_start"]},
                    link=run.record(published["t_start"], published["t_start"] + seconds)))
                one_pool.append(deltamesh_run(pools[:1])[0])
                log.info("fan_out deltamesh: all %.2fs, one pool alone %.2fs", seconds, one_pool[-1])
                if repeat == 0 and settings.runs("astraflow"):  # 12 serialized whole-version sends: its 12 transfers are samples already
                    batch = run.mesh.batch()
                    for pool in pools:
                        batch.add(pool, f"get-{pool.name}", "get", "--url", files)
                    seconds, results, egress, wire = run.timed(batch, origin, lambda: run.mesh.file_bytes_out(origin))
                    first = min(r["t_done"] for r in results.values()) - min(r["t_go"] for r in results.values())
                    samples["astraflow"].append(Sample(seconds, egress, wire, {"first_pool_seconds": first},
                                                       link=run.record(run.t_released, run.t_released + seconds)))
                    log.info("fan_out astraflow: all %.2fs", seconds)
        out = scenario_json("fan_out", link, samples, settings)
        out["pools"] = len(pools)
        lan = pools[0].link_to(wan.hosts["regionA"])
        out["pool_link"] = {"mbit": lan.mbit_ab, "rtt_ms": lan.rtt_ms}
        out["one_pool_seconds"] = round(statistics.median(one_pool), 3)
        out["one_pool_runs"] = [round(s, 3) for s in one_pool]
        dm = out["methods"]["deltamesh"]
        out["all_over_one_pool"] = round(dm["seconds"] / out["one_pool_seconds"], 3)
        out["egress_over_version"] = {m: round(v["origin_egress_bytes"] / settings.payload_bytes, 3)
                                      for m, v in out["methods"].items()}
        return out


SCENARIOS = {"long_link": long_link, "long_link_loss": lossy_link, "relay_chain": relay_chain,
             "relay_chain_loss": lossy_relay_chain, "fan_out": fan_out}
"""Scenario name -> its function (one scenario's JSON, or a list of them)."""
