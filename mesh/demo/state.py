"""What the demo knows about a running mesh: per-version facts accumulated over the run, and the latest readings.

The monitor feeds it what the services report; nothing here does I/O. Per version of each model it
keeps the bytes each link carried for it (the trainer's upload to the origin; for every relay link,
the piece bytes the downstream gateway received from its upstream for that version, as its
`/v1/models/{model}/traffic` counts them: a delta, and a full only when a pool or the relay's anchor
needed one), the size a full snapshot would have cost, the trainer's step record, and when each
pool's engine first served it (the step record also carries each pool's trainer-side mismatch,
`pool_mismatch` finds a pool's latest). For the latency budget (mesh/demo/latency.py) it also keeps
when each gateway held the whole version (`stored_at` of its version listing) and when the version
reached each stage in each pool (the `timeline` of the pool's status), each a wall-clock time of the
host that saw it. Per pool it keeps the latest status and the bytes it pulled from its gateway each
time its engine moved to a newer version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class VersionFacts:
    version: int
    payload: dict[str, int] = field(default_factory=dict)
    """kind -> payload bytes at the origin (a version may have a delta and a full)."""
    weights_hash: str = ""
    link_bytes: dict[str, int] = field(default_factory=dict)
    """link name -> bytes that link carried for this version."""
    served_at: dict[str, float] = field(default_factory=dict)
    """pool -> wall time its engine first served this version (or a newer one)."""
    stored_at: dict[str, float] = field(default_factory=dict)
    """region -> wall time its gateway first held every piece of this version (of either kind)."""
    pool_stages: dict[str, dict[str, float]] = field(default_factory=dict)
    """pool -> stage (mesh/pool/timeline.py) -> wall time this version reached it there."""


@dataclass
class ModelRun:
    """One policy's weight stream and its trainer's steps."""

    model_id: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[int, VersionFacts] = field(default_factory=dict)
    full_bytes: int = 0
    """Payload of the newest full snapshot seen at the origin: what a full sync costs."""

    def version(self, v: int) -> VersionFacts:
        facts = self.versions.get(v)
        if facts is None:
            facts = self.versions[v] = VersionFacts(v)
        return facts

    @property
    def trainer_version(self) -> int | None:
        return self.steps[-1]["version"] if self.steps else None

    def full_bytes_at(self, v: int) -> int:
        """The full snapshot's size at version v (the newest full at or before it, else any)."""
        fulls = [(u, f.payload["full"]) for u, f in self.versions.items() if "full" in f.payload]
        before = [size for u, size in sorted(fulls) if u <= v]
        return before[-1] if before else (fulls[0][1] if fulls else self.full_bytes)


@dataclass
class LinkReading:
    """An inter-region link as its downstream gateway sees it."""

    name: str
    bandwidth_mbps: float
    delay_ms: float
    rtt_ms: float | None = None
    bytes_total: int = 0
    throughput_bps: float | None = None


@dataclass
class PoolReading:
    name: str
    region: str
    status: dict[str, Any] = field(default_factory=dict)
    """The pool's own /v1/status."""
    pulled: dict[str, int] = field(default_factory=dict)
    """model_id -> bytes its gateway has served it."""
    rtt_ms: float | None = None
    moves: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)
    """model_id -> (version reached, wall time, bytes pulled so far), one entry per newer version."""

    def engine_version(self, model_id: str) -> int | None:
        entry = self.status.get("models", {}).get(model_id)
        return None if entry is None else entry.get("engine_version")

    def submitted(self) -> int:
        return int(self.status.get("worker", {}).get("submitted", 0))

    def sandbox_counts(self) -> dict[str, int] | None:
        """Outcome -> test executions its sandbox has run; None for a pool without one (no code workflow)."""
        counts = self.status.get("sandbox")
        return None if counts is None else {k: int(n) for k, n in counts.items()}


