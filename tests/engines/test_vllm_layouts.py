"""The layout rules of `deltamesh.delta.layouts` against what vLLM's own tensor-parallel workers hold.

vLLM's CPU build starts here with 4 tensor-parallel worker processes (one start for this module; the
2-rank layout is checked by test_vllm_ranks.py on its engine) on the tiny Qwen3 model (4 attention heads,
2 key/value heads: each pair of ranks shares a replicated key/value head; a vocabulary of 101 rows padded
to 128, so the last rank holds 5 real rows and 27 rows of padding). Every rank's slices, read from the
workers' parameters through the worker extension with the fused q/k/v and gate/up split apart and the
vocabulary padding dropped (tests/engines/vllm_layout_check.py), must equal the shares the layout gives
that rank of the checkpoint.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from deltamesh.delta import read_weights
from deltamesh.delta.encode import table_of
from deltamesh.delta.layouts import PoolLayout, shares_of
from deltamesh.mesh.demo.models import VLLM_TINY, tiny_model_dir
from deltamesh.mesh.engines.vllm_ranks import VLLMRanksConfig, VLLMRanksEngine

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("vllm_layout_check", Path(__file__).with_name("vllm_layout_check.py"))
layout_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_check)

TP = 4


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir(VLLM_TINY)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = VLLMRanksEngine(VLLMRanksConfig(model_id="tiny", model_dir=str(model_dir), tensor_parallel_size=TP,
                                             kv_cache_bytes=64 << 20))
    yield engine
    asyncio.run(engine.close())


def test_four_ranks_hold_what_the_layout_says(engine, model_dir) -> None:
    hf = json.loads((model_dir / "config.json").read_text())
    assert hf["num_key_value_heads"] < TP, "the key/value heads must be replicated for this test to mean it"
    checkpoint = read_weights(model_dir)
    assert engine.layout == PoolLayout(tp=TP, kv_heads=hf["num_key_value_heads"])
    compared, unreadable = layout_check.check_layout(engine, checkpoint, hf, TP)
    # every (rank, tensor) pair compared, but those the CPU build repacked (never the norms or embeddings)
    assert compared + unreadable >= TP * len(checkpoint) and compared >= TP * 3
    last = shares_of(table_of(checkpoint), engine.layout, TP - 1)["model.embed_tokens.weight"]
    assert (last.start, last.stop) == (96, 101)  # the last rank's 5 real rows of the padded vocabulary
