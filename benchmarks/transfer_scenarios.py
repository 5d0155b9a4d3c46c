"""The three network scenarios of the transfer benchmark, each running deltamesh and its baselines
through the same emulated links in one run.

* `long_link`: origin -> regionA over one long link. `deltamesh`: a pool-style puller in regionA
  fetches the version's pieces from the origin gateway with parallel connections, opened while its
  head poll is on its way (`deltamesh_late_open`: opened only with the piece requests, as before).
  `deltamesh_tls`: the same from a second origin gateway serving HTTPS (a certificate of a CA made
  for the run, which the puller verifies; transfer_tls.py), in the same run. `single_stream`: one HTTP GET of the whole
  version from a plain file server at the origin.
* `relay_chain`: origin -> regionA -> regionB. `deltamesh`: regionA's gateway relays cut-through and
  regionB's puller fetches from it as soon as it announces the version. `store_and_forward`: the same,
  but regionB starts only once regionA holds the whole version (shardcast-style relaying, without its
  polling interval). `direct`: regionB pulls straight from the origin over an extra link whose rate
  is the chain's bottleneck and whose RTT is the sum of both hops.
* `fan_out`: origin -> 3 regions -> 4 pools each. `deltamesh`: one relay gateway per region, every
  pool pulls from its region's gateway; `one_pool_seconds` is the same with a single pool pulling.
  `astraflow`: every pool GETs its own copy from a file server at the origin, one TCP stream each,
  the server sending to one pool at a time (as AstraFlow's sender does); pools reach the origin
  through their region host by IP forwarding, so they share the region's long link.

Times run from the instant every process is released (see transfer_agent.py) to the last byte
verified. In `long_link` the version is on the origin gateway before that instant; in the other two
the release starts its upload to the origin gateway (on the origin's loopback), so deltamesh's times
include publishing, while the baselines' file is already in place.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from transfer_mesh import GATEWAY_PORT, Mesh, route_through, set_tcp_buffers, wire_tx_bytes
from transfer_payload import MODEL_ID
from wan import Host, Wan, build, load_topology, verify_link

log = logging.getLogger(__name__)

TOPOLOGIES = Path(__file__).resolve().parent / "wan" / "topologies"
REGIONS = ("regionA", "regionB", "regionC")
DIRECT_PORT = 8601
TLS_PORT = 8443


@dataclass
class Settings:
    payload: Path
    payload_bytes: int
    piece_bytes: float
    """Mean piece size of the version (what one fetch request carries)."""
    repeats: int = 3
    rtt_scale: float = 1.0
    """Multiplies every link's RTT (the --quick runs use shorter links)."""
    connections: int = 16
    """Parallel piece fetches over long links (relay gateways and pullers); pools on a LAN use 4."""
    tcp_buffers: str = "linux"
    congestion: str = "cubic"
    initcwnd: int = 0
    """Initial congestion and receive windows (segments) on every host's routes; 0: Linux's own (10)."""
    verify: bool = True
    work_root: Path | None = None
    pool_rtt_ms: float | None = None
    """RTT of the region-to-pool links instead of the topology's (0: no delayer on them)."""
    methods: frozenset[str] | None = None
    """Run only these methods (None: all); deltamesh always runs."""

    def runs(self, method: str) -> bool:
        return method == "deltamesh" or self.methods is None or method in self.methods


@dataclass
class Sample:
    seconds: float
    origin_egress_bytes: int
    origin_wire_bytes: int
    extra: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)
    """[seconds since the clock started, bytes received] as each tenth of the version arrived (where known)."""


