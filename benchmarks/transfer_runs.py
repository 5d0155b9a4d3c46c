"""What every network scenario of the transfer benchmark shares: its settings, the timed runs and their
samples, each run's record of what the links did (wan.LinkRecorder: drops, lateness, retransmits and
windows, and whether the emulator's link check held), the medians and per-run figures of a method,
the topology and its link check, and a scratch folder that is removed afterwards.

A method runs `settings.repeats` times where its figure is one the targets are about (TARGETED), else
`settings.side_repeats` times; every run is kept, its link record beside it, whether its link check
held or not (`links_ok`), so a run on a bad link is seen as such instead of averaged in unnoticed.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from transfer_mesh import Mesh, wire_tx_bytes
from transfer_payload import MODEL_ID
from wan import Host, Link, LinkRecorder, Wan, build, load_topology, verify_link

log = logging.getLogger(__name__)

TOPOLOGIES = Path(__file__).resolve().parent / "wan" / "topologies"
TARGETED = frozenset({"deltamesh", "deltamesh_warm", "direct"})
"""Methods whose figures the targets are about (BENCHMARKS.md): they run `repeats` times."""


@dataclass
class Settings:
    payload: Path
    payload_bytes: int
    piece_bytes: float
    """Mean piece size of the version (what one fetch request carries)."""
    repeats: int = 10
    """Runs of each method a target is about (TARGETED)."""
    side_repeats: int = 3
    """Runs of every other method (variants, baselines)."""
    rtt_scale: float = 1.0
    """Multiplies every link's RTT (the --quick runs use shorter links)."""
    connections: int = 16
    """Parallel piece fetches over long links (relay gateways and pullers); pools on a LAN use 4."""
    tcp_buffers: str = "linux"
    congestion: str = "cubic"
    """Every host's default congestion control and every gateway's `congestion` setting."""
    initcwnd: int = 0
    """Initial congestion and receive windows (segments) on every host's routes; 0: Linux's own (10)."""
    verify: bool = True
    work_root: Path | None = None
    pool_rtt_ms: float | None = None
    """RTT of the region-to-pool links instead of the topology's (0: no delayer on them)."""
    methods: frozenset[str] | None = None
    """Run only these methods (None: all); deltamesh always runs."""
    baseline_window_s: float = 12.0
    """A single-stream download is measured this long, then extrapolated (transfer_baseline.py)."""
    loss_rates: tuple[float, ...] = (0.001, 0.01)
    """Random loss of the lossy scenarios' long links, each way."""
    loss_connections: int = 64
    """Parallel piece fetches over a lossy long link."""
    record_links: bool = True

    def runs(self, method: str) -> bool:
        return method == "deltamesh" or self.methods is None or method in self.methods

    def repeats_of(self, method: str) -> int:
        return self.repeats if method in TARGETED else min(self.repeats, self.side_repeats)


@dataclass
class Sample:
    seconds: float
    origin_egress_bytes: int
    origin_wire_bytes: int
    extra: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)
    """[seconds since the clock started, bytes received] as each tenth of the version arrived (where known)."""
    link: dict | None = None
    """What the links did during the run (wan.RunRecord.as_dict()), where recorded."""
    notes: dict = field(default_factory=dict)
    """How the figure was had, where it was not simply measured (an extrapolated baseline)."""


def summarize(samples: list[Sample], payload_bytes: int, mbit: float) -> dict:
    """The median of each figure; utilization = payload bits / median seconds / link rate; and every
    run's own seconds, utilization, link record and link check."""
    seconds = statistics.median(s.seconds for s in samples)
    out = {
        "seconds": round(seconds, 3),
        "utilization": round(payload_bytes * 8 / seconds / (mbit * 1e6), 4),
        "origin_egress_bytes": int(statistics.median(s.origin_egress_bytes for s in samples)),
        "origin_wire_bytes": int(statistics.median(s.origin_wire_bytes for s in samples)),
        "payload_bytes": payload_bytes,
        "runs": [round(s.seconds, 3) for s in samples],
        "run_utilization": [round(payload_bytes * 8 / s.seconds / (mbit * 1e6), 4) for s in samples],
    }
    for key in samples[0].extra:
        values = [s.extra[key] for s in samples if s.extra.get(key) is not None]
        if values:
            out[key] = round(statistics.median(values), 3)
    timed = [s for s in samples if s.timeline]
    if timed:  # the median run's arrival of each tenth: the link's utilization over time (benchmarks/report.py)
        out["timeline"] = min(timed, key=lambda s: abs(s.seconds - seconds)).timeline
    if any(s.link is not None for s in samples):
        out["link_records"] = [s.link for s in samples]
        out["links_ok"] = [None if s.link is None else s.link["ok"] for s in samples]
    if any(s.notes for s in samples):
        out["run_notes"] = [s.notes for s in samples]
        out["extrapolated_runs"] = sum(1 for s in samples if s.notes.get("extrapolated"))
    return out


