"""Prometheus metrics of `deltamesh pool sync`, read off its `WeightSync` at each scrape.

A weights-only pool has no engine, broker or workflow to count; what an operator watches is where it
is and whether it keeps up: the version its directory holds, the newest head its gateways announce
(and each one's), how far behind that is, the state of its transfer, how many rounds in a row have
failed (an outage of its gateways: `deltamesh.mesh.pool.retry_log`), and what its freshness checks found:
the refusals by reason and which gateways are stale, under the names a rollout pool uses for them
(`deltamesh.mesh.pool.metrics`; docs/SECURITY.md). Served with the process and build metrics of
`deltamesh.metrics.service_registry` when `metrics_listen` is set (off by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from deltamesh.gateway.server.registry import TRANSFER_STATES
from deltamesh.metrics import service_registry

if TYPE_CHECKING:
    from deltamesh.mesh.pool.weight_sync import WeightSync


class SyncCollector:
    """The gauges of one `WeightSync`, built afresh at each scrape."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync

    def collect(self) -> Iterable[Metric]:
        s, model = self.sync, self.sync.model or ""
        version = GaugeMetricFamily("deltamesh_pool_sync_version", "Version the pool's directory holds", labels=["model"])
        head = GaugeMetricFamily("deltamesh_pool_sync_head", "Newest version a gateway announced", labels=["model"])
        behind = GaugeMetricFamily("deltamesh_pool_sync_versions_behind",
                                   "Versions the directory is behind the newest head seen", labels=["model"])
        if s.version is not None:
            version.add_metric([model], s.version)
        if s.head is not None:
            head.add_metric([model], s.head)
            behind.add_metric([model], max(0, s.head - (s.version if s.version is not None else -1)))
        state = GaugeMetricFamily("deltamesh_pool_sync_state", "1 for the transfer's current state", labels=["state"])
        for name in TRANSFER_STATES:
            state.add_metric([name], 1 if s.state == name else 0)
        failing = GaugeMetricFamily("deltamesh_pool_sync_failed_rounds",
                                    "Rounds in a row that failed (0 while syncing works)")
        failing.add_metric([], s.outage.failures)
        return [version, head, behind, state, failing, *self.freshness(model)]

    def freshness(self, model: str) -> list[Metric]:
        """What the pool's own checks found: refusals by reason, and each gateway's head and staleness."""
        refusals = CounterMetricFamily(
            "deltamesh_pool_gateway_refusals", "Offers refused from gateways, by reason: rollback (an older "
            "version), equivocation (another weights hash for a verified version), statement (a head statement "
            "that does not verify), stale (a gateway newly found behind)", labels=["model", "reason"])
        for reason, count in self.sync.book.refusals.items():
            refusals.add_metric([model, reason], count)
        stale = GaugeMetricFamily("deltamesh_pool_gateway_stale", "1 while the pool holds a gateway stale (behind "
                                  "a version known elsewhere, or without a fresh head statement), else 0",
                                  labels=["model", "gateway"])
        heads = GaugeMetricFamily("deltamesh_pool_sync_gateway_head", "The head each gateway announced at its last "
                                  "answer (the pool's head is the newest of those in good standing)",
                                  labels=["model", "gateway"])
        for url, standing in self.sync.book.describe().items():
            stale.add_metric([model, url], 1 if standing["state"] == "stale" else 0)
            if standing["head"] is not None:
                heads.add_metric([model, url], standing["head"])
        return [refusals, stale, heads]


def sync_registry(sync: WeightSync) -> CollectorRegistry:
    """The registry `pool sync` serves at `/metrics`: its gauges, process and build metrics."""
    registry = service_registry("pool-sync")
    registry.register(SyncCollector(sync))
    return registry
