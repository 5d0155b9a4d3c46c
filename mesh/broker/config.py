"""Typed settings of the dataflow broker (`deltamesh broker --config FILE`, table `[broker]`).

One dataclass per concern: where the broker serves and its data lives and how durable an
acknowledgement is, the task source and its curator (`[broker.tasks]`, `[broker.tasks.curator]`), the
data policies applied to trajectories and batches (`[broker.policies]`, `[broker.policies.replay]`),
and the balance report (`[broker.balance]`). Each validates itself, so a bad value fails at start-up
with the key that is wrong. The command's flags are derived from these fields (`deltamesh.config_flags`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from deltamesh.config_flags import flag
from deltamesh.http import parse_listen
from deltamesh.http_guard import HEADER_TIMEOUT_S, MAX_PER_ADDRESS, ConnectionLimits
from deltamesh.mesh.broker.backends import check_db
from deltamesh.tls import TlsSettings

MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""What a model_id may look like (as at the gateways): it appears in URL paths."""


@dataclass
class CuratorConfig:
    """Pre-rollout curator: which prompts are leased out again (see curators.py)."""

    name: str = "accept_all"
    """accept_all, filter_solved, greso, or "module:callable"."""
    history: int = 4
    """Recent groups per task that filter_solved looks at."""
    solved_reward: float = 1.0
    """A sample with at least this reward counts as solved."""
    greso_target: float = 0.25
    """Wanted share of zero-variance groups among observed ones."""
    greso_step: float = 0.01
    """How much the exploration probability moves per observed group."""
    greso_start: float = 0.5
    """GRESO: the exploration probability a task starts with."""
    greso_min: float = 0.05
    """GRESO: the exploration probability never drops below this."""
    seed: int = 0
    """Seed of the curator's random choices."""

    def __post_init__(self) -> None:
        if self.history < 1:
            raise ValueError("curator.history must be >= 1")
        if not 0.0 <= self.greso_target <= 1.0 or not 0.0 < self.greso_step <= 1.0:
            raise ValueError("curator.greso_target must be in [0, 1] and greso_step in (0, 1]")
        if not 0.0 < self.greso_min <= self.greso_start <= 1.0:
            raise ValueError("curator needs 0 < greso_min <= greso_start <= 1")


@dataclass
class TasksConfig:
    """Where rollout tasks come from and how they are leased to pools."""

    dataset: str | None = field(default=None, metadata=flag("--dataset", metavar="FILE"))
    """JSONL of {"id", "prompt", ...}; imported into the store on first start."""
    epochs: int = 1
    """Passes over the dataset."""
    n_samples: int = 8
    """Samples per prompt: one group."""
    model_ids: list[str] = field(default_factory=list)
    """Models each task produces for; empty = all known."""
    lease_timeout_s: float = 600.0
    """A lease not completed this long after it was handed out expires, and its task goes out again."""
    max_lease_batch: int = 16
    """Most tasks one lease request gets, whatever it asks for."""
    max_inflight_per_pool: int = 64
    """Active leases one pool may hold before it returns results: counted per token holder, so the
    names a pool may also lease under (`NAME.SUFFIX`) share its bound."""
    max_buffered_groups: int | None = None
    """Backpressure: no new leases while, for every model, fresh groups waiting plus active leases reach
    this many; pools then idle rather than make data that goes stale before a trainer takes it."""
    curator: CuratorConfig = field(default_factory=CuratorConfig)
    """Which prompts are leased out again (`[broker.tasks.curator]`)."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.n_samples < 1:
            raise ValueError("tasks.epochs and tasks.n_samples must be >= 1")
        if self.lease_timeout_s <= 0 or self.max_lease_batch < 1 or self.max_inflight_per_pool < 1:
            raise ValueError("tasks.lease_timeout_s, max_lease_batch and max_inflight_per_pool must be positive")
        if self.max_buffered_groups is not None and self.max_buffered_groups < 1:
            raise ValueError("tasks.max_buffered_groups must be >= 1 or unset")


@dataclass
class ReplayConfig:
    """Replay: a fraction of every batch drawn (whole groups) from groups already trained on."""

    fraction: float = 0.0
    """Share of every batch drawn from replay (0: off)."""
    selector: str = "latest"
    """latest, uniform, reward, or "module:callable"."""
    max_staleness: int | None = None
    """Versions behind the trainer a replayed group may be."""
    capacity: int = 65536
    """Samples kept for replay; the oldest are retired beyond it."""
    seed: int = 0
    """Seed of the replay draw."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError("replay.fraction must be in [0, 1)")
        if self.capacity < 0 or (self.max_staleness is not None and self.max_staleness < 0):
            raise ValueError("replay.capacity and replay.max_staleness must be >= 0")


