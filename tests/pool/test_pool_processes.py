"""Rollout pools as real `deltamesh pool run` processes with a real broker and real gateways on loopback.

The trainer is played by the test: it publishes versions of a tiny model through the gateway
publisher library and reads what the pools produced back from the broker's batch API.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import pytest

from deltamesh.delta import dir_manifest
from deltamesh.mesh.workflows.verifiable_math import digit_sum_tasks
from deltamesh.trainer.batch_client import BatchClient
from deltamesh.trainer.publisher import Publisher

pytestmark = pytest.mark.slow


def _publish(pub: Publisher, weights, version: int | None = None) -> None:
    asyncio.run(pub.publish(weights, version))


def _drain(broker_url: str, model: str, group_size: int) -> list[dict]:
    """Every sample the broker holds, one group per batch (consumes them)."""
    async def main() -> list[dict]:
        samples = []
        async with BatchClient(broker_url, model) as client:
            while (batch := await client.next_batch(group_size, timeout_s=1.0)) is not None:
                samples += batch.samples
        return samples

    return asyncio.run(main())


def _submitted(pool) -> int:
    return pool.status()["worker"].get("submitted", 0)


def _dir_version(path) -> int | None:
    manifest = dir_manifest(path) if path.exists() else None
    return None if manifest is None else manifest.version


def _model_status(pool, model: str) -> dict:
    return pool.status()["models"].get(model, {})


def test_two_regions_generate_and_a_new_version_reaches_both(kit):
    broker = kit.broker(tasks=digit_sum_tasks(400), n_samples=2)
    east = kit.gateway("east")
    west = kit.gateway("west", upstream=east.url)
    for s in (broker, east, west):
        s.wait_healthy()
    v1 = kit.next_version(kit.base_weights(), 1)
    pub = Publisher(east.url, kit.private_key, kit.model, full_every=0, piece_bytes=32768)
    _publish(pub, v1, 1)
    pools = {"p-east": kit.pool("p-east", east.url, broker.url, "--tier", "big"),
             "p-west": kit.pool("p-west", west.url, broker.url, "--tier", "small")}
    procs = (broker, east, west, *pools.values())
    for p in pools.values():
        p.wait_healthy()
    kit.wait_until(lambda: all(_submitted(p) >= 4 for p in pools.values()), 120, "both pools to submit", procs=procs)
    assert all(_model_status(p, kit.model)["engine_version"] == 1 for p in pools.values())

    _publish(pub, kit.next_version(v1, 2))
    kit.wait_until(lambda: all(_model_status(p, kit.model)["engine_version"] == 2 for p in pools.values()), 60,
                   "v2 to reach both regions", procs=procs)
    # The status shows when v2 reached each stage in each pool (mesh/pool/timeline.py), in order.
    kit.wait_until(lambda: all("persisted" in _model_status(p, kit.model)["timeline"].get("2", {})
                               for p in pools.values()), 60, "v2's directory write", procs=procs)
    for p in pools.values():
        stages = _model_status(p, kit.model)["timeline"]["2"]
        assert list(stages) == ["head", "fetched", "verified", "applied", "serving", "persisted"], stages
        assert list(stages.values()) == sorted(stages.values())
    after_swap = {name: _submitted(p) for name, p in pools.items()}
    kit.wait_until(lambda: all(_submitted(p) >= after_swap[n] + 6 for n, p in pools.items()), 60,
                   "trajectories generated with v2", procs=procs)
    for p in pools.values():
        p.kill(signal.SIGTERM)
        assert p.proc.returncode == 143, p.log_tail()  # stopped cleanly by SIGTERM (docs/CLI.md)

    samples = _drain(broker.url, kit.model, 2)
    by_pool = {name: [s for s in samples if s["pool"] == name] for name in pools}
    assert {s["pool"] for s in samples} == set(pools)
    for name, region, tier in (("p-east", "east", "big"), ("p-west", "west", "small")):
        mine = by_pool[name]
        assert all(s["region"] == region and s["model_id"] == kit.model and s["metadata"]["tier"] == tier
                   for s in mine)
        assert any(s["max_version"] == 1 for s in mine), f"{name} generated with v1"
        assert any(s["min_version"] == 2 for s in mine), f"{name}'s later tokens carry v2"
        assert all(1 <= s["min_version"] <= s["max_version"] <= 2 for s in mine)
        assert all(s["timings"]["leased_at"] > 0 and s["group_size"] == 2 for s in mine)


def test_a_killed_pool_loses_nothing_its_tasks_are_completed_by_another(kit):
    tasks = digit_sum_tasks(8, seed=1)
    broker = kit.broker(tasks=tasks, n_samples=2, lease_timeout_s=4.0)
    gateway = kit.gateway("east")
    broker.wait_healthy()
    gateway.wait_healthy()
    pub = Publisher(gateway.url, kit.private_key, kit.model, full_every=0, piece_bytes=32768)
    _publish(pub, kit.next_version(kit.base_weights(), 1), 1)
    # A slow pool (long generations) that leases several tasks at once.
    slow = kit.pool("p-slow", gateway.url, broker.url, "--sampling.ignore-eos", "--worker.lease-batch", "4",
                    "--worker.max-episodes", "4", max_new_tokens=400)
    leases = kit.wait_until(
        lambda: [le for le in kit.get_json(f"{broker.url}/v1/leases?pool=p-slow")["leases"] if le["state"] == "active"],
        120, "the slow pool to lease", interval=0.05, procs=(broker, gateway, slow))
    slow.kill(signal.SIGKILL)
    held = {le["task_id"] for le in leases}

    fast = kit.pool("p-fast", gateway.url, broker.url)
    kit.wait_until(lambda: kit.get_json(f"{broker.url}/v1/status")["tasks"]["finished"], 120,
                   "every task to be done", procs=(broker, gateway, fast))
    samples = _drain(broker.url, kit.model, 2)
    done_by = {}
    for s in samples:
        done_by.setdefault(s["task_id"], set()).add(s["pool"])
    assert set(done_by) == {t["id"] for t in tasks}, "no task is lost"
    lost_by_slow = {t for t in held if "p-slow" not in done_by[t]}
    assert lost_by_slow, "the slow pool was killed mid-rollout"
    assert all("p-fast" in done_by[t] for t in lost_by_slow)
    assert sum(1 for s in samples if s["task_id"] in lost_by_slow) == 2 * len(lost_by_slow)


def test_staleness_bound_stops_leasing_and_a_restarted_pool_syncs_before_it_generates(kit):
    broker = kit.broker(tasks=digit_sum_tasks(20, seed=2), n_samples=2, epochs=100)
    gateway = kit.gateway("east")
    broker.wait_healthy()
    gateway.wait_healthy()
    pub = Publisher(gateway.url, kit.private_key, kit.model, full_every=0, piece_bytes=32768)
    w = [kit.base_weights()]
    for v in range(1, 5):
        w.append(kit.next_version(w[-1], v))
    _publish(pub, w[1], 1)
    pool = kit.pool("p1", gateway.url, broker.url, "--worker.max-staleness", "1")
    procs = (broker, gateway, pool)
    pool.wait_healthy()
    kit.wait_until(lambda: _submitted(pool) > 0, 120, "the pool to submit", procs=procs)

    # The trainer moves to v3 before anything newer than v1 is published: two versions behind.
    kit.post_json(f"{broker.url}/v1/models/{kit.model}/version", {"version": 3})
    kit.wait_until(lambda: not pool.status()["leasing"]["may_lease"], 30, "the pool to stop leasing", procs=procs)
    assert "2 versions behind v3 (bound 1)" in pool.status()["leasing"]["reason"]
    leased = pool.status()["worker"]["leased"]
    time.sleep(1.5)
    assert pool.status()["worker"]["leased"] == leased

    _publish(pub, w[2])
    _publish(pub, w[3])
    kit.wait_until(lambda: pool.status()["worker"]["leased"] > leased, 60, "leasing to resume at v3", procs=procs)
    assert _model_status(pool, kit.model)["engine_version"] == 3
    # The engine swaps in place first and persists the version to its directory after; the restart
    # below must find v3 on disk, so wait for that write before the kill.
    synced = kit.tmp / "weights" / "p1" / kit.model
    kit.wait_until(lambda: _dir_version(synced) == 3, 60, "v3 to reach the pool's directory", procs=procs)

    pool.kill(signal.SIGKILL)
    _publish(pub, w[4])
    restarted_at = time.time()
    pool.start().wait_healthy()
    kit.wait_until(lambda: _submitted(pool) > 0, 120, "the restarted pool to submit", procs=procs)
    status = _model_status(pool, kit.model)
    assert status["resumed_from_dir"] == 3 and status["fetched"] == {"full": 0, "delta": 1}
    pool.kill(signal.SIGTERM)

    samples = [s for s in _drain(broker.url, kit.model, 2) if s["timings"]["finished_at"] > restarted_at]
    assert samples and all(s["min_version"] == s["max_version"] == 4 for s in samples)


def test_a_synchronous_pool_waits_for_the_version_its_trainer_is_making_before_it_leases_again(kit):
    """Max staleness 0 (a synchronous run): once the trainer takes a batch at v1, the broker's
    training_version is 2, so the pool serving v1 stops leasing (what it made now would be a version
    stale by the time it is trained on), though v1 is still the newest published version; it leases
    again only once it serves v2, and every episode leased from then on is generated with v2 alone."""
    broker = kit.broker(tasks=digit_sum_tasks(20, seed=3), n_samples=2, epochs=100)
    gateway = kit.gateway("east")
    broker.wait_healthy()
    gateway.wait_healthy()
    pub = Publisher(gateway.url, kit.private_key, kit.model, full_every=0, piece_bytes=32768)
    w1 = kit.next_version(kit.base_weights(), 1)
    _publish(pub, w1, 1)
    version_url = f"{broker.url}/v1/models/{kit.model}/version"
    kit.post_json(version_url, {"version": 1})
    pool = kit.pool("p1", gateway.url, broker.url, "--worker.max-staleness", "0")
    procs = (broker, gateway, pool)
    pool.wait_healthy()
    kit.wait_until(lambda: _submitted(pool) > 0, 120, "the pool to submit at v1", procs=procs)
    assert pool.status()["leasing"]["may_lease"]

    async def take_batch():
        async with BatchClient(broker.url, kit.model) as trainer:
            return await trainer.next_batch(2, timeout_s=10)

    assert asyncio.run(take_batch()) is not None  # the trainer is making v2 from it now
    assert kit.get_json(f"{broker.url}/v1/status")["models"][kit.model]["training_version"] == 2
    kit.wait_until(lambda: not pool.status()["leasing"]["may_lease"], 30, "the pool to stop leasing", procs=procs)
    closed_at = time.time()
    assert "1 versions behind v2 (bound 0)" in pool.status()["leasing"]["reason"]
    leased = pool.status()["worker"]["leased"]
    time.sleep(2.0)  # several broker reads (every second) later: still waiting
    assert pool.status()["worker"]["leased"] == leased
    assert _model_status(pool, kit.model)["engine_version"] == 1

    _publish(pub, kit.next_version(w1, 2), 2)
    kit.post_json(version_url, {"version": 2})
    kit.wait_until(lambda: pool.status()["worker"]["leased"] > leased, 60, "leasing to resume at v2", procs=procs)
    assert _model_status(pool, kit.model)["engine_version"] == 2
    submitted = _submitted(pool)
    kit.wait_until(lambda: _submitted(pool) >= submitted + 2, 60, "groups generated with v2", procs=procs)
    pool.kill(signal.SIGTERM)

    after = [s for s in _drain(broker.url, kit.model, 2) if s["timings"]["leased_at"] > closed_at]
    assert after and all(s["min_version"] == s["max_version"] == 2 for s in after)


def test_a_synchronous_run_trains_no_batch_on_a_sample_older_than_the_version_it_trains(kit):
    """Max staleness 0 on the broker and the pool, one step's groups buffered (the sync mode). The
    trainer, played here as the trainer loop runs, takes a batch, trains for a while, then publishes
    the version it made in the background and polls the next batch before that publish is reported.
    The pool reads the trainer's versions only every 5 s, so after a take it would lease at the old
    version (every second batch of a learning run was one version stale so): the broker must hold
    that lease back, the pool wait for the new version, and every batch hold only samples generated
    at the version it trains."""
    broker = kit.broker(tasks=digit_sum_tasks(40, seed=4), n_samples=2, epochs=100, max_buffered_groups=2,
                        max_staleness=0)
    gateway = kit.gateway("east")
    broker.wait_healthy()
    gateway.wait_healthy()
    pub = Publisher(gateway.url, kit.private_key, kit.model, full_every=0, piece_bytes=32768)
    weights = kit.next_version(kit.base_weights(), 1)
    _publish(pub, weights, 1)
    version_url = f"{broker.url}/v1/models/{kit.model}/version"
    kit.post_json(version_url, {"version": 1})
    pool = kit.pool("p1", gateway.url, broker.url, "--worker.max-staleness", "0",
                    "--worker.broker-refresh-s", "5", "--worker.idle-s", "0.1")
    pool.wait_healthy()

    async def train(steps: int) -> list[tuple[int, list[dict]]]:
        """(version trained, samples) of each batch taken."""
        nonlocal weights
        taken, version, publishing = [], 1, None
        async with BatchClient(broker.url, kit.model) as trainer:
            for _ in range(steps):
                batch = await trainer.next_batch(4, timeout_s=90)
                assert batch is not None, pool.log_tail()
                taken.append((version, batch.samples))
                await asyncio.sleep(1.5)  # the optimizer step
                if publishing is not None:
                    await publishing
                version += 1
                weights = kit.next_version(weights, version)
                publishing = asyncio.create_task(publish_and_report(version))
            await publishing
        return taken

    async def publish_and_report(version: int) -> None:
        await pub.publish(weights, version)
        await asyncio.to_thread(kit.post_json, version_url, {"version": version})

    taken = asyncio.run(train(5))
    stale = [(v, s["min_version"], s.get("id")) for v, samples in taken for s in samples if s["min_version"] < v]
    assert not stale, f"(version trained, sample version, id) of stale samples: {stale}"
    assert all(s["min_version"] == s["max_version"] == v for v, samples in taken for s in samples)
    with urllib.request.urlopen(f"{broker.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'deltamesh_broker_leases_total{event="held_back"}' in metrics  # the broker's answer did it


def test_a_pool_told_to_stop_while_its_broker_is_gone_stops_at_once(kit):
    """Found by the chaos soak (benchmarks/soak.py, seed 1): with no broker answering, a pool's lease
    request retries for its failover time (a minute), and a SIGTERM waited that out before the pool
    drained, so a supervisor's stop grace ran out first and killed it. The pool always has room for more
    episodes here, so its worker is asking for a lease when the broker dies; the episodes still running
    retry their submissions, which the drain bounds (`worker.drain_s`)."""
    broker = kit.broker(tasks=digit_sum_tasks(400), n_samples=2, epochs=10)
    gateway = kit.gateway("east")
    broker.wait_healthy()
    gateway.wait_healthy()
    pub = Publisher(gateway.url, kit.private_key, kit.model, full_every=0, piece_bytes=32768)
    _publish(pub, kit.next_version(kit.base_weights(), 1), 1)
    pool = kit.pool("p1", gateway.url, broker.url, "--worker.max-episodes", "256", "--worker.drain-s", "2")
    procs = (broker, gateway, pool)
    pool.wait_healthy()
    kit.wait_until(lambda: _submitted(pool) > 0, 120, "the pool to submit", procs=procs)
    broker.kill(signal.SIGKILL)
    time.sleep(3.0)  # the pool's next lease request is retrying by now
    started = time.monotonic()
    pool.kill(signal.SIGTERM)
    took = time.monotonic() - started
    assert pool.proc.returncode == 143, pool.log_tail()
    assert took < 15.0, f"the pool took {took:.0f} s to stop"
