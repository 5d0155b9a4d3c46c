"""Settings of the trainer service (`deltamesh train`): the `[trainer]` table, the one table it reads.

`TrainLoopConfig` extends the compute core's settings (`deltamesh.trainer.config.TrainerConfig`:
model_id, seed, micro-batching and the `[trainer.loss]`, `[trainer.optim]` and `[trainer.checkpoint]`
sections) with where the trainer meets the mesh and how its loop runs, so one table holds both and no
setting is declared twice. (These keys were once a separate `[train]` table; such a file fails naming
the move.) Command-line flags derived from these fields override the file. Every value is checked
in `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from deltamesh.config import http_url, http_urls
from deltamesh.config_flags import flag
from deltamesh.delta.layouts import PoolLayout, parse_layout
from deltamesh.gateway.config import DEFAULT_PIECE_BYTES
from deltamesh.http import parse_listen
from deltamesh.tls import TlsSettings
from deltamesh.trainer.config import TrainerConfig
from deltamesh.trainer.publish_settings import PublishSettings


@dataclass
class TrainLoopConfig(TrainerConfig):
    """One trainer process: the compute core's settings, its broker, origin gateway, initial model,
    signing key and loop settings."""

    broker: str = field(default="", metadata=flag(metavar="URL[,URL...]"))
    """Base URL of the broker the batches come from, or of its active and standby brokers separated
    by commas (`http://a:8700,http://b:8700`): calls fail over between them."""
    broker_token: str = field(default="", metadata=flag(metavar="TOKEN", secret_env="DELTAMESH_BROKER_TOKEN"))
    """Bearer token for the broker (`deltamesh tokens add --role trainer`); empty for an anonymous broker."""
    gateway: str = field(default="", metadata=flag(metavar="URL"))
    """Base URL of the origin gateway the versions are published to."""
    gateway_token: str = field(default="", metadata=flag(metavar="TOKEN", secret_env="DELTAMESH_GATEWAY_TOKEN"))
    """Bearer token for the origin gateway (role trainer, scoped to this model id); empty for an
    anonymous gateway or when the TLS client certificate says who the trainer is."""
    statement_every_s: float = 30.0
    """Between versions, re-sign and upload the head statement this often (0: only with each version),
    so pools that require fresh statements (`statement_max_age_s`) can tell a frozen gateway apart."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS towards the broker and the gateway (`[trainer.tls]`): the CA to verify them, and the client
    certificate to present where they require one."""
    model: str = field(default="", metadata=flag(metavar="PATH"))
    """The initial model: a Hugging Face model directory (bf16 or fp32)."""
    key: str = field(default="", metadata=flag(metavar="PEM"))
    """The trainer's Ed25519 private key."""
    batch_size: int = 16
    """Samples asked of the broker per step (whole groups, so a multiple of the group size)."""
    poll_s: float = 10.0
    """Longest wait of one batch long poll; the loop polls again until a batch comes, and a stop
    request takes effect when a poll ends."""
    max_steps: int | None = None
    """Stop after this many optimizer steps over the whole run, restarts included (unset: until stopped)."""
    full_every: int = 10
    """Every N-th version is also published as a full snapshot (0: only the first)."""
    piece_bytes: int = DEFAULT_PIECE_BYTES
    """Size of the published pieces."""
    upload_connections: int = 4
    """Parallel uploads to the gateway."""
    publish_parts: Literal["auto", "on", "off"] = "auto"
    """on: every rank encodes and uploads its own rows of each version, and rank 0 signs one manifest
    of them (a version built in parts: no rank holds the whole model); off: the weights are gathered to
    rank 0, which publishes them whole; auto: on when the trainer runs on several ranks."""
    pool_layouts: list[str] = field(default_factory=list, metadata=flag("--pool-layout", metavar="LAYOUT"))
    """Layouts of the tensor- or expert-parallel pools that follow this model (`tp2`, `ep4`, `tp4-kv2`):
    each version is hashed and cut so that every rank of them fetches and checks its share alone."""
    encode_first: Literal["auto", "on", "off"] = "auto"
    """on: the next step's compute waits until the version just published is encoded (its upload goes
    on beside the step), so the trainer's own threads do not slow the encode, which every pool waits
    for; off: the step starts at once. auto: on when the trainer computes on the CPU, whose cores the
    step and the encode share; off on a GPU, where they do not."""
    reference: bool = True
    """Keep a frozen copy of the initial weights for the KL penalty (skipped anyway when the loss's kl_coef is 0)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: the rank's GPU if there is one, else the CPU."""
    metrics_file: str | None = None
    """Append one JSON line per step here."""
    metrics_listen: str = field(default="", metadata=flag(metavar="HOST:PORT"))
    """Serve Prometheus `/metrics` (and `/healthz`) of rank 0 on this address; empty: off. Read-only and
    unauthenticated, like a pool's status server: bind it to loopback or the scraper's network."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.broker = http_urls(self.broker, "broker")
        self.gateway = http_url(self.gateway, "gateway")
        if not self.model:
            raise ValueError("model (the initial model directory) is required")
        if not self.key:
            raise ValueError("key (the trainer's Ed25519 private key file) is required")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0 or unset, got {self.max_steps}")
        if self.statement_every_s < 0:
            raise ValueError(f"statement_every_s must be >= 0, got {self.statement_every_s}")
        if self.full_every < 0:
            raise ValueError(f"full_every must be >= 0 (0: only the first version is full), got {self.full_every}")
        if self.piece_bytes < 1024:
            raise ValueError(f"piece_bytes must be >= 1024, got {self.piece_bytes}")
        if self.upload_connections < 1:
            raise ValueError(f"upload_connections must be >= 1, got {self.upload_connections}")
        if self.metrics_listen:
            parse_listen(self.metrics_listen)
        for layout in self.pool_layouts:
            parse_layout(layout)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")

    def publish_settings(self, layouts: Sequence[PoolLayout] = ()) -> PublishSettings:
        """Where and how this trainer's versions go out (`layouts`: `pool_layouts`, parsed), handed whole
        to its publisher."""
        return PublishSettings(self.gateway, self.model_id, full_every=self.full_every, piece_bytes=self.piece_bytes,
                               connections=self.upload_connections, token=self.gateway_token, tls=self.tls,
                               layouts=tuple(layouts))
