"""Dtypes the codec carries: safetensors names, torch dtypes, and the integer word view of a tensor.

The codec never does arithmetic on values, only on *words*: the raw bits of each element seen as a
signed integer of the same width. `word_view` gives that view without copying; `is_float` says
whether a dtype is sign-magnitude (its words need the order-preserving key of `bitdiff.py`).
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import CodecError
from .manifest import DTYPE_SIZES, FLOAT_DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

# Signed words of each width: torch arithmetic on them wraps modulo 2**bits, which is what deltas need.
WORD_DTYPES: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Unsigned numpy twins, used where wrap-around must be well defined (numpy unsigned arithmetic is).
NP_UWORDS: dict[int, type] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
NP_SWORDS: dict[int, type] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def dtype_name(t: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise CodecError(f"unsupported dtype {t.dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise CodecError(f"unsupported dtype {name!r}") from None


def is_float(name: str) -> bool:
    return name in FLOAT_DTYPES


def word_size(name: str) -> int:
    return DTYPE_SIZES[name]


def word_view(t: torch.Tensor) -> torch.Tensor:
    """The 1-D signed-integer view of a contiguous tensor's elements (same storage, any device)."""
    if not t.is_contiguous():
        raise CodecError("word_view needs a contiguous tensor")
    flat = t.reshape(-1)
    width = flat.element_size()
    if flat.dtype == WORD_DTYPES[width]:
        return flat
    return flat.view(WORD_DTYPES[width])


def np_words(t: torch.Tensor) -> np.ndarray:
    """A zero-copy unsigned numpy view of a contiguous CPU tensor's words."""
    flat = word_view(t.detach())
    if flat.device.type != "cpu":
        raise CodecError("np_words needs a CPU tensor")
    if flat.numel() == 0:
        return np.empty(0, dtype=NP_UWORDS[flat.element_size()])
    return flat.numpy().view(NP_UWORDS[flat.element_size()])
