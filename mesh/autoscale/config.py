"""Settings of the autoscaler (`deltamesh autoscale --config FILE`, table `[autoscale]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class AutoscaleConfig:
    broker: str = "http://127.0.0.1:8700"
    launcher: Literal["local", "command"] = "local"
    # local: argv of one pool process; "{index}" and "{broker}" are filled in per process.
    # command: argv run on every change; "{count}" is the number of pools wanted.
    command: list[str] = field(default_factory=list)
    gpus_per_pool: int = 1
    min_pools: int = 0
    max_pools: int = 8
    initial_pools: int = 0  # local: started at once; command: the count assumed to exist already
    interval_s: float = 10.0
    cooldown_s: float = 60.0  # least time between two changes
    stop_grace_s: float = 10.0  # local: SIGTERM, then SIGKILL after this long
    command_timeout_s: float = 300.0
    scale_up_above: float = 0.10
    scale_down_below: float = 0.05
    headroom: float = 1.10

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("autoscale.command must be set (the pool process, or the scaling command)")
        if self.gpus_per_pool < 1 or not 0 <= self.min_pools <= self.max_pools:
            raise ValueError("autoscale needs gpus_per_pool >= 1 and 0 <= min_pools <= max_pools")
        if not self.min_pools <= self.initial_pools <= self.max_pools:
            raise ValueError("autoscale.initial_pools must lie within [min_pools, max_pools]")
        if self.interval_s <= 0 or self.cooldown_s < 0 or self.stop_grace_s < 0 or self.command_timeout_s <= 0:
            raise ValueError("autoscale intervals and timeouts must be positive")
