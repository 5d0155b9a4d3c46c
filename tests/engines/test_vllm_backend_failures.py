"""The `deltamesh` backend's engine side when vLLM fails to take a version, or takes it wrongly: undone.

The backend object runs here on the model of an in-process vLLM engine (`VLLMEngine`, its CPU build,
one start for the module), as vLLM's worker would run it, beside an origin and a relay gateway
(processes). Faults are injected where no real part can produce them on demand: vLLM's reload raising
half way through the layers, and a read-back of vLLM's parameters that differs from the signed
hashes. Either way the update raises, and the engine computes exactly what it computed before.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltamesh.delta import read_weights
from deltamesh.mesh.demo.models import smollm2_adam_versions, smollm2_model_dir
from deltamesh.mesh.engines.base import SamplingParams
from deltamesh.mesh.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from deltamesh.mesh.vllm_plugin.config import parse_backend_config
from deltamesh.mesh.vllm_plugin.local_mesh import LocalMesh
from deltamesh.mesh.vllm_plugin.worker_weights import WorkerWeights
from deltamesh.trainer import WeightPublisher
from deltamesh.trainer.publish_config import PublishConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    engine = VLLMEngine(VLLMEngineConfig(model_id=MODEL, model_dir=str(smollm2_model_dir())))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("backend-failures"), MODEL) as mesh:
        yield mesh


def probe(engine: VLLMEngine) -> tuple[list[int], list[float]]:
    (gen,) = asyncio.run(engine.generate([engine.encode("The capital of France is")], GREEDY))
    return gen.tokens, gen.logprobs


def test_a_failed_reload_and_a_wrong_read_back_are_undone(engine, mesh, monkeypatch):
    from vllm.config.weight_transfer import WeightTransferConfig

    from deltamesh.mesh.vllm_plugin.engine import DeltameshWeightTransferEngine

    llm = engine._engine
    (model,) = llm.apply_model(lambda m: m)  # the in-process worker's model, as vLLM hands it to a backend
    backend = DeltameshWeightTransferEngine(WeightTransferConfig(backend="deltamesh"), llm.vllm_config,
                                            torch.device("cpu"), model)
    backend.init_transfer_engine(parse_backend_config(mesh.engine_init(give_up_s=10, stall_timeout_s=5)))
    publisher = WeightPublisher(PublishConfig(**mesh.publish_table(full_every=0)))
    try:
        publisher.publish(read_weights(smollm2_model_dir()))  # v0, a full snapshot of what vLLM loaded
        backend.update_weights({"version": 0})
        before = probe(engine)
        publisher.publish(smollm2_adam_versions([5e-6])[5e-6])  # v1, a real step's delta

        reload = WorkerWeights._reload_in_worker
        calls = []

        def failing(self, source):  # the first reload dies after 40 tensors; the undo goes through
            def items():
                for k, item in enumerate(source["weights_iterator"]):
                    if k == 40 and not calls:
                        calls.append(k)
                        raise RuntimeError("injected failure inside vLLM's reload")
                    yield item
            reload(self, {**source, "weights_iterator": items()})

        monkeypatch.setattr(WorkerWeights, "_reload_in_worker", failing)
        with pytest.raises(RuntimeError, match="v1 not taken, still serving v0: RuntimeError: injected"):
            backend.update_weights({"version": 1})
        monkeypatch.undo()
        assert calls and backend.version == 0 and probe(engine) == before

        monkeypatch.setattr(WorkerWeights, "digests", lambda self, names, checkpoint: {n: "0" * 32 for n in names})
        with pytest.raises(RuntimeError, match="v1 not taken, still serving v0: .*does not serve what was applied"):
            backend.update_weights({"version": 1})
        monkeypatch.undo()
        assert backend.version == 0 and probe(engine) == before

        backend.update_weights({"version": 1})  # and it still updates
        assert backend.version == 1 and probe(engine) != before
    finally:
        publisher.close()
        backend.shutdown()
