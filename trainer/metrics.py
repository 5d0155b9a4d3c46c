"""Prometheus metrics of one trainer (rank 0), in a registry of its own.

With `metrics_listen` set, `deltamesh train` serves them (`deltamesh.metrics.status_app`) there, read-only and
unauthenticated like a pool's status server: bind it to loopback or the scraper's network. Besides
the process and build metrics (`deltamesh.metrics`), the series are the trainer-side mismatch of each
rollout pool (`deltamesh.trainer.mismatch`), labelled by model_id and pool; every series is listed
in docs/CONFIG.md ("The trainer's metrics").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Mapping

from prometheus_client import Counter, Gauge

from deltamesh.metrics import service_registry

if TYPE_CHECKING:
    from deltamesh.trainer.mismatch import PoolMismatch


class TrainerMetrics:
    def __init__(self) -> None:
        r = self.registry = service_registry("trainer")
        labels = ["model_id", "pool"]
        self.mismatch_abs = Gauge("deltamesh_trainer_mismatch",
                                  "Mean |trainer - behaviour logprob| on the pool's tokens of the trainer's version, "
                                  "in its latest batch", labels, registry=r)
        self.mismatch_k3 = Gauge("deltamesh_trainer_mismatch_k3",
                                 "k3 estimate mean(exp(d) - 1 - d) of KL(behaviour || trainer) on the same tokens",
                                 labels, registry=r)
        self.flagged = Gauge("deltamesh_trainer_mismatch_flagged",
                             "1 while the pool's latest judged mismatch counts as a jump, else 0", labels, registry=r)
        self.tokens = Counter("deltamesh_trainer_mismatch_tokens_total",
                              "Tokens of the trainer's own version the mismatch was measured on", labels, registry=r)
        self.flags = Counter("deltamesh_trainer_mismatch_flags_total", "Batches on which the pool was flagged",
                             labels, registry=r)

    def mismatch(self, model_id: str, readings: Mapping[str, PoolMismatch], judged: Collection[str]) -> None:
        """One batch's readings; only the `judged` pools (enough tokens) change their flagged gauge."""
        for pool, r in readings.items():
            self.mismatch_abs.labels(model_id, pool).set(r.abs_mean)
            self.mismatch_k3.labels(model_id, pool).set(r.k3_mean)
            self.tokens.labels(model_id, pool).inc(r.tokens)
            if pool in judged:
                self.flagged.labels(model_id, pool).set(int(r.flagged))
                if r.flagged:
                    self.flags.labels(model_id, pool).inc()