def summarize(samples: list[Sample], payload_bytes: int, mbit: float) -> dict:
    """The median of each figure; utilization = payload bits / median seconds / link rate."""
    seconds = statistics.median(s.seconds for s in samples)
    out = {
        "seconds": round(seconds, 3),
        "utilization": round(payload_bytes * 8 / seconds / (mbit * 1e6), 4),
        "origin_egress_bytes": int(statistics.median(s.origin_egress_bytes for s in samples)),
        "origin_wire_bytes": int(statistics.median(s.origin_wire_bytes for s in samples)),
        "payload_bytes": payload_bytes,
        "runs": [round(s.seconds, 3) for s in samples],
    }
    for key in samples[0].extra:
        values = [s.extra[key] for s in samples if s.extra.get(key) is not None]
        if values:
            out[key] = round(statistics.median(values), 3)
    timed = [s for s in samples if s.timeline]
    if timed:  # the median run's arrival of each tenth: the link's utilization over time (benchmarks/report.py)
        out["timeline"] = min(timed, key=lambda s: abs(s.seconds - seconds)).timeline
    return out


def build_topology(wan: Wan, name: str, rtt_scale: float, pool_rtt_ms: float | None = None) -> None:
    topology = load_topology(TOPOLOGIES / f"{name}.toml")
    for spec in topology.link:
        spec.rtt_ms *= rtt_scale
        if pool_rtt_ms is not None and spec.b.startswith("pool"):
            spec.rtt_ms = pool_rtt_ms
    build(wan, topology)


def check_link(wan: Wan, a: Host, b: Host, settings: Settings) -> dict:
    """The link's asked rate and RTT, and (unless disabled) what it measures, before the runs."""
    link = a.link_to(b)
    out = {"mbit": link.mbit_from(a), "rtt_ms": link.rtt_ms}
    if settings.verify:
        check = verify_link(a, b, rtt_count=3)  # long enough to measure past slow start
        out.update(measured_mbit=check.mbit, measured_rtt_ms=check.rtt_ms)
        if not check.ok:
            log.warning("link %s -> %s: %s", a.name, b.name, check.message)
    return out


def steady_mbit(result: dict) -> float | None:
    """Receive rate from the first tenth of a transfer to its end: the link fill once under way."""
    marks = result.get("progress") or []
    if len(marks) < 2 or marks[-1][0] <= marks[0][0]:
        return None
    return (marks[-1][1] - marks[0][1]) * 8 / (marks[-1][0] - marks[0][0]) / 1e6


@contextmanager
def work_dir(settings: Settings):
    """A scenario's scratch folder: removed afterwards; on failure only its logs are kept, and named."""
    root = settings.work_root or Path(tempfile.gettempdir())
    path = Path(tempfile.mkdtemp(prefix="transfer-", dir=root))
    try:
        yield path
    except BaseException:
        for bulky in (*path.glob("store-*"), path / "pools"):
            shutil.rmtree(bulky, ignore_errors=True)
        log.error("scenario failed; its logs are in %s", path)
        raise
    shutil.rmtree(path, ignore_errors=True)


class Scenario:
    """Shared plumbing of one scenario: the WAN, the mesh, version numbering, timed batches."""

    def __init__(self, wan: Wan, settings: Settings, work: Path):
        self.wan = wan
        self.settings = settings
        self.mesh = Mesh(wan, work)
        self.version = 0

    def host(self, name: str) -> Host:
        return self.wan.hosts[name]

    def publish(self, origin: Host, gateway: str, version: int, batch=None, after: Path | None = None) -> None:
        """Add the upload of `version` to `batch` (to start once `after` exists, if given), or (without
        a batch) upload it now and wait."""
        own = batch is None
        batch = batch or self.mesh.batch()
        batch.add(origin, "publish", "publish", "--gateway", gateway, "--payload", str(self.settings.payload),
                  "--version", str(version), "--key", str(self.mesh.private_key), *self.mesh.ca_args(gateway),
                  *(["--after", str(after)] if after else []))
        if own:
            batch.start()
            batch.finish(600)

    def add_pull(self, batch, host: Host, gateway: str, version: int, *, connections: int, after_complete=False,
                 warm_version: int | None = None, armed: Path | None = None, open_ahead: bool = True):
        args = ["--gateway", gateway, "--model", MODEL_ID, "--version", str(version), *self.mesh.ca_args(gateway),
                "--trusted-key", str(self.mesh.public_key), "--connections", str(connections), "--name", host.name,
                *([] if open_ahead else ["--no-open-ahead"])]
        if warm_version is not None:
            args += ["--warm-version", str(warm_version), "--armed", str(armed)]
        batch.add(host, f"pull-{host.name}", "pull", *args, *(["--after-complete"] if after_complete else []))

    def timed(self, batch, origin: Host, egress) -> tuple[float, dict, int, int]:
        """Run a batch; (seconds to the last agent's end, results, origin egress bytes, wire bytes)."""
        before, wire_before = egress(), wire_tx_bytes(origin)
        t0 = batch.start()
        results = batch.finish(1800)
        last = max(r["t_done"] for name, r in results.items() if name != "publish")
        return last - t0, results, egress() - before, wire_tx_bytes(origin) - wire_before

    def next_version(self) -> int:
        self.version += 1
        return self.version


