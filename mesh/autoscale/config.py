"""Settings of the autoscaler (`deltamesh autoscale --config FILE`, table `[autoscale]`; flags derived
from these fields override it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from deltamesh.config import http_urls
from deltamesh.config_flags import flag
from deltamesh.mesh.broker.config import ScaleThresholds


@dataclass
class AutoscaleConfig:
    """The autoscaler: which broker it reads, how it launches pools, and its bounds and thresholds."""

    broker: str = field(default="http://127.0.0.1:8700", metadata=flag(metavar="URL[,URL...]"))
    """Base URL of the broker whose balance report drives the decisions, or of its active and standby
    brokers separated by commas (`http://a:8700,http://b:8700`): calls fail over between them."""
    broker_token: str = field(default="", metadata=flag(metavar="TOKEN", secret_env="DELTAMESH_BROKER_TOKEN"))
    """Bearer token for the broker (`deltamesh tokens add --role admin`); empty for an anonymous broker."""
    launcher: Literal["local", "command"] = "local"
    """local: pool processes on this machine; command: a command that sets the pool count elsewhere."""
    command: list[str] = field(default_factory=list, metadata=flag(metavar="ARG"))
    """local: argv of one pool process ("{index}" and "{broker}", every broker URL separated by commas,
    are filled in per process); command: argv run on every change ("{count}" is the number of pools
    wanted)."""
    gpus_per_pool: int = 1
    """GPUs one pool brings."""
    min_pools: int = 0
    """Fewest pools kept."""
    max_pools: int = 8
    """Most pools started."""
    initial_pools: int = 0
    """local: started at once; command: the count assumed to exist already."""
    interval_s: float = 10.0
    """Seconds between decisions."""
    cooldown_s: float = 60.0
    """Least time between two changes."""
    stop_grace_s: float = 10.0
    """local: SIGTERM, then SIGKILL after this long."""
    command_timeout_s: float = 300.0
    """command: longest one run of the scaling command may take."""
    thresholds: ScaleThresholds = field(default_factory=ScaleThresholds)
    """When pools are added or removed (`[autoscale.thresholds]`, the broker's balance report's kind)."""

    def __post_init__(self) -> None:
        self.broker = http_urls(self.broker, "broker")
        if not self.command:
            raise ValueError("autoscale.command must be set (the pool process, or the scaling command)")
        if self.gpus_per_pool < 1 or not 0 <= self.min_pools <= self.max_pools:
            raise ValueError("autoscale needs gpus_per_pool >= 1 and 0 <= min_pools <= max_pools")
        if not self.min_pools <= self.initial_pools <= self.max_pools:
            raise ValueError("autoscale.initial_pools must lie within [min_pools, max_pools]")
        if self.interval_s <= 0 or self.cooldown_s < 0 or self.stop_grace_s < 0 or self.command_timeout_s <= 0:
            raise ValueError("autoscale intervals and timeouts must be positive")