@dataclass
class PoliciesConfig:
    """Data policies: post-rollout group filters, the staleness bound, replay."""

    filters: list[str] = field(default_factory=lambda: ["keep_all"])
    """Group filters applied in order when a group completes (keep_all, zero_adv, ... or "module:callable")."""
    max_staleness: int | None = None
    """Versions behind the trainer a fresh group may be; unset: no bound."""
    max_version_ahead: int = 2
    """Versions above the newest one its trainer reported that a trajectory may claim (a pool can take a
    version a moment before the trainer's report of it reaches the broker); one claiming more is
    refused (409) and counted, since staleness is measured from the versions a trajectory claims."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Replay of groups already trained on (`[broker.policies.replay]`)."""

    def __post_init__(self) -> None:
        if not self.filters:
            raise ValueError("policies.filters must name at least one filter (keep_all keeps everything)")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("policies.max_staleness must be >= 0")
        if self.max_version_ahead < 0:
            raise ValueError("policies.max_version_ahead must be >= 0")


@dataclass
class ScaleThresholds:
    """When rollout capacity should change, from the trainer's wait fraction: declared once, read by the
    broker's balance report (`[broker.balance.thresholds]`) and the autoscaler (`[autoscale.thresholds]`)."""

    scale_up_above: float = 0.10
    """Wait fraction above which rollout capacity grows."""
    scale_down_below: float = 0.05
    """Wait fraction below which rollout capacity shrinks."""
    headroom: float = 1.10
    """Kept above the consumption rate when shrinking."""

    def __post_init__(self) -> None:
        if self.headroom < 1.0:
            raise ValueError("thresholds.headroom must be >= 1")
        if not 0.0 <= self.scale_down_below <= self.scale_up_above < 1.0:
            raise ValueError("thresholds need 0 <= scale_down_below <= scale_up_above < 1")


@dataclass
class BalanceConfig:
    """The balance report: wait fraction and the rollout GPU target (AstraFlow's controller)."""

    window_steps: int = 20
    """Trainer steps the report looks back over."""
    thresholds: ScaleThresholds = field(default_factory=ScaleThresholds)
    """When the report's GPU target departs from the GPUs there are (`[broker.balance.thresholds]`)."""
    pool_ttl_s: float = 120.0
    """A pool counts towards the GPU total this long after its last request."""

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.pool_ttl_s <= 0:
            raise ValueError("balance.window_steps and pool_ttl_s must be positive")


@dataclass
class LeaderConfig:
    """Active/standby brokers on one PostgreSQL database (`[broker.leader]`; unused with SQLite): the
    active broker holds a lease that it renews, a standby takes it over once it expires."""

    url: str = field(default="", metadata=flag("--advertise-url", metavar="URL"))
    """This broker's URL as its clients reach it; standbys name it to callers while this broker is
    active. Default: made from `listen` (http or https as the broker serves)."""
    ttl_s: float = 3.0
    """How long the lease lasts unrenewed: a killed active broker is replaced within about this much."""
    margin_s: float = 0.5
    """The active broker stops serving this long before its lease can expire at the database."""

    def __post_init__(self) -> None:
        if not 0 < self.margin_s < self.ttl_s / 2:
            raise ValueError("leader.margin_s must be positive and under half of leader.ttl_s")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"leader.url must be an http:// or https:// URL, got {self.url!r}")