def long_link(settings: Settings) -> dict:
    """Cold: the first version over fresh connections, already published when the clock starts.
    Warm (`*_warm`): the steady state of a mesh that gets a version every step, i.e. a version
    fetched over the connections the previous one came over, after they idled (hosts run with
    `tcp_slow_start_after_idle=0`, see transfer_mesh). deltamesh's warm puller holds the head, so
    it asks for the next version ahead, as a relay does; its clock starts when the publish starts,
    the baseline's when its GET is sent (its file is in place). `deltamesh_tls*`: the same from an
    origin gateway serving HTTPS, interleaved with the plain runs."""
    with work_dir(settings) as work, Wan("txl") as wan:
        build_topology(wan, "long_link", settings.rtt_scale)
        run = Scenario(wan, settings, work)
        origin, far = run.host("origin"), run.host("regionA")
        link = check_link(wan, origin, far, settings)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        methods = ("deltamesh", "deltamesh_late_open", "deltamesh_tls", "single_stream", "deltamesh_warm",
                   "deltamesh_tls_warm", "single_stream_warm")
        # Two full versions kept: a warm run's warm-up version and its timed one.
        keep = ["--keep-fulls", "2"]
        gateways = {GATEWAY_PORT: run.mesh.gateway(origin, "origin", extra=keep)}
        if any(settings.runs(m) for m in methods if "_tls" in m):
            gateways[TLS_PORT] = run.mesh.gateway(origin, "origin-tls", port=TLS_PORT, extra=keep, tls=True)
        files = run.mesh.file_server(origin, settings.payload / "version.bin")
        samples: dict[str, list[Sample]] = {m: [] for m in methods}
        pull = f"pull-{far.name}"
        for _ in range(settings.repeats):
            for method in filter(settings.runs, methods):
                batch = run.mesh.batch()
                if method.startswith("deltamesh"):
                    port = TLS_PORT if "_tls" in method else GATEWAY_PORT
                    gateway = gateways[port]
                    warm = run.next_version() if method.endswith("_warm") else None
                    version = run.next_version()
                    armed = work / f"armed-{version}"
                    if warm is None:  # in place before the clock starts, like the baseline's file
                        run.publish(origin, gateway, version)
                    else:  # published once the puller's requests for it wait at the gateway
                        run.publish(origin, gateway, warm)
                        run.publish(origin, gateway, version, batch, after=armed)
                    run.add_pull(batch, far, gateway, version, connections=settings.connections, warm_version=warm,
                                 armed=armed, open_ahead=method != "deltamesh_late_open")
                    egress, name = (lambda: run.mesh.gateway_bytes_out(origin, port)), pull
                else:
                    batch.add(far, "get", "get", "--url", files, *(["--warm"] if method.endswith("_warm") else []))
                    egress, name = (lambda: run.mesh.file_bytes_out(origin)), "get"
                seconds, results, out, wire = run.timed(batch, origin, egress)
                result = results[name]
                if "publish" in results:  # deltamesh warm: from the start of the timed version's publish
                    result["t_start"] = results["publish"]["t_start"]
                if "t_start" in result:  # warm: only the second fetch counts, and only its bytes
                    seconds, out, wire = result["t_done"] - result["t_start"], out // 2, wire // 2
                t0 = result.get("t_start", result["t_go"])
                tenths = [[round(t - t0, 3), n] for t, n in result.get("progress") or []]
                samples[method].append(Sample(seconds, out, wire, {"steady_mbit": steady_mbit(result)}, tenths))
                log.info("long_link: %s %.2fs; %s", method, seconds, _timeline(result))
        scenario = scenario_json("long_link", link, samples, settings)
        scenario["tls_minus_plain_points"] = tls_gap(scenario["methods"])
        return scenario


