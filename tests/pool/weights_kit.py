"""Helpers of the pool's weight-stream tests (test_weights.py, test_write_behind.py): a gateway in
this process, a pool's weights on a fresh tiny transformers engine, and waits; conftest.py makes
it importable as `deltamesh_pool_test_weights_kit` (test modules cannot import a conftest or each other)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch

from deltamesh.delta import live_tensors
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weights import PolicyWeights
from deltamesh.trainer.publisher import Publisher


def tiny_engine(kit) -> TransformersEngine:
    return TransformersEngine(TransformersEngineConfig(model_id=kit.model, model_dir=str(kit.model_dir)))


def sync_config(kit, gateway: str, name: str = "p") -> PoolSyncConfig:
    return PoolSyncConfig(gateways=[gateway], token=kit.token, name=name, dir=str(kit.tmp / "weights" / name),
                          trusted_keys=[str(kit.public_key)], model=kit.model, heartbeat_s=0.3, poll_wait_s=1,
                          stall_timeout_s=3, give_up_s=20)


def same(engine: TransformersEngine, weights: dict[str, torch.Tensor]) -> bool:
    live = live_tensors(engine.model)
    return all(torch.equal(live[n].view(torch.int16), w.view(torch.int16)) for n, w in weights.items())


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def gateway(kit, first: dict[str, torch.Tensor] | None, piece_bytes: int = 16384):
    """A gateway in this process with `first` published as v1 (a full): `async with ... as (url, pub)`."""
    async with kit.running_gateway(kit.gateway_config()) as url:
        pub = Publisher(url, kit.private_key, kit.model, full_every=0, piece_bytes=piece_bytes)
        if first is not None:
            await pub.publish(first, 1)
        yield url, pub


@contextlib.asynccontextmanager
async def pool_weights(kit, url: str, *, hot_swap: bool = True, running: bool = False):
    """A pool's weights on a fresh engine, subscribed to the gateway at `url`: `async with ... as
    (engine, weights)`. With `running` they run their own loop; otherwise the test drives `sync_round`."""
    engine = tiny_engine(kit)
    try:
        weights = PolicyWeights(engine, sync_config(kit, url), hot_swap=hot_swap)
        async with (Running(weights) if running else weights) as w:
            yield engine, w
    finally:
        await engine.close()


def change_behind_the_pools_back(engine: TransformersEngine, v1: dict[str, torch.Tensor],
                                  v2: dict[str, torch.Tensor]) -> None:
    """Move one live word of a tensor that the v1 -> v2 delta changes, so the delta's base no longer
    matches the live weights."""
    name = next(n for n, t in v2.items() if not torch.equal(t.view(torch.int16), v1[n].view(torch.int16)))
    with torch.no_grad():
        live_tensors(engine.model)[name].view(-1)[0] += 1.0


class Running:
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


def gate_writes(w) -> tuple[asyncio.Event, list[list[int]]]:
    """Hold the pool's directory writes until the returned gate is set; the list records each write's
    versions as it goes through."""
    gate, written = asyncio.Event(), []
    persist = w.sync.persist

    async def gated(versions):
        await gate.wait()
        written.append([v.version for v in versions])
        return await persist(versions)

    w.sync.persist = gated
    return gate, written
