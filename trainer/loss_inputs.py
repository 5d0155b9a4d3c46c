"""What one optimizer step consumes, as plain tensors: tokens, masks, logprobs, rewards and groups.

`LossInputs` is the compute core's side of the batch interface: whatever format batches travel in,
the trainer turns each into one of these. Per-token tensors are [B, T] and aligned with the tokens
they describe (see `deltamesh.trainer.losses`): `behaviour_logprobs[b, t]` is the rollout engine's
logprob of `input_ids[b, t]`, and `loss_mask[b, t]` says whether that token is trained on (the
response tokens; never column 0). `versions[b, t]`, when given, is the policy version that generated
the token (-1 where none did); the trainer measures its mismatch with the pools on the tokens of its
own current version (`deltamesh.trainer.mismatch`). The constructor checks shapes and values and
fixes dtypes, so a malformed batch fails here with a clear message rather than deep inside the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from deltamesh.trainer.distributed import DistContext, broadcast_tensors

if TYPE_CHECKING:
    from deltamesh.data import Batch


@dataclass
class LossInputs:
    """One batch of B sequences padded to T tokens (right or left padding both work)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool
    behaviour_logprobs: torch.Tensor  # [B, T] float32
    rewards: torch.Tensor  # [B] float32
    group_ids: torch.Tensor  # [B] int64: sequences sampled for the same prompt share an id
    attention_mask: torch.Tensor | None = None  # [B, T] int64; None: every token is real
    ref_logprobs: torch.Tensor | None = None  # [B, T] float32, for the KL penalty
    versions: torch.Tensor | None = None  # [B, T] int64, the version that generated each token (-1: none)

    DTYPES: ClassVar[dict[str, torch.dtype]] = {
        "input_ids": torch.int64,
        "loss_mask": torch.bool,
        "behaviour_logprobs": torch.float32,
        "rewards": torch.float32,
        "group_ids": torch.int64,
        "attention_mask": torch.int64,
        "ref_logprobs": torch.float32,
        "versions": torch.int64,
    }

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.is_floating_point():
            raise ValueError(f"input_ids must be a [B, T] integer tensor, got {tuple(self.input_ids.shape)}")
        shape = tuple(self.input_ids.shape)
        rows = shape[0]
        for name in ("loss_mask", "behaviour_logprobs", "attention_mask", "ref_logprobs", "versions"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} like input_ids")
        for name in ("rewards", "group_ids"):
            t = getattr(self, name)
            if tuple(t.shape) != (rows,):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({rows},): one per sequence")
        for name, dtype in self.DTYPES.items():
            t = getattr(self, name)
            if t is not None and t.dtype != dtype:
                setattr(self, name, t.to(dtype))
        if rows and self.loss_mask[:, 0].any():
            raise ValueError("loss_mask is set in column 0, which no logprob scores")
        if self.attention_mask is not None and (self.loss_mask & (self.attention_mask == 0)).any():
            raise ValueError("loss_mask covers tokens that attention_mask marks as padding")
        if not torch.isfinite(self.rewards).all():
            raise ValueError("rewards must be finite")
        for name in ("behaviour_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None and not torch.isfinite(t[self.loss_mask]).all():
                raise ValueError(f"{name} must be finite on every loss token")

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def slice(self, start: int, stop: int) -> "LossInputs":
        """Sequences [start, stop) (views, no copy)."""
        return LossInputs(**{n: None if t is None else t[start:stop] for n, t in self.tensors().items()})

    def to(self, device: torch.device | str) -> "LossInputs":
        return LossInputs(**{n: None if t is None else t.to(device) for n, t in self.tensors().items()})


def broadcast_inputs(inputs: LossInputs | None, ctx: DistContext) -> LossInputs:
    """Rank 0's batch on every rank (rank 0 passes it, the others None); single-process a no-op."""
    if not ctx.distributed:
        if inputs is None:
            raise ValueError("single-process training needs the batch")
        return inputs
    sent = broadcast_tensors(None if inputs is None else inputs.tensors(), LossInputs.DTYPES, ctx)
    return LossInputs(**sent)


def inputs_from_batch(batch: "Batch") -> LossInputs:
    """The loss inputs of a broker batch: right-padded rows, attention from the lengths, groups by index.

    Reference logprobs are not part of a batch; add them with `step.batch_logprobs` and a frozen
    reference model when the KL penalty is on.
    """
    t = batch.tensors()
    width = t["tokens"].shape[1]
    attention = (torch.arange(width).unsqueeze(0) < t["lengths"].unsqueeze(1)).to(torch.int64)
    return LossInputs(
        input_ids=t["tokens"],
        loss_mask=t["loss_mask"],
        behaviour_logprobs=t["logprobs"],
        rewards=t["rewards"],
        group_ids=t["group_index"],
        attention_mask=attention,
        versions=t["versions"],
    )
