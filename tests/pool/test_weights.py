"""A policy's weight stream against a real gateway (in-process, real loopback socket) and a real tiny
transformers engine: in-place hot swap, the synced directory, restarts and the reload fallbacks."""

from __future__ import annotations

import asyncio
import time

import torch

from deltamesh.delta import dir_manifest, read_weights
from deltamesh.gateway.config import PoolSyncConfig
from deltamesh.gateway.publisher import Publisher
from deltamesh.mesh.engines.hotswap import live_tensors
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.mesh.pool.weights import PolicyWeights


def _engine(kit) -> TransformersEngine:
    return TransformersEngine(TransformersEngineConfig(model_id=kit.model, model_dir=str(kit.model_dir)))


def _sync_config(kit, gateway: str, name: str = "p") -> PoolSyncConfig:
    return PoolSyncConfig(gateways=[gateway], token=kit.token, name=name, dir=str(kit.tmp / "weights" / name),
                          trusted_keys=[str(kit.public_key)], model=kit.model, heartbeat_s=0.3, poll_wait_s=1,
                          stall_timeout_s=3, give_up_s=20)


def _same(engine: TransformersEngine, weights: dict[str, torch.Tensor]) -> bool:
    live = live_tensors(engine.model)
    return all(torch.equal(live[n].view(torch.int16), w.view(torch.int16)) for n, w in weights.items())


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class _Running:
    """`PolicyWeights.run` as a task, stopped and awaited on exit."""

    def __init__(self, weights: PolicyWeights):
        self.weights = weights
        self.stop = asyncio.Event()

    async def __aenter__(self) -> PolicyWeights:
        self.task = asyncio.create_task(self.weights.run(self.stop))
        return self.weights

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def test_hot_swap_in_place_then_restart_resumes_from_the_directory(kit):
    v0 = kit.base_weights()
    v1 = kit.next_version(v0, 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)

    async def main():
        async with kit.running_gateway(kit.gateway_config()) as url:
            pub = Publisher(url, kit.private_key, kit.model, full_every=0, piece_bytes=16384)
            await pub.publish(v1, 1)
            engine = _engine(kit)
            async with _Running(PolicyWeights(engine, _sync_config(kit, url))) as w:
                await _until(lambda: w.ready, 30, "the first sync")
                # The engine started from other weights (v0 of the model directory): the full snapshot
                # went in place, before the directory was written.
                assert engine.version == 1 and w.version == 1 and _same(engine, v1)
                assert w.status.fetched == {"full": 1, "delta": 0} and w.status.swaps == {"in_place": 1, "reload": 0}
                await pub.publish(v2)
                await _until(lambda: engine.version == 2 and w.sync.version == 2, 30, "v2")
                assert _same(engine, v2) and w.status.swaps == {"in_place": 2, "reload": 0}
                assert w.status.fetched == {"full": 1, "delta": 1}
                assert dir_manifest(w.dir).version == 2
            await engine.close()

            # A restarted pool: a fresh engine from the model directory, the same synced directory.
            engine = _engine(kit)
            async with _Running(PolicyWeights(engine, _sync_config(kit, url))) as w:
                await _until(lambda: w.ready, 30, "the restart")
                assert w.status.resumed_from_dir == 2 and engine.version == 2 and _same(engine, v2)
                assert w.status.fetched == {"full": 0, "delta": 0}, "nothing is downloaded again"
                await pub.publish(v3)
                await _until(lambda: engine.version == 3, 30, "v3")
                assert w.status.fetched == {"full": 0, "delta": 1} and w.status.swaps == {"in_place": 1, "reload": 1}
                assert _same(engine, v3)
            await engine.close()

    asyncio.run(main())


def test_a_failed_in_place_update_falls_back_to_the_directory(kit):
    """Live weights that are not the delta's base (here: one word changed behind the pool's back) make the
    in-place update fail its hash check; the engine is restored, then loads the version from disk."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with kit.running_gateway(kit.gateway_config()) as url:
            pub = Publisher(url, kit.private_key, kit.model, full_every=0, piece_bytes=16384)
            await pub.publish(v1, 1)
            engine = _engine(kit)
            async with _Running(PolicyWeights(engine, _sync_config(kit, url))) as w:
                await _until(lambda: w.ready, 30, "the first sync")
                name = next(n for n, t in v2.items() if not torch.equal(t.view(torch.int16), v1[n].view(torch.int16)))
                with torch.no_grad():
                    live_tensors(engine.model)[name].view(-1)[0] += 1.0
                await pub.publish(v2)
                await _until(lambda: engine.version == 2, 30, "v2")
                assert _same(engine, v2)
                assert w.status.swaps == {"in_place": 1, "reload": 1}
                assert "in-place update to v2 failed" in w.status.last_error
            await engine.close()

    asyncio.run(main())


def test_without_hot_swap_every_version_is_reloaded_from_disk(kit):
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with kit.running_gateway(kit.gateway_config()) as url:
            pub = Publisher(url, kit.private_key, kit.model, full_every=0, piece_bytes=16384)
            engine = _engine(kit)
            async with _Running(PolicyWeights(engine, _sync_config(kit, url), hot_swap=False)) as w:
                await asyncio.sleep(0.5)
                assert not w.ready and w.version is None, "nothing published: not ready to generate"
                await pub.publish(v1, 1)
                await _until(lambda: w.ready, 30, "v1")
                await pub.publish(v2)
                await _until(lambda: engine.version == 2, 30, "v2")
                assert _same(engine, v2) and read_weights(w.dir).keys() == v2.keys()
                assert w.status.swaps == {"in_place": 0, "reload": 2}
            await engine.close()

    asyncio.run(main())
