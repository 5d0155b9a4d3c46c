"""Building a pool's engine for one policy: the in-process transformers or vLLM engine, or the SGLang adapter.

Each engine gets a metrics registry of its own (merged into the pool's `/metrics`). Building the
transformers engine loads the model, which blocks, so it runs in a worker thread; its weights are
replaced by the synced version before the pool generates (see `weights.py`).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from deltamesh.mesh.engines.base import Engine
from deltamesh.mesh.pool.config import PolicyConfig, PoolConfig


async def open_engine(config: PoolConfig, policy: PolicyConfig) -> tuple[Engine, CollectorRegistry]:
    """A started engine serving `policy` (whose model_id is resolved), and its metrics registry."""
    registry = CollectorRegistry()
    if config.engine == "transformers":
        from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig

        cfg = TransformersEngineConfig(model_id=policy.model_id, model_dir=policy.model_path, device=config.device,
                                       max_batch=config.max_batch, seed=config.seed)
        return await asyncio.to_thread(TransformersEngine, cfg, registry=registry), registry
    if config.engine == "vllm":
        from deltamesh.mesh.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

        # On a GPU, vLLM sizes its KV cache from its memory share; on the CPU build an explicit size.
        vcfg = VLLMEngineConfig(model_id=policy.model_id, model_dir=policy.model_path, max_batch=config.max_batch,
                                seed=config.seed, kv_cache_bytes=None if config.device.startswith("cuda") else 512 << 20)
        return await asyncio.to_thread(VLLMEngine, vcfg, registry=registry), registry
    from deltamesh.mesh.engines.sglang_engine import SGLangEngine, SGLangEngineConfig

    cfg = SGLangEngineConfig(model_id=policy.model_id, model_path=policy.model_path, url=policy.engine_url,
                             port=policy.engine_port)
    return await SGLangEngine.open(cfg, registry=registry), registry
