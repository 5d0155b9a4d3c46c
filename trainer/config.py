"""The trainer's typed settings: the RL loss, the optimizer, checkpointing, batch splitting and the mismatch watch.

`TrainerConfig` is the compute core's part of the `[trainer]` table of a deltamesh config file
(`deltamesh train` reads the whole table as `deltamesh.trainer.loop_config.TrainLoopConfig`, which
extends it), loaded with `deltamesh.config.load_config(TrainerConfig, path, section="trainer", ...)`.
The loss and optimizer sections are plain dataclasses so that the loss functions and the optimizer
step can be called and tested on their own. Every value is checked in `__post_init__`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from deltamesh.config_flags import flag


@dataclass
class LossConfig:
    """M2PO/PPO clipped objective with GRPO advantages and an optional KL penalty."""

    eps_low: float = 0.2
    """PPO's clip range is [1 - eps_low, 1 + eps_high]."""
    eps_high: float = 0.28
    """Upper side of PPO's clip range."""
    m2_threshold: float | None = 0.04
    """M2PO's bound on the mean squared log-ratio between behaviour and current policy (unset: no
    second-moment mask)."""
    kl_coef: float = 1e-3
    """Weight of the k3 KL estimate against the reference policy; applies only when a batch carries
    reference logprobs."""
    group_std: bool = True
    """GRPO: divide each group's advantages by the group's standard deviation."""
    batch_normalize: bool = False
    """Normalise the advantages over the whole batch as well."""
    adv_eps: float = 1e-6
    """Added to standard deviations before dividing by them."""
    temperature: float = 1.0
    """The sampling temperature the behaviour logprobs were taken at (the trainer divides its logits by it)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.m2_threshold is not None and not self.m2_threshold >= 0.0:
            raise ValueError(f"m2_threshold must be >= 0 or unset, got {self.m2_threshold}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if not self.adv_eps > 0.0:
            raise ValueError(f"adv_eps must be > 0, got {self.adv_eps}")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass
class OptimizerConfig:
    """AdamW on the fp32 master weights, with optional linear warm-up and global grad-norm clipping."""

    lr: float = 1e-6
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's two moment decay rates."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.01
    """Applies to matrices only (ndim >= 2), never to norms' gains or biases."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (unset: no clipping)."""
    warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many steps."""
    skip_without_signal: bool = True
    """No update from a batch in which no group's rewards differ (every advantage 0): its only loss is
    the KL penalty at its minimum, whose near-zero gradient AdamW would scale up to full-size steps
    (and weight decay and momentum would move the weights anyway). The version is still made."""

    def __post_init__(self) -> None:
        if not self.lr > 0.0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not self.eps > 0.0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0.0:
            raise ValueError(f"max_grad_norm must be > 0 or unset, got {self.max_grad_norm}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class CheckpointConfig:
    """Where and how often the trainer checkpoints."""

    dir: Path | None = None
    """Directory of the trainer's checkpoints (unset: none; a restarted trainer starts over)."""
    every: int = 10
    """Checkpoint every N published versions."""
    keep: int = 2
    """Newest checkpoints kept."""

    def __post_init__(self) -> None:
        if self.dir is not None:
            self.dir = Path(self.dir)
        if self.every < 1:
            raise ValueError(f"checkpoint.every must be >= 1, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {self.keep}")


@dataclass
class MismatchConfig:
    """When the trainer names a rollout pool whose behaviour logprobs jumped away from its own
    (`deltamesh.trainer.mismatch`): a pool's mean |trainer - behaviour logprob| on a batch's
    current-version tokens is flagged when it exceeds `floor` and `ratio` times the median of the
    other pools in the batch or of its own recent batches."""

    ratio: float = 3.0
    """How many times the other pools' median (or the pool's own running median) counts as a jump."""
    floor: float = 0.02
    """Mismatch (nats per token) below which no pool is flagged: bf16 engines differ from an fp32
    trainer by about this much with the same weights."""
    min_tokens: int = 32
    """Current-version tokens a pool needs in a batch for its reading to be judged (or to judge others by)."""
    window: int = 20
    """Batches of a pool's own history its running median covers."""
    min_history: int = 5
    """Readings a pool needs before its own running median is used."""

    def __post_init__(self) -> None:
        if not self.ratio > 1.0:
            raise ValueError(f"mismatch.ratio must be > 1, got {self.ratio}")
        if not (self.floor >= 0.0 and math.isfinite(self.floor)):
            raise ValueError(f"mismatch.floor must be a finite number >= 0, got {self.floor}")
        if self.min_tokens < 1:
            raise ValueError(f"mismatch.min_tokens must be >= 1, got {self.min_tokens}")
        if self.window < 1 or not 1 <= self.min_history <= self.window:
            raise ValueError(f"mismatch.window must be >= 1 and min_history in 1..window, got {self.window} "
                             f"and {self.min_history}")


@dataclass
class TrainerConfig:
    """Everything the trainer's compute core needs."""

    model_id: str = field(default="default", metadata=flag(metavar="ID"))
    """The model_id of this policy's weight stream and batches."""
    seed: int = 0
    """Seed of the trainer's random state."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward pass on each rank (unset: the rank's whole share of the batch at
    once); it changes memory use, not the result's meaning, since the loss is normalised over the batch."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The RL loss (`[trainer.loss]`)."""
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer (`[trainer.optim]`)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing (`[trainer.checkpoint]`)."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """When a rollout pool's logprob mismatch counts as a jump (`[trainer.mismatch]`)."""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or unset, got {self.micro_batch_size}")
