"""Typed settings of `deltamesh publish` and of a training loop's `WeightPublisher`: the `[publish]`
table, loaded by `deltamesh.config.load_config`; flags are derived from its fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamesh.config import http_url
from deltamesh.config_flags import flag
from deltamesh.gateway.config import DEFAULT_PIECE_BYTES
from deltamesh.tls import TlsSettings, check_token_transport
from deltamesh.trainer.publish_settings import PublishSettings


@dataclass
class PublishConfig:
    """`deltamesh publish`: which origin gateway, model and key, and how versions are cut and uploaded."""

    gateway: str = field(default="", metadata=flag(metavar="URL"))
    """Origin gateway base URL."""
    model: str = ""
    """Model id the version is published under."""
    key: str = field(default="", metadata=flag(metavar="PEM"))
    """The trainer's Ed25519 private key."""
    token: str = field(default="", metadata=flag("--token", secret_env="DELTAMESH_TOKEN"))
    """The trainer's token at the gateway (role trainer, scoped to its model ids); empty when its client
    certificate (common name trainer/NAME) identifies it, or the gateway is anonymous."""
    version: int | None = None
    """Version number (unset: one after the gateway's head)."""
    full_every: int = 10
    """Also publish a full snapshot every N versions."""
    piece_mib: float = DEFAULT_PIECE_BYTES / 2**20
    """Piece size in MiB."""
    connections: int = 4
    """Parallel uploads."""
    state: str = ""
    """Directory keeping the last published weights (empty: $XDG_CACHE_HOME/deltamesh/publish/MODEL)."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS towards the gateway: `--ca` verifies an https:// gateway, `cert` is presented when it asks."""

    def __post_init__(self) -> None:
        self.gateway = http_url(self.gateway, "gateway")
        if not self.model:
            raise ValueError("model is required (the model id)")
        if not self.key:
            raise ValueError("key is required (the trainer's private key file)")
        if self.token:
            check_token_transport(self.gateway, self.tls.insecure)
        if self.version is not None and self.version < 0:
            raise ValueError("version must be >= 0")
        if self.full_every < 0 or self.connections < 1 or not self.piece_mib > 0:
            raise ValueError("full_every must be >= 0, connections >= 1 and piece_mib > 0")

    def publish_settings(self) -> PublishSettings:
        """Where and how `deltamesh publish` (or a `WeightPublisher`) sends versions, handed whole to its
        publisher."""
        return PublishSettings(self.gateway, self.model, full_every=self.full_every,
                               piece_bytes=int(self.piece_mib * 2**20), connections=self.connections,
                               token=self.token or None, tls=self.tls)
