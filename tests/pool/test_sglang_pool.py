"""A pool with the SGLang engine: every version is applied to the synced directory, then loaded with
`/update_weights_from_disk`, and trajectories carry the server's weight version.

SGLang needs CUDA kernels and cannot run here, so the engine talks to the SGLang stand-in of the
engine tests (tests/engines/sglang_standin.py, a real HTTP server following SGLang's documented API
with a fake model); everything else (pool, broker, gateway) is real.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from deltamesh.delta import dir_manifest
from deltamesh.mesh.broker.config import BrokerConfig, TasksConfig
from deltamesh.mesh.pool.config import PolicyConfig, PoolConfig, SamplingConfig, WorkerConfig
from deltamesh.mesh.pool.pool import RolloutPool
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.mesh.workflows.verifiable_math import digit_sum_tasks
from deltamesh.trainer.batch_client import BatchClient
from deltamesh.trainer.publisher import Publisher

STANDIN = Path(__file__).resolve().parent.parent / "engines" / "sglang_standin.py"


def test_an_sglang_pool_reloads_each_version_from_the_synced_directory(kit):
    port = kit.free_port()
    standin = subprocess.Popen([sys.executable, str(STANDIN), "--model-path", str(kit.model_dir), "--port", str(port),
                                "--token-delay-s", "0.001"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    engine_url = f"http://127.0.0.1:{port}"
    dataset = kit.tmp / "tasks.jsonl"
    dataset.write_text("".join(json.dumps(t) + "\n" for t in digit_sum_tasks(100)))
    broker_config = BrokerConfig(models=[kit.model], durability="process",
                                 tasks=TasksConfig(dataset=str(dataset), n_samples=2, epochs=10))
    v1 = kit.next_version(kit.base_weights(), 1)

    async def main():
        async with kit.running_broker(broker_config, kit.tmp / "broker.db") as broker, \
                kit.running_gateway(kit.gateway_config()) as gateway:
            pub = Publisher(gateway, kit.private_key, kit.model, piece_bytes=32768)
            await pub.publish(v1, 1)
            config = PoolConfig(
                name="sg", broker=broker, dir=str(kit.tmp / "weights"), engine="sglang",
                sync=WeightSyncSettings(gateways=[gateway], token=kit.token, trusted_keys=[str(kit.public_key)],
                                        heartbeat_s=0.5, poll_wait_s=1.0),
                worker=WorkerConfig(max_episodes=2, lease_batch=2),
                models=[PolicyConfig(kit.model, str(kit.model_dir), engine_url=engine_url)],
                sampling=SamplingConfig(max_new_tokens=4))
            pool = RolloutPool(config)
            stop = asyncio.Event()
            running = asyncio.create_task(pool.run(stop))

            async def until(predicate, what: str) -> None:
                deadline = time.monotonic() + 60
                while not predicate():
                    assert not running.done(), running.exception()
                    assert time.monotonic() < deadline, f"{what}: {pool.status()}"
                    await asyncio.sleep(0.05)

            def submitted() -> int:
                return pool.worker.counts.submitted if pool.worker else 0

            await until(lambda: submitted() >= 4, "trajectories from v1")
            await pub.publish(kit.next_version(v1, 2))
            await until(lambda: pool.weights[kit.model].version == 2, "v2")
            at_v2 = submitted()
            await until(lambda: submitted() >= at_v2 + 4, "trajectories from v2")
            status = pool.status()["models"][kit.model]
            stop.set()
            await asyncio.wait_for(running, 60)
            samples = []
            async with BatchClient(broker, kit.model) as client:
                while (batch := await client.next_batch(2, timeout_s=0.5)) is not None:
                    samples += batch.samples
            return status, samples

    try:
        status, samples = asyncio.run(main())
        with urllib.request.urlopen(f"{engine_url}/standin/calls", timeout=10) as r:
            calls = [c for c in json.loads(r.read()) if c["call"] == "update_weights_from_disk"]
    finally:
        standin.kill()
        standin.wait(10)
    synced = kit.tmp / "weights" / kit.model
    assert dir_manifest(synced).version == 2
    # One load per version, from the synced directory, labelled with the version number.
    assert [(c["model_path"], c["weight_version"]) for c in calls] == [(str(synced), "1"), (str(synced), "2")]
    assert status["swaps"] == {"in_place": 0, "reload": 2} and status["engine_version"] == 2
    versions = {(s["min_version"], s["max_version"]) for s in samples}
    assert (1, 1) in versions and (2, 2) in versions and versions <= {(1, 1), (1, 2), (2, 2)}