def tls_gap(methods: dict) -> dict[str, float]:
    """Utilization over TLS minus plain, in percentage points, cold and warm (where both ran)."""
    gap = {}
    for mode, tail in (("cold", ""), ("warm", "_warm")):
        plain, tls = methods.get(f"deltamesh{tail}"), methods.get(f"deltamesh_tls{tail}")
        if plain and tls:
            gap[mode] = round(100 * (tls["utilization"] - plain["utilization"]), 1)
    return gap


def _timeline(result: dict) -> str:
    """An agent's result as seconds since its start: announce, fetch start, tenths received, done."""
    t0 = result.get("t_start", result["t_go"])
    marks = [("announced", result.get("t_announced")), ("fetch", result.get("t_fetch")),
             ("first byte", result.get("t_first_byte"))]
    parts = [f"{name} {t - t0:.2f}" for name, t in marks if t is not None]
    parts.append("tenths " + " ".join(f"{t - t0:.2f}" for t, _ in result.get("progress") or []))
    return ", ".join(parts) + f", done {result['t_done'] - t0:.2f}"


def relay_chain(settings: Settings) -> dict:
    with work_dir(settings) as work, Wan("txc") as wan:
        build_topology(wan, "relay_chain", settings.rtt_scale)
        run = Scenario(wan, settings, work)
        origin, a, b = run.host("origin"), run.host("regionA"), run.host("regionB")
        hops = [origin.link_to(a), a.link_to(b)]
        # The direct path: as fast as the chain's slowest hop, as long as both hops together.
        wan.link(origin, b, mbit=min(h.mbit_ab for h in hops), rtt_ms=sum(h.rtt_ms for h in hops))
        link = check_link(wan, a, b, settings)
        link["hops"] = [{"mbit": h.mbit_ab, "rtt_ms": h.rtt_ms} for h in hops]
        link["mbit"] = min(h.mbit_ab for h in hops)
        link["rtt_ms"] = sum(h.rtt_ms for h in hops)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        gateway = run.mesh.gateway(origin, "origin")
        relay = run.mesh.gateway(a, "regionA", [gateway], relay_connections=settings.connections)
        # A second origin gateway that regionA does not follow, so a direct pull is the only copy sent.
        lone = run.mesh.gateway(origin, "origin-direct", port=DIRECT_PORT)
        samples: dict[str, list[Sample]] = {"deltamesh": [], "store_and_forward": [], "direct": []}
        for _ in range(settings.repeats):
            for method in filter(settings.runs, samples):
                version = run.next_version()
                batch = run.mesh.batch()
                port = DIRECT_PORT if method == "direct" else GATEWAY_PORT
                run.publish(origin, lone if method == "direct" else gateway, version, batch)
                run.add_pull(batch, b, lone if method == "direct" else relay, version,
                             connections=settings.connections, after_complete=method == "store_and_forward")
                seconds, results, egress, wire = run.timed(
                    batch, origin, lambda: run.mesh.gateway_bytes_out(origin, port))
                pull = results[f"pull-{b.name}"]
                samples[method].append(Sample(seconds, egress, wire, {
                    "publish_seconds": results["publish"]["t_done"] - results["publish"]["t_start"],
                    "start_seconds": pull["t_fetch"] - pull["t_go"]}))
                log.info("relay_chain %s: %.2fs", method, seconds)
        out = scenario_json("relay_chain", link, samples, settings)
        direct = out["methods"].get("direct", {}).get("seconds")
        out["two_hops_over_one"] = {m: round(out["methods"][m]["seconds"] / direct, 3)
                                    for m in ("deltamesh", "store_and_forward") if direct and m in out["methods"]}
        return out


