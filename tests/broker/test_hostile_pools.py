"""Pools that act against the mesh through the broker's own routes, each with a valid pool token: a
real broker on loopback with a real tokens file, its records in SQLite and in PostgreSQL.

A pool cannot fill the group of a lease another pool holds (nor of a lease not issued yet), so it
cannot complete that lease with its own samples; a trajectory claiming a policy version far above
the trainer's newest is refused and counted, not batched; and one lease request, or one token
leasing under several names, takes no more than the configured bounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltamesh.broker_client import BrokerClient
from deltamesh.http import HttpError, serving
from deltamesh.mesh.broker.backends import open_store
from deltamesh.mesh.broker.config import BrokerConfig, PoliciesConfig, TasksConfig
from deltamesh.mesh.broker.server import SLOT_KEY, build_app
from deltamesh.mesh.broker.service import Broker
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.batch_client import BatchClient


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path) -> str:
    return request.getfixturevalue("postgres_dsn") if request.param == "postgres" else str(tmp_path / "broker.db")


@pytest.fixture
def tokens(tmp_path) -> tuple[str, dict[str, str]]:
    path = tmp_path / "tokens.toml"
    return str(path), {
        "bp1": add_token(path, TokenSpec("bp1", "pool", ["m"])),
        "bp2": add_token(path, TokenSpec("bp2", "pool", ["m"])),
        "trainer": add_token(path, TokenSpec("m-trainer", "trainer", ["m"])),
        "admin": add_token(path, TokenSpec("ops", "admin")),
    }


@asynccontextmanager
async def broker(tmp_path, db: str, tokens_file: str, tasks: int = 100, **tasks_config
                 ) -> AsyncIterator[tuple[str, Broker]]:
    """A broker serving `tasks` prompts of groups of 2, on `db` (an SQLite file or a PostgreSQL DSN)."""
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+1="}) + "\n" for i in range(tasks)))
    config = BrokerConfig(models=["m"], tokens_file=tokens_file, durability="process",
                          tasks=TasksConfig(dataset=str(dataset), n_samples=2, **tasks_config))
    app = build_app(config, open_store=lambda: open_store(db, durability="process"))
    async with serving(app, "127.0.0.1:0") as url:
        yield url, app[SLOT_KEY].broker


def from_pool(group: list, pool: str) -> list:
    for t in group:
        t.pool = pool
    return group


async def refused_count(url: str, token: str, reason: str) -> float:
    """`deltamesh_broker_trajectories_refused_total{reason}` as the broker's /metrics shows it."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "deltamesh_broker_trajectories_refused_total" and s.labels.get("reason") == reason)


def test_a_pool_cannot_fill_another_pools_lease(tmp_path, db, tokens, make_group):
    path, tok = tokens

    async def scenario():
        async with broker(tmp_path, db, path) as (url, b), \
                BrokerClient(url, token=tok["bp1"], pool="bp1") as bp1, \
                BrokerClient(url, token=tok["bp2"], pool="bp2") as bp2, \
                BatchClient(url, "m", token=tok["trainer"]) as trainer:
            [lease] = await bp1.lease(1)
            forged = from_pool(make_group(lease.group_id, [100.0, 100.0], task_id=lease.task_id), "bp2")
            with pytest.raises(HttpError) as e:
                await bp2.submit(forged)
            assert e.value.status == 403, e.value
            assert f"lease {lease.lease_id} of pool 'bp1'" in e.value.reason and "'bp2' may not" in e.value.reason
            # nor the lease of a group id not issued yet, before it goes to another pool
            ahead = from_pool(make_group("L99", [100.0, 100.0], task_id="q98"), "bp2")
            with pytest.raises(HttpError) as e:
                await bp2.submit(ahead)
            assert e.value.status == 403 and "no lease L99 has been issued" in e.value.reason
            assert b.models["m"].fresh_samples == 0
            assert [le["lease_id"] for le in b.leases("bp1")] == [lease.lease_id]

            own = from_pool(make_group(lease.group_id, [1.0, 0.0], task_id=lease.task_id), "bp1")
            assert (await bp1.submit(own)).accepted == 2
            assert b.leases() == []  # done by its holder's result
            batch = await trainer.next_batch(2, timeout_s=5)
            assert batch.groups == [lease.group_id]
            assert sorted(s["reward"] for s in batch.samples) == [0.0, 1.0]
            assert {s["pool"] for s in batch.samples} == {"bp1"}
            assert await refused_count(url, tok["admin"], "lease_not_held") == 2

    asyncio.run(scenario())


