"""Which slice of each tensor a pool rank holds, as vLLM splits a model over tensor- and expert-parallel ranks.

A `PoolLayout` names how a pool's engine splits the model: `tp` tensor-parallel ranks and, for a
mixture of experts, `ep` expert-parallel ranks (whole experts per rank). `share_of` gives, for one
tensor of the checkpoint (Hugging Face names and shapes) and one rank, the `Share` that rank holds,
following vLLM's layers:

- column-parallel (`QKVParallelLinear`, `MergedColumnParallelLinear`, `ColumnParallelLinear`): the
  rows (output features, dim 0) of q/k/v, gate/up projections and their biases are split evenly; a
  key/value projection with fewer heads than ranks is not split but replicated per head (rank r holds
  head r * kv_heads // tp);
- vocabulary-parallel (`VocabParallelEmbedding`, `ParallelLMHead`): the vocabulary padded to a multiple
  of 64 is split evenly and each rank holds its range's real rows;
- row-parallel (`RowParallelLinear`: o_proj, down_proj): the columns (input features, dim 1) are split
  evenly; their biases are held whole;
- experts (`FusedMoE`): with `ep` > 1 each rank holds the whole tensors of experts
  [r * E / ep, (r + 1) * E / ep) (or those rows of a fused [E, ...] tensor), and none of the others';
  with `ep` == 1 they split like the dense MLP;
- everything else (norms, the router, embeddings of a tp of 1) is held whole by every rank.

`cuts_for` turns the layouts a trainer publishes for into the `Cuts` of every tensor (parts.py): the
bounds where some rank's share ends, and for each row band the ranks that need it, so that a version
is encoded with a hash per share and pieces a rank can fetch alone (shares.py). The rules cover the
dense and mixture-of-experts decoders vLLM serves under these names (Llama, Qwen2/3, Mistral and their
MoE variants); a tensor they do not know is held whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from .cuts import ALL, Cuts, TensorSpec
from .errors import CodecError
from .share_plan import Share

VOCAB_PADDING = 64
"""vLLM pads a vocabulary-parallel embedding's rows to a multiple of this before splitting them."""
_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj|w1|w2|w3|w13_weight|w2_weight)$")


WHOLE = Share()


@dataclass(frozen=True)
class PoolLayout:
    """How one pool's engine splits the model over its ranks (`ranks` = max(tp, ep))."""

    tp: int = 1
    ep: int = 1
    kv_heads: int | None = None
    """The model's key/value heads (`num_key_value_heads`), when fewer than `tp` may hold them."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1 or (self.tp > 1 and self.ep > 1 and self.tp != self.ep):
            raise ValueError(f"tp {self.tp} and ep {self.ep}: each >= 1, and equal when both are over 1")

    @property
    def ranks(self) -> int:
        return max(self.tp, self.ep)

    @property
    def name(self) -> str:
        return f"tp{self.tp}ep{self.ep}"


def share_of(spec: TensorSpec, layout: PoolLayout, rank: int, experts: int | None = None) -> Share | None:
    """What `rank` of `layout` holds of tensor `spec` (None: nothing). `experts`: experts per layer."""
    name, shape = spec.name, spec.shape
    expert = _EXPERT.search(name)
    if layout.ep > 1 and expert is not None:
        mine = _owned_experts(layout, rank, experts)
        return WHOLE if int(expert.group(1)) in mine else None
    if layout.ep > 1 and _FUSED_EXPERTS.search(name):
        first, stop = _span(shape[0], layout.ep, rank)
        return Share(0, first, stop)
    tp = layout.tp
    if tp == 1 or not shape:
        return WHOLE
    if _VOCAB.search(name):
        padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        per = -(-padded // tp)
        first, stop = min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
        return Share(0, first, stop) if stop > first else None
    column = _COLUMN.search(name)
    if column is not None:
        if column.group(1) in ("k_proj", "v_proj") and layout.kv_heads is not None and layout.kv_heads < tp:
            size = shape[0] // layout.kv_heads
            head = rank * layout.kv_heads // tp
            return Share(0, head * size, (head + 1) * size)
        return Share(0, *_span(shape[0], tp, rank))
    if _ROW.search(name) and len(shape) >= 2:
        return Share(1, *_span(shape[1], tp, rank))
    return WHOLE


def shares_of(table: Iterable[TensorSpec], layout: PoolLayout, rank: int) -> dict[str, Share]:
    """Every tensor `rank` of `layout` holds, with its share."""
    table = list(table)
    experts = count_experts(table)
    out = {}
    for spec in table:
        share = share_of(spec, layout, rank, experts)
        if share is not None:
            out[spec.name] = share
    return out


def count_experts(table: Iterable[TensorSpec]) -> int | None:
    """Experts per layer, from the checkpoint's tensor names (None for a dense model)."""
    found = [int(m.group(1)) for spec in table if (m := _EXPERT.search(spec.name))]
    return max(found) + 1 if found else None


