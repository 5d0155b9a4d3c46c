"""What each of a gateway's links carried: piece bytes received from each upstream, served to each peer.

The same bytes are kept two ways. Prometheus counters with bounded labels (no version label, which
would grow with every version): `deltamesh_gateway_upstream_bytes_total{model,kind,upstream}` and
`deltamesh_gateway_served_bytes_total{model,kind,role,peer}`. And per version, for the newest
`VERSIONS_KEPT` versions of each model, in `GET /v1/models/{model}/traffic` (`describe`), which is
where the demo reads what a relayed version cost on each link.

Received bytes are counted as they arrive off the wire (including those of a piece that then fails
its hash, or that a switch of source leaves behind), since that is what the link carried. Served
bytes are put on a peer's name only for peers this gateway knows (registered pools, announced
gateways); any other client counts as `peer=""` of its role, so a client cannot grow the labels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from deltamesh.gateway.server.metrics import GatewayMetrics

VERSIONS_KEPT = 1024
"""Versions per model whose per-version figures are kept (the oldest are forgotten first)."""


@dataclass
class VersionTraffic:
    received: Counter = field(default_factory=Counter)
    """(kind, upstream URL) -> bytes received."""
    served: Counter = field(default_factory=Counter)
    """(kind, role, peer) -> bytes served."""

    def to_json(self, version: int) -> dict:
        return {
            "version": version,
            "received_bytes": sum(self.received.values()),
            "received": [{"kind": k, "upstream": u, "bytes": n} for (k, u), n in sorted(self.received.items())],
            "served_bytes": sum(self.served.values()),
            "served": [{"kind": k, "role": r, "peer": p, "bytes": n} for (k, r, p), n in sorted(self.served.items())],
        }


class Traffic:
    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        self._models: dict[str, dict[int, VersionTraffic]] = {}

    def version(self, model: str, version: int) -> VersionTraffic:
        """The record of one version (made empty if new: a relayed version whose pieces carry no byte
        still shows up, with 0 bytes)."""
        versions = self._models.setdefault(model, {})
        record = versions.get(version)
        if record is None:
            record = versions[version] = VersionTraffic()
            if len(versions) > VERSIONS_KEPT:
                del versions[min(versions)]
        return record

    def received(self, upstream: str, model: str, version: int, kind: str, nbytes: int) -> None:
        self.metrics.upstream_bytes.labels(model, kind, upstream).inc(nbytes)
        self.version(model, version).received[(kind, upstream)] += nbytes

    def served(self, role: str, peer: str, model: str, version: int, kind: str, nbytes: int) -> None:
        """Bytes served to a peer; `peer` must be "" unless this gateway knows the peer (see above)."""
        self.metrics.served_bytes.labels(model, kind, role, peer).inc(nbytes)
        self.version(model, version).served[(kind, role, peer)] += nbytes

    def describe(self, model: str) -> list[dict]:
        versions = self._models.get(model, {})
        return [versions[v].to_json(v) for v in sorted(versions)]
