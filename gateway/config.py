"""Typed settings of the weight network's processes, loaded by `deltamesh.config.load_config`.

One gateway runs per region (`GatewayConfig`, the `[gateway]` table of `deltamesh gateway`). The
origin gateway has no upstream and accepts publishes; a relay gateway lists one or more upstream
gateway URLs and mirrors their versions. Every gateway trusts a set of trainer public keys (PEM
files), knows its callers from a hashed tokens file (or client certificates) and serves HTTPS with
its `[gateway.tls]` section. The settings of the protocol's other sides live with their owners: a
pool's `[pool.sync]` in `deltamesh.mesh.pool.sync_config`, `deltamesh publish`'s `[publish]` in
`deltamesh.trainer.publish_config`. Flags are derived from these fields (`deltamesh.config_flags`);
`flag(...)` metadata names the short aliases the command lines have always had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamesh.config import http_url
from deltamesh.config_flags import flag
from deltamesh.congestion import check_name
from deltamesh.http import parse_listen
from deltamesh.http_guard import HEADER_TIMEOUT_S, MAX_PER_ADDRESS, ConnectionLimits
from deltamesh.tls import TlsSettings, check_token_transport

DEFAULT_PIECE_BYTES = 4 * 1024 * 1024
"""Size of a published version's pieces unless a publisher is told otherwise."""


