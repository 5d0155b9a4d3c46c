"""Prometheus metrics of a rollout pool, in the one registry its status server exposes at `/metrics`.

The pool's own counters (leases, episodes, submitted trajectories, weight transfers, refusals and
stale gateways, checks of what the engine serves and drift, whether it may lease, how long each
version spent in each stage of its way in) live in a per-pool `CollectorRegistry`. Each engine keeps its
metrics in a registry of its own (two engines of one process would otherwise register the same
metric names twice); `EngineMetricsCollector` merges their families into the pool's registry, one
family per name.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

_CHECK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_EPISODE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class PoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.leases = Counter("deltamesh_pool_leases_total", "Tasks leased from the broker", registry=r)
        self.episodes = Counter("deltamesh_pool_episodes_total", "Episodes finished, by result", ["result"], registry=r)
        self.episode_seconds = Histogram("deltamesh_pool_episode_seconds", "Wall time of one episode",
                                         buckets=_EPISODE_BUCKETS, registry=r)
        self.submitted = Counter("deltamesh_pool_submitted_trajectories_total", "Trajectories acknowledged by the broker",
                                 ["model"], registry=r)
        self.running = Gauge("deltamesh_pool_running_episodes", "Episodes in progress", registry=r)
        self.leasing = Gauge("deltamesh_pool_leasing", "1 while the pool may lease, 0 while it waits for weights",
                             registry=r)
        self.behind = Gauge("deltamesh_pool_versions_behind",
                            "Versions the engine is behind the newest known version", ["model"], registry=r)
        self.transfers = Counter("deltamesh_pool_transfer_steps_total", "Plan steps fetched, by kind",
                                 ["model", "kind"], registry=r)
        self.transfer_bytes = Counter("deltamesh_pool_transfer_bytes_total", "Payload bytes fetched", ["model"], registry=r)
        self.version_stage_seconds = Histogram(
            "deltamesh_pool_version_stage_seconds",
            "Seconds a version took to reach each stage of its way into the pool from its previous stage "
            "(fetched, verified, applied, serving, persisted; mesh/pool/timeline.py)", ["model", "stage"],
            buckets=_STAGE_BUCKETS, registry=r)
        self.swaps = Counter("deltamesh_pool_weight_swaps_total", "Versions brought into an engine, by way",
                             ["model", "way"], registry=r)
        self.checks = Counter("deltamesh_pool_serve_checks_total",
                              "Checks that the engine serves exactly the version it claims (weights read back "
                              "against the manifest's signed hashes), by result", ["model", "result"], registry=r)
        self.check_failures = Counter("deltamesh_pool_check_failures_total",
                                      "Checks that found the engine serving other weights than it claims",
                                      ["model"], registry=r)
        self.check_seconds = Histogram("deltamesh_pool_serve_check_seconds", "Time one check of the engine took",
                                       ["model"], buckets=_CHECK_BUCKETS, registry=r)
        self.drifted = Gauge("deltamesh_pool_drifted",
                             "1 while the engine's weights differ from the version it claims (no leases until a "
                             "full reload passes its check), else 0", ["model"], registry=r)
        self.refusals = Counter("deltamesh_pool_gateway_refusals_total",
                                "Offers refused from gateways, by reason: rollback (an older version), "
                                "equivocation (another weights hash for a verified version), statement (a head "
                                "statement that does not verify), stale (a gateway newly found behind)",
                                ["model", "reason"], registry=r)
        self.stale_gateways = Gauge("deltamesh_pool_gateway_stale",
                                    "1 while the pool holds a gateway stale (behind a version known elsewhere, "
                                    "or without a fresh head statement), else 0", ["model", "gateway"], registry=r)


class EngineMetricsCollector:
    """Exposes the metrics of several engines' registries as one set of families."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(family.samples)
        return list(families.values())
