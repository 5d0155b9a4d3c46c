"""vLLM's weights as the backend sees them from inside the worker: the same in-place reload, direct.

`deltamesh.mesh.engines.vllm_weights.VLLMWeights` writes checkpoint tensors into an in-process
engine through its worker (layer grouping over the model's fused modules, vLLM's in-place reload,
undoing a reload that failed half way, reading parameters back as checkpoint tensors). A
weight-transfer backend runs in the worker already, with the model in hand, so `WorkerWeights` is the
same class making its calls on the model directly: `apply_model` (what `VLLMWeights` reads the model
through) runs the function on it, and the reload and its undo call vLLM's functions on it.

Only a server without tensor parallelism uses it: with `tensor_parallel_size` > 1 each rank holds,
fetches and applies only its own share instead (`rank_updates.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

import torch

from deltamesh.mesh.engines.vllm_weights import VLLMWeights, finish_reload

T = TypeVar("T")


class WorkerWeights(VLLMWeights):
    """`VLLMWeights` of the worker's own `model` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, names: Iterable[str]) -> None:
        self._model = model
        self._vllm_config = vllm_config
        super().__init__(self, names)

    def apply_model(self, fn: Callable[[torch.nn.Module], T]) -> list[T]:
        """`fn(model)`, as one worker's answer (the form an engine's `apply_model` gives)."""
        return [fn(self._model)]

    def _reload_in_worker(self, source: dict[str, Any]) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(self._vllm_config, self._model, weights_iterator=source.get("weights_iterator"),
                       weights_path=source.get("weights_path"), is_checkpoint_format=True)

    def _finish_reload(self) -> None:
        finish_reload(self._model, self._vllm_config.model_config)
