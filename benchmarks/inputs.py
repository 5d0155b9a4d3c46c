"""Benchmark inputs: pairs of bf16 weight versions (old, new) that a codec must carry.

Real deltas (built and cached by `deltamesh.trainer.models`): SmolLM2-135M-Instruct's pretrained
weights as fp32 master weights, one Adam step on next-token loss over real English text, both sides
cast to bf16; and the delta of a later step of one Adam run, whose updates are no longer all exactly
+-lr as a first step's are. Synthetic: a model with Qwen3-0.6B's tensor names and shapes (hidden
1024, 28 layers, intermediate 3072, 16 query / 8 key-value heads of dim 128, vocab 151936, tied
embeddings: 1.19 GB in bf16) holding seeded random weights, of which a given fraction of words move
by one or two bf16 ulps, as they do in a real step; it exists to measure speed at a realistic size.
`adam_step_case` makes such a version the way a real step does: fp32 master weights move by +-lr and
are cast to bf16, so the words that change crowd into the small weights, whose bf16 spacing is finest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltamesh.mesh.demo.models import smollm2_adam_run, smollm2_adam_versions, smollm2_state_dict, to_bf16

Weights = dict[str, torch.Tensor]


@dataclass
class Case:
    name: str
    old: Weights
    new: Weights
    note: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    master: Weights = field(default_factory=dict)
    """The fp32 master weights `new` was cast from, where the case has them."""

    @property
    def model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.new.values())

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.new.values())

    def changed_words(self) -> int:
        return sum(int((self.old[k].view(torch.int16) != t.view(torch.int16)).sum()) for k, t in self.new.items())


def real_cases(lrs: list[float]) -> list[Case]:
    """SmolLM2-135M: base version and its bf16 weights after one real Adam step at each rate."""
    old = to_bf16(smollm2_state_dict())
    versions = smollm2_adam_versions(lrs)
    return [
        Case(f"smollm2-135m adam lr={lr:g}", old, versions[lr], note="real pretrained weights, one Adam step")
        for lr in lrs
    ]


def adam_run_case(lr: float, steps: int = 4) -> Case:
    """SmolLM2-135M: the delta made by step `steps` of one Adam run (updates of varied size)."""
    old, new = smollm2_adam_run(lr, steps)
    return Case(f"smollm2-135m adam step {steps} lr={lr:g}", old, new, note="real weights, mid-run Adam step")


def qwen3_shapes(layers: int = 28, hidden: int = 1024, intermediate: int = 3072, q_heads: int = 16,
                 kv_heads: int = 8, head_dim: int = 128, vocab: int = 151936) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3 decoder with tied embeddings (defaults: Qwen3-0.6B)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        })
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def synthetic_case(shapes: dict[str, tuple[int, ...]], *, changed: float = 0.01, seed: int = 0,
                   name: str = "qwen3-0.6b shapes, synthetic", device: str = "cpu") -> Case:
    """Seeded random bf16 weights and a version in which ~`changed` of the words move by 1-2 ulps,
    made on `device` (where they then live; a seed gives other weights on another device)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    old, new = {}, {}
    for tensor_name, shape in shapes.items():
        if len(shape) == 1:  # norm gains sit near 1, matrices near 0, as in trained models
            values = 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
        else:
            values = 0.02 * torch.randn(shape, generator=gen, device=device)
        o = values.to(torch.bfloat16)
        del values
        n = o.clone()
        w_old, w_new = o.view(torch.int16).reshape(-1), n.view(torch.int16).reshape(-1)
        # Unique positions: a repeated index in one scatter makes the winning write nondeterministic.
        pos = torch.unique(torch.randint(o.numel(), (round(o.numel() * changed),), generator=gen, device=device))
        count = pos.numel()
        step = torch.randint(1, 3, (count,), generator=gen, dtype=torch.int16, device=device)
        step = torch.where(torch.rand(count, generator=gen, device=device) < 0.5, step, -step)
        # A word whose magnitude bits are tiny only grows, so no step crosses zero into another sign.
        step = torch.where((w_old[pos] & 0x7FFF) <= 2, step.abs(), step)
        w_new[pos] = w_old[pos] + step
        old[tensor_name], new[tensor_name] = o, n
    return Case(name, old, new, note=f"seeded random weights, {changed:.1%} of words moved by 1-2 ulps")


def _random_weights(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norm gains sit near 1, matrices near 0, as in trained models
        return 1.0 + 0.05 * torch.randn(shape, generator=gen)
    return 0.02 * torch.randn(shape, generator=gen)


def _updates(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Adam's update over lr: about 1 in size (0.5-1.5: a step after the first), either sign."""
    size = 0.5 + torch.rand(shape, generator=gen)
    return torch.where(torch.rand(shape, generator=gen) < 0.5, size, -size)


def _moved_fraction(sample: torch.Tensor, updates: torch.Tensor, lr: float) -> float:
    old = sample.to(torch.bfloat16).view(torch.int16)
    return float((old != (sample + lr * updates).to(torch.bfloat16).view(torch.int16)).float().mean())


def adam_step_case(shapes: dict[str, tuple[int, ...]], *, changed: float = 0.01, seed: int = 0,
                   name: str = "synthetic, first-Adam-step statistics") -> Case:
    """Seeded random fp32 master weights on the bf16 grid, moved by lr times an update of size 0.5-1.5
    (an Adam step's, either sign) and cast to bf16, with lr set so that ~`changed` of the matrices'
    words move. A word moves when its update crosses half its bf16 spacing, which is proportional to
    its magnitude: changes crowd into the small weights (mostly by one ulp, by more where the spacing
    is below lr) and norm gains near 1 stay put, as in a real step (SmolLM2 at lr 5e-6: 1.0% of words,
    60% of them by one ulp, their median magnitude 1/160 of all words'; here 64% and 1/110)."""
    gen = torch.Generator().manual_seed(seed)
    sample = _random_weights((1 << 20, 2), gen).to(torch.bfloat16).float()
    updates = _updates(sample.shape, gen)
    lo, hi = 1e-9, 1e-2  # the moved fraction grows with lr: bisect on a log scale
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if _moved_fraction(sample, updates, mid) < changed else (lo, mid)
    lr = (lo * hi) ** 0.5
    old, new, master = {}, {}, {}
    for tensor_name, shape in shapes.items():
        base = _random_weights(shape, gen).to(torch.bfloat16)
        master[tensor_name] = base.float().add_(_updates(shape, gen).mul_(lr))
        old[tensor_name], new[tensor_name] = base, master[tensor_name].to(torch.bfloat16)
    return Case(name, old, new, note=f"seeded random weights, fp32 master moved by lr {lr:.3g} x 0.5-1.5, cast "
                                     "to bf16", master=master)