def test_a_trajectory_claiming_a_future_version_is_refused_and_counted(tmp_path, db, tokens, make_group):
    path, tok = tokens

    async def scenario():
        async with broker(tmp_path, db, path) as (url, b), \
                BrokerClient(url, token=tok["bp1"], pool="bp1") as bp1, \
                BatchClient(url, "m", token=tok["trainer"]) as trainer:
            await trainer.report_version(1)
            for version in (2**31 - 1, 4):  # 1 + policies.max_version_ahead (2) is the most taken
                with pytest.raises(HttpError) as e:
                    await bp1.submit(from_pool(make_group(f"far-{version}", [1.0, 0.0], version=version), "bp1"))
                assert e.value.status == 409, e.value
                assert f"claims policy version {version}" in e.value.reason and "at v1" in e.value.reason
            assert b.models["m"].fresh_samples == 0
            assert await refused_count(url, tok["admin"], "version_ahead") == 2
            assert (await bp1.submit(from_pool(make_group("near", [1.0, 0.0], version=3), "bp1"))).accepted == 2
            assert (await trainer.next_batch(2, timeout_s=5)).groups == ["near"]

    asyncio.run(scenario())


def test_the_margin_for_versions_ahead_is_configurable(tmp_path, make_group):
    async def scenario():
        config = BrokerConfig(models=["m"], policies=PoliciesConfig(max_version_ahead=0), anonymous=True)
        async with serving(build_app(config, tmp_path / "b.db"), "127.0.0.1:0") as url, \
                BrokerClient(url, pool="p") as pool:
            with pytest.raises(HttpError) as e:
                await pool.submit(make_group("g", [1.0, 0.0], version=1))
            assert e.value.status == 409
            assert (await pool.submit(make_group("g", [1.0, 0.0], version=0))).accepted == 2

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="max_version_ahead must be >= 0"):
        PoliciesConfig(max_version_ahead=-1)


def test_one_lease_request_takes_at_most_the_per_request_cap(tmp_path, db, tokens):
    path, tok = tokens

    async def scenario():
        async with broker(tmp_path, db, path) as (url, b), BrokerClient(url, token=tok["bp1"], pool="bp1") as bp1:
            taken = await bp1.lease(10**18)
            assert len(taken) == BrokerConfig().tasks.max_lease_batch == 16
            assert b.status()["tasks"]["cursor"]["position"] == 16  # the other 84 tasks stay for other pools

    asyncio.run(scenario())


def test_a_pool_token_holds_at_most_its_outstanding_cap_under_every_name(tmp_path, db, tokens):
    path, tok = tokens

    async def scenario():
        async with broker(tmp_path, db, path, max_inflight_per_pool=5) as (url, b):
            held = 0
            for name in ("bp1", "bp1.a", "bp1.b", "bp1.c"):  # names a pool token may lease under
                async with BrokerClient(url, token=tok["bp1"], pool=name) as client:
                    held += len(await client.lease(4))
            assert held == 5
            async with BrokerClient(url, token=tok["bp2"], pool="bp2") as other:
                assert len(await other.lease(4)) == 4  # another pool's bound is its own

    asyncio.run(scenario())


def test_lease_caps_are_configurable_and_checked(tmp_path):
    assert dataclasses.replace(TasksConfig(), max_lease_batch=2).max_lease_batch == 2
    for bad in ({"max_lease_batch": 0}, {"max_inflight_per_pool": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            TasksConfig(**bad)