@dataclass
class MeshState:
    model_ids: tuple[str, ...]
    upstreams: dict[str, str] = field(default_factory=dict)
    """region -> the region its gateway relays from ("" for the origin)."""
    started_at: float = field(default_factory=time.time)
    models: dict[str, ModelRun] = field(default_factory=dict)
    pools: dict[str, PoolReading] = field(default_factory=dict)
    links: dict[str, LinkReading] = field(default_factory=dict)
    broker: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The evaluator's results, oldest version first (`GET /v1/evals`: version, weights_hash, accuracy, ...)."""
    eval_status: dict[str, Any] = field(default_factory=dict)
    """The evaluator's own status (the version it holds, the one it scores, how many wait)."""
    phase: str = "starting"
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for m in self.model_ids:
            self.models.setdefault(m, ModelRun(m))

    # -- updates from the monitor ------------------------------------------------------------------
    def origin_listing(self, model_id: str, listing: list[dict[str, Any]]) -> None:
        run = self.models[model_id]
        for e in listing:
            if not e.get("complete"):
                continue
            facts = run.version(int(e["version"]))
            facts.payload[e["kind"]] = int(e["payload_bytes"])
            facts.weights_hash = e.get("weights_hash") or facts.weights_hash
            if e["kind"] == "full":
                run.full_bytes = int(e["payload_bytes"])

    def gateway_listing(self, model_id: str, region: str, listing: list[dict[str, Any]]) -> None:
        """Any gateway's version listing: when it held each version whole."""
        run = self.models[model_id]
        for e in listing:
            at = e.get("stored_at")
            if at is None:
                continue
            stored = run.version(int(e["version"])).stored_at
            stored[region] = min(float(at), stored.get(region, float(at)))

    def relay_traffic(self, model_id: str, link: str, versions: list[dict[str, Any]]) -> None:
        """A relay gateway's per-version traffic: what it received came over its upstream link."""
        run = self.models[model_id]
        for e in versions:
            facts = run.version(int(e["version"]))
            # The gateway forgets its oldest versions' figures (and all of them on a restart); keep
            # the largest amount ever seen.
            facts.link_bytes[link] = max(facts.link_bytes.get(link, 0), int(e["received_bytes"]))

    def trainer_step(self, model_id: str, record: dict[str, Any], upload_link: str) -> None:
        run = self.models[model_id]
        run.steps.append(record)
        if record.get("published"):
            run.version(int(record["version"])).link_bytes[upload_link] = int(record.get("publish_bytes", 0))

    def pool_status(self, name: str, status: dict[str, Any], now: float) -> None:
        reading = self.pools[name]
        reading.status = status
        for model_id, entry in status.get("models", {}).items():
            if model_id not in self.models:
                continue
            for u, stages in (entry.get("timeline") or {}).items():
                self.models[model_id].version(int(u)).pool_stages.setdefault(name, {}).update(stages)
            v = entry.get("engine_version")
            if v is None:
                continue
            moves = reading.moves.setdefault(model_id, [])
            if moves and moves[-1][0] >= v:
                continue
            at = entry.get("last_swap_at") or now
            moves.append((int(v), float(at), reading.pulled.get(model_id, 0)))
            run = self.models[model_id]
            for u in range(v + 1):
                run.version(u).served_at.setdefault(name, float(at))

    # -- derived figures -----------------------------------------------------------------------------
    def pool_behind(self, name: str, model_id: str) -> int | None:
        """Versions the pool's engine is behind its trainer's newest published version."""
        trainer = self.models[model_id].trainer_version
        served = self.pools[name].engine_version(model_id)
        if trainer is None or served is None:
            return None
        return max(0, trainer - served)

    def served_at_time(self, name: str, model_id: str, when: float) -> int | None:
        """The version pool `name` served at wall time `when` (None if none yet)."""
        served = None
        for v, at, _ in self.pools[name].moves.get(model_id, []):
            if at > when:
                break
            served = v
        return served

    def all_pools_at(self, model_id: str, v: int) -> float | None:
        """Wall time the last pool started serving version v (None until all have)."""
        facts = self.models[model_id].versions.get(v)
        if facts is None or any(p not in facts.served_at for p in self.pools):
            return None
        return max(facts.served_at[p] for p in self.pools)

    def eval_at(self, version: int) -> dict[str, Any] | None:
        """The evaluator's result for `version`, if scored."""
        for r in self.evals:
            if r["version"] == version:
                return r
        return None

    def rewards(self, model_id: str) -> list[float]:
        return [float(r["reward_mean"]) for r in self.models[model_id].steps]

    def pool_mismatch(self, name: str, model_id: str) -> dict[str, Any] | None:
        """The pool's latest trainer-side mismatch reading (tokens, abs, k3, flagged, reason, version), if any."""
        for r in reversed(self.models[model_id].steps):
            mismatch = r.get("mismatch") or {}
            reading = mismatch.get("pools", {}).get(name)
            if reading is not None:
                return {**reading, "version": mismatch.get("version")}
        return None
