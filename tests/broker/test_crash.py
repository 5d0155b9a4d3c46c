"""SIGKILL the broker process while 8 clients submit: after a restart every acknowledged trajectory is
stored exactly once, no unacknowledged submission is half-stored, and leases and buffers come back."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter

import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.data import Trajectory
from deltamesh.http import HttpError
from deltamesh.trainer.batch_client import BatchClient

CLIENTS = 8
ACKS_BEFORE_KILL = 40


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["fsync", "process"])
def test_sigkill_during_submissions_loses_nothing_acknowledged(broker_process, make_group, tmp_path, durability):
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"p{i}"}) + "\n" for i in range(10)))
    broker = broker_process(f'[broker]\nmodels = ["m"]\ndurability = "{durability}"\n'
                            f'[broker.tasks]\ndataset = "{dataset}"\nlease_timeout_s = 3600\nn_samples = 4\n')
    broker.start()
    acked: list[list[Trajectory]] = []  # each acknowledged submission
    unacked: list[list[Trajectory]] = []  # each submission in flight when the broker died

    async def client(i: int) -> None:
        async with BrokerClient(broker.url, pool=f"pool{i}", failover_s=0) as pool:  # no waiting for a restart
            for n in range(100_000):
                trajs = (make_group(f"c{i}-{n}a", [1.0, 0.0, 1.0, 0.0], tokens=256)
                         + make_group(f"c{i}-{n}b", [0.0, 0.0, 1.0, 1.0], tokens=256))
                try:
                    await pool.submit(trajs)
                except HttpError:
                    unacked.append(trajs)
                    return
                acked.append(trajs)

    async def before_kill() -> list[dict]:
        async with BrokerClient(broker.url, pool="holder") as holder, BatchClient(broker.url, "m") as trainer:
            leases = await holder.lease(3)
            done = make_group(leases[0].group_id, [1.0, 0.0, 0.0, 1.0], task_id=leases[0].task_id)
            for t in done:
                t.pool = "holder"  # only the pool holding a lease may fill its group
            await holder.submit(done)
            await holder.submit(make_group("early", [1.0, 0.0, 1.0, 0.0]))
            await trainer.report_version(2)
            assert (await trainer.next_batch(4, timeout_s=5)).groups == [leases[0].group_id]
            await trainer.ack()  # trained: never served again (tests/broker/test_delivery.py: unacknowledged ones are)
        open_leases = broker.get("/v1/leases")["leases"]
        clients = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
        while len(acked) < ACKS_BEFORE_KILL and not unacked:
            await asyncio.sleep(0.005)
        assert not unacked, "a submission failed before the kill"
        broker.kill()  # SIGKILL while the 8 clients are mid-submission
        await asyncio.gather(*clients)
        return open_leases

    open_leases = asyncio.run(before_kill())
    assert len(open_leases) == 2 and len(unacked) == CLIENTS

    broker.start()  # same database, same port
    status = broker.get("/v1/status")
    assert broker.get("/v1/leases")["leases"] == open_leases  # same ids, tasks, pools and deadlines
    assert status["models"]["m"]["version"] == 2
    assert status["tasks"]["cursor"] == {"epoch": 0, "position": 3}

    async def after_restart() -> None:
        async with BrokerClient(broker.url, pool="again") as pool, BatchClient(broker.url, "m") as trainer:
            for trajs in acked[:10]:  # everything acknowledged is already there
                assert (await pool.submit(trajs)).duplicates == len(trajs)
            batch = await trainer.next_batch(8, timeout_s=5)
            assert batch.groups[0] == "early" and len(batch) == 8  # the buffer kept its order

    asyncio.run(after_restart())
    broker.stop()

    with sqlite3.connect(broker.db) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        stored = Counter(r[0] for r in db.execute("SELECT id FROM trajectories"))
        assert all(stored[t.id] == 1 for trajs in acked for t in trajs)
        for trajs in unacked:  # committed before the kill (only the answer was lost) or not at all; never in part
            assert [stored[t.id] for t in trajs] in ([1] * len(trajs), [0] * len(trajs))
        assert db.execute("SELECT COUNT(*) FROM groups g WHERE count != (SELECT COUNT(*) FROM trajectories t "
                          "WHERE t.model_id = g.model_id AND t.group_id = g.group_id)").fetchone()[0] == 0
        fresh_now = db.execute("SELECT COALESCE(SUM(size), 0) FROM groups WHERE state = 'fresh'").fetchone()[0]
    # the restarted broker's buffer held exactly what the store says is fresh (before serving one batch of 8)
    assert status["models"]["m"]["fresh_samples"] == fresh_now + 8
    assert status["models"]["m"]["fresh_samples"] >= 4 + ACKS_BEFORE_KILL * 8
