"""Typed configuration of a regional gateway (`GatewayConfig`), loaded by `deltamesh.config.load_config`.

One gateway runs per region. The origin gateway has no upstream and accepts publishes; a relay
gateway lists one or more upstream gateway URLs and mirrors their versions. Every gateway trusts a
set of trainer public keys (PEM files) and a set of region tokens that pools register with.
A pool follows its region's gateways by `WeightSyncSettings`; `PoolSyncConfig` adds where its
weights live (the rollout pool's own config extends the same settings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamesh.config import http_url
from deltamesh.http import parse_listen


@dataclass
class GatewayConfig:
    region: str = "origin"
    listen: str = "127.0.0.1:8700"
    store: str = "gateway-store"
    upstreams: list[str] = field(default_factory=list)
    """Upstream gateway base URLs, in order of preference; empty for the origin."""
    advertise: str = ""
    """This gateway's own base URL as others reach it (told to upstreams so they can probe it)."""
    trusted_keys: list[str] = field(default_factory=list)
    """PEM files of the trainer public keys whose signed manifests this gateway accepts."""
    pool_tokens: list[str] = field(default_factory=list)
    """Bearer tokens that pools of this region register with."""
    keep_deltas: int = 20
    """Retention: how many of the newest delta versions (per model) stay in the store."""
    keep_fulls: int = 2
    """Retention: how many of the newest full snapshots (per model) stay in the store."""
    lease_s: float = 120.0
    """How long a handed-out plan keeps its versions from garbage collection (renewed by reads)."""
    piece_wait_s: float = 10.0
    """How long a request for a piece that is announced but not yet here waits before a 503."""
    head_wait_max_s: float = 60.0
    """Upper bound of a long-poll's wait."""
    relay_connections: int = 4
    """Parallel piece fetches per version when relaying from upstreams."""
    stall_timeout_s: float = 20.0
    """An upstream that sends no byte for this long is treated as stalled and another is tried."""
    bandwidth_cap_mbps: float = 0.0
    """Per upstream link cap on relayed bytes in megabits per second; 0 for none."""
    link_delay_ms: float = 0.0
    """Latency added to every request to an upstream (and to its RTT probe), in milliseconds: a distant
    region emulated in the application, for demos on one machine; 0 for none."""
    heartbeat_timeout_s: float = 30.0
    """A pool that has not heartbeaten for this long is marked down."""
    probe_interval_s: float = 5.0
    """Period of RTT probes to upstreams, downstream gateways and pool endpoints."""
    max_piece_bytes: int = 256 * 1024 * 1024
    """Largest piece a publisher may upload or a manifest may declare."""

    def __post_init__(self) -> None:
        if not self.region or not self.region.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"region {self.region!r} must be a non-empty name of letters, digits, - and _")
        parse_listen(self.listen)
        self.upstreams = [http_url(u, "upstream") for u in self.upstreams]
        if self.advertise:
            self.advertise = http_url(self.advertise, "advertise")
        if not self.trusted_keys:
            raise ValueError("trusted_keys must name at least one trainer public key file")
        if any(not t for t in self.pool_tokens):
            raise ValueError("pool_tokens must not contain empty tokens")
        if self.keep_deltas < 1 or self.keep_fulls < 1:
            raise ValueError("keep_deltas and keep_fulls must be >= 1")
        for name in ("lease_s", "piece_wait_s", "head_wait_max_s", "stall_timeout_s",
                     "heartbeat_timeout_s", "probe_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.relay_connections < 1:
            raise ValueError("relay_connections must be >= 1")
        if self.bandwidth_cap_mbps < 0:
            raise ValueError("bandwidth_cap_mbps must be >= 0 (0 for no cap)")
        if not 0 <= self.link_delay_ms <= 60_000:
            raise ValueError("link_delay_ms must be in [0, 60000] (0 for none)")
        if self.max_piece_bytes < 1:
            raise ValueError("max_piece_bytes must be >= 1")

    @property
    def is_origin(self) -> bool:
        return not self.upstreams


@dataclass
class WeightSyncSettings:
    """How a pool follows its region's gateways: the settings `PoolSyncConfig` (`deltamesh pool sync`)
    and the rollout pool's config (`deltamesh pool run`) share, checked here once for both."""

    gateways: list[str] = field(default_factory=list)
    """Gateway base URLs: the region's gateway first, alternates after (used when it fails)."""
    token: str = ""
    """The region's pool token (registration with the gateway)."""
    trusted_keys: list[str] = field(default_factory=list)
    """PEM files of the trainer public keys whose signed versions are accepted."""
    gpus: int = 0
    tier: str = ""
    connections: int = 4
    """Parallel piece fetches per transfer."""
    heartbeat_s: float = 2.0
    poll_wait_s: float = 30.0
    stall_timeout_s: float = 20.0
    give_up_s: float = 120.0
    """How long a piece may stay unavailable from every gateway before the transfer is abandoned and retried."""
    full_every: int = 0
    """Take a full snapshot after this many deltas in a row (0: the plan decides by bytes alone)."""

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("gateways must list at least one gateway URL")
        self.gateways = [http_url(u, "gateway") for u in self.gateways]
        if not self.token:
            raise ValueError("token is required (the region's pool token)")
        if not self.trusted_keys:
            raise ValueError("trusted_keys must name at least one trainer public key file")
        if self.gpus < 0 or self.connections < 1 or self.full_every < 0:
            raise ValueError("gpus and full_every must be >= 0 and connections >= 1")
        if min(self.heartbeat_s, self.poll_wait_s, self.stall_timeout_s, self.give_up_s) <= 0:
            raise ValueError("heartbeat_s, poll_wait_s, stall_timeout_s and give_up_s must be > 0")


@dataclass
class PoolSyncConfig(WeightSyncSettings):
    """A pool agent's weight sync: which gateways to follow and where the weights live."""

    name: str = ""
    dir: str = ""
    """The safetensors directory the pool's engine loads; versions are applied to it atomically."""
    model: str = ""
    """Model id to follow; empty to take the one model the gateway serves (or the one DIR holds)."""
    engine: str = "none"
    endpoint: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.name:
            raise ValueError("name is required")
        if not self.dir:
            raise ValueError("dir is required")
