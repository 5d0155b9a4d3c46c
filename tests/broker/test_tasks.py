"""Rollout tasks through the broker: dataset import, leases with deadlines, epochs, completion by
submitted groups, expiry and re-issue, faster pools getting more, and the curator skipping prompts."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.mesh.broker.config import BrokerConfig, CuratorConfig, TasksConfig
from deltamesh.mesh.broker.tasks import DatasetError, read_dataset


def write_dataset(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"What is {i}+{i}?", "answer": str(2 * i),
                                        "tests": [i]}) + "\n" for i in range(n)))
    return path


def config(tmp_path: Path, n: int = 3, **tasks) -> BrokerConfig:
    return BrokerConfig(models=["m"], tasks=TasksConfig(dataset=str(write_dataset(tmp_path / "d.jsonl", n)), **tasks))


def leased_group(make_group, lease, pool: str, rewards=(1.0, 0.0), **kw) -> list:
    """A complete group for `lease`, submitted by `pool` (only the pool holding a lease may fill its group)."""
    group = make_group(lease.group_id, list(rewards), task_id=lease.task_id, **kw)
    for t in group:
        t.pool = pool
    return group


def test_read_dataset_keeps_extra_fields_and_names_bad_lines(tmp_path):
    tasks = read_dataset(write_dataset(tmp_path / "d.jsonl", 2))
    assert [(t.task_id, t.prompt, t.metadata) for t in tasks] == [
        ("q0", "What is 0+0?", {"answer": "0", "tests": [0]}), ("q1", "What is 1+1?", {"answer": "2", "tests": [1]})]
    (tmp_path / "noid.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert [t.task_id for t in read_dataset(tmp_path / "noid.jsonl")] == ["line1", "line3"]
    for text, reason in (('{"prompt": "a"}\n{oops\n', ":2: not JSON"), ('["a"]\n', "with a prompt"),
                         ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "appears twice")):
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(DatasetError, match=reason):
            read_dataset(tmp_path / "bad.jsonl")


def test_leases_walk_the_dataset_over_epochs(serve_broker, tmp_path):
    async def scenario():
        async with serve_broker(config(tmp_path, 3, epochs=2, n_samples=4)) as (url, broker), \
                BrokerClient(url, pool="p", region="eu", gpus=2) as pool:
            leases = await pool.lease(4)
            assert [(le.task_id, le.epoch) for le in leases] == [("q0", 0), ("q1", 0), ("q2", 0), ("q0", 1)]
            first = leases[0]
            assert first.prompt == "What is 0+0?" and first.metadata == {"answer": "0", "tests": [0]}
            assert first.n_samples == 4 and first.model_ids == ["m"] and first.group_id == first.lease_id
            assert len({le.lease_id for le in leases}) == 4
            assert [(le.task_id, le.epoch) for le in await pool.lease(9)] == [("q1", 1), ("q2", 1)]
            assert await pool.lease(1) == []
            assert broker.status()["tasks"]["exhausted"] and not broker.status()["tasks"]["finished"]
            assert broker.balance()["pools"]["p"] == {"region": "eu", "gpus": 2, "leased": 6, "idle_s": pytest.approx(0, abs=1)}

    asyncio.run(scenario())


def test_a_lease_is_done_when_every_model_has_its_group(serve_broker, make_group, tmp_path):
    cfg = config(tmp_path, 2, n_samples=2)
    cfg.models = ["solver", "verifier"]

    async def scenario():
        async with serve_broker(cfg) as (url, broker), BrokerClient(url, pool="p") as pool:
            lease = (await pool.lease(1))[0]
            assert lease.model_ids == ["solver", "verifier"]
            await pool.submit(make_group(lease.group_id, [1.0, 0.0], model_id="solver", task_id=lease.task_id))
            assert [le["lease_id"] for le in broker.leases()] == [lease.lease_id]
            verdicts = make_group(lease.group_id, [1.0], model_id="verifier", task_id=lease.task_id)
            verdicts[0].id = "verdict-0"  # trajectory ids are unique across models
            await pool.submit(verdicts)
            assert broker.leases() == []

    asyncio.run(scenario())
    with sqlite3.connect(tmp_path / "broker.db") as conn:
        assert conn.execute("SELECT state FROM leases").fetchall() == [("done",)]


def test_expired_leases_are_issued_again(serve_broker, make_group, tmp_path):
    async def scenario():
        async with serve_broker(config(tmp_path, 2, lease_timeout_s=0.3)) as (url, broker), \
                BrokerClient(url, pool="slow") as slow, BrokerClient(url, pool="other") as other:
            stuck, late = await slow.lease(2)
            await asyncio.sleep(0.8)  # both deadlines pass; the expiry loop runs every 0.075 s
            assert {le["state"] for le in broker.leases()} == {"expired"}
            # a late result still completes its lease, which is then not issued again
            await slow.submit(leased_group(make_group, late, "slow"))
            again = await other.lease(5)
            assert [(le.task_id, le.epoch) for le in again] == [(stuck.task_id, 0)]
            assert again[0].lease_id != stuck.lease_id
            assert [le["pool"] for le in broker.leases()] == ["other"]

    asyncio.run(scenario())
    with sqlite3.connect(tmp_path / "broker.db") as conn:
        assert dict(conn.execute("SELECT lease_id, state FROM leases")) == {"L1": "reissued", "L2": "done",
                                                                          "L3": "active"}


def test_faster_pools_get_more_tasks(serve_broker, make_group, tmp_path):
    async def scenario():
        cfg = config(tmp_path, 40, max_inflight_per_pool=2, n_samples=2)
        async with serve_broker(cfg) as (url, broker), BrokerClient(url, pool="fast") as fast, \
                BrokerClient(url, pool="slow") as slow:
            held = await slow.lease(2)
            for _ in range(10):  # the fast pool returns its groups at once; the slow one still holds its two
                for le in await fast.lease(2):
                    await fast.submit(leased_group(make_group, le, "fast"))
                assert await slow.lease(2) == []  # at its in-flight limit
            pools = broker.balance()["pools"]
            assert pools["fast"]["leased"] == 20 and pools["slow"]["leased"] == len(held) == 2

    asyncio.run(scenario())


def test_filter_solved_curator_skips_solved_prompts_next_epoch(serve_broker, make_group, tmp_path):
    cfg = config(tmp_path, 3, epochs=2, n_samples=2, curator=CuratorConfig(name="filter_solved", history=1))

    async def scenario():
        async with serve_broker(cfg) as (url, broker), BrokerClient(url, pool="p") as pool:
            for le in await pool.lease(3):
                rewards = [1.0, 1.0] if le.task_id == "q1" else [1.0, 0.0]
                await pool.submit(make_group(le.group_id, rewards, task_id=le.task_id))
            assert [(le.task_id, le.epoch) for le in await pool.lease(3)] == [("q0", 1), ("q2", 1)]

    asyncio.run(scenario())
