"""Multi-turn episodes through the mesh: a `RolloutPool` in this process runs the `tool_use` workflow
(the tiny model calling a Python tool in the sandbox) against a real broker and gateway on loopback
sockets; the trainer's client takes the batch from the broker and the trainer takes a step on it.
Every episode has at least two turns, and the loss mask of every sample the trainer gets is exactly
the model's tokens: the prompt and the environment's observations are masked out."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from deltamesh.mesh.pool.config import PolicyConfig, PoolConfig, SamplingConfig, WorkerConfig
from deltamesh.mesh.pool.pool import RolloutPool
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.mesh.sandbox import SandboxConfig
from deltamesh.mesh.workflows.tool_use import tool_tasks
from deltamesh.trainer.batch_client import BatchClient
from deltamesh.trainer.config import TrainerConfig
from deltamesh.trainer.loss_inputs import inputs_from_batch
from deltamesh.trainer.models import load_causal_lm
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.step import TrainState, build_optimizer, train_step

EPISODES = 4


def test_tool_use_episodes_reach_the_trainer_with_only_the_models_tokens_in_the_loss(kit):
    broker_config = kit.broker_config(tool_tasks(8))
    weights = kit.next_version(kit.base_weights(), 11)

    async def main():
        async with kit.running_broker(broker_config, kit.tmp / "broker.db") as broker, \
                kit.running_gateway(kit.gateway_config(region="north")) as gateway:
            await Publisher(gateway, kit.private_key, kit.model, piece_bytes=32768).publish(weights, 3)
            config = PoolConfig(
                name="tools", broker=broker, dir=str(kit.tmp / "weights"),
                sync=WeightSyncSettings(gateways=[gateway], token=kit.token, trusted_keys=[str(kit.public_key)],
                                        heartbeat_s=0.5, poll_wait_s=1.0),
                worker=WorkerConfig(workflow="tool_use", max_episodes=2, lease_batch=2,
                                    workflow_options={"max_turns": 3, "prompt_template": "{prompt}\n"}),
                models=[PolicyConfig(kit.model, str(kit.model_dir))], sampling=SamplingConfig(max_new_tokens=4),
                sandbox=SandboxConfig(test_timeout_s=1.0, timeout_s=10.0))
            pool = RolloutPool(config)
            stop = asyncio.Event()
            running = asyncio.create_task(pool.run(stop))
            deadline = time.monotonic() + 90
            while not (pool.worker and pool.worker.counts.submitted >= EPISODES):
                assert not running.done(), running.exception()
                assert time.monotonic() < deadline, pool.status()
                await asyncio.sleep(0.1)
            status = pool.status()
            stop.set()
            await asyncio.wait_for(running, 60)
            async with BatchClient(broker, kit.model) as client:
                batch = await client.next_batch(EPISODES, timeout_s=5.0)
            return status, batch

    status, batch = asyncio.run(main())
    assert status["sandbox"] is not None and status["worker"]["episodes_failed"] == 0
    assert batch is not None and len(batch) == EPISODES
    for i, sample in enumerate(batch.samples):
        meta = sample["metadata"]
        assert meta["workflow"] == "tool_use" and meta["turns"] >= 2
        model_tokens = [p for a, b in meta["turn_spans"] for p in range(a, b)]
        n = int(batch.lengths[i])
        assert np.flatnonzero(batch.loss_mask[i, :n]).tolist() == model_tokens
        mask = batch.loss_mask[i, :n].astype(bool)
        assert (batch.versions[i, :n][mask] == 3).all() and (batch.versions[i, :n][~mask] == -1).all()
        assert (batch.logprobs[i, :n][~mask] == 0).all() and (batch.logprobs[i, :n][mask] < 0).all()
        assert sample["min_version"] == sample["max_version"] == 3
        assert sample["reward"] == (1.0 if meta["correct"] else 0.0)
        assert sum(meta["outcomes"].values()) == meta["tool_calls"]

    # The trainer trains on exactly those tokens.
    model = load_causal_lm(str(kit.model_dir), dtype=torch.float32, device="cpu")
    inputs = inputs_from_batch(batch)
    metrics = train_step(TrainState(model, build_optimizer(model, TrainerConfig().optim)), inputs, TrainerConfig())
    assert metrics["tokens"] == int(batch.loss_mask.sum()) and np.isfinite(metrics["loss"])
