"""Typed settings of a pool's side of the weight protocol, loaded by `deltamesh.config.load_config`.

A pool follows its region's gateways by `WeightSyncSettings`: the `[pool.sync]` section of a rollout
pool, and the settings that `PoolSyncConfig` (`deltamesh pool sync`) extends with where its weights
live. Flags are derived from these fields (`deltamesh.config_flags`); `flag(...)` metadata names the
short aliases the command lines have always had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamesh.config import http_url
from deltamesh.config_flags import flag
from deltamesh.http import parse_listen
from deltamesh.tls import TlsSettings, check_token_transport


@dataclass
class WeightSyncSettings:
    """How a pool follows its region's gateways: the `[pool.sync]` section of a rollout pool (`deltamesh
    pool run`), which `PoolSyncConfig` (`deltamesh pool sync`) extends, checked here once for both."""

    gateways: list[str] = field(default_factory=list, metadata=flag("--gateway", metavar="URL"))
    """Gateway base URLs: the region's gateway first, alternates after (used when it fails)."""
    token: str = field(default="", metadata=flag("--token", secret_env="DELTAMESH_TOKEN"))
    """This pool's token at its gateways (role pool, named after the pool: docs/api/gateway.md); may be
    empty when its client certificate (`tls`) identifies it."""
    trusted_keys: list[str] = field(default_factory=list, metadata=flag("--trusted-key", metavar="PEM"))
    """PEM files of the trainer public keys whose signed versions are accepted."""
    gpus: int = field(default=0, metadata=flag("--gpus"))
    """GPUs of the pool, as registered with the gateway (and reported to the broker)."""
    tier: str = field(default="", metadata=flag("--tier"))
    """Label of the pool's hardware tier, as registered (and tagged on its trajectories)."""
    connections: int = 4
    """Parallel piece fetches per transfer."""
    heartbeat_s: float = 2.0
    """Seconds between heartbeats to the gateway."""
    poll_wait_s: float = 30.0
    """Longest wait of one long poll for a new head."""
    stall_timeout_s: float = 20.0
    """A gateway that sends no byte for this long is treated as stalled and an alternate is tried."""
    give_up_s: float = 120.0
    """How long a piece may stay unavailable from every gateway before the transfer is abandoned and retried."""
    full_after_deltas: int = 0
    """Ask for a full snapshot instead of a delta chain once this many deltas would have been applied in a
    row since the last full (the plan's `full_every` hint to the gateway; 0: the plan decides by bytes
    alone). Not the trainer's `full_every`, which publishes a full snapshot every N versions."""
    stale_after_s: float = 60.0
    """Freeze check: a gateway whose head stays below a version the pool has known of for this long (from
    another of its gateways' heads, or a signed head statement) is flagged stale and the pool turns to
    its next gateway. Far above a relay's normal lag (it announces a version once its manifest is in);
    0: off."""
    statement_max_age_s: float = 0.0
    """Require each gateway's signed head statement to have been issued at most this many seconds ago; a
    gateway serving none or an older one is flagged stale. Set it above the trainer's statement period
    (docs/SECURITY.md); 0: not required (a statement that is served is still verified)."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS towards the gateways (`tls` section): `--ca` verifies https:// gateways, `cert` (common name
    pool/NAME) is presented to gateways that require client certificates."""

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("gateways must list at least one gateway URL")
        self.gateways = [http_url(u, "gateway") for u in self.gateways]
        if not self.token and not self.tls.cert:
            raise ValueError("token is required (the pool's token at its gateways), unless a client certificate "
                             "(tls cert, common name pool/NAME) identifies the pool")
        if self.token:
            for url in self.gateways:
                check_token_transport(url, self.tls.insecure)
        if self.stale_after_s < 0 or self.statement_max_age_s < 0:
            raise ValueError("stale_after_s and statement_max_age_s must be >= 0 (0: off)")
        if not self.trusted_keys:
            raise ValueError("trusted_keys must name at least one trainer public key file")
        if self.gpus < 0 or self.connections < 1 or self.full_after_deltas < 0:
            raise ValueError("gpus and full_after_deltas must be >= 0 and connections >= 1")
        if min(self.heartbeat_s, self.poll_wait_s, self.stall_timeout_s, self.give_up_s) <= 0:
            raise ValueError("heartbeat_s, poll_wait_s, stall_timeout_s and give_up_s must be > 0")


@dataclass
class PoolSyncConfig(WeightSyncSettings):
    """A pool agent's weight sync: which gateways to follow and where the weights live."""

    name: str = ""
    """Pool name, as registered with the gateway."""
    dir: str = ""
    """The safetensors directory the pool's engine loads; versions are applied to it atomically."""
    model: str = ""
    """Model id to follow; empty to take the one model the gateway serves (or the one DIR holds)."""
    engine: str = "none"
    """Label of the engine that serves the weights, as registered."""
    endpoint: str = field(default="", metadata=flag(metavar="URL"))
    """The pool's engine endpoint (probed by the gateway for RTT)."""
    metrics_listen: str = field(default="", metadata=flag(metavar="HOST:PORT"))
    """Serve Prometheus `/metrics` (and `/healthz`, `/v1/status`) on this address while following the
    head; empty: off. Read-only and unauthenticated, like `pool run`'s status server: anyone who reaches
    the address may read them, so bind it to loopback or the scraper's network."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.name:
            raise ValueError("name is required")
        if not self.dir:
            raise ValueError("dir is required")
        if self.metrics_listen:
            parse_listen(self.metrics_listen)
