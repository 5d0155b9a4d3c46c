"""The RL loss pieces against values worked out by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from deltamesh.trainer.config import LossConfig
from deltamesh.trainer.losses import (
    grpo_advantages,
    k3_kl,
    m2po_keep_mask,
    normalize_advantages,
    policy_loss,
    token_logprobs,
)


def test_token_logprobs_are_aligned_with_the_tokens_they_score():
    # Vocabulary of 2. Position 0's logits predict token 1, position 1's predict token 2.
    logits = torch.tensor([[[math.log(3.0), 0.0], [0.0, math.log(4.0)], [5.0, 5.0]]])
    ids = torch.tensor([[1, 0, 1]])
    lp = token_logprobs(logits, ids)
    # p(token1=0 | ...) = 3/4, p(token2=1 | ...) = 4/5; column 0 scores nothing.
    expected = torch.tensor([[0.0, math.log(3 / 4), math.log(4 / 5)]])
    torch.testing.assert_close(lp, expected)
    # Temperature 2 halves the logits: p = sqrt(3) / (sqrt(3) + 1), 2 / 3.
    lp2 = token_logprobs(logits, ids, temperature=2.0)
    expected2 = torch.tensor([[0.0, math.log(math.sqrt(3) / (math.sqrt(3) + 1)), math.log(2 / 3)]])
    torch.testing.assert_close(lp2, expected2)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 3.0, 0.0, 0.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 5, 5, 5])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    # Group 7: mean 0.5, sample std sqrt(0.5) -> +-0.5 / 0.7071. Group 3: no spread -> 0.
    # Group 9 has one member -> 0. Group 5: mean 1, sample std sqrt((4 + 1 + 1) / 2) = sqrt(3).
    s3 = math.sqrt(3.0)
    expected = torch.tensor([math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0, 0.0, 2 / s3, -1 / s3, -1 / s3])
    torch.testing.assert_close(adv, expected)
    centred = grpo_advantages(rewards, groups, scale_by_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 2.0, -1.0, -1.0]))
    assert adv.dtype == torch.float32


def test_batch_level_normalisation_by_hand():
    a = torch.tensor([1.0, 2.0, 3.0, 6.0])
    # mean 3, sample std sqrt((4 + 1 + 0 + 9) / 3)
    std = math.sqrt(14 / 3)
    torch.testing.assert_close(normalize_advantages(a, eps=0.0), torch.tensor([-2 / std, -1 / std, 0.0, 3 / std]))
    torch.testing.assert_close(normalize_advantages(torch.tensor([4.0])), torch.tensor([0.0]))


def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_fits():
    behaviour = torch.tensor([[0.0, -2.0, -1.0, -0.1, 0.0, -0.5, 9.0]])
    logp = torch.zeros(1, 7)
    mask = torch.tensor([[False, True, True, True, True, True, False]])
    # d over loss tokens = [4, 1, 0.01, 0, 0.25]. Masking none: mean 5.26/5 = 1.052; masking 4:
    # 1.26/4 = 0.315; masking 4 and 1: 0.26/3 = 0.0867 <= 0.1. So exactly those two go.
    keep = m2po_keep_mask(logp, behaviour, mask, threshold=0.1)
    assert keep.tolist() == [[False, False, False, True, True, True, False]]
    # A looser bound keeps more: 0.315 <= 0.4 after masking only the largest.
    assert m2po_keep_mask(logp, behaviour, mask, 0.4).tolist() == [[False, False, True, True, True, True, False]]
    # Loose enough to keep every loss token (never a non-loss one).
    assert m2po_keep_mask(logp, behaviour, mask, 10.0).tolist() == mask.tolist()
    # Threshold 0 masks every token that moved at all.
    assert m2po_keep_mask(logp, behaviour, mask, 0.0).tolist() == [[False, False, False, False, True, False, False]]


def test_m2po_ties_mask_earlier_tokens_first_and_empty_masks_are_fine():
    behaviour = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    logp = torch.zeros(1, 5)
    mask = torch.tensor([[False, True, True, True, True]])
    # d = [1, 1, 1, 0]; mean of the rest must reach <= 0.5: mask two of the tied ones -> 1/2.
    assert m2po_keep_mask(logp, behaviour, mask, 0.5).tolist() == [[False, False, False, True, True]]
    empty = torch.zeros(1, 5, dtype=torch.bool)
    assert not m2po_keep_mask(logp, behaviour, empty, 0.5).any()


def test_k3_kl_by_hand():
    logp = torch.tensor([0.0, math.log(0.5), -1.0])
    ref = torch.tensor([0.0, 0.0, -1.0 - math.log(3.0)])
    # x = ref - logp: 0 -> 0; ln 2 -> 2 - ln 2 - 1; -ln 3 -> 1/3 + ln 3 - 1.
    expected = torch.tensor([0.0, 1 - math.log(2.0), 1 / 3 + math.log(3.0) - 1])
    torch.testing.assert_close(k3_kl(logp, ref), expected)
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def _case():
    """Two sequences, advantages +1 and -1, ratios 1.5 and 0.5 on each (log-ratios ln 1.5, ln 0.5)."""
    behaviour = torch.zeros(2, 4)
    logp = torch.tensor([[0.0, math.log(1.5), math.log(0.5), 0.0], [0.0, math.log(1.5), math.log(0.5), 0.0]])
    logp.requires_grad_(True)
    mask = torch.tensor([[False, True, True, False], [False, True, True, False]])
    adv = torch.tensor([1.0, -1.0])
    return logp, behaviour, adv, mask


def test_clipped_objective_and_its_gradient_by_hand():
    logp, behaviour, adv, mask = _case()
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.0)
    terms = policy_loss(logp, behaviour, adv, mask, mask, cfg)
    # A=+1: ratio 1.5 -> min(1.5, 1.28) = 1.28 (clipped); ratio 0.5 -> min(0.5, 0.8) = 0.5.
    # A=-1: ratio 1.5 -> min(-1.5, -1.28) = -1.5; ratio 0.5 -> min(-0.5, -0.8) = -0.8 (clipped).
    # Token-mean over the 4 loss tokens of the negated objective.
    expected = -(1.28 + 0.5 - 1.5 - 0.8) / 4
    assert terms.loss.item() == pytest.approx(expected, rel=1e-6)
    assert terms.sums["clipped"].item() == 2
    assert terms.sums["tokens"].item() == 4 and terms.sums["kept"].item() == 4
    terms.loss.backward()
    # d(-ratio * A / 4)/d logp = -ratio * A / 4 where unclipped, 0 where the clip is active.
    expected_grad = torch.tensor([[0.0, 0.0, -0.5 / 4, 0.0], [0.0, 1.5 / 4, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected_grad)


def test_kl_penalty_and_batch_wide_token_count():
    logp, behaviour, adv, mask = _case()
    ref = logp.detach() + math.log(2.0)  # x = ln 2 on every token: k3 = 1 - ln 2
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.5)
    terms = policy_loss(logp, behaviour, adv, mask, mask, cfg, ref_logp=ref, token_count=10)
    pg = -(1.28 + 0.5 - 1.5 - 0.8)
    kl = 4 * (1 - math.log(2.0))
    assert terms.loss.item() == pytest.approx((pg + 0.5 * kl) / 10, rel=1e-6)
    assert terms.sums["kl"].item() == pytest.approx(kl, rel=1e-6)
    assert terms.sums["pg"].item() == pytest.approx(pg, rel=1e-6)
    terms.loss.backward()
    # The KL gradient per token: d/dlogp kl_coef * (e^x - x - 1) / 10 = 0.5 * (1 - e^x) / 10 = -0.05.
    expected_grad = torch.tensor([[0.0, -0.05, -0.5 / 10 - 0.05, 0.0], [0.0, 1.5 / 10 - 0.05, -0.05, 0.0]])
    torch.testing.assert_close(logp.grad, expected_grad)


def test_masked_tokens_drop_out_of_the_policy_term_but_stay_in_the_denominator():
    logp, behaviour, adv, mask = _case()
    keep = mask.clone()
    keep[0, 1] = False  # the clipped A=+1 token
    cfg = LossConfig(kl_coef=0.0)
    terms = policy_loss(logp, behaviour, adv, mask, keep, cfg)
    assert terms.loss.item() == pytest.approx(-(0.5 - 1.5 - 0.8) / 4, rel=1e-6)
    assert terms.sums["kept"].item() == 3


def test_far_off_policy_tokens_cannot_produce_nan():
    logp = torch.tensor([[0.0, 0.0, -200.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -150.0, 0.0]])
    mask = torch.tensor([[False, True, True]])
    ref = torch.tensor([[0.0, 0.0, 0.0]])
    cfg = LossConfig(kl_coef=1e-3)
    for keep in (mask, torch.tensor([[False, False, True]])):
        logp.grad = None
        terms = policy_loss(logp, behaviour, torch.tensor([-1.0]), mask, keep, cfg, ref_logp=ref)
        terms.loss.backward()
        assert torch.isfinite(terms.loss) and torch.isfinite(logp.grad).all()
