"""Prometheus metrics of one gateway, in a registry of its own (several gateways may share a process).

Counters and histograms are updated where things happen (publish, relay, serve; the per-link byte
counters through `deltamesh.gateway.traffic`); gauges that describe state (versions held, head,
pools up and stale, link RTT and throughput, free disk and whether it is full) are refreshed from the
store, registry and link monitor each time `/metrics` is scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltamesh.gateway.links import LinkMonitor
from deltamesh.gateway.registry import PoolRegistry
from deltamesh.gateway.store import VersionStore

_PIECE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.versions = Gauge("deltamesh_gateway_versions", "Versions held in the store",
                              ["model", "kind", "complete"], registry=r)
        self.head = Gauge("deltamesh_gateway_head_version", "Newest version announced", ["model"], registry=r)
        self.bytes_in = Counter("deltamesh_gateway_bytes_in", "Piece bytes received",
                                ["kind", "source"], registry=r)
        self.bytes_out = Counter("deltamesh_gateway_bytes_out", "Piece bytes served",
                                 ["kind", "peer_role"], registry=r)
        self.upstream_bytes = Counter("deltamesh_gateway_upstream_bytes",
                                      "Piece bytes received from each upstream, as they arrive (see traffic.py)",
                                      ["model", "kind", "upstream"], registry=r)
        self.served_bytes = Counter("deltamesh_gateway_served_bytes",
                                    "Piece bytes served to each known peer (others as peer=\"\")",
                                    ["model", "kind", "role", "peer"], registry=r)
        self.relay_fetches = Counter("deltamesh_gateway_relay_fetches",
                                     "Versions a relay set out to fetch, by why: follow (the newest deltas), "
                                     "anchor (a full kept for first pulls), demand (asked for by a downstream)",
                                     ["kind", "why"], registry=r)
        self.piece_seconds = Histogram("deltamesh_gateway_piece_seconds",
                                       "Latency of one piece: served (including any wait) or fetched",
                                       ["op"], buckets=_PIECE_BUCKETS, registry=r)
        self.transfer_seconds = Histogram("deltamesh_gateway_transfer_seconds",
                                          "Time from a version's manifest to its last piece",
                                          ["kind", "source"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.corrupt_pieces = Counter("deltamesh_gateway_corrupt_pieces", "Pieces that failed their hash",
                                      ["where"], registry=r)
        self.disk_full = Gauge("deltamesh_gateway_disk_full",
                               "1 while the store refuses versions for lack of disk space (507), else 0", registry=r)
        self.disk_free = Gauge("deltamesh_gateway_disk_free_bytes", "Free bytes of the store's filesystem",
                               registry=r)
        self.disk_reserved = Gauge("deltamesh_gateway_disk_reserved_bytes",
                                   "Bytes promised to the pieces of versions still arriving", registry=r)
        self.relay_retrying = Gauge("deltamesh_gateway_relay_retrying",
                                    "Versions whose mirror failed and waits to be tried again", registry=r)
        self.rejected = Counter("deltamesh_gateway_rejected_requests", "Requests refused", ["reason"], registry=r)
        self.pools = Gauge("deltamesh_gateway_pools", "Registered pools by state", ["state"], registry=r)
        self.link_rtt = Gauge("deltamesh_gateway_link_rtt_seconds", "Median RTT of a link",
                              ["peer", "role"], registry=r)
        self.link_throughput = Gauge("deltamesh_gateway_link_throughput_bytes_per_second",
                                     "Recent transfer throughput of a link", ["peer", "role"], registry=r)
        self.link_errors = Gauge("deltamesh_gateway_link_errors", "Errors seen on a link", ["peer", "role"],
                                 registry=r)

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
        heads = store.heads()
        up = down = stale = 0
        for p in pools.describe(heads):
            if not p["up"]:
                down += 1
            elif p["versions_behind"]:
                stale += 1
            else:
                up += 1
        self.pools.labels("current").set(up)
        self.pools.labels("stale").set(stale)
        self.pools.labels("down").set(down)
        for link in links.describe():
            labels = (link["peer"], link["role"])
            if link["rtt_ms"]["p50"] is not None:
                self.link_rtt.labels(*labels).set(link["rtt_ms"]["p50"] / 1000)
            self.link_throughput.labels(*labels).set(link["throughput_bps"] or 0)
            self.link_errors.labels(*labels).set(link["errors"])
        return generate_latest(self.registry)
