"""The long-link scenarios of the transfer benchmark: one 400 Mbit/s, 300 ms link, without loss
(`long_link`) and losing packets at random (`long_link_loss_*`, one per rate of `--loss`).

* `deltamesh` (cold): a pool-style puller in regionA fetches a version already on the origin gateway,
  over fresh parallel connections opened while its head poll is on its way (`deltamesh_late_open`:
  opened only with the piece requests). `deltamesh_tls`: the same from a second origin gateway serving
  HTTPS (a certificate of a CA made for the run, transfer_tls.py).
* `deltamesh_warm`: the steady state of a mesh that gets a version every step. One puller fetches a
  warm-up version, then `repeats` times idles and asks for the next version ahead, which is published
  once its requests wait at the gateway (as a relay holding the head does); each run's clock starts
  with that publish. Hosts run with `tcp_slow_start_after_idle=0` (transfer_mesh).
* `single_stream` (`_warm`): one HTTP GET of the whole version from a plain file server at the origin
  (the warm one over a connection warmed first), measured for `baseline_window_s` and extrapolated
  (transfer_baseline.py), as the table and JSON say.

Each run carries the record of what the link did meanwhile (transfer_runs.Scenario.record).
"""

from __future__ import annotations

import logging

from transfer_baseline import baseline_seconds
from transfer_mesh import GATEWAY_PORT, set_tcp_buffers
from transfer_runs import Sample, Scenario, Settings, build_topology, check_link, scenario_json, steady_mbit, work_dir
from wan import Wan

log = logging.getLogger(__name__)

TLS_PORT = 8443
COLD = ("deltamesh", "deltamesh_late_open", "deltamesh_tls", "single_stream")
WARM = ("deltamesh_warm", "deltamesh_tls_warm", "single_stream_warm")
LOSSY_FIRST = {"deltamesh_warm": None, "deltamesh": 3}
"""The methods run at the first loss rate (None: `repeats` runs, else at most that many)."""
LOSSY_OTHERS = {"deltamesh_warm": 3, "single_stream": 3}
"""The methods run at every other loss rate, beside the single-stream baseline."""


def long_link(settings: Settings) -> dict:
    """Cold and warm deltamesh (plain and TLS) against one stream, over the lossless long link."""
    with work_dir(settings) as work, Wan("txl") as wan:
        build_topology(wan, "long_link", settings.rtt_scale)
        origin, far = wan.hosts["origin"], wan.hosts["regionA"]
        link = check_link(wan, origin, far, settings)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        with Scenario(wan, settings, work, record=[origin.link_to(far)]) as run:
            plan = {m: settings.repeats_of(m) for m in COLD + WARM if settings.runs(m)}
            samples = LinkRuns(run, settings, tls=any("_tls" in m for m in plan)).measure(plan)
        scenario = scenario_json("long_link", link, samples, settings)
        scenario["tls_minus_plain_points"] = tls_gap(scenario["methods"])
        return scenario


def lossy_link(settings: Settings) -> list[dict]:
    """deltamesh against one stream over the long link losing packets, one scenario per loss rate, all
    on one emulated network whose loss changes between them."""
    out = []
    with work_dir(settings) as work, Wan("txp") as wan:
        build_topology(wan, "long_link", settings.rtt_scale, loss=settings.loss_rates[0])
        origin, far = wan.hosts["origin"], wan.hosts["regionA"]
        long = origin.link_to(far)
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        with Scenario(wan, settings, work, record=[long]) as run:
            runs = LinkRuns(run, settings, tls=False, connections=settings.loss_connections)
            for k, rate in enumerate(settings.loss_rates):
                for sender in (origin, far):
                    long.set_loss(sender, rate)
                link = check_link(wan, origin, far, settings)
                wanted = LOSSY_FIRST if k == 0 else LOSSY_OTHERS
                plan = {m: settings.repeats if n is None else min(n, settings.repeats) for m, n in wanted.items()
                        if settings.runs(m)}
                samples = runs.measure(plan)
                scenario = scenario_json(f"long_link_loss_{rate * 100:g}pct", link, samples, settings)
                scenario["connections"] = settings.loss_connections
                out.append(scenario)
    return out