@dataclass
class BrokerConfig:
    """Everything `deltamesh broker` needs: where it serves and stores, its limits, and its sections."""

    listen: str = field(default="127.0.0.1:8700", metadata=flag(metavar="HOST:PORT"))
    """Address to serve on."""
    db: str = field(default="broker.db", metadata=flag(metavar="PATH|URL"))
    """The broker's durable store: an SQLite file (one broker per file), or a PostgreSQL database as a
    postgresql:// URL (e.g. postgresql://user@host/dbname), which standby brokers can share and take over.
    The broker creates and migrates its tables there (`deltamesh broker migrate`)."""
    models: list[str] = field(default_factory=list, metadata=flag("--model", metavar="ID"))
    """Model_ids known from the start."""
    allow_register: bool = True
    """A trainer's first version report registers its model_id."""
    durability: Literal["fsync", "process"] = "fsync"
    """fsync: an acknowledgement survives power loss (SQLite synchronous=FULL); process: it survives a
    killed broker process but not a crashed machine (synchronous=NORMAL), for more ingest per core."""
    max_body_bytes: int = 256 * 1024 * 1024
    """Largest request body."""
    max_trajectories_per_submission: int = 4096
    """Most trajectories in one submission."""
    max_tokens: int = 262144
    """Most tokens of one trajectory."""
    max_poll_s: float = 300.0
    """Longest a batch long-poll may wait."""
    ack_timeout_s: float = 1800.0
    """A delivered batch not acknowledged this long after its delivery (or after the trainer's last poll
    that said it still holds it) goes back to the buffer. It must exceed the trainer's longest step."""
    max_commit_trajectories: int = 8192
    """Most trajectories one group commit writes."""
    header_timeout_s: float = HEADER_TIMEOUT_S
    """A connection whose request line and headers are not all in this long after it opened (or after
    its next request's first byte) is closed; so is a TLS handshake that takes longer."""
    max_connections_per_address: int = MAX_PER_ADDRESS
    """Most connections one client address may hold open; more are closed at once."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """The task source and its leases (`[broker.tasks]`)."""
    policies: PoliciesConfig = field(default_factory=PoliciesConfig)
    """Data policies (`[broker.policies]`)."""
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """The balance report (`[broker.balance]`)."""
    tokens_file: str = field(default="", metadata=flag(metavar="TOML"))
    """Who may call which route: a tokens file of `deltamesh tokens add` (re-read when it changes or on
    SIGHUP). Without one, a broker on PostgreSQL takes its tokens from its database (`deltamesh tokens
    add --db`), and one on SQLite must be `anonymous`."""
    anonymous: bool = False
    """Serve without authentication, every caller allowed: only for a broker that no one else can reach."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS of the broker's server (`[broker.tls]`): HTTPS with `--tls-cert/--tls-key`, mTLS with `--client-ca`."""
    leader: LeaderConfig = field(default_factory=LeaderConfig)
    """Active/standby brokers on PostgreSQL (`[broker.leader]`)."""

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        if self.tokens_file and self.anonymous:
            raise ValueError("tokens_file and anonymous exclude each other")
        if not self.db:
            raise ValueError("db must name the broker's SQLite file or PostgreSQL URL")
        check_db(self.db)
        bad = [m for m in self.models if not MODEL_ID.match(m)]
        if bad:
            raise ValueError(f"models {bad} do not match {MODEL_ID.pattern}")
        if self.max_body_bytes < 1024 or self.max_trajectories_per_submission < 1 or self.max_tokens < 1:
            raise ValueError("max_body_bytes, max_trajectories_per_submission and max_tokens must be positive")
        if self.max_poll_s <= 0 or self.max_commit_trajectories < 1 or self.ack_timeout_s <= 0:
            raise ValueError("max_poll_s, max_commit_trajectories and ack_timeout_s must be positive")
        ConnectionLimits(self.header_timeout_s, self.max_connections_per_address)  # checks them
