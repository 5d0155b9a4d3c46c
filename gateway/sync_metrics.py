"""Prometheus metrics of `deltamesh pool sync`, read off its `WeightSync` at each scrape.

A weights-only pool has no engine, broker or workflow to count; what an operator watches is where it
is and whether it keeps up: the version its directory holds, the newest head it has seen, how far
behind that is, the state of its transfer and how many rounds in a row have failed (an outage of its
gateways: `deltamesh.gateway.outage`). Served with the process and build metrics of
`deltamesh.metrics.service_registry` when `metrics_listen` is set (off by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from deltamesh.gateway.registry import TRANSFER_STATES
from deltamesh.metrics import service_registry

if TYPE_CHECKING:
    from deltamesh.gateway.weight_sync import WeightSync


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
        return [version, head, behind, state, failing]


def sync_registry(sync: WeightSync) -> CollectorRegistry:
    """The registry `pool sync` serves at `/metrics`: its gauges, process and build metrics."""
    registry = service_registry("pool-sync")
    registry.register(SyncCollector(sync))
    return registry
