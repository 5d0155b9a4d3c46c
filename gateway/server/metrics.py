"""Prometheus metrics of one gateway, in a registry of its own (several gateways may share a process).

Counters and histograms are updated where things happen (publish, relay, serve; the per-link byte
counters through `deltamesh.gateway.server.traffic`; propagation when a version's last piece is in); gauges
that describe state (versions held, head, pools by state, free disk and whether it is full) are
refreshed from the store each time `/metrics` is scraped. Series per pool and per link are built
afresh at each scrape (`_StateCollector`) from the registry and the link monitor, so a pool or link
that is forgotten leaves no series behind. Names follow Prometheus' conventions: counters end in
`_total`, no `_created` series, and the registry carries process and build metrics
(`deltamesh.metrics`).
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from deltamesh.gateway.fetch.links import LinkMonitor
from deltamesh.gateway.server.registry import PoolRegistry
from deltamesh.gateway.server.store import VersionStore
from deltamesh.gateway.server.stored_version import StoredVersion
from deltamesh.metrics import service_registry

_PIECE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = service_registry("gateway")
        self.versions = Gauge("deltamesh_gateway_versions", "Versions held in the store",
                              ["model", "kind", "complete"], registry=r)
        self.head = Gauge("deltamesh_gateway_head_version", "Newest version announced", ["model"], registry=r)
        self.bytes_in = Counter("deltamesh_gateway_bytes_in_total", "Piece bytes received",
                                ["kind", "source"], registry=r)
        self.bytes_out = Counter("deltamesh_gateway_bytes_out_total", "Piece bytes served",
                                 ["kind", "peer_role"], registry=r)
        self.upstream_bytes = Counter("deltamesh_gateway_upstream_bytes_total",
                                      "Piece bytes received from each upstream, as they arrive (see traffic.py)",
                                      ["model", "kind", "upstream"], registry=r)
        self.served_bytes = Counter("deltamesh_gateway_served_bytes_total",
                                    "Piece bytes served to each known peer (others as peer=\"\")",
                                    ["model", "kind", "role", "peer"], registry=r)
        self.relay_fetches = Counter("deltamesh_gateway_relay_fetches_total",
                                     "Versions a relay set out to fetch, by why: follow (the newest deltas), "
                                     "anchor (a full kept for first pulls), demand (asked for by a downstream)",
                                     ["kind", "why"], registry=r)
        self.piece_seconds = Histogram("deltamesh_gateway_piece_seconds",
                                       "Latency of one piece: served (including any wait) or fetched",
                                       ["op"], buckets=_PIECE_BUCKETS, registry=r)
        self.transfer_seconds = Histogram("deltamesh_gateway_transfer_seconds",
                                          "Time from a version's manifest to its last piece",
                                          ["kind", "source"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.corrupt_pieces = Counter("deltamesh_gateway_corrupt_pieces_total", "Pieces that failed their hash",
                                      ["where"], registry=r)
        self.disk_full = Gauge("deltamesh_gateway_disk_full",
                               "1 while the store refuses versions for lack of disk space (507), else 0", registry=r)
        self.disk_free = Gauge("deltamesh_gateway_disk_free_bytes", "Free bytes of the store's filesystem",
                               registry=r)
        self.disk_reserved = Gauge("deltamesh_gateway_disk_reserved_bytes",
                                   "Bytes promised to the pieces of versions still arriving", registry=r)
        self.relay_retrying = Gauge("deltamesh_gateway_relay_retrying",
                                    "Versions whose mirror failed and waits to be tried again", registry=r)
        self.rejected = Counter("deltamesh_gateway_rejected_requests_total", "Requests refused", ["reason"], registry=r)
        self.dropped = Counter("deltamesh_gateway_connections_dropped_total",
                               "Connections closed unanswered: header_timeout (request headers not in within "
                               "header_timeout_s), address_cap (over max_connections_per_address)", ["reason"],
                               registry=r)
        self.pools = Gauge("deltamesh_gateway_pools", "Registered pools by state", ["state"], registry=r)
        self.propagation_seconds = Histogram(
            "deltamesh_gateway_propagation_seconds",
            "Time from the trainer's signing of a version (its manifest's created_ms) to its last piece here",
            ["kind"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.last_propagation = Gauge("deltamesh_gateway_last_propagation_seconds",
                                      "Propagation time of the newest version completed here", ["model"], registry=r)
        self._newest: dict[str, int] = {}
        self.state = _StateCollector()
        r.register(self.state)

    def version_complete(self, entry: StoredVersion, now: float) -> None:
        """Record how long `entry` took to get here from the trainer (0 if the clocks disagree)."""
        m = entry.manifest
        seconds = max(0.0, now - m.created_ms / 1000)
        self.propagation_seconds.labels(entry.kind).observe(seconds)
        # An older version completing late (an anchor full, a demand) does not replace the newest's figure.
        if m.version >= self._newest.get(m.model_id, -1):
            self._newest[m.model_id] = m.version
            self.last_propagation.labels(m.model_id).set(seconds)

    def render(self, store: VersionStore, pools: PoolRegistry, links: LinkMonitor) -> bytes:
        self.versions.clear()
        for model in store.models():
            head = store.head(model)
            if head is not None:
                self.head.labels(model).set(head)
            counts: dict[tuple[str, str], int] = {}
            for e in store.entries(model):
                key = (e.kind, "yes" if e.complete else "no")
                counts[key] = counts.get(key, 0) + 1
            for (kind, complete), n in counts.items():
                self.versions.labels(model, kind, complete).set(n)
        disk = store.disk_state()
        self.disk_full.set(1 if disk["full"] else 0)
        self.disk_free.set(disk["free_bytes"] or 0)
        self.disk_reserved.set(disk["reserved_bytes"])
        described = pools.describe(store.heads())
        up = down = stale = 0
        for p in described:
            if not p["up"]:
                down += 1
            elif p["versions_behind"]:
                stale += 1
            else:
                up += 1
        self.pools.labels("current").set(up)
        self.pools.labels("stale").set(stale)
        self.pools.labels("down").set(down)
        self.state.pools, self.state.links = described, links.describe()
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class _StateCollector:
    """Per-pool and per-link families, from what `render` last read off the registry and link monitor."""

    def __init__(self) -> None:
        self.pools: list[dict] = []
        self.links: list[dict] = []

    def collect(self) -> Iterable[Metric]:
        pool_labels = ["pool", "model"]
        version = _gauge("deltamesh_gateway_pool_version", "Version a pool last reported holding", pool_labels)
        behind = _gauge("deltamesh_gateway_pool_versions_behind",
                        "Versions a pool is behind this gateway's head of its model (its lag)", pool_labels)
        seen = _gauge("deltamesh_gateway_pool_last_seen_seconds", "Seconds since a pool's last heartbeat",
                      pool_labels)
        pool_up = _gauge("deltamesh_gateway_pool_up", "1 while a pool heartbeats within the timeout, else 0",
                         pool_labels)
        for p in self.pools:
            values = [p["name"], p["model"]]
            if p["version"] is not None:
                version.add_metric(values, p["version"])
            if p["versions_behind"] is not None:
                behind.add_metric(values, p["versions_behind"])
            seen.add_metric(values, p["last_seen_s"])
            pool_up.add_metric(values, 1 if p["up"] else 0)
        link_labels = ["peer", "role"]
        rtt = _gauge("deltamesh_gateway_link_rtt_seconds", "RTT of a link over its recent probes, by quantile",
                     [*link_labels, "quantile"])
        throughput = _gauge("deltamesh_gateway_link_throughput_bytes_per_second",
                            "Recent transfer throughput of a link", link_labels)
        link_up = _gauge("deltamesh_gateway_link_up", "1 while a link's newest probe answered, else 0", link_labels)
        errors = CounterMetricFamily("deltamesh_gateway_link_errors",
                                     "Errors seen on a link (failed probes, fetches and follows)", labels=link_labels)
        for link in self.links:
            values = [link["peer"], link["role"]]
            for q, key in (("0.5", "p50"), ("0.95", "p95")):
                if link["rtt_ms"][key] is not None:
                    rtt.add_metric([*values, q], link["rtt_ms"][key] / 1000)
            throughput.add_metric(values, link["throughput_bps"] or 0)
            if link["probe_ok"] is not None:
                link_up.add_metric(values, 1 if link["probe_ok"] else 0)
            errors.add_metric(values, link["errors"])
        return [version, behind, seen, pool_up, rtt, throughput, link_up, errors]
