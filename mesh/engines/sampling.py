"""Token sampling for the in-process engine: temperature, top-k and top-p over a batch of logits.

Returns each sampled token with its behaviour log-probability: the log-probability under the
temperature-scaled distribution before top-k/top-p truncation (see `deltamesh.mesh.engines.base`),
computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

from deltamesh.mesh.engines.base import SamplingParams


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [batch, vocab]; return (tokens [batch], logprobs [batch])."""
    logits = logits.float()
    if params.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = _truncate(logp.exp(), params)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _truncate(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero the probabilities outside the top-k and the top-p nucleus (multinomial renormalizes)."""
    if params.top_k == 0 and params.top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if params.top_k:
        drop[:, params.top_k:] = True
    if params.top_p < 1.0:
        # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
