"""The big models of the latency budget at scale, tensor by tensor, and the share of a version one
pool rank fetches and holds under its engine's layout (for simulate_scale.py).

A trainer rank holds dim-0 rows of every tensor (FSDP2's local shard), so a version's pieces cover
row ranges. A pool rank fetches the pieces covering what it holds:
- Tensor parallelism, as vLLM lays a dense decoder out: column-parallel weights (q, k, v, gate, up:
  fused as qkv and gate_up, split by heads and rows; the vocabulary-parallel embedding and head) are
  split on dim 0, so a rank fetches 1/TP of them; row-parallel weights (o, down) are split on dim 1,
  a block of columns that every row range crosses, so a rank fetches them whole (and holds 1/TP);
  norms are replicated.
- Expert parallelism: routed experts are stacked per layer ([experts, rows, cols], torchtitan's
  layout), so dim 0 is the expert and a rank's experts are whole row ranges: it fetches and holds
  its experts and every dense tensor (attention, shared expert, router, dense MLP, embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DenseLayout:
    """A Qwen3 decoder (defaults: Qwen3-14B's config)."""

    name: str = "Qwen3-14B"
    layers: int = 40
    hidden: int = 5120
    intermediate: int = 17408
    q_heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    tied: bool = False

    def groups(self) -> dict[str, int]:
        """Parameters by tensor-parallel kind: column (split on dim 0), row (split on dim 1), replicated."""
        h, q, kv = self.hidden, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        column = self.layers * (q * h + 2 * kv * h + 2 * self.intermediate * h)
        column += self.vocab * h * (1 if self.tied else 2)
        row = self.layers * (h * q + h * self.intermediate)
        replicated = self.layers * (2 * h + 2 * self.head_dim) + h
        return {"column": column, "row": row, "replicated": replicated}

    @property
    def params(self) -> int:
        return sum(self.groups().values())

    @property
    def tensors(self) -> int:
        return self.layers * 11 + (2 if self.tied else 3)

    def pool_share(self, ranks: int) -> tuple[float, float]:
        """(fraction of a version's bytes one of `ranks` tensor-parallel ranks fetches, fraction it holds)."""
        g = self.groups()
        fetched = g["column"] / ranks + g["row"] + g["replicated"]
        held = (g["column"] + g["row"]) / ranks + g["replicated"]
        return fetched / self.params, held / self.params

    def describe(self, ranks: int) -> str:
        g = self.groups()
        return (f"tensor parallel x{ranks}: column-parallel {g['column'] / self.params:.1%} of the weights fetched "
                f"1/{ranks}, row-parallel {g['row'] / self.params:.1%} fetched whole (held 1/{ranks}), norms "
                f"replicated")


@dataclass(frozen=True)
class MoeLayout:
    """A DeepSeek-V3-style MoE decoder with MLA attention (defaults: Kimi K2's config, 1.03T)."""

    name: str = "1T MoE"
    layers: int = 61
    dense_layers: int = 1
    hidden: int = 7168
    dense_intermediate: int = 18432
    expert_intermediate: int = 2048
    experts: int = 384
    shared_experts: int = 1
    heads: int = 64
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    vocab: int = 163840

    def attention(self) -> int:
        h, n = self.hidden, self.heads
        return (self.q_lora * h + self.q_lora + n * (self.qk_nope + self.qk_rope) * self.q_lora
                + (self.kv_lora + self.qk_rope) * h + self.kv_lora + n * (self.qk_nope + self.v_head) * self.kv_lora
                + h * n * self.v_head)

    def groups(self) -> dict[str, int]:
        """Parameters of the routed experts, and of everything else (dense)."""
        h, moe = self.hidden, self.layers - self.dense_layers
        expert = 3 * h * self.expert_intermediate
        dense = self.layers * (self.attention() + 2 * h) + self.dense_layers * 3 * h * self.dense_intermediate
        dense += moe * (self.shared_experts * expert + self.experts * h + self.experts) + 2 * self.vocab * h + h
        return {"experts": moe * self.experts * expert, "dense": dense}

    @property
    def params(self) -> int:
        return sum(self.groups().values())

    @property
    def tensors(self) -> int:
        """Attention 7 and norms 2 per layer; a dense layer's MLP 3; a MoE layer's stacked experts 3,
        shared expert 3, router weight and bias; embeddings, head, final norm."""
        moe = self.layers - self.dense_layers
        return self.layers * 9 + self.dense_layers * 3 + moe * 8 + 3

    def pool_share(self, ranks: int) -> tuple[float, float]:
        """(fraction fetched, fraction held) by one of `ranks` expert-parallel ranks: the same."""
        g = self.groups()
        share = (g["dense"] + g["experts"] / ranks) / self.params
        return share, share

    def describe(self, ranks: int) -> str:
        g = self.groups()
        return (f"expert parallel x{ranks}: {self.experts // ranks} of {self.experts} experts per layer "
                f"(experts {g['experts'] / self.params:.1%} of the weights) plus every dense tensor "
                f"({g['dense'] / self.params:.1%})")


Layout = DenseLayout | MoeLayout
