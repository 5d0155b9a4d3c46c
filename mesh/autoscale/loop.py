"""The autoscaler's control loop: balance report in, pool count out.

Every `interval_s` it reads the broker's balance report, takes G = pools running x GPUs per pool
(what the launcher knows, not what the broker has seen so far), computes each trainer's target with
the broker's formula (`deltamesh.mesh.broker.balance.target_gpus`) from that trainer's wait fraction
and production/consumption, keeps the largest (the hungriest trainer decides), rounds up to whole
pools, clamps to [min_pools, max_pools], and asks the launcher for that count if it differs and the
cooldown since the last change has passed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from deltamesh.http import HttpError
from deltamesh.mesh.autoscale.config import AutoscaleConfig
from deltamesh.mesh.autoscale.launchers import Launcher, LaunchError
from deltamesh.mesh.broker.balance import target_gpus
from deltamesh.signals import sleep_or_stop

log = logging.getLogger(__name__)

BalanceSource = Callable[[], Awaitable[dict[str, Any]]]


@dataclass
class Decision:
    current: int  # pools before
    wanted: int  # pools after clamping
    target_gpus: int
    acted: bool
    reason: str


class Autoscaler:
    def __init__(self, config: AutoscaleConfig, launcher: Launcher, balance: BalanceSource, *,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.launcher = launcher
        self.balance = balance
        self.clock = clock
        self.last_change: float | None = None

    def wanted_pools(self, report: dict[str, Any], current: int) -> tuple[int, int]:
        """(target GPUs, pools wanted within bounds) for `current` pools running."""
        c = self.config
        gpus = current * c.gpus_per_pool
        targets = [target_gpus(gpus, m["wait_fraction"], m["produced"], m["consumed"], c.thresholds)
                   for m in report.get("models", {}).values()]
        target = max(targets, default=gpus)
        return target, min(c.max_pools, max(c.min_pools, math.ceil(target / c.gpus_per_pool)))

    async def step(self) -> Decision:
        report = await self.balance()
        current = self.launcher.current()
        target, wanted = self.wanted_pools(report, current)
        if wanted == current:
            return Decision(current, wanted, target, False, "balanced")
        now = self.clock()
        if self.last_change is not None and now - self.last_change < self.config.cooldown_s:
            return Decision(current, wanted, target, False, "cooldown")
        log.info("scaling rollout pools %d -> %d (target %d GPUs)", current, wanted, target)
        await self.launcher.scale_to(wanted)
        self.last_change = now
        return Decision(current, wanted, target, True, "scaled")

    async def run(self, stop: asyncio.Event) -> None:
        """Start `initial_pools`, then step every `interval_s` until `stop` is set; failures are logged."""
        if self.config.launcher == "local" and self.config.initial_pools:
            await self.launcher.scale_to(self.config.initial_pools)
        while not stop.is_set():
            try:
                decision = await self.step()
                log.debug("autoscale: %s", decision)
            except (HttpError, LaunchError, KeyError, TypeError) as e:
                log.warning("autoscale step failed: %s", e)
            await sleep_or_stop(stop, self.config.interval_s)
