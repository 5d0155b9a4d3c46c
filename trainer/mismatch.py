"""Trainer-side mismatch: how far each rollout pool's behaviour logprobs are from the trainer's own.

Only tokens a pool generated at the trainer's current version count: the pool then held the very
weights the trainer scores with (cast to bf16), so what differs is the engine (kernels, bf16 against
fp32, a bug), not policy lag, which older tokens really have. With d = trainer logprob - behaviour
logprob from the training forward pass (`train_step` calls `row_sums`; no second pass), a pool's
mismatch on a batch is mean |d| and its KL estimate is k3 = mean(exp(d) - 1 - d), an unbiased
estimate of KL(behaviour || trainer) from the behaviour samples. `pool_mismatch` splits a batch's
rows by the pool that submitted them (the broker records it, bound to the pool's token).
`MismatchWatch` names a pool whose mismatch jumps (`deltamesh.trainer.config.MismatchConfig`): it is
flagged when its mismatch exceeds both the floor and `ratio` times the median of the other pools
judged in the same batch, or `ratio` times its own running median; a warning names it and the
trainer's metrics (`deltamesh.trainer.metrics`) expose it.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from deltamesh.trainer.config import MismatchConfig
from deltamesh.trainer.losses import k3_kl
from deltamesh.trainer.metrics import TrainerMetrics

log = logging.getLogger(__name__)

ROW_SUMS = ("abs", "k3", "tokens")
"""The columns of `row_sums`: sum of |d|, sum of k3, tokens counted."""
UNNAMED_POOL = "unknown"
"""The pool label of samples that name none (an anonymous broker takes them as sent)."""


def row_sums(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row of [B, T] logprobs, the float64 sums of |d|, of exp(d) - 1 - d, and the token count, over `mask`.

    d = logp - behaviour_logp. Sums, not means, so micro-batches, ranks and rows of one pool add up.
    """
    m = mask.bool()
    trainer, behaviour = logp.detach().double(), behaviour_logp.detach().double()
    zero = torch.zeros_like(trainer)
    # k3_kl(p, q) is exp(q - p) - 1 - (q - p): with p the behaviour and q the trainer, q - p = d.
    return torch.stack([torch.where(m, (trainer - behaviour).abs(), zero).sum(1),
                        torch.where(m, k3_kl(behaviour, trainer), zero).sum(1), m.double().sum(1)], dim=1)


@dataclass
class PoolMismatch:
    """One pool's mismatch on one batch: its tokens at the trainer's version, mean |d| and mean k3."""

    tokens: int
    abs_mean: float
    k3_mean: float
    flagged: bool = False
    reason: str = ""

    def record(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "abs": self.abs_mean, "k3": self.k3_mean, "flagged": self.flagged,
                "reason": self.reason}


def pool_mismatch(rows: torch.Tensor, pools: Sequence[str]) -> dict[str, PoolMismatch]:
    """A batch's `row_sums` [N, 3] added up per pool (`pools[i]` sent row i); pools without a counted token left out."""
    sums: dict[str, list[float]] = {}
    for pool, (abs_sum, k3_sum, tokens) in zip(pools, rows.tolist()):
        if tokens:
            acc = sums.setdefault(pool or UNNAMED_POOL, [0.0, 0.0, 0.0])
            acc[0] += abs_sum
            acc[1] += k3_sum
            acc[2] += tokens
    return {pool: PoolMismatch(int(n), a / n, k / n) for pool, (a, k, n) in sorted(sums.items())}


class MismatchWatch:
    """Judges each batch's per-pool mismatch against the other pools and each pool's own history.

    A pool is judged only with at least `min_tokens` counted tokens in the batch; only such pools
    enter the other pools' median and the running medians. The flagged gauge of a pool not judged
    keeps its last value. Every judged reading, flagged or not, joins the pool's history, so a pool
    that moved for good stops being flagged against itself after a while, though not against the
    other pools.
    """

    def __init__(self, cfg: MismatchConfig, model_id: str, metrics: TrainerMetrics | None = None):
        self.cfg = cfg
        self.model_id = model_id
        self.metrics = metrics
        self._history: dict[str, deque[float]] = {}

    def observe(self, version: int, readings: dict[str, PoolMismatch]) -> dict[str, PoolMismatch]:
        """Judge one batch's `readings` (tokens at `version`); sets `flagged`/`reason` and returns them."""
        cfg = self.cfg
        judged = {p: r.abs_mean for p, r in readings.items() if r.tokens >= cfg.min_tokens}
        for pool, reading in readings.items():
            if pool not in judged:
                continue
            others = [m for p, m in judged.items() if p != pool]
            history = self._history.setdefault(pool, deque(maxlen=cfg.window))
            reasons = []
            if others:
                peers = statistics.median(others)
                if reading.abs_mean > max(cfg.ratio * peers, cfg.floor):
                    reasons.append(f"{reading.abs_mean / peers if peers else float('inf'):.1f}x the median "
                                   f"{peers:.4f} of the other pools")
            if len(history) >= cfg.min_history:
                own = statistics.median(history)
                if reading.abs_mean > max(cfg.ratio * own, cfg.floor):
                    reasons.append(f"{reading.abs_mean / own if own else float('inf'):.1f}x its own running "
                                   f"median {own:.4f}")
            history.append(reading.abs_mean)
            reading.flagged, reading.reason = bool(reasons), "; ".join(reasons)
            if reading.flagged:
                log.warning("%s v%d: pool %s's logprobs moved away from the trainer's: mean |d| %.4f on %d tokens "
                            "(%s); k3 %.4g", self.model_id, version, pool, reading.abs_mean, reading.tokens,
                            reading.reason, reading.k3_mean)
        if self.metrics is not None:
            self.metrics.mismatch(self.model_id, readings, judged)
        return readings
