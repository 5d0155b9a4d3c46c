"""deltamesh as a vLLM weight-transfer backend named `deltamesh` (docs/ENGINES.md, "vLLM's RL API").

`register` is the `vllm.general_plugins` entry point of the distribution (pyproject.toml), so that an
installed deltamesh (`pip install 'deltamesh[vllm]'`) is known to every vLLM process as it loads its
plugins: `--weight-transfer-config '{"backend": "deltamesh"}'` then picks the engine side
(`engine.DeltameshWeightTransferEngine`) on the server's workers, and a trainer's
`WeightTransferTrainerFactory.trainer_init(DeltameshTrainerInitInfo(...), ...)` the trainer side
(`trainer_engine.DeltameshTrainerWeightTransferEngine`). Both are registered by module path, so
nothing of them is imported until vLLM creates one; this package imports nothing of vLLM itself.
"""

from __future__ import annotations

BACKEND = "deltamesh"
"""The name the backend is registered under, in both of vLLM's factories."""


def register() -> None:
    """Register the backend with vLLM (called by vLLM in each of its processes; a second call is a no-op)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in (
        (WeightTransferEngineFactory, "deltamesh.mesh.vllm_plugin.engine", "DeltameshWeightTransferEngine"),
        (WeightTransferTrainerFactory, "deltamesh.mesh.vllm_plugin.trainer_engine",
         "DeltameshTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:
            pass  # registered already in this process
