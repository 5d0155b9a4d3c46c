"""At-least-once batch delivery: a batch stays the broker's until its trainer acknowledges it.

Real processes and real SQLite: a trainer's poll run as its own process (batch_poller.py) is SIGKILLed
mid long-poll and right after receiving a batch; the same samples are served again on the next poll,
or once the ack deadline passes with no poll at all. An acknowledged batch is never served again,
also across broker restarts (SIGKILL), while an unacknowledged one survives them and is requeued.
Acknowledgements are idempotent; an unknown batch id is a 404 that changes nothing. A group joins
replay only once acknowledged, and a store written before acknowledgements existed is upgraded.
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.data import Batch
from deltamesh.http import HttpError
from deltamesh.mesh.broker.config import BrokerConfig, PoliciesConfig, ReplayConfig
from deltamesh.mesh.broker.sqlite_store import SCHEMA_VERSION, SqliteStore
from deltamesh.trainer.batch_client import BatchClient

POLLER = Path(__file__).with_name("batch_poller.py")


class Poller:
    """batch_poller.py as a child process; its JSON lines arrive on a queue (read by a thread)."""

    def __init__(self, url: str, size: int, polls: int = 1, timeout_s: float = 30.0):
        self.proc = subprocess.Popen([sys.executable, str(POLLER), url, "m", str(size), str(polls), str(timeout_s)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def event(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """The next event it printed (anything else it printed, such as a traceback, fails the test)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"batch_poller said nothing for {timeout_s} s") from None
            try:
                return json.loads(line)
            except ValueError:
                raise AssertionError(f"batch_poller: {line}{''.join(self.lines.queue)}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def pollers():
    made: list[Poller] = []

    def start(*args: Any, **kw: Any) -> Poller:
        made.append(Poller(*args, **kw))
        return made[-1]

    yield start
    for p in made:
        p.kill()


def metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def submit(url: str, trajectories: list) -> None:
    async def go() -> None:
        async with BrokerClient(url, pool="p") as pool:
            await pool.submit(trajectories)

    asyncio.run(go())


def same_samples(batch: Batch, seen: dict[str, Any]) -> bool:
    return [s["id"] for s in batch.samples] == seen["ids"] and batch.tokens.tolist() == seen["tokens"]


def test_a_trainer_killed_mid_poll_or_before_its_ack_gets_the_same_samples_on_its_next_poll(
        broker_process, pollers, make_group):
    broker = broker_process('[broker]\nmodels = ["m"]\nack_timeout_s = 600\n')
    broker.start()

    def status() -> dict[str, int]:
        return broker.get("/v1/status")["models"]["m"]

    # Killed in the middle of a long poll: the data that arrives afterwards is not taken for it.
    dead = pollers(broker.url, 8)
    assert dead.event()["event"] == "polling"
    time.sleep(0.3)  # the poll is waiting at the broker
    dead.kill()
    submit(broker.url, make_group("g0", [1.0, 0.0, 1.0, 0.0]) + make_group("g1", [0.0, 1.0, 1.0, 1.0]))
    time.sleep(0.3)
    assert status()["fresh_groups"] == 2 and metric(broker.url, "deltamesh_broker_batches_served_total",
                                                    model_id="m") == 0

    # Killed after receiving a batch, before acknowledging it: the batch waits for its ack.
    first = pollers(broker.url, 8)
    assert first.event()["event"] == "polling"
    seen = first.event()
    assert seen["event"] == "batch" and len(seen["ids"]) == 8
    first.kill()
    submit(broker.url, make_group("g2", [1.0, 0.0, 1.0, 0.0]))
    assert (status()["fresh_groups"], status()["unacked_batches"], status()["unacked_samples"]) == (1, 1, 8)

    async def restarted_trainer() -> None:
        async with BatchClient(broker.url, "m") as trainer:
            again = await trainer.next_batch(8, timeout_s=5)  # holds nothing: the dead one's batch comes back
            assert same_samples(again, seen) and again.batch_id != seen["batch_id"]
            assert (await trainer.ack())["acked"] == [again.batch_id]
            assert await trainer.next_batch(8, timeout_s=0.3) is None  # only g2 is left: never g0, g1 again

    asyncio.run(restarted_trainer())
    assert metric(broker.url, "deltamesh_broker_batches_requeued_total", model_id="m", reason="not_held") == 1
    assert metric(broker.url, "deltamesh_broker_batch_acks_total", model_id="m", outcome="acked") == 1
    assert (status()["fresh_groups"], status()["unacked_batches"]) == (1, 0)


def test_an_unacknowledged_batch_goes_back_to_the_buffer_at_its_ack_deadline(broker_process, pollers, make_group):
    broker = broker_process('[broker]\nmodels = ["m"]\nack_timeout_s = 1.0\n')
    broker.start()
    submit(broker.url, make_group("g0", [1.0, 0.0, 1.0, 0.0]))
    dead = pollers(broker.url, 4)
    assert dead.event()["event"] == "polling"
    seen = dead.event()
    received = time.monotonic()
    dead.kill()
    assert broker.get("/v1/status")["models"]["m"]["unacked_batches"] == 1
    # Nobody polls: the deadline alone puts the group back.
    wait_for(lambda: broker.get("/v1/status")["models"]["m"]["fresh_groups"] == 1, 10, "the deadline's requeue")
    assert time.monotonic() - received >= 0.9
    assert metric(broker.url, "deltamesh_broker_batches_requeued_total", model_id="m", reason="deadline") == 1

    async def next_trainer() -> None:
        async with BatchClient(broker.url, "m") as trainer:
            assert same_samples(await trainer.next_batch(4, timeout_s=5), seen)

    asyncio.run(next_trainer())


async def after_restart(call: Callable[[], Awaitable[Any]]) -> Any:
    """A call made right after the broker restarted: once more if it went out on a connection to the
    killed process (as the trainer's client retries any failed poll)."""
    try:
        return await call()
    except HttpError as e:
        if e.status != 0:
            raise
        return await call()


@pytest.mark.slow
def test_acknowledged_batches_are_never_served_again_across_broker_restarts(broker_process, make_group):
    broker = broker_process('[broker]\nmodels = ["m"]\nack_timeout_s = 600\n')
    broker.start()
    submit(broker.url, [t for i in range(6) for t in make_group(f"g{i}", [1.0, 0.0, 0.0, 1.0])])

    def status() -> dict[str, int]:
        return broker.get("/v1/status")["models"]["m"]

    async def scenario() -> None:
        # failover_s=0: a call to the killed broker fails at once instead of waiting for it to return
        async with BatchClient(broker.url, "m", auto_ack=False, failover_s=0) as trainer:
            b1 = await trainer.next_batch(8, timeout_s=5)
            assert b1.groups == ["g0", "g1"] and (await trainer.ack())["acked"] == [b1.batch_id]
            b2 = await trainer.next_batch(8, timeout_s=5)
            assert b2.groups == ["g2", "g3"] and trainer.held == [b2.batch_id]

            broker.kill()
            with pytest.raises(HttpError):
                await trainer.ack()  # the broker is down: the ack stays pending, to go with the next poll
            assert trainer.unconfirmed_acks == [b2.batch_id] and trainer.held == []
            broker.start()
            assert (status()["unacked_batches"], status()["fresh_groups"]) == (1, 2)  # b2 survived the kill
            b3 = await after_restart(lambda: trainer.next_batch(8, timeout_s=5))  # carries b2's ack
            assert b3.groups == ["g4", "g5"] and trainer.unconfirmed_acks == []

            broker.kill()
            broker.start()
            assert trainer.held == [b3.batch_id] and status()["unacked_batches"] == 1
            # It still holds b3: nothing is requeued.
            assert await after_restart(lambda: trainer.next_batch(8, timeout_s=0.2)) is None
            assert status()["unacked_batches"] == 1

            async with BatchClient(broker.url, "m") as other:  # a new trainer holds nothing: b3 comes back
                again = await other.next_batch(8, timeout_s=5)
                assert again.groups == ["g4", "g5"] and again.tokens.tolist() == b3.tokens.tolist()
                assert (await other.ack())["acked"] == [again.batch_id]
                assert await other.next_batch(8, timeout_s=0.3) is None  # g0..g3 never again
            late = await trainer.ack()  # the first trainer acknowledges b3 after it was requeued
            assert late == {"acked": [], "already_acked": [], "requeued": [b3.batch_id]}

    asyncio.run(scenario())
    broker.kill()
    broker.start()
    assert (status()["unacked_batches"], status()["fresh_groups"]) == (0, 0)


def test_acks_are_idempotent_and_an_unknown_batch_id_is_404(serve_broker, make_group):
    async def scenario() -> None:
        async with serve_broker() as (url, broker), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m", auto_ack=False) as trainer, aiohttp.ClientSession() as s:
            await pool.submit(make_group("g0", [1.0, 0.0]) + make_group("g1", [0.0, 1.0]))
            batch = await trainer.next_batch(2, timeout_s=5)

            async def post(model_id: str, body: Any) -> tuple[int, dict]:
                async with s.post(f"{url}/v1/models/{model_id}/acks", json=body) as r:
                    return r.status, await r.json()

            code, answer = await post("m", {"batch_ids": [batch.batch_id, "nope"]})
            assert code == 404 and "nope" in answer["error"]
            assert list(broker.models["m"].unacked) == [batch.batch_id]  # nothing was acknowledged
            assert await post("m", {"batch_ids": [batch.batch_id]}) == (
                200, {"acked": [batch.batch_id], "already_acked": [], "requeued": []})
            assert await post("m", {"batch_ids": [batch.batch_id]}) == (
                200, {"acked": [], "already_acked": [batch.batch_id], "requeued": []})
            for model_id, body, status in (("m", {}, 400), ("m", {"batch_ids": "x"}, 400),
                                           ("m", {"batch_ids": [3]}, 400), ("ghost", {"batch_ids": [batch.batch_id]}, 404)):
                assert (await post(model_id, body))[0] == status, (model_id, body)
            async with s.post(f"{url}/v1/models/m/batch", json={"size": 2, "held": "x"}) as r:
                assert r.status == 400
            # In a poll, an unknown id is only logged: the poll still serves.
            async with s.post(f"{url}/v1/models/m/batch", json={"size": 2, "ack": ["nope"], "timeout_s": 5}) as r:
                assert r.status == 200 and r.headers["X-Batch-Id"]
            with pytest.raises(HttpError, match="404"):
                await trainer.ack(["nope"])
            assert trainer.unconfirmed_acks == []  # a 4xx is final: not sent again

    asyncio.run(scenario())


def test_a_group_joins_replay_only_once_its_batch_is_acknowledged(serve_broker, make_group):
    config = BrokerConfig(models=["m"], policies=PoliciesConfig(replay=ReplayConfig(fraction=0.5)))

    async def scenario() -> None:
        async with serve_broker(config) as (url, broker), BrokerClient(url, pool="p") as pool, \
                BatchClient(url, "m", auto_ack=False) as trainer:
            await pool.submit([t for i in range(8) for t in make_group(f"g{i}", [1.0, 0.0])])
            first = await trainer.next_batch(4, timeout_s=5)
            second = await trainer.next_batch(4, timeout_s=5)  # the first is held, not acknowledged: no replay
            assert (first.groups, second.groups, second.replay.sum()) == (["g0", "g1"], ["g2", "g3"], 0)
            await trainer.ack()
            third = await trainer.next_batch(4, timeout_s=5)
            assert third.groups == ["g3", "g4"] and third.replay.tolist() == [1, 1, 0, 0]
            async with BatchClient(url, "m") as restarted:  # holds nothing: `third` goes back, g4 first again
                fourth = await restarted.next_batch(4, timeout_s=5)
                assert fourth.groups[-1] == "g4" and fourth.replay.tolist() == [1, 1, 0, 0]

    asyncio.run(scenario())


def test_a_store_from_before_acknowledgements_is_upgraded_with_its_batches_acknowledged(tmp_path):
    db = tmp_path / "old.db"
    SqliteStore(db).close()
    conn = sqlite3.connect(db, isolation_level=None)  # make it a schema 1 store: batches had no state,
    conn.executescript("ALTER TABLE batches DROP COLUMN state; ALTER TABLE batches DROP COLUMN settled_at; "
                       "ALTER TABLE trajectories DROP COLUMN digest; "  # trajectories no content digest
                       "INSERT INTO trajectories(id, model_id, group_id, task_id, reward, min_version, max_version, "
                       "n_tokens, pool, region, meta) VALUES ('t', 'm', 'g', 'task', 1.0, 0, 0, 0, 'p', '', '{}'); "
                       "INSERT INTO batches(batch_id, model_id, version, served_at, n_groups) "
                       "VALUES ('b', 'm', 0, 0, 1); UPDATE meta SET value='1' WHERE key='schema';")
    conn.close()
    store = SqliteStore(db)
    try:
        assert store.batch_states("m", ["b", "x"]) == {"b": "acked"} and store.load().deliveries == []
    finally:
        store.close()
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone() == (SCHEMA_VERSION,)
    assert conn.execute("SELECT id, digest FROM trajectories").fetchall() == [("t", None)]  # old rows: no digest
    conn.close()


def test_training_version_counts_the_batches_a_trainer_took_until_its_version_moves_past_them(broker_process,
                                                                                               make_group):
    """A pool with a staleness bound compares its version with `training_version`: while the trainer
    trains on a batch taken at v, it is v + 1, so a synchronous run's pools (bound 0) wait for v + 1
    rather than make samples the broker would drop as stale."""
    broker = broker_process('[broker]\nmodels = ["m"]\n')
    broker.start()
    submit(broker.url, make_group("g0", [1.0, 0.0, 1.0, 0.0]) + make_group("g1", [0.0, 1.0, 1.0, 1.0]))

    def versions() -> tuple[int, int]:
        s = broker.get("/v1/status")["models"]["m"]
        return s["version"], s["training_version"]

    async def trainer() -> None:
        async with BatchClient(broker.url, "m") as t:
            assert versions() == (0, 0)
            assert await t.next_batch(4, timeout_s=5) is not None
            assert versions() == (0, 1)  # training v0 -> v1
            await t.report_version(1)
            assert versions() == (1, 1)
            assert await t.next_batch(4, timeout_s=5) is not None
            assert versions() == (1, 2)
            await t.report_version(2)
            assert versions() == (2, 2)

    asyncio.run(trainer())
