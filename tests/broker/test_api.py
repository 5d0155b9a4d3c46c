"""The broker's HTTP API against a real broker on a loopback socket with a real SQLite file:
idempotent durable submission, every refusal (400/404/409/413) storing nothing, batches per model
with the data policies applied, long-polls, and metrics."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.data import TRAJECTORIES_CONTENT_TYPE, encode_trajectories
from deltamesh.http import HttpError
from deltamesh.mesh.broker.config import BrokerConfig, PoliciesConfig, ReplayConfig
from deltamesh.trainer.batch_client import BatchClient


async def post(url: str, data: bytes, content_type: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers={"Content-Type": content_type}) as r:
        return r.status, json.loads(await r.read() or b"{}")


def stored(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]


def test_submission_is_idempotent(serve_broker, make_group, tmp_path):
    async def scenario():
        async with serve_broker() as (url, broker), BrokerClient(url, pool="p1", region="eu") as pool:
            first = make_group("g", [1.0, 0.0, 1.0, 0.0])
            assert (await pool.submit(first[:2])).accepted == 2
            again = await pool.submit(first[:3])  # two duplicates and one new
            assert (again.accepted, again.duplicates) == (1, 2)
            assert broker.models["m"].fresh_samples == 0  # 3 of 4: the group is not complete
            done = await pool.submit(first)
            assert (done.accepted, done.duplicates) == (1, 3)
            assert broker.models["m"].fresh_samples == 4
            assert (await pool.submit(first)).duplicates == 4
            assert broker.models["m"].fresh_samples == 4  # a duplicate never completes a group twice

    asyncio.run(scenario())
    assert stored(tmp_path / "broker.db") == 4


def test_an_id_reused_with_other_content_is_a_conflict(serve_broker, make_group, tmp_path):
    async def scenario():
        async with serve_broker() as (url, broker), BrokerClient(url, pool="p1") as pool:
            group = make_group("g", [1.0, 0.0, 1.0, 0.0])
            assert (await pool.submit(group[:2])).accepted == 2
            before = broker.status()
            forged = make_group("g", [0.5, 0.0, 1.0, 0.0])[:1]  # same id as group[0], another reward
            forged[0].pool = "p1"
            with pytest.raises(HttpError) as e:
                await pool.submit(forged + group[2:3])
            assert e.value.status == 409 and "submitted before with other content" in e.value.reason
            assert broker.status() == before  # the whole submission was refused: group[2] not taken either
            retry = await pool.submit(group[:3])  # the real retry is still a plain duplicate
            assert (retry.accepted, retry.duplicates) == (1, 2)

    asyncio.run(scenario())
    assert stored(tmp_path / "broker.db") == 3


@pytest.mark.parametrize("body, content_type, status, reason", [
    (b"{not json", "application/json", 400, "malformed JSON"),
    (b'{"trajectories": "x"}', "application/json", 400, "body must be"),
    (b'{"trajectories": [{"id": 3}]}', "application/json", 400, "tokens must be a list"),
    (b"\x00" * 64, TRAJECTORIES_CONTENT_TYPE, 400, "safetensors"),
    (b"plain", "text/plain", 400, "Content-Type must be"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "nested deeper"),
    (b'{"trajectories": ' + b"[" * 70 + b"]" * 70 + b"}", "application/json", 400, "nested deeper"),
])
def test_malformed_submissions_get_400_and_store_nothing(serve_broker, tmp_path, body, content_type, status, reason):
    async def scenario():
        async with serve_broker() as (url, broker):
            code, answer = await post(f"{url}/v1/trajectories", body, content_type)
            assert code == status and reason in answer["error"]

    asyncio.run(scenario())
    assert stored(tmp_path / "broker.db") == 0


def test_wrongly_typed_and_conflicting_submissions_store_nothing(serve_broker, make_group, tmp_path):
    async def scenario():
        async with serve_broker() as (url, broker), BrokerClient(url, pool="p") as pool:
            bad = make_group("g", [1.0, 0.0])
            bad[1].reward = float("nan")
            code, answer = await post(f"{url}/v1/trajectories", encode_trajectories(bad), TRAJECTORIES_CONTENT_TYPE)
            assert code == 400 and "reward must be a finite number" in answer["error"]
            ok = make_group("h", [1.0, 0.0])
            assert (await pool.submit(ok)).accepted == 2
            # a new sample for a complete group, and a disagreeing group_size: refused whole
            extra = make_group("h", [1.0, 0.0, 1.0])
            for t in extra:
                t.id = t.id + "-late"
            code, answer = await post(f"{url}/v1/trajectories", encode_trajectories(extra), TRAJECTORIES_CONTENT_TYPE)
            assert code == 400 and "has size 2" in answer["error"]
            over = make_group("k", [1.0, 0.0])
            over.append(make_group("k", [1.0, 0.0])[0])
            over[-1].id = "k-extra"
            code, answer = await post(f"{url}/v1/trajectories", encode_trajectories(over), TRAJECTORIES_CONTENT_TYPE)
            assert code == 400 and "would hold 3 samples" in answer["error"]

    asyncio.run(scenario())
    with sqlite3.connect(tmp_path / "broker.db") as conn:
        assert sorted(r[0] for r in conn.execute("SELECT id FROM trajectories")) == ["h-0", "h-1"]
        assert conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0] == 1


def test_oversized_submissions_are_refused(serve_broker, make_group, make_trajectory, tmp_path):
    config = BrokerConfig(models=["m"], max_body_bytes=64 * 1024, max_tokens=1000, max_trajectories_per_submission=8)

    async def scenario():
        async with serve_broker(config) as (url, broker):
            many = [make_trajectory(f"t{i}", f"g{i}", group_size=1, tokens=1200) for i in range(30)]
            code, answer = await post(f"{url}/v1/trajectories", encode_trajectories(many), TRAJECTORIES_CONTENT_TYPE)
            assert code == 413 and "exceeds 65536" in answer["error"]
            long = [make_trajectory("long", "g", group_size=1, tokens=1001)]
            code, answer = await post(f"{url}/v1/trajectories", encode_trajectories(long), TRAJECTORIES_CONTENT_TYPE)
            assert code == 400 and "allowed 1..1000" in answer["error"]
            nine = [make_trajectory(f"n{i}", f"n{i}", group_size=1) for i in range(9)]
            code, answer = await post(f"{url}/v1/trajectories", encode_trajectories(nine), TRAJECTORIES_CONTENT_TYPE)
            assert code == 400 and "1..8 headers" in answer["error"]

    asyncio.run(scenario())
    assert stored(tmp_path / "broker.db") == 0


def test_unknown_model_is_404_and_registration(serve_broker, make_group, tmp_path):
    async def scenario():
        async with serve_broker(BrokerConfig(models=["m"], allow_register=False)) as (url, broker):
            mixed = make_group("a", [1.0]) + make_group("b", [1.0], model_id="ghost")
            code, answer = await post(f"{url}/v1/trajectories", encode_trajectories(mixed), TRAJECTORIES_CONTENT_TYPE)
            assert code == 404 and "ghost" in answer["error"]
            async with BatchClient(url, "ghost") as trainer:
                for call in (trainer.report_version(1), trainer.next_batch(4, timeout_s=0.1)):
                    with pytest.raises(Exception, match="404"):
                        await call
        async with serve_broker(BrokerConfig(models=["m"]), db=tmp_path / "b2.db") as (url, broker):
            async with BatchClient(url, "newcomer") as trainer, BrokerClient(url, pool="p") as pool:
                assert (await trainer.report_version(3))["version"] == 3
                assert (await pool.submit(make_group("c", [1.0], model_id="newcomer"))).accepted == 1
                with pytest.raises(Exception, match="409"):
                    await trainer.report_version(2)
            async with BatchClient(url, "bad%20name") as odd:
                with pytest.raises(Exception, match="400 model_id 'bad name' does not match"):
                    await odd.report_version(1)

    asyncio.run(scenario())
    assert stored(tmp_path / "broker.db") == 0


def test_two_models_are_served_independently(serve_broker, make_group):
    async def scenario():
        async with serve_broker(BrokerConfig(models=["solver", "verifier"])) as (url, broker), \
                BrokerClient(url, pool="p") as pool, BatchClient(url, "solver") as solver, \
                BatchClient(url, "verifier") as verifier:
            for i in range(3):
                await pool.submit(make_group(f"s{i}", [1.0, 0.0], model_id="solver")
                                  + make_group(f"v{i}", [1.0, 0.0], model_id="verifier"))
            batch = await solver.next_batch(4, version=2, timeout_s=5)
            assert batch.model_id == "solver" and batch.groups == ["s0", "s1"]
            assert {s["model_id"] for s in batch.samples} == {"solver"}
            assert broker.models["verifier"].fresh_samples == 6 and broker.models["verifier"].version == 0
            vb = await verifier.next_batch(6, timeout_s=5)
            assert vb.groups == ["v0", "v1", "v2"] and broker.models["solver"].fresh_samples == 2

    asyncio.run(scenario())


def test_long_poll_times_out_then_wakes_on_data(serve_broker, make_group):
    async def scenario():
        async with serve_broker() as (url, broker), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            assert await trainer.next_batch(4, timeout_s=0.2) is None
            waiting = asyncio.create_task(trainer.next_batch(4, timeout_s=10))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await pool.submit(make_group("g", [1.0, 0.0, 0.0, 1.0]))
            batch = await asyncio.wait_for(waiting, 5)
            assert batch.groups == ["g"] and batch.tokens.shape[0] == 4

    asyncio.run(scenario())


def test_staleness_bound_drops_old_groups(serve_broker, make_group, tmp_path):
    config = BrokerConfig(models=["m"], policies=PoliciesConfig(max_staleness=2))

    async def scenario():
        async with serve_broker(config) as (url, broker), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            await trainer.report_version(5)  # a trajectory may claim no version far above the trainer's
            for v in range(6):
                await pool.submit(make_group(f"v{v}", [1.0, 0.0], version=v))
            batch = await trainer.next_batch(4, timeout_s=5)
            assert batch.groups == ["v3", "v4"]  # v0..v2 are more than 2 versions behind 5
            assert [s["min_version"] for s in batch.samples] == [3, 3, 4, 4]
            assert list(broker.models["m"].fresh) == ["v5"]
            assert (await trainer.ack())["acked"] == [batch.batch_id]  # served groups keep their tokens until then

    asyncio.run(scenario())
    with sqlite3.connect(tmp_path / "broker.db") as conn:
        states = dict(conn.execute("SELECT group_id, state FROM groups"))
        # acknowledged groups retire at once when replay is off; dropped and retired ones lose their token arrays
        assert states == {"v0": "stale", "v1": "stale", "v2": "stale", "v3": "retired", "v4": "retired",
                          "v5": "fresh"}
        assert conn.execute("SELECT COUNT(*) FROM trajectories WHERE payload IS NULL").fetchone()[0] == 10
        assert conn.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 12  # ids stay: idempotency


def test_zero_adv_drops_uniform_groups(serve_broker, make_group):
    config = BrokerConfig(models=["m"], policies=PoliciesConfig(filters=["zero_adv"]))

    async def scenario():
        async with serve_broker(config) as (url, broker), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            await pool.submit(make_group("same1", [1.0, 1.0]) + make_group("mixed1", [1.0, 0.0])
                              + make_group("same0", [0.0, 0.0]) + make_group("mixed2", [0.5, 0.0]))
            batch = await trainer.next_batch(4, timeout_s=5)
            assert batch.groups == ["mixed1", "mixed2"]
            assert await trainer.next_batch(2, timeout_s=0.2) is None
            text = await _metrics(url)
            assert 'deltamesh_broker_groups_total{model_id="m",outcome="zero_adv"} 2.0' in text
            assert 'deltamesh_broker_groups_total{model_id="m",outcome="kept"} 2.0' in text

    asyncio.run(scenario())


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        return await r.text()


def test_replay_fraction_and_flags(serve_broker, make_group):
    config = BrokerConfig(models=["m"], policies=PoliciesConfig(replay=ReplayConfig(fraction=0.5, selector="latest")))

    async def scenario():
        async with serve_broker(config) as (url, broker), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m") as trainer:
            await pool.submit([t for i in range(8) for t in make_group(f"g{i}", [1.0, 0.0])])
            first = await trainer.next_batch(8, timeout_s=5)
            assert first.replay.sum() == 0 and first.groups == ["g0", "g1", "g2", "g3"]  # nothing to replay yet
            second = await trainer.next_batch(8, timeout_s=5)
            assert second.replay.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
            assert second.groups == ["g3", "g2", "g4", "g5"]  # latest replayed first, then fresh in order
            text = await _metrics(url)
            assert 'deltamesh_broker_batch_samples_total{model_id="m",source="replay"} 4.0' in text

    asyncio.run(scenario())


def test_step_reports_and_status_endpoints(serve_broker, make_group):
    async def scenario():
        async with serve_broker() as (url, broker), BatchClient(url, "m") as trainer:
            answer = await trainer.report_step(wait_s=1.0, step_s=4.0)
            assert answer["wait_fraction"] == 0.25 and answer["steps"] == 1
            async with aiohttp.ClientSession() as s:
                for body, reason in (({"wait_s": 5, "step_s": 1}, "cannot exceed"), ({"wait_s": "x", "step_s": 1},
                                     "wait_s must be"), ({"step_s": 1}, "wait_s is required")):
                    async with s.post(f"{url}/v1/models/m/steps", json=body) as r:
                        assert r.status == 400 and reason in (await r.json())["error"]
                async with s.get(f"{url}/v1/status") as r:
                    status = await r.json()
                    assert status["models"]["m"]["fresh_samples"] == 0
                async with s.post(f"{url}/v1/models/m/batch", json={"size": 0}) as r:
                    assert r.status == 400
                for body, reason in (({"pool": ""}, "pool must be 1..256"), ({"pool": "p", "gpus": -1}, "gpus must be"),
                                     ({"pool": "p", "max_tasks": "3"}, "max_tasks must be"), ([1], "JSON object")):
                    async with s.post(f"{url}/v1/leases", json=body) as r:
                        assert r.status == 400 and reason in (await r.json())["error"]

    asyncio.run(scenario())


@pytest.mark.parametrize("depth", [70, 100_000])
def test_deeply_nested_json_is_a_400_on_every_json_route(serve_broker, depth):
    body = b'{"pool": "p", "x": ' + b"[" * depth + b"]" * depth + b"}"

    async def scenario():
        async with serve_broker() as (url, broker):
            before = broker.status()
            for path in ("/v1/leases", "/v1/models/m/version", "/v1/models/m/batch"):
                code, answer = await post(f"{url}{path}", body, "application/json")
                assert code == 400 and "nested deeper than 64" in answer["error"], (path, answer)
            assert broker.leases() == [] and broker.status() == before

    asyncio.run(scenario())

