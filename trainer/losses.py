"""The RL objective on plain tensors: GRPO advantages, M2PO's second-moment mask, PPO clipping, k3 KL.

Conventions shared by every function here. Sequences are rows of a [B, T] token matrix. A
per-token logprob tensor is aligned with the tokens it scores: `logp[b, t]` is
log pi(token[b, t] | token[b, :t]), so column 0 scores nothing and the loss mask is always False
there. Behaviour logprobs are the rollout engine's, reference logprobs a frozen reference policy's.

The loss is aggregated as a token-level mean over the whole batch: the sum over every loss token of
(-clipped surrogate on the tokens M2PO keeps + kl_coef * k3 KL), divided by the number of loss
tokens (M2PO-masked tokens count in that denominator but contribute nothing to the policy term;
the KL penalty applies to every loss token). Passing the batch-wide token count lets a caller split
a batch into micro-batches or over ranks and still get exactly the whole-batch gradient by summing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltamesh.trainer.config import LossConfig

# exp() of a log-ratio beyond this is clamped: a token this far off-policy must not overflow the
# ratio (its gradient would be inf * 0 = NaN even when masked out).
LOG_RATIO_LIMIT = 20.0


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token logprobs [B, T] of `input_ids` under causal-LM `logits` [B, T, V] (column 0 is 0).

    Logits at position t predict token t + 1; they are divided by the sampling temperature so the
    result is comparable with the behaviour logprobs the sampler reported.
    """
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    picked = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's group-relative advantages: (r - mean_group) / (std_group + eps), one per sequence.

    Groups are the sequences sharing a group id (the samples of one prompt). The std is the sample
    (n - 1) standard deviation; a group of one sequence gets advantage 0. With `scale_by_std` False
    the advantages are only centred (Dr. GRPO). Computed in float64, returned as float32.
    """
    r = rewards.detach().double().reshape(-1)
    _, group = torch.unique(group_ids.reshape(-1), return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    counts = zeros.clone().index_add_(0, group, torch.ones_like(r))
    means = zeros.clone().index_add_(0, group, r) / counts
    centred = r - means[group]
    if scale_by_std:
        sq = zeros.clone().index_add_(0, group, centred * centred)
        std = (sq / (counts - 1).clamp(min=1)).sqrt()
        # A group without spread is all zeros; keep it so even when eps is 0.
        centred = torch.where(centred == 0, centred, centred / (std[group] + eps))
    return centred.float()


def rewards_differ(rewards: torch.Tensor, group_ids: torch.Tensor) -> bool:
    """Whether any group's rewards differ. If none do, every GRPO advantage is 0 (up to rounding) and
    no sample carries a policy-gradient signal."""
    r = rewards.detach().double().reshape(-1)
    if r.numel() == 0:
        return False
    _, group = torch.unique(group_ids.reshape(-1), return_inverse=True)
    n = int(group.max()) + 1
    high = torch.full((n,), -math.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, group, r, "amax")
    low = torch.full((n,), math.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, group, r, "amin")
    return bool((high > low).any())


def normalize_advantages(advantages: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Batch-level normalisation over sequences: (a - mean) / (std + eps), sample std."""
    a = advantages.double()
    if a.numel() < 2:
        return (a - a.mean()).float()
    centred = a - a.mean()
    return torch.where(centred == 0, centred, centred / (a.std() + eps)).float()


def m2po_keep_mask(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, loss_mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """M2PO's second-moment trust region: which loss tokens stay in the policy term.

    Over the loss tokens, d = (logp_behaviour - logp)^2. The tokens with the largest d are masked,
    largest first, until the mean of d over the remaining tokens is <= `threshold` (the fewest
    masked that achieve it; ties broken by position, earlier first). Returns a bool [B, T] mask, a
    subset of `loss_mask`. Uses no gradient.
    """
    sel = loss_mask.bool()
    d = (behaviour_logp.detach().double() - logp.detach().double()).square()[sel]
    keep = sel.clone()
    n = d.numel()
    if n == 0:
        return keep
    order = torch.sort(d, descending=True, stable=True).indices
    ordered = d[order]
    # rest_sum[k]: sum of d over the tokens left after masking the k largest (k = 0..n).
    rest_sum = torch.cat([ordered.flip(0).cumsum(0).flip(0), ordered.new_zeros(1)])
    rest_count = torch.arange(n, -1, -1, dtype=torch.float64, device=d.device)
    k = int(torch.nonzero(rest_sum <= threshold * rest_count)[0])
    kept = torch.ones(n, dtype=torch.bool, device=d.device)
    kept[order[:k]] = False
    keep[sel] = kept
    return keep


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(x) - x - 1 with x = ref - logp."""
    x = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.expm1(x) - x


@dataclass
class LossTerms:
    """One (micro-)batch's loss and the sums its statistics are built from.

    `loss` is differentiable and already divided by the batch-wide token count. The sums are
    float64 scalars that add up across micro-batches and ranks: loss tokens, tokens M2PO kept,
    kept tokens whose ratio was clipped, the policy and KL terms (undivided), d = squared
    log-ratio over all loss tokens and over the kept ones, and the ratio over kept tokens.
    """

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]


SUM_NAMES = ("tokens", "kept", "clipped", "pg", "kl", "d_all", "d_kept", "ratio")


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    keep_mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    token_count: int | float | None = None,
) -> LossTerms:
    """The clipped surrogate on `keep_mask` tokens plus the k3 KL penalty on `loss_mask` tokens.

    Per kept token: ratio = exp(logp - logp_behaviour), objective = min(ratio * A, clip(ratio,
    1 - eps_low, 1 + eps_high) * A) with A the sequence's advantage; the loss is the negated
    objective. `token_count` is the denominator of the token mean (default: this batch's loss
    tokens). See the module docstring for the aggregation.
    """
    mask = loss_mask.bool()
    keep = keep_mask.bool() & mask
    if token_count is None:
        token_count = max(int(mask.sum()), 1)
    adv = advantages.to(logp.dtype).reshape(-1, 1)
    diff = logp - behaviour_logp.to(logp.dtype)
    # Masked tokens get log-ratio 0 so neither value nor gradient can turn into inf or NaN there.
    log_ratio = torch.where(keep, diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), torch.zeros_like(diff))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    objective = torch.minimum(unclipped, clipped)
    pg_tokens = torch.where(keep, -objective, torch.zeros_like(objective))
    total = pg_tokens.sum()
    kl_sum = torch.zeros((), dtype=torch.float64, device=logp.device)
    if ref_logp is not None and cfg.kl_coef > 0.0:
        kl_tokens = torch.where(mask, k3_kl(logp, ref_logp.to(logp.dtype)), torch.zeros_like(logp))
        total = total + cfg.kl_coef * kl_tokens.sum()
        kl_sum = kl_tokens.detach().double().sum()
    d = diff.detach().double().square()
    sums = {
        "tokens": mask.double().sum(),
        "kept": keep.double().sum(),
        "clipped": (keep & (clipped < unclipped)).double().sum(),
        "pg": pg_tokens.detach().double().sum(),
        "kl": kl_sum,
        "d_all": d[mask].sum(),
        "d_kept": d[keep].sum(),
        "ratio": ratio.detach().double()[keep].sum(),
    }
    return LossTerms(loss=total / token_count, sums=sums)
