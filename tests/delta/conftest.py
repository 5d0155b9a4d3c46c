"""Fixtures of the codec tests: a signing key, and a bit-exact comparison of weights."""

from __future__ import annotations

from typing import Callable, Mapping

import pytest
import torch

from deltamesh.delta import generate_key


@pytest.fixture(scope="session")
def key():
    return generate_key()


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture(scope="session")
def same_weights() -> Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], bool]:
    """Whether two weight mappings hold the same names, dtypes, shapes and bytes (NaN payloads too)."""

    def same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
        if a.keys() != b.keys():
            return False
        return all(
            a[n].dtype == b[n].dtype and tuple(a[n].shape) == tuple(b[n].shape) and _bits(a[n]) == _bits(b[n])
            for n in a
        )

    return same
