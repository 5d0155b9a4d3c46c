"""Building an engine for one policy: the in-process transformers or vLLM engine, or the SGLang adapter.

A rollout pool builds one per policy, and so does the evaluator (`deltamesh eval`) for the policy it
scores. Each engine gets a metrics registry of its own (merged into its process's `/metrics`).
Building an in-process engine loads the model, which blocks, so it runs in a worker thread; its
weights are replaced by the synced version before anything is generated (see `weights.py`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from deltamesh.mesh.engines.base import Engine
from deltamesh.mesh.pool.config import PolicyConfig

if TYPE_CHECKING:
    from deltamesh.mesh.engines.vllm_engine import VLLMEngineConfig

VLLM_CPU_KV_CACHE_BYTES = 512 << 20
"""KV cache of an in-process vLLM engine on the CPU build (on a GPU vLLM sizes it from its memory share)."""


async def open_engine(kind: str, policy: PolicyConfig, *, device: str = "cpu", max_batch: int = 64,
                      seed: int | None = None, prefill_chunk_tokens: int = 128,
                      tensor_parallel_size: int = 1) -> tuple[Engine, CollectorRegistry]:
    """A started engine of `kind` (transformers, vllm or sglang) serving `policy` (whose model_id is
    resolved), and its metrics registry; vllm with `tensor_parallel_size` > 1 runs over that many ranks."""
    registry = CollectorRegistry()
    if kind == "transformers":
        from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig

        cfg = TransformersEngineConfig(model_id=policy.model_id, model_dir=policy.model_path, device=device,
                                       max_batch=max_batch, seed=seed, prefill_chunk_tokens=prefill_chunk_tokens)
        return await asyncio.to_thread(TransformersEngine, cfg, registry=registry), registry
    if kind == "vllm":
        from deltamesh.mesh.engines.vllm_engine import VLLMEngine
        from deltamesh.mesh.engines.vllm_ranks import VLLMRanksConfig, VLLMRanksEngine

        vcfg = vllm_config(policy, device=device, max_batch=max_batch, seed=seed,
                           tensor_parallel_size=tensor_parallel_size)
        engine_cls = VLLMRanksEngine if isinstance(vcfg, VLLMRanksConfig) else VLLMEngine
        return await asyncio.to_thread(engine_cls, vcfg, registry=registry), registry
    from deltamesh.mesh.engines.sglang_engine import SGLangEngine, SGLangEngineConfig

    cfg = SGLangEngineConfig(model_id=policy.model_id, model_path=policy.model_path, url=policy.engine_url,
                             port=policy.engine_port)
    return await SGLangEngine.open(cfg, registry=registry), registry


def vllm_config(policy: PolicyConfig, *, device: str = "cpu", max_batch: int = 64, seed: int | None = None,
                tensor_parallel_size: int = 1) -> "VLLMEngineConfig":
    """The vLLM engine's settings for `policy`: over ranks (`VLLMRanksConfig`) when `tensor_parallel_size` > 1."""
    from deltamesh.mesh.engines.vllm_engine import VLLMEngineConfig
    from deltamesh.mesh.engines.vllm_ranks import VLLMRanksConfig

    common = dict(model_id=policy.model_id, model_dir=policy.model_path, max_batch=max_batch, seed=seed,
                  kv_cache_bytes=None if device.startswith("cuda") else VLLM_CPU_KV_CACHE_BYTES)
    if tensor_parallel_size > 1:
        return VLLMRanksConfig(**common, tensor_parallel_size=tensor_parallel_size)
    return VLLMEngineConfig(**common)
