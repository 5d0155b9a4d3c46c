"""Proof of what the engine serves (`serve_check.py`), on a real gateway (in-process, loopback) and a real
tiny transformers engine: correct swaps never alarm; a tensor corrupted inside the live engine after a
swap, or an update call that "succeeds" without changing the weights, is caught within one version;
a tensor no delta touches is caught within the rotation; the pool then drifts (no leases, metrics),
reloads in full and recovers. The same faults on SmolLM2 with vLLM: tests/engines/test_vllm_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from prometheus_client import CollectorRegistry

from deltamesh.delta import live_tensors
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.mesh.pool.config import ServeCheckConfig
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.serve_check import ServeCheck
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weights import PolicyWeights
from deltamesh.trainer.publisher import Publisher


def _same(engine: TransformersEngine, weights: dict[str, torch.Tensor]) -> bool:
    live = live_tensors(engine.model)
    return all(torch.equal(live[n].view(torch.int16), w.view(torch.int16)) for n, w in weights.items())


def _bump(engine: TransformersEngine, name: str) -> None:
    """One live word of `name` moves by one ulp, inside the engine only (not on disk)."""
    with torch.no_grad():
        live_tensors(engine.model)[name].view(-1).view(torch.int16)[3] += 1


@contextlib.asynccontextmanager
async def _pool(kit, first: dict[str, torch.Tensor], rotation: int = 4):
    """A gateway with `first` published as v1, and a pool's weights on a fresh engine that the test drives
    with `sync_round`: `async with ... as (engine, weights, publisher, metrics)`."""
    async with kit.running_gateway(kit.gateway_config()) as url:
        pub = Publisher(url, kit.private_key, kit.model, full_every=0)
        await pub.publish(first, 1)
        engine = TransformersEngine(TransformersEngineConfig(model_id=kit.model, model_dir=str(kit.model_dir)))
        sync = PoolSyncConfig(gateways=[url], token=kit.token, name="p", dir=str(kit.tmp / "weights"),
                              trusted_keys=[str(kit.public_key)], model=kit.model, stall_timeout_s=3, give_up_s=20)
        metrics = PoolMetrics(CollectorRegistry())
        try:
            async with PolicyWeights(engine, sync, metrics=metrics, check=ServeCheckConfig(rotation=rotation)) as w:
                assert await w.sync_round()
                w._started = True  # what `run` sets after its first round: `ready` now follows the engine
                yield engine, w, pub, metrics
        finally:
            await engine.close()


def _metric(metrics: PoolMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model": "tiny", **labels}) or 0.0


def test_correct_swaps_pass_and_a_corrupted_tensor_is_caught_then_reloaded(kit):
    weights = kit.next_version(kit.base_weights(), 1)

    async def main():
        nonlocal weights
        async with _pool(kit, weights) as (engine, w, pub, metrics):
            for seed in range(2, 8):  # correct deltas: no false alarm
                weights = kit.next_version(weights, seed)
                await pub.publish(weights)
                assert await w.sync_round() and _same(engine, weights)
            assert w.status.checks == {"ok": 7, "failed": 0} and not w.status.drifted and w.ready
            assert _metric(metrics, "deltamesh_pool_drifted") == 0

            # The engine's update writes one word wrong (after its own hash check): caught this version.
            name = "model.layers.0.mlp.down_proj.weight"
            apply_update = engine.apply_update

            async def corrupting(version):
                await apply_update(version)
                _bump(engine, name)

            engine.apply_update = corrupting
            weights = kit.next_version(weights, 8)
            await pub.publish(weights)
            assert await w.sync_round()
            engine.apply_update = apply_update
            assert w.status.checks == {"ok": 8, "failed": 1}, w.status.last_check
            assert w.status.swaps["reload"] == 1 and _same(engine, weights)  # reloaded in full: recovered
            assert not w.status.drifted and w.ready
            assert _metric(metrics, "deltamesh_pool_check_failures_total") == 1
            assert _metric(metrics, "deltamesh_pool_drifted") == 0
            assert _metric(metrics, "deltamesh_pool_serve_checks_total", result="failed") == 1

    asyncio.run(main())


def test_an_update_that_changes_nothing_is_caught_and_drift_stops_leasing_until_a_reload_passes(kit):
    weights = kit.next_version(kit.base_weights(), 1)

    async def main():
        async with _pool(kit, weights) as (engine, w, pub, metrics):
            async def stale(version):  # "succeeds", claims the version, keeps serving the old weights
                engine._set_version(version.manifest.version, version.manifest)

            engine.apply_update = stale
            load_version = engine.load_version
            failing = []

            async def broken_reload(path, version):
                failing.append(version)
                raise OSError("disk hiccup")

            engine.load_version = broken_reload
            new = kit.next_version(weights, 2)
            await pub.publish(new)
            assert await w.sync_round()
            assert w.status.drifted and not w.ready and failing == [2]  # caught; the reload failed
            assert "differ from the signed hashes" in w.status.last_check
            assert _metric(metrics, "deltamesh_pool_drifted") == 1
            engine.load_version = load_version
            assert await w.sync_round() is False  # the next round reloads first, and checks
            assert not w.status.drifted and w.ready and _same(engine, new)
            assert w.status.checks == {"ok": 2, "failed": 1}  # v1, then v2 after the reload
            assert _metric(metrics, "deltamesh_pool_drifted") == 0

    asyncio.run(main())


def test_with_a_rotation_of_one_every_tensor_is_read_back_after_every_swap(kit):
    """A tensor the delta does not touch, gone bad inside the engine right after the swap: with
    `rotation=1` the check reads every tensor and catches it in the same version. (With a longer
    rotation the rotation catches it within that many versions: an in-place apply takes the digests
    of tensors a delta does not touch from the last verified manifest, without reading them.)"""
    untouched = "model.norm.weight"
    weights = kit.next_version(kit.base_weights(), 1)

    async def main():
        async with _pool(kit, weights, rotation=1) as (engine, w, pub, _):
            apply_update = engine.apply_update

            async def corrupting(version):
                await apply_update(version)
                _bump(engine, untouched)

            engine.apply_update = corrupting
            new = {**kit.next_version(weights, 2), untouched: weights[untouched]}
            await pub.publish(new)
            assert await w.sync_round()
            assert w.status.checks == {"ok": 2, "failed": 1} and untouched in w.status.last_error
            assert _same(engine, new) and not w.status.drifted and w.status.swaps["reload"] == 1

    asyncio.run(main())


def test_the_rotation_covers_every_tensor_within_its_length(kit):
    from deltamesh.delta import encode_delta, generate_key

    v0 = kit.base_weights()
    manifest = encode_delta(v0, kit.next_version(v0, 1), model_id="tiny", version=1, base_version=0,
                            key=generate_key()).manifest
    check = ServeCheck(ServeCheckConfig(rotation=3))
    seen: set[str] = set()
    for _ in range(3):
        seen |= set(check.plan(manifest, touched=[]))
    assert seen == {t.name for t in manifest.tensors}
    assert check.plan(manifest, None) == [t.name for t in manifest.tensors]
    with pytest.raises(ValueError):
        ServeCheckConfig(rotation=0)
