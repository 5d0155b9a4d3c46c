"""A whole `RolloutPool` in this process serving two policies (the solver_verifier workflow), against a
real broker and a real gateway on loopback sockets: one engine and one weight stream per model_id,
trajectories of both models grouped per lease and tagged with the version of every token."""

from __future__ import annotations

import asyncio
import json
import time

from deltamesh.http import client_session, request_json
from deltamesh.mesh.broker.config import BrokerConfig, PoliciesConfig, TasksConfig
from deltamesh.mesh.pool.config import PolicyConfig, PoolConfig, SamplingConfig, WorkerConfig
from deltamesh.mesh.pool.pool import RolloutPool
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.mesh.workflows.verifiable_math import digit_sum_tasks
from deltamesh.trainer.batch_client import BatchClient
from deltamesh.trainer.publisher import Publisher


def test_a_pool_serves_two_policies_each_following_its_own_weights(kit):
    dataset = kit.tmp / "tasks.jsonl"
    dataset.write_text("".join(json.dumps(t) + "\n" for t in digit_sum_tasks(50)))
    # No trainer reports a version here, and the pool serves v3: the broker must take claims 3 ahead.
    broker_config = BrokerConfig(models=["solver", "verifier"], durability="process",
                                 tasks=TasksConfig(dataset=str(dataset), n_samples=2, epochs=5),
                                 policies=PoliciesConfig(max_version_ahead=3))
    base = kit.base_weights()
    versions = {"solver": kit.next_version(base, 11), "verifier": kit.next_version(base, 12)}

    async def main():
        async with kit.running_broker(broker_config, kit.tmp / "broker.db") as broker, \
                kit.running_gateway(kit.gateway_config(region="north")) as gateway:
            for model_id, weights in versions.items():
                await Publisher(gateway, kit.private_key, model_id, piece_bytes=32768).publish(weights, 3)
            config = PoolConfig(
                name="sv", broker=broker, dir=str(kit.tmp / "weights"),
                sync=WeightSyncSettings(gateways=[gateway], token=kit.token, trusted_keys=[str(kit.public_key)],
                                        heartbeat_s=0.5, poll_wait_s=1.0),
                worker=WorkerConfig(workflow="solver_verifier", max_episodes=4, lease_batch=2),
                models=[PolicyConfig("solver", str(kit.model_dir)), PolicyConfig("verifier", str(kit.model_dir))],
                sampling=SamplingConfig(max_new_tokens=3))
            pool = RolloutPool(config)
            stop = asyncio.Event()
            running = asyncio.create_task(pool.run(stop))
            deadline = time.monotonic() + 90
            while not (pool.worker and all(pool.worker.counts.submitted_by_model.get(m, 0) >= 4 for m in versions)):
                assert not running.done(), running.exception()
                assert time.monotonic() < deadline, pool.status()
                await asyncio.sleep(0.1)
            status = pool.status()
            async with client_session() as s:
                registered = (await request_json(s, "GET", f"{gateway}/v1/pools"))["pools"]
            stop.set()
            await asyncio.wait_for(running, 60)

            samples = []
            for model_id in versions:
                async with BatchClient(broker, model_id) as client:
                    while (batch := await client.next_batch(4, timeout_s=0.5)) is not None:
                        samples += batch.samples
            return status, registered, samples

    status, registered, samples = asyncio.run(main())
    assert status["region"] == "north"
    for model_id in versions:
        assert status["models"][model_id]["engine_version"] == 3
        assert status["models"][model_id]["fetched"] == {"full": 1, "delta": 0}
    assert {(p["name"], p["model"], p["version"]) for p in registered} == {("sv.solver", "solver", 3),
                                                                          ("sv.verifier", "verifier", 3)}
    assert {s["model_id"] for s in samples} == {"solver", "verifier"}
    assert all(s["pool"] == "sv" and s["region"] == "north" and s["min_version"] == s["max_version"] == 3
               for s in samples)
    for s in samples:
        assert s["metadata"]["role"] == s["model_id"]
    # Each lease is one group per model: the solver's turns (first answers and retries) and the verifier's reviews.
    verifier_groups = {s["group_id"] for s in samples if s["model_id"] == "verifier"}
    assert verifier_groups and all(sum(1 for s in samples if s["group_id"] == g and s["model_id"] == "verifier") == 2
                                   for g in verifier_groups)
