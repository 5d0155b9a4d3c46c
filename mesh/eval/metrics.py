"""Prometheus metrics of an evaluator, in the registry its server exposes at `/metrics`.

Besides the weight stream's own (the pool metrics: transfers, swaps, checks of what the engine serves)
and the engine's, the series are: the newest scored version and its avg@n, how many versions were
scored, skipped (no longer at any gateway) or failed, how long a scoring took, and how many versions
wait to be scored. Every series is listed in docs/CONFIG.md ("The evaluator's metrics").
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SCORE_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class EvalMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.accuracy = Gauge("deltamesh_eval_accuracy", "avg@n on the held-out set of the newest scored version",
                              ["model_id"], registry=r)
        self.version = Gauge("deltamesh_eval_version", "The newest scored version", ["model_id"], registry=r)
        self.runs = Counter("deltamesh_eval_versions_total",
                            "Versions taken up, by outcome: scored, skipped (no longer at any gateway), failed",
                            ["model_id", "outcome"], registry=r)
        self.seconds = Histogram("deltamesh_eval_score_seconds", "Wall time of scoring one version",
                                 ["model_id"], buckets=_SCORE_BUCKETS, registry=r)
        self.waiting = Gauge("deltamesh_eval_versions_waiting",
                             "Published versions due to be scored that are not scored yet", ["model_id"], registry=r)