class LinkRuns:
    """The runs of the long-link methods over one origin -> regionA link (origin gateways and a file server
    started once)."""

    def __init__(self, run: Scenario, settings: Settings, *, tls: bool, connections: int | None = None):
        self.run, self.settings = run, settings
        self.connections = connections or settings.connections
        self.origin, self.far = run.host("origin"), run.host("regionA")
        # Versions kept: a warm session's timed version and the one before (asked for ahead).
        keep = ["--keep-fulls", "2"]
        self.gateways = {GATEWAY_PORT: run.mesh.gateway(self.origin, "origin", extra=keep)}
        if tls:
            self.gateways[TLS_PORT] = run.mesh.gateway(self.origin, "origin-tls", port=TLS_PORT, extra=keep, tls=True)
        self.files = run.mesh.file_server(self.origin, settings.payload / "version.bin")

    def measure(self, plan: dict[str, int]) -> dict[str, list[Sample]]:
        """Run each method of `plan` that many times: cold methods in rounds, alternating, then each warm
        method as one session of that many timed versions."""
        samples: dict[str, list[Sample]] = {m: [] for m in plan}
        for k in range(max((n for m, n in plan.items() if m in COLD), default=0)):
            for method in (m for m in COLD if plan.get(m, 0) > k):
                samples[method].append(self.cold(method))
        for method in (m for m in WARM if plan.get(m)):
            samples[method] = self.warm(method, plan[method])
        return samples

    def _port(self, method: str) -> int:
        return TLS_PORT if "_tls" in method else GATEWAY_PORT

    def cold(self, method: str) -> Sample:
        run = self.run
        batch = run.mesh.batch()
        if method == "single_stream":
            batch.add(self.far, "get", "get", "--url", self.files, "--cap-s", str(self.settings.baseline_window_s))
            seconds, results, out, wire = run.timed(batch, self.origin, lambda: run.mesh.file_bytes_out(self.origin))
            return self._baseline(results["get"], results["get"]["t_go"], wire)
        port = self._port(method)
        version = run.next_version()
        run.publish(self.origin, self.gateways[port], version)  # in place before the clock starts, like the file
        run.add_pull(batch, self.far, self.gateways[port], version, connections=self.connections,
                     open_ahead=method != "deltamesh_late_open")
        seconds, results, out, wire = run.timed(batch, self.origin, lambda: run.mesh.gateway_bytes_out(self.origin, port))
        result = results[f"pull-{self.far.name}"]
        log.info("%s: %.2fs", method, seconds)
        return Sample(seconds, out, wire, {"steady_mbit": steady_mbit(result)}, _tenths(result, result["t_go"]),
                      link=run.record(result["t_go"], result["t_done"]))

    def warm(self, method: str, repeats: int) -> list[Sample]:
        if method == "single_stream_warm":
            return [self._warm_baseline() for _ in range(repeats)]
        run, port = self.run, self._port(method)
        gateway = self.gateways[port]
        warm = run.next_version()
        first = run.next_version()
        for _ in range(repeats - 1):
            run.next_version()
        run.publish(self.origin, gateway, warm)
        armed = run.mesh.work / f"armed-{first}"
        batch = run.mesh.batch()
        run.publish(self.origin, gateway, first, batch, after=armed, count=repeats)
        run.add_pull(batch, self.far, gateway, first, connections=self.connections, warm_version=warm, armed=armed,
                     repeat=repeats)
        _, results, out, wire = run.timed(batch, self.origin, lambda: run.mesh.gateway_bytes_out(self.origin, port))
        published, pulled = results["publish"]["versions"], results[f"pull-{self.far.name}"]["runs"]
        samples = []
        for pub, result in zip(published, pulled, strict=True):
            # The clock runs from the start of the timed version's publish; the session's bytes are
            # shared evenly by its versions, the warm-up one included.
            seconds = result["t_done"] - pub["t_start"]
            samples.append(Sample(seconds, out // (repeats + 1), wire // (repeats + 1),
                                  {"steady_mbit": steady_mbit(result)}, _tenths(result, pub["t_start"]),
                                  link=run.record(pub["t_start"], result["t_done"])))
            log.info("%s: %.2fs", method, seconds)
        return samples

    def _warm_baseline(self) -> Sample:
        run = self.run
        batch = run.mesh.batch()
        batch.add(self.far, "get", "get", "--url", self.files, "--warm", "--cap-s", str(self.settings.baseline_window_s))
        _, results, out, wire = run.timed(batch, self.origin, lambda: run.mesh.file_bytes_out(self.origin))
        result = results["get"]
        return self._baseline(result, result["t_start"], wire // 2)

    def _baseline(self, result: dict, t_start: float, wire: int) -> Sample:
        seconds, notes = baseline_seconds(result, t_start)
        log.info("single stream: %.2fs%s", seconds, " (extrapolated)" if notes["extrapolated"] else "")
        return Sample(seconds, self.settings.payload_bytes, wire, {"steady_mbit": steady_mbit(result)},
                      _tenths(result, t_start), link=self.run.record(t_start, result["t_done"]), notes=notes)


def _tenths(result: dict, t0: float) -> list:
    return [[round(t - t0, 3), n] for t, n in result.get("progress") or []]


def tls_gap(methods: dict) -> dict[str, float]:
    """Utilization over TLS minus plain, in percentage points, cold and warm (where both ran)."""
    gap = {}
    for mode, tail in (("cold", ""), ("warm", "_warm")):
        plain, tls = methods.get(f"deltamesh{tail}"), methods.get(f"deltamesh_tls{tail}")
        if plain and tls:
            gap[mode] = round(100 * (tls["utilization"] - plain["utilization"]), 1)
    return gap