@dataclass
class GatewayConfig:
    """A regional gateway: its store, its upstreams, whom it trusts, and its limits."""

    region: str = "origin"
    """Name of this gateway's region (letters, digits, - and _)."""
    listen: str = field(default="127.0.0.1:8700", metadata=flag(metavar="HOST:PORT"))
    """Address to serve on."""
    store: str = "gateway-store"
    """Directory of the version store (survives restarts)."""
    upstreams: list[str] = field(default_factory=list, metadata=flag("--upstream", metavar="URL"))
    """Upstream gateway base URLs, in order of preference; empty for the origin."""
    advertise: str = field(default="", metadata=flag(metavar="URL"))
    """This gateway's own base URL as others reach it (told to upstreams so they can probe it)."""
    trusted_keys: list[str] = field(default_factory=list, metadata=flag("--trusted-key", metavar="PEM"))
    """PEM files of the trainer public keys whose signed manifests this gateway accepts."""
    tokens_file: str = field(default="", metadata=flag(metavar="TOML"))
    """Who may call which route: a hashed tokens file of `deltamesh.tokens` (roles pool, trainer, gateway,
    admin, metrics), re-read when it changes. Required unless `anonymous` (docs/api/gateway.md)."""
    anonymous: bool = False
    """Serve without authentication, every caller allowed, and probe no announced URL: only for a gateway
    that no one else can reach (tests, a demo on one machine)."""
    upstream_token: str = field(default="", metadata=flag(metavar="TOKEN", secret_env="DELTAMESH_UPSTREAM_TOKEN"))
    """A relay's `gateway` token (named after its region), sent to its upstreams; empty when its client
    certificate (tls cert, common name gateway/REGION) identifies it, or its upstreams are anonymous."""
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
    min_rate_kib_s: float = 64.0
    """Slowest useful rate of one piece request to an upstream (KiB/s, on average after a credit of
    stall_timeout_s): a slower one is dropped and the piece continues from another source."""
    min_rate_fraction: float = 0.05
    """With an alternate upstream, a request is also dropped below this share of its upstream's measured rate."""
    source_tries: int = 3
    """Times an upstream may serve a piece wrong (bad bytes, short, stalled, too slow) before it is no longer
    asked for that piece; a piece no upstream serves intact fails its version, which is retried later."""
    relay_parallel: int = 8
    """Models a relay lists at once in a sync pass (each model's versions are then mirrored concurrently)."""
    disk_margin_mib: float = 64.0
    """Disk space kept free beyond what stored versions take and what arriving ones reserve; a manifest or
    piece that does not fit is refused with 507 and nothing of it is kept."""
    bandwidth_cap_mbps: float = 0.0
    """Per upstream link cap on relayed bytes in megabits per second; 0 for none."""
    link_delay_ms: float = 0.0
    """Latency added to every request to an upstream (and to its RTT probe), in milliseconds: a distant
    region emulated in the application, for demos on one machine; 0 for none."""
    heartbeat_timeout_s: float = 30.0
    """A pool that has not heartbeaten for this long is marked down."""
    pool_expire_s: float = 600.0
    """A pool that has not heartbeaten for this long is forgotten (it vanished without deregistering);
    until then it is listed down. 0 keeps it until it deregisters."""
    probe_interval_s: float = 5.0
    """Period of RTT probes to upstreams, downstream gateways and pool endpoints."""
    max_piece_bytes: int = 256 * 1024 * 1024
    """Largest piece a publisher may upload or a manifest may declare."""
    staging_max_gib: float = 64.0
    """Most bytes (GiB) of pieces a trainer's ranks may hold staged (uploaded before the manifest that
    names them: a version built in parts) at once on an origin; past it a staged piece is refused with 507."""
    staging_ttl_s: float = 600.0
    """How long a staged piece waits for the manifest that claims it before it is deleted."""
    max_downstreams: int = 256
    """Most downstream gateways whose announcements are held at once."""
    downstream_ttl_s: float = 60.0
    """A downstream's announcement lapses this long after it was made unless it announces again (relays
    re-announce every third of the TTL their upstream answers with)."""
    header_timeout_s: float = HEADER_TIMEOUT_S
    """A connection whose request line and headers are not all in this long after it opened (or after
    its next request's first byte) is closed; so is a TLS handshake that takes longer."""
    max_connections_per_address: int = MAX_PER_ADDRESS
    """Most connections one client address may hold open; more are closed at once. A pool fetching with
    `connections` N holds about 2N + 4: raise it where many pools reach the gateway through one NAT address."""
    congestion: str = ""
    """TCP congestion control of the connections this gateway serves (set by its operator), e.g. "bbr" on
    long links that lose packets (docs/api/gateway.md, Long links): Linux's TCP_CONGESTION on its listening
    socket, which the connections it accepts inherit. Empty: the host's default. A name the host does not
    offer, or does not let the process use, stops the gateway at start with the reason."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS (`[gateway.tls]`): HTTPS with `--tls-cert/--tls-key`, client certificates required with
    `--client-ca` (mTLS); `--ca` verifies upstreams, which are shown `cert` when they ask for one."""

    def __post_init__(self) -> None:
        if not self.region or not self.region.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"region {self.region!r} must be a non-empty name of letters, digits, - and _")
        parse_listen(self.listen)
        self.upstreams = [http_url(u, "upstream") for u in self.upstreams]
        if self.advertise:
            self.advertise = http_url(self.advertise, "advertise")
        if not self.trusted_keys:
            raise ValueError("trusted_keys must name at least one trainer public key file")
        if self.tokens_file and self.anonymous:
            raise ValueError("tokens_file and anonymous exclude each other")
        if self.upstream_token:
            for url in self.upstreams:
                check_token_transport(url, self.tls.insecure)
        if self.keep_deltas < 1 or self.keep_fulls < 1:
            raise ValueError("keep_deltas and keep_fulls must be >= 1")
        for name in ("lease_s", "piece_wait_s", "head_wait_max_s", "stall_timeout_s",
                     "heartbeat_timeout_s", "probe_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.relay_connections < 1:
            raise ValueError("relay_connections must be >= 1")
        if not self.min_rate_kib_s > 0 or not 0 <= self.min_rate_fraction < 1:
            raise ValueError("min_rate_kib_s must be > 0 and min_rate_fraction in [0, 1)")
        if self.source_tries < 1 or self.relay_parallel < 1 or self.disk_margin_mib < 0:
            raise ValueError("source_tries and relay_parallel must be >= 1 and disk_margin_mib >= 0")
        if self.bandwidth_cap_mbps < 0:
            raise ValueError("bandwidth_cap_mbps must be >= 0 (0 for no cap)")
        if not 0 <= self.link_delay_ms <= 60_000:
            raise ValueError("link_delay_ms must be in [0, 60000] (0 for none)")
        if self.max_piece_bytes < 1:
            raise ValueError("max_piece_bytes must be >= 1")
        if self.staging_max_gib < 0 or self.staging_ttl_s <= 0:
            raise ValueError("staging_max_gib must be >= 0 and staging_ttl_s > 0")
        ConnectionLimits(self.header_timeout_s, self.max_connections_per_address)  # checks them
        check_name(self.congestion)  # the host's offer is checked where the gateway runs (set_congestion)
        if self.pool_expire_s and self.pool_expire_s < self.heartbeat_timeout_s:
            raise ValueError("pool_expire_s must be 0 (never) or at least heartbeat_timeout_s")
        if self.max_downstreams < 1 or not self.downstream_ttl_s > 0:
            raise ValueError("max_downstreams must be >= 1 and downstream_ttl_s > 0")

    @property
    def is_origin(self) -> bool:
        return not self.upstreams
