"""The balance report: how long each trainer waits for data, and how many rollout GPUs would fix it.

Per model_id the broker keeps the last `window_steps` trainer steps, each with the seconds the trainer
waited for its batch, the step's length, and the trajectories produced (accepted) and consumed
(served fresh) while it ran. Over that window the wait fraction is w = sum(wait) / sum(step), and
the target rollout GPU count follows AstraFlow's controller (`target_gpus`). The current GPU count G
is the sum of what pools declared in lease requests within the last `pool_ttl_s` seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

from deltamesh.mesh.broker.config import BalanceConfig, ScaleThresholds


def target_gpus(gpus: int, wait_fraction: float, produced: int, consumed: int,
                thresholds: ScaleThresholds | None = None) -> int:
    """G_target = ceil(G / (1 - w)) if w > 0.10; min(G, ceil(G * n_c / n_p * 1.10)) if w < 0.05 and
    n_p, n_c > 0; otherwise G (0.10, 0.05 and 1.10: the default `thresholds`). A starved trainer asks
    for more rollout capacity; a fed one releases what production beyond consumption (plus headroom)
    does not need."""
    t = thresholds or ScaleThresholds()
    if wait_fraction > t.scale_up_above:
        return math.ceil(gpus / (1.0 - wait_fraction))
    if wait_fraction < t.scale_down_below and produced > 0 and consumed > 0:
        return min(gpus, math.ceil(gpus * consumed / produced * t.headroom))
    return gpus


@dataclass
class StepRecord:
    wait_s: float
    step_s: float
    produced: int
    consumed: int


class BalanceWindow:
    """One trainer's recent steps and the production/consumption counted while each ran."""

    def __init__(self, window_steps: int):
        self.steps: deque[StepRecord] = deque(maxlen=window_steps)
        self.produced = 0  # since the last step report
        self.consumed = 0

    def add_step(self, wait_s: float, step_s: float) -> None:
        self.steps.append(StepRecord(wait_s, step_s, self.produced, self.consumed))
        self.produced = self.consumed = 0

    def summary(self) -> dict[str, Any]:
        wait = sum(s.wait_s for s in self.steps)
        step = sum(s.step_s for s in self.steps)
        return {
            "steps": len(self.steps), "wait_s": wait, "step_s": step,
            "wait_fraction": min(1.0, wait / step) if step > 0 else 0.0,
            "produced": sum(s.produced for s in self.steps), "consumed": sum(s.consumed for s in self.steps),
        }


@dataclass
class PoolSeen:
    region: str
    gpus: int
    last_seen: float
    leased: int = 0


class PoolRegistry:
    """The pools that asked for work recently, and the GPUs they declared."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.pools: dict[str, PoolSeen] = {}

    def seen(self, pool: str, region: str, gpus: int, now: float) -> None:
        entry = self.pools.setdefault(pool, PoolSeen(region, gpus, now))
        entry.region, entry.gpus, entry.last_seen = region, gpus, now

    def leased(self, pool: str, n: int) -> None:
        self.pools[pool].leased += n

    def active(self, now: float) -> dict[str, PoolSeen]:
        return {name: p for name, p in self.pools.items() if now - p.last_seen <= self.ttl_s}


def balance_report(windows: Mapping[str, BalanceWindow], pools: PoolRegistry, now: float,
                   config: BalanceConfig) -> dict[str, Any]:
    """The JSON report: per model its window summary and target, plus the overall target (the largest)."""
    active = pools.active(now)
    gpus = sum(p.gpus for p in active.values())
    models = {}
    for model_id, window in windows.items():
        summary = window.summary()
        summary["target_gpus"] = target_gpus(gpus, summary["wait_fraction"], summary["produced"], summary["consumed"],
                                             config.thresholds)
        models[model_id] = summary
    return {
        "gpus": gpus,
        "target_gpus": max((m["target_gpus"] for m in models.values()), default=gpus),
        "models": models,
        "pools": {name: {"region": p.region, "gpus": p.gpus, "leased": p.leased, "idle_s": round(now - p.last_seen, 3)}
                  for name, p in active.items()},
    }
