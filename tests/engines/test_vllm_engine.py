"""The vLLM engine on real SmolLM2-135M weights: generation, swaps between steps, in-place updates.

vLLM (the CPU build, installed by `make install`) starts once for this whole module (~30 s here);
every test shares that engine and leaves it serving v0's weights. A real delta is one Adam step at
lr 5e-6 (`smollm2_adam_versions`). "Equal to a fresh engine" is checked against the same engine
reloading that version's directory from disk (`load_version`, vLLM's `reload_weights(weights_path=)`),
which starts no second engine; the transformers engine's logprobs are compared for closeness only
(other kernels). The last test drives a pool's weight stream (a real gateway in this process) into the
same engine to show the check of what vLLM serves (`serve_check.py`) catching injected faults.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from deltamesh.delta import (
    BaseMismatchError,
    decode_version,
    encode_delta,
    encode_full,
    generate_key,
    load_manifest,
    read_weights,
    save_keypair,
)
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.app import create_app
from deltamesh.http import serving
from deltamesh.mesh.demo.models import smollm2_adam_versions, smollm2_model_dir, smollm2_version_dirs
from deltamesh.mesh.engines.base import Engine, EngineError, SamplingParams
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.mesh.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from deltamesh.mesh.pool.config import ServeCheckConfig
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weights import PolicyWeights
from deltamesh.trainer.publisher import Publisher

pytestmark = pytest.mark.slow

MODEL = "smollm2"
KEY = generate_key()
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def weights() -> dict:
    return {"v0": read_weights(smollm2_model_dir()), "v1": smollm2_adam_versions([5e-6])[5e-6]}


@pytest.fixture(scope="module")
def engine():
    engine = VLLMEngine(VLLMEngineConfig(model_id=MODEL, model_dir=str(smollm2_model_dir())))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def version_dirs(tmp_path_factory, weights) -> dict[str, Path]:
    """Model directories (config, tokenizer) holding v0's and v1's weights, without a manifest."""
    return smollm2_version_dirs(tmp_path_factory.mktemp("vllm-versions"), weights)


def decoded(old: dict | None, new: dict, version: int, base_version: int | None = None):
    """`new` as the pool hands it over: a signed delta from `old` (or a full snapshot), verified, decoded."""
    if old is None:
        enc = encode_full(new, model_id=MODEL, version=version, key=KEY)
    else:
        enc = encode_delta(old, new, model_id=MODEL, version=version, base_version=base_version, key=KEY)
    return decode_version(load_manifest(enc.manifest_bytes, [KEY.public_key()]), enc.pieces)


def probe(engine: Engine) -> tuple[list[int], list[float]]:
    (gen,) = asyncio.run(engine.generate([engine.encode("The capital of France is")], GREEDY))
    return gen.tokens, gen.logprobs


def back_to_v0(engine: VLLMEngine, version_dirs: dict[str, Path], version: int) -> None:
    asyncio.run(engine.load_version(version_dirs["v0"], version))


def test_generates_with_logprobs_and_versions(engine: VLLMEngine) -> None:
    assert isinstance(engine, Engine) and engine.supports_in_place
    prompts = [engine.encode("The capital of France is"), engine.encode("1, 2, 3,")]
    gens = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)))
    for gen in gens:
        assert 1 <= len(gen.tokens) == len(gen.logprobs) == len(gen.versions) <= 6
        assert all(lp <= 0 for lp in gen.logprobs) and set(gen.versions) == {engine.version}
        assert gen.finish_reason in ("stop", "length")
    again = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)))
    assert [g.tokens for g in again] == [g.tokens for g in gens]  # a request's seed makes it reproducible
    stop = gens[0].tokens[1]
    (stopped,) = asyncio.run(engine.generate(prompts[:1], SamplingParams(max_new_tokens=6, temperature=0.8, seed=3,
                                                                         stop_token_ids=(stop,))))
    assert stopped.tokens == gens[0].tokens[:2] and stopped.finish_reason == "stop"  # the stop token is kept
    with pytest.raises(ValueError):
        asyncio.run(engine.generate([[10**9]], GREEDY))


def test_logprobs_close_to_transformers_engine(engine: VLLMEngine) -> None:
    tokens, logprobs = probe(engine)
    reference = TransformersEngine(TransformersEngineConfig(model_id=MODEL, model_dir=str(smollm2_model_dir())))
    ref_tokens, ref_logprobs = probe(reference)
    assert tokens == ref_tokens
    # Other kernels, same bf16 weights, the same 8 greedy tokens. Measured up to ~0.03 nats apart where
    # vLLM's CPU build computes in its plain layout, and up to 0.12 (0.04 on average) on a CPU with
    # AVX512-BF16, where it packs its weights for oneDNN's bf16 kernels. Wrong weights or a wrong
    # normalisation would also change the tokens, or move logprobs by far more.
    gaps = [round(abs(a - b), 4) for a, b in zip(logprobs, ref_logprobs)]
    assert max(gaps) < 0.25 and sum(gaps) / len(gaps) < 0.08, f"logprobs {logprobs} against {ref_logprobs}: {gaps}"


def test_delta_swapped_mid_generation_tags_later_tokens(engine: VLLMEngine, weights, version_dirs) -> None:
    # Decoded before the generation starts, and a generation long enough that the swap lands inside it
    # even on a loaded machine: only the engine's own apply races the decode steps.
    update = decoded(weights["v0"], weights["v1"], 1, 0)

    async def scenario():
        params = SamplingParams(max_new_tokens=96, temperature=0, ignore_eos=True)
        task = asyncio.create_task(engine.generate([engine.encode("Once upon a time")], params))
        while not any(len(r.gen.tokens) >= 3 for r in engine._requests.values()):
            await asyncio.sleep(0.01)
        await engine.apply_update(update)
        return await task

    try:
        (gen,) = asyncio.run(scenario())
        assert engine.version == 1
        assert gen.versions[0] == 0 and gen.versions[-1] == 1 and gen.versions == sorted(gen.versions)
        assert engine.metrics.straddled._value.get() >= 1
    finally:  # the module's later tests start from v0 whatever happened here
        back_to_v0(engine, version_dirs, engine.version + 1)


def test_in_place_equals_reload_from_disk(engine: VLLMEngine, weights, version_dirs) -> None:
    base = engine.version
    v0 = probe(engine)
    asyncio.run(engine.apply_update(decoded(weights["v0"], weights["v1"], base + 1, base)))
    in_place = probe(engine)
    assert in_place != v0  # one Adam step moves the probe's logprobs
    asyncio.run(engine.load_version(version_dirs["v1"], base + 2))
    assert probe(engine) == in_place  # the same weights from disk, every layer reprocessed: bit-equal
    asyncio.run(engine.apply_update(decoded(None, weights["v0"], base + 3)))  # a full snapshot, in place
    assert engine.version == base + 3 and probe(engine) == v0


def test_failed_updates_keep_the_old_version(engine: VLLMEngine, weights, monkeypatch) -> None:
    base = engine.version
    before = probe(engine)
    wrong_base = decoded(weights["v1"], weights["v0"], base + 1, base)  # a delta from weights not served
    with pytest.raises(BaseMismatchError):
        asyncio.run(engine.apply_update(wrong_base))
    assert engine.version == base and probe(engine) == before

    # vLLM fails half way through its reload: the layers it already took are put back.
    reload = engine._weights._reload
    failures = []

    def failing(**source):  # the first reload fails after 40 tensors; the restore goes through
        def items():
            for k, item in enumerate(source["weights_iterator"]):
                if k == 40 and not failures:
                    failures.append(k)
                    raise RuntimeError("injected failure inside vLLM's reload")
                yield item
        reload(weights_iterator=items())

    monkeypatch.setattr(engine._weights, "_reload", failing)
    with pytest.raises(EngineError, match="still serving"):
        asyncio.run(engine.apply_update(decoded(weights["v0"], weights["v1"], base + 1, base)))
    monkeypatch.undo()
    assert failures and engine.version == base and probe(engine) == before
    asyncio.run(engine.apply_update(decoded(weights["v0"], weights["v1"], base + 1, base)))  # and it still updates
    assert engine.version == base + 1 and probe(engine) != before


def test_a_generate_cancelled_mid_step_leaves_the_others_served(engine: VLLMEngine, monkeypatch) -> None:
    """Regression (issue 33, benchmarks/swap.py): a generate call cancelled while vLLM ran the step that
    finished its request made the driver set a result on the cancelled future, which raised and ended
    the driver, so every other waiting generate call waited forever."""
    import threading
    import time

    stepping = threading.Event()
    step = engine._engine.step

    def slow_step():
        stepping.set()
        time.sleep(0.2)  # the cancellation lands while this step runs
        return step()

    monkeypatch.setattr(engine._engine, "step", slow_step)
    # The steps and generate calls contend for the engine's lock, which an earlier test's event loop may
    # have bound to itself (each test runs its own loop; a pool runs one for its lifetime).
    monkeypatch.setattr(engine, "_lock", asyncio.Lock())

    async def scenario():
        prompt = engine.encode("The capital of France is")
        other = asyncio.create_task(engine.generate([prompt], GREEDY))
        victim = asyncio.create_task(engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0)))
        await asyncio.to_thread(stepping.wait)
        victim.cancel()
        (gen,) = await asyncio.wait_for(other, 60)
        return gen, victim

    gen, victim = asyncio.run(scenario())
    assert victim.cancelled() and len(gen.tokens) == GREEDY.max_new_tokens
    assert not engine._requests


def _bump_in_vllm(engine: VLLMEngine, param: str) -> None:
    """One word of vLLM's own parameter `param` moves by an ulp: inside the engine, not in its host copy
    nor on disk (a fault injection: updates never write parameters directly)."""
    def bump(model):
        with torch.no_grad():
            model.get_parameter(param).data.view(-1).view(torch.int16)[3] += 1

    engine._engine.apply_model(bump)


def test_the_pool_proves_what_vllm_serves_and_recovers(engine, weights, tmp_path) -> None:
    """Real SmolLM2 deltas (one Adam step at lr 5e-6) through a pool's weight stream: correct swaps never
    alarm; a swap that vLLM did not take (its reload made a no-op: the host copy moved, vLLM did not),
    a tensor changed inside vLLM right after a swap, and a norm (no delta touches one) changed inside
    vLLM between swaps are each caught, the pool drifts, reloads in full and recovers."""
    key = generate_key()
    public = save_keypair(key, tmp_path / "trainer.key")
    gateway = GatewayConfig(store=str(tmp_path / "store"), trusted_keys=[str(public)], anonymous=True,
                            piece_wait_s=1.0, probe_interval_s=0.5)
    expected = {}

    async def greedy_probe() -> tuple[list[int], list[float]]:
        (gen,) = await engine.generate([engine.encode("The capital of France is")], GREEDY)
        return gen.tokens, gen.logprobs

    async def scenario():
        async with serving(create_app(gateway), "127.0.0.1:0") as url:
            pub = Publisher(url, key, MODEL, full_every=0)
            await pub.publish(weights["v0"], engine.version + 1)
            sync = PoolSyncConfig(gateways=[url], token="t", name="vllm-pool", dir=str(tmp_path / "synced"),
                                  trusted_keys=[str(public)], model=MODEL, stall_timeout_s=30, give_up_s=300)
            metrics = PoolMetrics(CollectorRegistry())
            async with PolicyWeights(engine, sync, metrics=metrics, check=ServeCheckConfig(rotation=2)) as w:
                assert await w.sync_round()  # the full snapshot, in place
                if "(0 unreadable" not in w.status.last_check:
                    pytest.skip(f"vLLM packs its weights into an opaque format on this CPU: {w.status.last_check}")
                w._started = True
                current = "v0"
                expected["v0"] = await greedy_probe()  # v0's weights, as the check has just shown

                async def publish(name: str) -> None:
                    nonlocal current
                    await pub.publish(weights[name])
                    assert await w.sync_round()
                    current = name

                for name in ("v1", "v0"):  # correct deltas
                    await publish(name)
                assert w.status.checks == {"ok": 3, "failed": 0} and w.ready

                load = engine._weights.load
                engine._weights.load = lambda tensors, names: None  # "succeeds", vLLM keeps v0's weights
                try:
                    await publish("v1")
                finally:
                    engine._weights.load = load
                assert w.status.checks == {"ok": 4, "failed": 1} and "differ from the signed hashes" in w.status.last_error
                assert w.status.swaps["reload"] == 1 and not w.status.drifted and w.ready

                apply_update = engine.apply_update

                async def corrupting(version):
                    await apply_update(version)
                    _bump_in_vllm(engine, "model.layers.3.mlp.down_proj.weight")

                engine.apply_update = corrupting
                try:
                    await publish("v0")
                finally:
                    del engine.apply_update
                assert w.status.checks == {"ok": 5, "failed": 2} and "down_proj" in w.status.last_error
                assert w.status.swaps["reload"] == 2 and not w.status.drifted
                assert await greedy_probe() == expected["v0"]  # recovered: bit-equal to v0 as served before

                _bump_in_vllm(engine, "model.layers.5.input_layernorm.weight")
                for name in ("v1", "v0"):  # a rotation of 2: caught within two versions
                    await publish(name)
                    if w.status.checks["failed"] == 3:
                        break
                assert w.status.checks["failed"] == 3 and "input_layernorm" in w.status.last_error
                assert w.status.swaps["reload"] == 3 and not w.status.drifted
                if current != "v0":
                    await publish("v0")
                assert w.status.checks["failed"] == 3, "no false alarm"
                assert metrics.registry.get_sample_value("deltamesh_pool_check_failures_total", {"model": MODEL}) == 3
                assert metrics.registry.get_sample_value("deltamesh_pool_drifted", {"model": MODEL}) == 0

    asyncio.run(scenario())
    assert probe(engine) == expected["v0"]  # later tests start from v0's weights
