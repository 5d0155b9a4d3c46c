"""Settings of the trainer service (`deltamesh train`): where it meets the mesh and how its loop runs.

`TrainLoopConfig` is the `[train]` table of a deltamesh config file; the compute core's settings
(loss, optimizer, checkpoints, model_id) stay in `[trainer]` (`deltamesh.trainer.config`). Command-line
flags override both. Every value is checked in `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltamesh.config import http_url
from deltamesh.gateway.publisher import DEFAULT_PIECE_BYTES


@dataclass
class TrainLoopConfig:
    """One trainer process: its broker, origin gateway, initial model, signing key and loop settings.

    `batch_size` is the number of samples asked of the broker per step (whole groups, so make it a
    multiple of the group size). `poll_s` bounds one long poll; the loop polls again until a batch
    comes, and a stop request takes effect when a poll ends. `max_steps` counts optimizer steps over
    the whole run, restarts included (None: run until stopped). `full_every` makes every N-th version
    also a full snapshot (0: only the first). `reference` keeps a frozen copy of the initial weights
    for the KL penalty (it is skipped anyway when the loss's `kl_coef` is 0). `device` is "auto"
    (the rank's GPU if there is one, else the CPU), "cpu" or "cuda". `metrics_file` receives one
    JSON line per step.
    """

    broker: str = ""
    gateway: str = ""
    model: str = ""
    key: str = ""
    batch_size: int = 16
    poll_s: float = 10.0
    max_steps: int | None = None
    full_every: int = 10
    piece_bytes: int = DEFAULT_PIECE_BYTES
    upload_connections: int = 4
    reference: bool = True
    device: str = "auto"
    metrics_file: str | None = None

    def __post_init__(self) -> None:
        self.broker = http_url(self.broker, "broker")
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
        if self.full_every < 0:
            raise ValueError(f"full_every must be >= 0 (0: only the first version is full), got {self.full_every}")
        if self.piece_bytes < 1024:
            raise ValueError(f"piece_bytes must be >= 1024, got {self.piece_bytes}")
        if self.upload_connections < 1:
            raise ValueError(f"upload_connections must be >= 1, got {self.upload_connections}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
