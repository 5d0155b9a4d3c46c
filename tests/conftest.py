"""Shared test fixtures: free ports, temporary directories, process clean-up and weight versions."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def next_bf16_version(weights: dict, seed: int, share: float = 0.02) -> dict:
    """The weights after one RL optimizer step: `share` of each tensor's bf16 words move by +-1 or 2 ulps.

    A word whose magnitude bits are tiny only grows, so no move crosses zero into the other sign (or NaN).
    """
    import torch  # here, not at the top: most test directories never need torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        words = w.contiguous().view(-1).view(torch.int16).clone()
        hit = torch.rand(words.shape, generator=g) < share
        moves = torch.randint(1, 3, words.shape, generator=g, dtype=torch.int16)
        down = (torch.rand(words.shape, generator=g) < 0.5) & ((words & 0x7FFF) > 2)
        moved = torch.where(down, words - moves, words + moves)
        out[name] = torch.where(hit, moved, words).view(torch.bfloat16).view(w.shape)
    return out


@pytest.fixture(scope="session")
def rl_step():
    """`next_bf16_version`, for test modules (they cannot import a conftest)."""
    return next_bf16_version
