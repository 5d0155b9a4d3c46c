"""Token sampling: truncation keeps the right tokens, logprobs are those of the tempered distribution."""

from __future__ import annotations

import pytest
import torch

from deltamesh.mesh.engines.base import Generation, SamplingParams
from deltamesh.mesh.engines.sampling import sample_next

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9, -5.0]] * 2000)


def draw(**kw) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_next(LOGITS, SamplingParams(**kw), torch.Generator().manual_seed(0))


def test_greedy_and_its_logprob():
    tokens, logprobs = draw(temperature=0)
    assert (tokens == 1).all()
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS[0], -1)[1])


def test_top_k_and_top_p_keep_only_the_head():
    tokens, _ = draw(temperature=1.0, top_k=2)
    assert set(tokens.tolist()) == {1, 3}
    tokens, _ = draw(temperature=1.0, top_p=0.5)  # token 1 alone has ~0.47: token 3 completes the nucleus
    assert set(tokens.tolist()) == {1, 3}
    tokens, _ = draw(temperature=1.0, top_p=0.01)
    assert set(tokens.tolist()) == {1}
    tokens, _ = draw(temperature=1.0)
    assert {0, 1, 2, 3} <= set(tokens.tolist())


def test_logprobs_are_tempered_but_not_truncated():
    tokens, logprobs = draw(temperature=0.5, top_k=2)
    expected = torch.log_softmax(LOGITS[0] / 0.5, -1)[tokens]
    assert torch.allclose(logprobs, expected)


def test_params_and_generation_are_validated():
    for bad in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="one entry per generated token"):
        Generation(prompt=[1], tokens=[2, 3], logprobs=[-0.1], versions=[0, 0])
