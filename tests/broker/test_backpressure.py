"""The broker's backpressure (`tasks.max_buffered_groups`), which keeps the demo's pools from running ahead.

A real broker serves on a loopback socket with a real SQLite file; a pool's client leases and submits
over HTTP and a trainer's client takes batches, as in the mesh.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.config import ConfigError, from_dict
from deltamesh.data import Trajectory
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.trainer.batch_client import BatchClient

GROUP = 2


def bounded(tmp_path: Path, cap: int | None) -> BrokerConfig:
    """A broker serving 20 tasks whose buffer holds at most `cap` groups (None: no bound)."""
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"{i}+0=", "answer": str(i)}) + "\n"
                               for i in range(20)))
    return from_dict(BrokerConfig, {"models": ["m"], "durability": "process", "tasks": {
        "dataset": str(dataset), "n_samples": GROUP, "max_buffered_groups": cap}})


def answers(lease) -> list[Trajectory]:
    """A complete group for one lease: two short trajectories generated at version 0."""
    mask = np.array([0, 0, 1, 1], np.uint8)
    return [Trajectory(id=f"{lease.group_id}-{i}", task_id=lease.task_id, group_id=lease.group_id, group_size=GROUP,
                       model_id="m", tokens=np.array([5, 6, 7, 8], np.int32),
                       logprobs=np.array([0, 0, -1, -1], np.float32), loss_mask=mask,
                       versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=float(i))
            for i in range(GROUP)]


def test_no_leases_beyond_the_bound_until_a_trainer_takes_a_batch(tmp_path, serve_broker):
    async def scenario() -> None:
        async with serve_broker(bounded(tmp_path, 3)) as (url, _), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            first = await pool.lease(max_tasks=5)
            assert len(first) == 3  # the bound caps even a single request
            assert await pool.lease(max_tasks=5) == []
            for lease in first:
                await pool.submit(answers(lease))
            # Three groups wait, none is leased: still at the bound.
            assert await pool.lease(max_tasks=5) == []
            batch = await trainer.next_batch(2 * GROUP, timeout_s=5)
            assert batch is not None and len(batch) == 2 * GROUP
            assert len(await pool.lease(max_tasks=5)) == 2  # room again for what the trainer took

    asyncio.run(scenario())


def test_without_a_bound_pools_lease_freely(tmp_path, serve_broker):
    async def scenario() -> None:
        async with serve_broker(bounded(tmp_path, None)) as (url, _), BrokerClient(url, pool="p") as pool:
            assert len(await pool.lease(max_tasks=8)) == 8
            assert len(await pool.lease(max_tasks=8)) == 8

    asyncio.run(scenario())


def test_a_bound_below_one_is_refused():
    with pytest.raises(ConfigError, match="max_buffered_groups"):
        from_dict(BrokerConfig, {"tasks": {"max_buffered_groups": 0}})