def fan_out(settings: Settings, pools_per_region: int = 4) -> dict:
    with work_dir(settings) as work, Wan("txf") as wan:
        build_topology(wan, "fanout", settings.rtt_scale, settings.pool_rtt_ms)
        run = Scenario(wan, settings, work)
        origin = run.host("origin")
        pools = [run.host(f"pool{r[-1]}{i}") for r in REGIONS for i in range(1, pools_per_region + 1)]
        link = check_link(wan, origin, run.host("regionA"), settings)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        for pool in pools:
            route_through(pool, run.host(f"region{pool.name[4]}"), origin)
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

        for repeat in range(settings.repeats):
            seconds, results, egress, wire = deltamesh_run(pools)
            first = min(r["t_done"] for n, r in results.items() if n != "publish") - results["publish"]["t_start"]
            samples["deltamesh"].append(Sample(seconds, egress, wire, {
                "first_pool_seconds": first,
                "publish_seconds": results["publish"]["t_done"] - results["publish"]["t_start"]}))
            one_pool.append(deltamesh_run(pools[:1])[0])
            log.info("fan_out deltamesh: all %.2fs, one pool alone %.2fs", seconds, one_pool[-1])
            if repeat == 0 and settings.runs("astraflow"):  # 12 serialized whole-version sends: its 12 transfers are samples already
                batch = run.mesh.batch()
                for pool in pools:
                    batch.add(pool, f"get-{pool.name}", "get", "--url", files)
                seconds, results, egress, wire = run.timed(batch, origin, lambda: run.mesh.file_bytes_out(origin))
                first = min(r["t_done"] for r in results.values()) - min(r["t_go"] for r in results.values())
                samples["astraflow"].append(Sample(seconds, egress, wire, {"first_pool_seconds": first}))
                log.info("fan_out astraflow: all %.2fs", seconds)
        out = scenario_json("fan_out", link, samples, settings)
        out["pools"] = len(pools)
        lan = pools[0].link_to(run.host("regionA"))
        out["pool_link"] = {"mbit": lan.mbit_ab, "rtt_ms": lan.rtt_ms}
        out["one_pool_seconds"] = round(statistics.median(one_pool), 3)
        out["one_pool_runs"] = [round(s, 3) for s in one_pool]
        dm = out["methods"]["deltamesh"]
        out["all_over_one_pool"] = round(dm["seconds"] / out["one_pool_seconds"], 3)
        out["egress_over_version"] = {m: round(v["origin_egress_bytes"] / settings.payload_bytes, 3)
                                      for m, v in out["methods"].items()}
        return out


def scenario_json(name: str, link: dict, samples: dict[str, list[Sample]], settings: Settings) -> dict:
    return {
        "name": name,
        "link": link,
        "tcp_buffers": settings.tcp_buffers,
        "congestion": settings.congestion,
        "initcwnd": settings.initcwnd or 10,
        "connections": settings.connections,
        "piece_bytes": round(settings.piece_bytes),
        "methods": {m: summarize(s, settings.payload_bytes, link["mbit"]) for m, s in samples.items() if s},
    }


SCENARIOS = {"long_link": long_link, "relay_chain": relay_chain, "fan_out": fan_out}

