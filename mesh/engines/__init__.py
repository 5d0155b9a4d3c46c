"""Rollout engines: the `Engine` interface, the in-process transformers engine (hot weight swap) and
the SGLang adapter. Import an engine from its module (`transformers_engine`, `sglang_engine`); this
package exports only the interface, so importing it loads neither torch models nor a tokenizer."""

from deltamesh.mesh.engines.base import Engine, EngineError, Generation, SamplingParams

__all__ = ["Engine", "EngineError", "Generation", "SamplingParams"]
