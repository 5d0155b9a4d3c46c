"""Where and how a trainer's versions go out, as one object handed whole to its publisher.

The trainer's settings (`TrainLoopConfig` for `deltamesh train`, `PublishConfig` for `deltamesh publish`
and `WeightPublisher`) each build one `PublishSettings`; the publisher of whole weights
(`Publisher.from_settings`), each rank's publisher of a version in parts (`ShardPublisher.from_settings`)
and rank 0's `MeshClient` take it as it is, so no setting is copied by hand through a constructor's
arguments or renamed on the way. `check_publish_numbers` is the one check of its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltamesh.delta.layouts import PoolLayout
from deltamesh.gateway.config import DEFAULT_PIECE_BYTES
from deltamesh.tls import TlsSettings


def check_publish_numbers(full_every: int, piece_bytes: int, connections: int) -> None:
    """Raise ValueError unless a full snapshot every `full_every` versions (0: only the first), pieces of
    `piece_bytes` and `connections` parallel uploads make sense."""
    if full_every < 0:
        raise ValueError("full_every must be >= 0 (0: only the first version is full)")
    if piece_bytes < 1 or connections < 1:
        raise ValueError(f"piece_bytes and connections must be >= 1, got {piece_bytes} and {connections}")


@dataclass(frozen=True)
class PublishSettings:
    """The origin gateway, the model id, the cadence of full snapshots, how versions are cut and
    uploaded, the trainer's credentials there, and the pool layouts each version is cut and hashed for."""

    gateway: str
    model_id: str
    full_every: int = 10
    """Also publish a full snapshot every N versions (0: only the first version is full)."""
    piece_bytes: int = DEFAULT_PIECE_BYTES
    connections: int = 4
    """Parallel uploads."""
    token: str | None = None
    """The trainer's token at the gateway (role trainer); None or empty: a client certificate or none."""
    tls: TlsSettings | None = None
    layouts: tuple[PoolLayout, ...] = ()

    def __post_init__(self) -> None:
        check_publish_numbers(self.full_every, self.piece_bytes, self.connections)
