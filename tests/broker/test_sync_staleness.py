"""The staleness bound measured from the version a batch trains (`training_version`), on leases and batches.

With `policies.max_staleness` 0 (synchronous RL) a trainer that took a batch at v is making v+1 before
it reports it; the broker holds back a lease from a pool still serving v (its samples would be stale),
and a batch taken meanwhile holds no group older than the version it trains. A real broker serves on
a loopback socket with a real SQLite file; pools and the trainer are its real clients.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from deltamesh.broker_client import BrokerClient, HeldBack
from deltamesh.config import from_dict
from deltamesh.data import Trajectory
from deltamesh.http import HttpError, request_json
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.trainer.batch_client import BatchClient

GROUP = 2
BATCH = 2 * GROUP  # one step: two groups


def sync_config(tmp_path: Path, max_staleness: int | None = 0) -> BrokerConfig:
    """20 tasks, one step's groups buffered, the given staleness bound."""
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"{i}+0=", "answer": str(i)}) + "\n"
                               for i in range(20)))
    return from_dict(BrokerConfig, {"models": ["m"], "durability": "process",
                                    "tasks": {"dataset": str(dataset), "n_samples": GROUP, "max_buffered_groups": 2},
                                    "policies": {"max_staleness": max_staleness}})


def group(lease, version: int) -> list[Trajectory]:
    mask = np.array([0, 0, 1, 1], np.uint8)
    return [Trajectory(id=f"{lease.group_id}-{i}", task_id=lease.task_id, group_id=lease.group_id, group_size=GROUP,
                       model_id="m", tokens=np.array([5, 6, 7, 8], np.int32),
                       logprobs=np.array([0, 0, -1, -1], np.float32), loss_mask=mask,
                       versions=np.where(mask == 1, version, -1).astype(np.int32), reward=float(i))
            for i in range(GROUP)]


async def one_step(pool: BrokerClient, trainer: BatchClient, version: int) -> None:
    """The pool fills one step's groups at `version` and the trainer takes them."""
    for lease in await pool.lease(2, {"m": version}):
        await pool.submit(group(lease, version))
    batch = await trainer.next_batch(BATCH, timeout_s=5)
    assert batch is not None and {s["min_version"] for s in batch.samples} == {version}


async def status(url: str) -> dict:
    async with BrokerClient(url) as c:
        return await c.status()


def test_a_lease_for_a_pool_serving_a_version_behind_the_training_version_is_held_back(tmp_path, serve_broker):
    async def scenario() -> None:
        async with serve_broker(sync_config(tmp_path)) as (url, _), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            await one_step(pool, trainer, 0)  # the trainer is making v1 now; it has not reported it
            before = await status(url)
            assert before["models"]["m"]["training_version"] == 1 and before["models"]["m"]["version"] == 0
            with pytest.raises(HeldBack, match=r"m: v0 is 1 behind training_version v1") as held:
                await pool.lease(2, {"m": 0})
            assert held.value.training_versions == {"m": 1}
            after = await status(url)
            assert after["tasks"] == before["tasks"]  # nothing leased, the cursor did not move
            async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
                assert 'deltamesh_broker_leases_total{event="held_back"} 1.0' in await r.text()
            # Serving the version the next batch trains, the pool is leased to.
            assert len(await pool.lease(2, {"m": 1})) == 2

    asyncio.run(scenario())


def test_the_wire_answer_names_the_version_to_wait_for(tmp_path, serve_broker):
    """What a pool of another make sees: 200, no leases, `held_back` and a reason."""
    async def scenario() -> None:
        async with serve_broker(sync_config(tmp_path)) as (url, _), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            await one_step(pool, trainer, 0)
            async with aiohttp.ClientSession() as s:
                answer = await request_json(s, "POST", f"{url}/v1/leases",
                                            body={"pool": "p", "max_tasks": 2, "served": {"m": 0}})
                assert answer["leases"] == [] and answer["held_back"] == {"m": 1}
                assert "policies.max_staleness 0" in answer["reason"]
                with pytest.raises(HttpError, match="served must map") as bad:
                    await request_json(s, "POST", f"{url}/v1/leases",
                                       body={"pool": "p", "max_tasks": 2, "served": {"m": -1}})
                assert bad.value.status == 400

    asyncio.run(scenario())


def test_without_a_bound_or_a_served_version_leases_go_out_as_before(tmp_path, serve_broker):
    async def scenario() -> None:
        async with serve_broker(sync_config(tmp_path, None)) as (url, _), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            await one_step(pool, trainer, 0)
            assert len(await pool.lease(2, {"m": 0})) == 2  # no bound: no hold-back

    asyncio.run(scenario())


def test_a_batch_holds_no_group_older_than_the_version_it_trains(tmp_path, serve_broker):
    """Groups generated at v0 that come in after the trainer took its v0 batch (a pool that did not say
    what it serves) are dropped as stale, though the trainer has not reported v1 yet: the next batch
    trains v1."""
    async def scenario() -> None:
        async with serve_broker(sync_config(tmp_path)) as (url, _), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            await one_step(pool, trainer, 0)
            for lease in await pool.lease(2):  # no `served`: not held back
                await pool.submit(group(lease, 0))
            assert await trainer.next_batch(BATCH, timeout_s=1.5) is None
            assert (await status(url))["models"]["m"]["fresh_groups"] == 0  # dropped as stale
            for lease in await pool.lease(2, {"m": 1}):
                await pool.submit(group(lease, 1))
            batch = await trainer.next_batch(BATCH, timeout_s=5)
            assert batch is not None and {s["min_version"] for s in batch.samples} == {1}

    asyncio.run(scenario())


def test_a_batch_requeued_untrained_is_not_counted_towards_the_training_version(tmp_path, serve_broker):
    """A trainer that restarts without the batch it held makes no version from it: its groups go back,
    and training_version with them, so they are served again rather than dropped as stale."""
    async def scenario() -> None:
        async with serve_broker(sync_config(tmp_path)) as (url, _), BrokerClient(url, pool="p") as pool:
            async with BatchClient(url, "m", auto_ack=False) as trainer:
                for lease in await pool.lease(2, {"m": 0}):
                    await pool.submit(group(lease, 0))
                first = await trainer.next_batch(BATCH, timeout_s=5)
                assert first is not None
            assert (await status(url))["models"]["m"]["training_version"] == 1
            async with BatchClient(url, "m") as restarted:  # polls holding nothing: the batch goes back
                again = await restarted.next_batch(BATCH, timeout_s=5)
            assert again is not None and sorted(s["id"] for s in again.samples) == sorted(
                s["id"] for s in first.samples)
            assert (await status(url))["models"]["m"]["training_version"] == 1  # one batch out, not two

    asyncio.run(scenario())
