"""Prometheus metrics of one rollout engine, in the registry its pool exposes at `/metrics`.

Each engine takes the registry to register in (a fresh private one when none is given), so several
engines and services can live in one process without touching prometheus-client's global registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SWAP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    def __init__(self, model_id: str, engine: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"model": model_id, "engine": engine}
        r = self.registry
        self.tokens = Counter("deltamesh_engine_generated_tokens", "Tokens generated",
                              ["model", "engine"], registry=r).labels(**labels)
        self.generations = Counter("deltamesh_engine_generations", "Generations finished",
                                   ["model", "engine"], registry=r).labels(**labels)
        self.straddled = Counter("deltamesh_engine_straddling_generations",
                                 "Generations whose tokens came from more than one version",
                                 ["model", "engine"], registry=r).labels(**labels)
        self.version = Gauge("deltamesh_engine_version", "Policy version being served",
                             ["model", "engine"], registry=r).labels(**labels)
        self._updates = Counter("deltamesh_engine_weight_updates", "Weight updates by way and result",
                                ["model", "engine", "way", "result"], registry=r)
        self._update_seconds = Histogram("deltamesh_engine_weight_update_seconds",
                                         "Time a weight update held generation paused",
                                         ["model", "engine", "way"], buckets=_SWAP_BUCKETS, registry=r)
        self._labels = labels

    def update_done(self, way: str, ok: bool, seconds: float) -> None:
        """Record one weight update; `way` is "delta", "full" or "disk"."""
        self._updates.labels(**self._labels, way=way, result="ok" if ok else "failed").inc()
        if ok:
            self._update_seconds.labels(**self._labels, way=way).observe(seconds)
