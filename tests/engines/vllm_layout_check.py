"""What vLLM's tensor-parallel workers hold of each checkpoint tensor, against `deltamesh.delta.layouts`.

Shared by tests/engines/test_vllm_layouts.py (4 ranks) and test_vllm_ranks.py (2 ranks). Each worker's
parameters are read through the worker extension (`RankWorker.deltamesh_parameters` and
`deltamesh_digests`, plain data only). Where each checkpoint tensor lies in them is worked out here from
the model's sizes alone, as vLLM's layers place them, not from the layout rules under test: q, k, v
stacked in `qkv_proj` (key/value heads replicated when there are fewer than ranks), gate and up in
`gate_up_proj`, the vocabulary rows first with zero padding after them, o_proj and down_proj by input
columns, norms whole. Each region's digest must equal the digest of the share `layouts.shares_of` gives
that rank of the checkpoint tensor.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from deltamesh.delta import tensor_digest
from deltamesh.delta.encode import table_of
from deltamesh.delta.layouts import PoolLayout, shares_of


def vllm_regions(name: str, hf: Mapping[str, int], tp: int, params: Mapping[str, list]) -> tuple[str, int, int]:
    """(vLLM parameter, first row, stop row) holding a rank's part of checkpoint tensor `name`."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    hd = hf["head_dim"]
    q_rows = hf["num_attention_heads"] * hd // tp
    kv_rows = max(1, hf["num_key_value_heads"] // tp) * hd
    mlp_rows = hf["intermediate_size"] // tp
    stacked = {"q_proj": ("qkv_proj", 0, q_rows), "k_proj": ("qkv_proj", q_rows, q_rows + kv_rows),
               "v_proj": ("qkv_proj", q_rows + kv_rows, q_rows + 2 * kv_rows),
               "gate_proj": ("gate_up_proj", 0, mlp_rows), "up_proj": ("gate_up_proj", mlp_rows, 2 * mlp_rows)}
    if proj in stacked:
        fused, first, stop = stacked[proj]
        param = f"{parent}.{fused}.{leaf}"
        assert repacked(params, param) or \
            params[param][0][0] == stacked["v_proj" if fused == "qkv_proj" else "up_proj"][2], param
        return param, first, stop
    return name, 0, params[name][0][0] if params[name][0] else 0


def repacked(params: Mapping[str, list], param: str) -> bool:
    """Whether vLLM's CPU build repacked `param` into its own kernel's layout (on CPUs with AVX512-BF16 or
    AMX), leaving the parameter empty: nothing of it can be read back."""
    return params[param][0] == [0]


def check_layout(engine: Any, checkpoint: Mapping[str, torch.Tensor], hf: Mapping[str, int],
                 tp: int) -> tuple[int, int]:
    """Assert every rank of `engine` (a started `VLLMRanksEngine`) holds what `shares_of` says of every
    checkpoint tensor vLLM loads and keeps readable; returns how many (rank, tensor) pairs were compared
    and how many vLLM repacked out of reach."""
    layout = PoolLayout(tp=tp, kv_heads=hf["num_key_value_heads"])
    table = table_of(checkpoint)
    every_rank_params = engine._engine.collective_rpc("deltamesh_parameters")
    assert len(every_rank_params) == tp
    compared = unreadable = 0
    for rank, params in enumerate(every_rank_params):
        shares = shares_of(table, layout, rank)
        assert set(shares) == set(checkpoint), "a dense model: every rank holds part of every tensor"
        regions, expected = {}, {}
        for name, share in shares.items():
            if name == "lm_head.weight" and name not in params:
                continue  # tied to the embedding: vLLM keeps one parameter
            param, first, stop = vllm_regions(name, hf, tp, params)
            if repacked(params, param):
                unreadable += 1
                continue
            mine = share.take(checkpoint[name]).contiguous()
            if name.endswith("embed_tokens.weight"):
                # vLLM's rows of this rank: its real vocabulary rows first, then zero padding
                stop = first + mine.shape[0]
                if stop < params[param][0][0]:
                    pad = params[param][0][0] - stop
                    regions[name + "#padding"] = [param, stop, stop + pad]
                    expected[name + "#padding"] = tensor_digest(torch.zeros(pad, *mine.shape[1:], dtype=mine.dtype))
            assert list(mine.shape[1:]) == params[param][0][1:], (rank, name, mine.shape, params[param])
            assert stop - first == mine.shape[0], (rank, name, first, stop, mine.shape)
            regions[name] = [param, first, stop]
            expected[name] = tensor_digest(mine)
        (served,) = [a for r, a in enumerate(engine._engine.collective_rpc("deltamesh_digests", args=(regions,)))
                     if r == rank]
        wrong = sorted(label for label in expected if served[label] != expected[label])
        assert not wrong, f"rank {rank} of tp={tp}: vLLM holds other values than layouts says for {wrong}"
        compared += len(expected)
    return compared, unreadable
