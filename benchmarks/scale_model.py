"""The synthetic models of benchmarks/scale.py: a Qwen3-shaped dense model of a few GB built shard by shard,
its RL steps, and a mixture of experts for the expert-parallel fetch.

A trainer rank builds only its rows of each tensor (seeded by tensor and first row, so a run with the
same rank count builds the same model), and steps them as a first Adam step moves bf16 weights: every
weight moves by the learning rate in fp32, and the bf16 word changes only where that crosses half its
spacing, so the changes fall on the small weights, as in a real step (about 1% of words at the default
rate; SmolLM2-135M's real step at lr 5e-6 moves 0.98%: BENCHMARKS.md). The mixture of experts has 8
experts per layer whose tensors hold 90% of its words, as experts dominate real MoE checkpoints.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import torch
from inputs import qwen3_shapes

from deltamesh.delta.cuts import TensorSpec

LR = 1.0e-6
"""The step's learning rate: about 1% of this model's words move per step."""


def dense_shapes(gigabytes: float, *, quick: bool = False) -> dict[str, tuple[int, ...]]:
    """A Qwen3 decoder (hidden 2048, intermediate 6144, 16/8 heads of 128) with as many layers as make
    at least `gigabytes` of bf16; `quick`: a small one (hidden 256, 4/2 heads of 64, vocab 8192) for smoke runs."""
    layers = 1
    while True:
        if quick:
            shapes = qwen3_shapes(layers=layers, hidden=256, intermediate=768, q_heads=4, kv_heads=2, head_dim=64,
                                  vocab=8192)
        else:
            shapes = qwen3_shapes(layers=layers, hidden=2048, intermediate=6144)
        if sum(_numel(s) for s in shapes.values()) * 2 >= gigabytes * 1e9:
            return shapes
        layers += 1


def moe_shapes(layers: int = 6, experts: int = 8, hidden: int = 1024, intermediate: int = 2048,
               vocab: int = 16384) -> dict[str, tuple[int, ...]]:
    """A Qwen3-MoE decoder's names and shapes: attention, a router and `experts` MLPs per layer. The
    defaults put 90% of the words in the experts (Qwen3-30B-A3B has 95%, a 1T MoE more)."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (hidden // 4, hidden),
                       p + "self_attn.v_proj.weight": (hidden // 4, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate.weight": (experts, hidden)})
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (intermediate, hidden), q + "up_proj.weight": (intermediate, hidden),
                           q + "down_proj.weight": (hidden, intermediate)})
    return shapes


def table(shapes: dict[str, tuple[int, ...]]) -> list[TensorSpec]:
    return [TensorSpec(name, "BF16", shapes[name]) for name in sorted(shapes)]


def rows_block(name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of tensor `name` of the base model (seeded by name and rows)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{start}:{stop}".encode()))
    local = (stop - start, *shape[1:])
    if len(shape) == 1:  # norm gains sit near 1, matrices near 0, as in trained models
        return (1.0 + 0.05 * torch.randn(local, generator=gen)).to(torch.bfloat16)
    return (0.02 * torch.randn(local, generator=gen)).to(torch.bfloat16)


def step_block(t: torch.Tensor, name: str, start: int, version: int, lr: float = LR) -> torch.Tensor:
    """`t` (rows from `start` of tensor `name`) after step `version`: each weight moves by +-lr in fp32."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{start}:v{version}".encode()))
    out = torch.empty_like(t)
    flat, dst = t.reshape(-1), out.reshape(-1)
    for s in range(0, flat.numel(), 1 << 22):  # chunked: no fp32 copy of a whole tensor
        chunk = flat[s : s + (1 << 22)].float()
        sign = torch.randint(0, 2, chunk.shape, generator=gen, dtype=torch.int8).float() * 2 - 1
        dst[s : s + chunk.numel()] = (chunk + lr * sign).to(torch.bfloat16)
    return out


def numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(_numel(s) for s in shapes.values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def blocks(specs: list[TensorSpec], rows: dict[str, tuple[int, int]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor's held rows of the base model, one tensor at a time."""
    for spec in specs:
        start, stop = rows[spec.name]
        if stop > start:
            yield spec.name, rows_block(spec.name, spec.shape, start, stop)
