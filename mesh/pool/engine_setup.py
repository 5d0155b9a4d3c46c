"""Building an engine for one policy: the in-process transformers or vLLM engine, or the SGLang adapter.

A rollout pool builds one per policy, and so does the evaluator (`deltamesh eval`) for the policy it
scores. Each engine gets a metrics registry of its own (merged into its process's `/metrics`).
Building an in-process engine loads the model, which blocks, so it runs in a worker thread; its
weights are replaced by the synced version before anything is generated (see `weights.py`).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from deltamesh.mesh.engines.base import Engine
from deltamesh.mesh.pool.config import PolicyConfig

VLLM_CPU_KV_CACHE_BYTES = 512 << 20
"""KV cache of an in-process vLLM engine on the CPU build (on a GPU vLLM sizes it from its memory share)."""


async def open_engine(kind: str, policy: PolicyConfig, *, device: str = "cpu", max_batch: int = 64,
                      seed: int | None = None, prefill_chunk_tokens: int = 128) -> tuple[Engine, CollectorRegistry]:
    """A started engine of `kind` (transformers, vllm or sglang) serving `policy` (whose model_id is
    resolved), and its metrics registry."""
    registry = CollectorRegistry()
    if kind == "transformers":
        from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig

        cfg = TransformersEngineConfig(model_id=policy.model_id, model_dir=policy.model_path, device=device,
                                       max_batch=max_batch, seed=seed, prefill_chunk_tokens=prefill_chunk_tokens)
        return await asyncio.to_thread(TransformersEngine, cfg, registry=registry), registry
    if kind == "vllm":
        from deltamesh.mesh.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

        vcfg = VLLMEngineConfig(model_id=policy.model_id, model_dir=policy.model_path, max_batch=max_batch, seed=seed,
                                kv_cache_bytes=None if device.startswith("cuda") else VLLM_CPU_KV_CACHE_BYTES)
        return await asyncio.to_thread(VLLMEngine, vcfg, registry=registry), registry
    from deltamesh.mesh.engines.sglang_engine import SGLangEngine, SGLangEngineConfig

    cfg = SGLangEngineConfig(model_id=policy.model_id, model_path=policy.model_path, url=policy.engine_url,
                             port=policy.engine_port)
    return await SGLangEngine.open(cfg, registry=registry), registry