def build_topology(wan: Wan, name: str, rtt_scale: float, pool_rtt_ms: float | None = None,
                   loss: float | None = None) -> None:
    """Build `name`.toml; with `loss`, its long links (not the pools') lose packets at that rate each way
    (and can change it later: `Link.set_loss`)."""
    topology = load_topology(TOPOLOGIES / f"{name}.toml")
    for spec in topology.link:
        spec.rtt_ms *= rtt_scale
        pool = spec.b.startswith("pool")
        if pool_rtt_ms is not None and pool:
            spec.rtt_ms = pool_rtt_ms
        if loss is not None and not pool:
            spec.loss = loss
    build(wan, topology)


def check_link(wan: Wan, a: Host, b: Host, settings: Settings) -> dict:
    """The link's asked rate and RTT, and (unless disabled) what it measures, before the runs."""
    link = a.link_to(b)
    out = {"mbit": link.mbit_from(a), "rtt_ms": link.rtt_ms}
    if link.lossy:
        out["loss"] = link.loss_from(a).as_dict()
    if settings.verify:
        # A link that loses packets carries less than its rate (that is the point): its RTT is checked.
        check = verify_link(a, b, rtt_count=3, measure_rate=not link.loss_from(a).active)
        out.update(measured_mbit=check.mbit, measured_rtt_ms=check.rtt_ms, check_ok=check.ok)
        if not check.ok:
            log.warning("link %s -> %s: %s", a.name, b.name, check.message)
            out["check_message"] = check.message
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
    """Shared plumbing of one scenario: the WAN, the mesh, version numbering, timed batches, and the
    recording of the links named by `record` (use it with `with`, which stops the recording)."""

    def __init__(self, wan: Wan, settings: Settings, work: Path, record: list[Link] = ()):
        self.wan = wan
        self.settings = settings
        self.mesh = Mesh(wan, work, settings.congestion)
        self.version = 0
        self.t_released = 0.0
        """When the last timed batch was released."""
        self.recorder = LinkRecorder(wan, list(record)) if record and settings.record_links else None

    def __enter__(self) -> Scenario:
        if self.recorder is not None:
            self.recorder.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.recorder is not None:
            self.recorder.stop()

    def record(self, t0: float, t1: float) -> dict | None:
        """What the recorded links did from `t0` to `t1` (None when not recording)."""
        if self.recorder is None:
            return None
        record = self.recorder.record(t0, t1)
        if not record.ok:
            log.warning("link check failed for the run of %.1f s: %s", t1 - t0, "; ".join(record.problems))
        return record.as_dict()

    def host(self, name: str) -> Host:
        return self.wan.hosts[name]

    def publish(self, origin: Host, gateway: str, version: int, batch=None, after: Path | None = None,
                count: int = 1) -> None:
        """Add the upload of `version` (and the `count` - 1 after it) to `batch` (each once `after`.k
        exists, if given), or (without a batch) upload it now and wait."""
        own = batch is None
        batch = batch or self.mesh.batch()
        batch.add(origin, "publish", "publish", "--gateway", gateway, "--payload", str(self.settings.payload),
                  "--version", str(version), "--key", str(self.mesh.private_key), *self.mesh.ca_args(gateway),
                  "--count", str(count), *(["--after", str(after)] if after else []))
        if own:
            batch.start()
            batch.finish(600)

    def add_pull(self, batch, host: Host, gateway: str, version: int, *, connections: int, after_complete=False,
                 warm_version: int | None = None, armed: Path | None = None, open_ahead: bool = True,
                 repeat: int = 1):
        args = ["--gateway", gateway, "--model", MODEL_ID, "--version", str(version),
                *self.mesh.ca_args(gateway), "--trusted-key", str(self.mesh.public_key),
                "--connections", str(connections), "--name", host.name, *([] if open_ahead else ["--no-open-ahead"])]
        if warm_version is not None:
            args += ["--warm-version", str(warm_version), "--armed", str(armed), "--repeat", str(repeat)]
        batch.add(host, f"pull-{host.name}", "pull", *args, *(["--after-complete"] if after_complete else []))

    def timed(self, batch, origin: Host, egress) -> tuple[float, dict, int, int]:
        """Run a batch; (seconds to the last agent's end, results, origin egress bytes, wire bytes)."""
        before, wire_before = egress(), wire_tx_bytes(origin)
        t0 = batch.start()
        results = batch.finish(1800, self.recorder.sample if self.recorder is not None else None)
        last = max(r["t_done"] for name, r in results.items() if name != "publish")
        self.t_released = t0
        return last - t0, results, egress() - before, wire_tx_bytes(origin) - wire_before

    def next_version(self) -> int:
        self.version += 1
        return self.version


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