def cuts_for(table: Sequence[TensorSpec], layouts: Sequence[PoolLayout]) -> dict[str, Cuts]:
    """The cuts that give every rank of every layout its own tiles and pieces (see the module docstring)."""
    experts = count_experts(table)
    everyone = {(layout.name, r) for layout in layouts for r in range(layout.ranks)}
    out = {}
    for spec in table:
        rows: set[int] = set()
        cols: set[int] = set()
        needs: list[tuple[tuple[str, int], Share]] = []
        for layout in layouts:
            for r in range(layout.ranks):
                share = share_of(spec, layout, r, experts)
                if share is None:
                    continue
                needs.append(((layout.name, r), share))
                bounds = {share.start, share.stop} if share.dim is not None else set()
                (rows if share.dim == 0 else cols).update(bounds)
        if not spec.shape:
            continue
        row_cuts = tuple(sorted(b for b in rows if 0 < b < spec.shape[0]))
        col_cuts = tuple(sorted(b for b in cols if len(spec.shape) >= 2 and 0 < b < spec.shape[1]))
        keys = tuple(_band_key(lo, hi, needs, everyone)
                     for lo, hi in zip((0, *row_cuts), (*row_cuts, spec.shape[0])))
        if row_cuts or col_cuts or any(k != ALL for k in keys):
            out[spec.name] = Cuts(row_cuts, col_cuts, keys)
    return out


def _band_key(lo: int, hi: int, needs: list[tuple[tuple[str, int], Share]], everyone: set) -> str:
    """Who needs rows [lo, hi): every rank (ALL), or the ranks named, as one key."""
    who = {rank for rank, share in needs if share.dim != 0 or (share.start < hi and lo < share.stop)}
    return ALL if who == everyone else ",".join(f"{name}:{r}" for name, r in sorted(who))


def _span(size: int, parts: int, rank: int) -> tuple[int, int]:
    if size % parts:
        raise CodecError(f"a dimension of {size} does not split evenly over {parts} ranks")
    per = size // parts
    return rank * per, (rank + 1) * per


def _owned_experts(layout: PoolLayout, rank: int, experts: int | None) -> range:
    if experts is None or experts % layout.ep:
        raise CodecError(f"{experts} experts per layer do not split evenly over {layout.ep} expert-parallel ranks")
    per = experts // layout.ep
    return range(rank * per, (rank + 1) * per)


def parse_layout(text: str) -> PoolLayout:
    """A layout from its name: `tp2`, `ep4`, `tp2-ep2`, `tp4-kv2` (key/value heads, when fewer than tp)."""
    fields = {"tp": 1, "ep": 1}
    for part in text.strip().lower().split("-"):
        match = re.fullmatch(r"(tp|ep|kv)([1-9][0-9]*)", part)
        if match is None:
            raise ValueError(f"pool layout {text!r}: parts are tpN, epN and kvN joined by '-', e.g. tp2 or tp4-kv2")
        fields["kv_heads" if match.group(1) == "kv" else match.group(1)] = int(match.group(2))
    return PoolLayout(**fields)
