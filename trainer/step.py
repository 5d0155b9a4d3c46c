"""One RL optimizer step on fp32 master weights, and the bf16 weights that step publishes.

`train_step` takes a `LossInputs` batch (the same on every rank), computes GRPO advantages over the
whole batch, takes this rank's equal share of the sequences, runs them through the model in
micro-batches, accumulates the gradient of the M2PO/PPO loss (normalised by the whole batch's token
count, so micro-batches and ranks simply add up), clips the global gradient norm and takes one AdamW
step (none when no group's rewards differ: `OptimizerConfig.skip_without_signal`). When the batch is
split (micro-batches or ranks), M2PO's mask must still see every token of
the batch, so a gradient-free forward pass first gathers the current logprobs of all of them.
The training forward pass also yields, per row, the trainer-side mismatch sums on the tokens
generated at the trainer's current version (`deltamesh.trainer.mismatch`), kept in
`TrainState.row_mismatch` for the loop to split by pool.
The model trains in fp32; `published_weights` is what a version is: every floating tensor cast to
bf16. A trainer loop is then: batch -> `train_step` -> `published_weights` -> publish -> checkpoint.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deltamesh.trainer.config import OptimizerConfig, TrainerConfig
from deltamesh.trainer.distributed import (
    SINGLE,
    DistContext,
    all_reduce_sum,
    full_state_dict,
    local_state,
    local_tensor,
)
from deltamesh.trainer.loss_inputs import LossInputs
from deltamesh.trainer.losses import (
    SUM_NAMES,
    grpo_advantages,
    m2po_keep_mask,
    normalize_advantages,
    policy_loss,
    rewards_differ,
    token_logprobs,
)
from deltamesh.trainer.mismatch import ROW_SUMS, row_sums

log = logging.getLogger(__name__)

PUBLISH_DTYPE = torch.bfloat16


@dataclass
class TrainState:
    """The model being trained (fp32, possibly FSDP-sharded), its optimizer and its counters.

    `version` is the version number the current weights are published as; `step` counts optimizer
    steps taken (it drives the warm-up). Both advance by one per `train_step`. `row_mismatch` holds
    the last step's per-row `mismatch.row_sums` [B, 3] (on the CPU, the same on every rank), or None
    when its batch carried no token versions.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    version: int = 0
    step: int = 0
    row_mismatch: torch.Tensor | None = None


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and Python's RNGs (same seed on every rank)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the model's parameters; weight decay on matrices only (not norms or biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def learning_rate(cfg: OptimizerConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up, then constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def sequence_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """Per-token logprobs [B, T] of the sequences under the model (aligned as in `losses`)."""
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
        # Positions count real tokens only, so left-padded rows see the positions the sampler used.
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits
    return token_logprobs(logits, input_ids, temperature)


def clip_grad_norm(model: nn.Module, max_norm: float | None, ctx: DistContext) -> float:
    """Global L2 norm of the gradient over all ranks, then scale it down to `max_norm` if above.

    The squares are summed in float64: a sharded and an unsharded model then get the same float32
    clip coefficient (fp64 rounding differences vanish when rounded to fp32), which keeps a
    multi-rank run bit-identical to a single-process one.
    """
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g, dtype=torch.float64).square()
    norm = float(all_reduce_sum(total, ctx).sqrt())
    if max_norm is not None and norm > 0.0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(torch.tensor(coef, dtype=g.dtype))
    return norm


def _micro_bounds(rows: int, micro: int | None) -> list[tuple[int, int]]:
    size = rows if micro is None else min(micro, rows)
    return [(a, min(a + size, rows)) for a in range(0, rows, size)]


def batch_logprobs(
    model: nn.Module, inputs: LossInputs, cfg: TrainerConfig, ctx: DistContext = SINGLE
) -> torch.Tensor:
    """Per-token logprobs [B, T] of the whole batch under `model`, without gradient, on every rank.

    Each rank scores its share in micro-batches; the shares are then summed across ranks (each rank
    leaves the others' rows zero, so the sum is an exact gather). Used for M2PO's batch-wide mask
    and, with a frozen reference model, for the KL penalty's reference logprobs.
    """
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    first, stop = ctx.row_range(inputs.rows)
    logp = torch.zeros(inputs.input_ids.shape, dtype=torch.float32, device=device)
    with torch.no_grad():
        for a, b in _micro_bounds(stop - first, cfg.micro_batch_size):
            mb = inputs.slice(first + a, first + b)
            scored = sequence_logprobs(model, mb.input_ids, mb.attention_mask, cfg.loss.temperature)
            logp[first + a : first + b] = scored
    return all_reduce_sum(logp, ctx)


def train_step(
    state: TrainState, inputs: LossInputs, cfg: TrainerConfig, ctx: DistContext = SINGLE
) -> dict[str, float]:
    """One optimizer step on `inputs` (the whole batch, identical on every rank); returns metrics.

    Every rank must call it with the same batch. The metrics (loss, pg_loss, kl, m2, m2_kept,
    m2po_masked_frac, clip_frac, ratio_mean, grad_norm, lr, reward_mean, tokens, sequences, version,
    step, and the batch-wide mismatch, mismatch_k3 and mismatch_tokens on the tokens of the version
    trained on) are global, the same on every rank.
    """
    model, lcfg = state.model, cfg.loss
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    token_count = inputs.loss_tokens
    if token_count == 0:
        raise ValueError("the batch has no loss tokens")
    advantages = grpo_advantages(inputs.rewards, inputs.group_ids, scale_by_std=lcfg.group_std, eps=lcfg.adv_eps)
    if lcfg.batch_normalize:
        advantages = normalize_advantages(advantages, lcfg.adv_eps)
    advantages = advantages.to(device)
    first, stop = ctx.row_range(inputs.rows)
    bounds = _micro_bounds(stop - first, cfg.micro_batch_size)

    model.train()
    batch_keep = None
    if lcfg.m2_threshold is not None and (ctx.distributed or len(bounds) > 1):
        # A split batch: M2PO's mask must still rank every token of the batch, so score them all first.
        current = batch_logprobs(model, inputs, cfg, ctx)
        batch_keep = m2po_keep_mask(current, inputs.behaviour_logprobs, inputs.loss_mask, lcfg.m2_threshold)

    state.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(len(SUM_NAMES), dtype=torch.float64, device=device)
    # This rank's rows only; the others stay zero, so the all-reduce below gathers them exactly.
    mismatch = torch.zeros(inputs.rows, len(ROW_SUMS), dtype=torch.float64, device=device)
    for a, b in bounds:
        mb = inputs.slice(first + a, first + b)
        logp = sequence_logprobs(model, mb.input_ids, mb.attention_mask, lcfg.temperature)
        if lcfg.m2_threshold is None:
            keep = mb.loss_mask
        elif batch_keep is None:
            keep = m2po_keep_mask(logp, mb.behaviour_logprobs, mb.loss_mask, lcfg.m2_threshold)
        else:
            keep = batch_keep[first + a : first + b]
        terms = policy_loss(
            logp,
            mb.behaviour_logprobs,
            advantages[first + a : first + b],
            mb.loss_mask,
            keep,
            lcfg,
            ref_logp=mb.ref_logprobs,
            token_count=token_count,
        )
        terms.loss.backward()
        sums += torch.stack([terms.sums[n] for n in SUM_NAMES])
        if mb.versions is not None:
            current = mb.loss_mask & (mb.versions == state.version)  # older tokens carry lag, not mismatch
            mismatch[first + a : first + b] = row_sums(logp, mb.behaviour_logprobs, current)

    grad_norm = clip_grad_norm(model, cfg.optim.max_grad_norm, ctx)
    lr = learning_rate(cfg.optim, state.step)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    # Every rank sees the same batch, so every rank decides alike (no collective needed).
    update = not cfg.optim.skip_without_signal or rewards_differ(inputs.rewards, inputs.group_ids)
    if update:
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    # The version advances either way: the loop publishes one per batch, and the broker counts on it.
    state.step += 1
    state.version += 1

    # One collective for the loss sums and the mismatch rows together.
    reduced = all_reduce_sum(torch.cat([sums, mismatch.flatten()]), ctx)
    s = dict(zip(SUM_NAMES, reduced[: len(SUM_NAMES)].tolist()))
    rows = reduced[len(SUM_NAMES) :].reshape(inputs.rows, len(ROW_SUMS)).cpu()
    state.row_mismatch = rows if inputs.versions is not None else None
    abs_sum, k3_sum, counted = rows.sum(0).tolist()
    kept = max(s["kept"], 1.0)
    metrics = {
        "loss": (s["pg"] + lcfg.kl_coef * s["kl"]) / s["tokens"],
        "pg_loss": s["pg"] / s["tokens"],
        "kl": s["kl"] / s["tokens"],
        "m2": s["d_all"] / s["tokens"],
        "m2_kept": s["d_kept"] / kept,
        "m2po_masked_frac": 1.0 - s["kept"] / s["tokens"],
        "clip_frac": s["clipped"] / kept,
        "ratio_mean": s["ratio"] / kept,
        "grad_norm": grad_norm,
        "lr": lr,
        "updated": 1.0 if update else 0.0,
        "reward_mean": float(inputs.rewards.double().mean()),
        "tokens": s["tokens"],
        "mismatch": abs_sum / counted if counted else 0.0,
        "mismatch_k3": k3_sum / counted if counted else 0.0,
        "mismatch_tokens": counted,
        "sequences": float(inputs.rows),
        "version": float(state.version),
        "step": float(state.step),
    }
    log.debug("step %d: %s", state.step, metrics)
    return metrics


def published_shard(model: nn.Module) -> tuple[list, dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """What this rank publishes of a version built in parts (no collective): the model's tensor table,
    the rows it holds cast to bf16, and which rows (`distributed.local_state`)."""
    return local_state(model, PUBLISH_DTYPE)


def published_weights(model: nn.Module, ctx: DistContext = SINGLE) -> dict[str, torch.Tensor] | None:
    """The weights a version publishes: every floating tensor cast to bf16, on CPU, on rank 0.

    Other ranks get None but must call it too (it gathers the shards). Tied tensors appear once.
    """
    return full_state_dict(model, ctx, dtype=PUBLISH_DTYPE)
