"""Active/standby brokers on one real PostgreSQL cluster, as separate `deltamesh broker` processes.

A standby answers 503 naming the active broker and stores nothing; a SIGKILLed active broker is
replaced within 10 s while pools submit and a trainer trains, and every acknowledged trajectory is
trained on exactly once; a SIGSTOPped active broker that wakes up after a standby took over neither
commits nor serves; PostgreSQL stopped mid-burst makes the broker answer 503 and it recovers alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections import Counter

import psycopg
import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.data import TRAJECTORIES_CONTENT_TYPE, encode_trajectories
from deltamesh.mesh.demo.processes import free_port
from deltamesh.trainer.batch_client import BatchClient

CONFIG = '[broker]\nmodels = ["m"]\n[broker.leader]\nttl_s = 2.0\nmargin_s = 0.4\n'
TAKEOVER_S = 10.0  # the bound from a kill to a standby serving


@pytest.fixture
def brokers(broker_process, postgres_dsn):
    """Factory: start n broker processes on the test's fresh database (killed at the end of the test)."""

    def make(n: int) -> list:
        new = [broker_process(CONFIG, db=postgres_dsn, port=free_port()) for _ in range(n)]
        for bp in new:
            bp.start(ready="/healthz")
        return new

    return make


def health(bp) -> dict | None:
    try:
        return bp.get("/healthz")
    except (urllib.error.URLError, ConnectionError, OSError):
        return None


def wait_active(candidates: list, timeout_s: float = TAKEOVER_S):
    """The one broker that says it is active (and answers /v1/status), waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        active = [bp for bp in candidates if (health(bp) or {}).get("role") == "active"]
        assert len(active) <= 1, f"two active brokers: {[bp.url for bp in active]}"
        if active:
            return active[0]
        time.sleep(0.05)
    raise AssertionError(f"no broker became active within {timeout_s} s")


def post(url: str, data: bytes, content_type: str) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def stored_ids(dsn: str) -> Counter:
    with psycopg.connect(dsn) as conn:
        return Counter(r[0] for r in conn.execute("SELECT id FROM broker_trajectories"))


def test_standby_answers_503_with_the_leader_and_stores_nothing(brokers, postgres_dsn, make_group):
    first, second = brokers(2)
    active = wait_active([first, second])
    standby = second if active is first else first
    deadline = time.monotonic() + 5  # the standby learns who leads at its next poll of the lease
    while health(standby)["leader"] != active.url and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(standby) == {"ok": True, "role": "standby", "leader": active.url}
    data = encode_trajectories(make_group("g", [1.0, 0.0, 1.0, 0.0]))
    status, headers, body = post(standby.url + "/v1/trajectories", data, TRAJECTORIES_CONTENT_TYPE)
    assert status == 503 and headers["Retry-After"] == "1"
    assert headers["X-Broker-Leader"] == active.url and body["leader"] == active.url
    with pytest.raises(urllib.error.HTTPError) as refused:
        standby.get("/v1/status")
    assert refused.value.code == 503
    assert not stored_ids(postgres_dsn)
    status, _, body = post(active.url + "/v1/trajectories", data, TRAJECTORIES_CONTENT_TYPE)
    assert (status, body) == (200, {"accepted": 4, "duplicates": 0})


@pytest.mark.slow
def test_sigkill_of_the_active_broker_twice_loses_and_repeats_nothing(brokers, postgres_dsn, make_group):
    procs = brokers(3)
    urls = [bp.url for bp in procs]
    acked: list[str] = []  # ids of acknowledged trajectories
    trained: Counter = Counter()
    stop = asyncio.Event()
    takeovers: list[float] = []

    async def pool(i: int) -> None:
        async with BrokerClient(urls, pool=f"pool{i}") as client:
            n = 0
            while not stop.is_set():
                group = make_group(f"c{i}-{n}", [1.0, 0.0, 1.0, 0.0], tokens=64)
                await client.submit(group)  # any error here fails the test: failover must absorb it
                acked.extend(t.id for t in group)
                n += 1

    async def trainer() -> None:
        async with BatchClient(urls, "m") as batches:
            while not stop.is_set() or len(trained) < len(acked):
                # a batch waits for `size` samples: once the pools stop, one group at a time drains the rest
                batch = await batches.next_batch(4 if stop.is_set() else 16, timeout_s=2)
                if batch is not None:
                    trained.update(s["id"] for s in batch.samples)

    async def kill_twice() -> None:
        alive = list(procs)
        for _ in range(2):
            target = len(acked) + 200
            while len(acked) < target:
                await asyncio.sleep(0.01)
            active = await asyncio.to_thread(wait_active, alive)
            active.kill()
            killed_at = time.monotonic()
            alive.remove(active)
            await asyncio.to_thread(wait_active, alive)
            takeovers.append(time.monotonic() - killed_at)
        target = len(acked) + 200
        while len(acked) < target:
            await asyncio.sleep(0.01)
        stop.set()

    async def main() -> None:
        tasks = [asyncio.create_task(pool(i)) for i in range(4)] + [asyncio.create_task(trainer())]
        await asyncio.wait_for(kill_twice(), timeout=180)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    asyncio.run(main())
    assert len(takeovers) == 2 and max(takeovers) < TAKEOVER_S, takeovers
    assert len(acked) >= 600
    assert set(acked) <= set(trained), "an acknowledged trajectory was never trained on"
    assert max(trained.values()) == 1, [i for i, n in trained.items() if n > 1][:5]
    stored = stored_ids(postgres_dsn)
    assert set(trained) <= set(stored) and max(stored.values()) == 1


@pytest.mark.slow
def test_a_paused_active_broker_that_resumes_commits_and_serves_nothing(brokers, postgres_dsn, make_group):
    first, second = brokers(2)
    paused = wait_active([first, second])
    other = second if paused is first else first
    os.kill(paused.proc.pid, signal.SIGSTOP)
    try:
        assert wait_active([other]) is other
        data = encode_trajectories(make_group("after", [1.0, 0.0, 1.0, 0.0]))
        assert post(other.url + "/v1/trajectories", data, TRAJECTORIES_CONTENT_TYPE)[0] == 200
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    before = stored_ids(postgres_dsn)
    late = encode_trajectories(make_group("late", [0.0, 1.0, 0.0, 1.0]))
    deadline = time.monotonic() + 5  # it names its successor once it has looked at the lease again
    while True:
        status, headers, body = post(paused.url + "/v1/trajectories", late, TRAJECTORIES_CONTENT_TYPE)
        assert status == 503 and headers["X-Broker-Leader"] in ("", other.url), body
        if headers["X-Broker-Leader"] == other.url or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert headers["X-Broker-Leader"] == other.url
    with pytest.raises(urllib.error.HTTPError) as refused:
        paused.get("/v1/status")
    assert refused.value.code == 503
    assert stored_ids(postgres_dsn) == before
    assert health(paused)["role"] == "standby" and health(other)["role"] == "active"


@pytest.mark.slow
def test_postgres_stopped_mid_burst_gives_503_and_the_broker_recovers(brokers, postgres_cluster, postgres_dsn,
                                                                       make_group):
    (broker,) = brokers(1)
    wait_active([broker])
    url = broker.url + "/v1/trajectories"
    for n in range(20):
        assert post(url, encode_trajectories(make_group(f"ok{n}", [1.0, 0.0])), TRAJECTORIES_CONTENT_TYPE)[0] == 200
    postgres_cluster.stop(mode="immediate")
    try:
        answers = [post(url, encode_trajectories(make_group(f"down{n}", [1.0, 0.0])), TRAJECTORIES_CONTENT_TYPE)
                   for n in range(5)]
        assert {status for status, _, _ in answers} == {503}, answers
    finally:
        postgres_cluster.start()
    # Its lease may still run out and be taken again after the server is back (renewals failed while it
    # was down): the broker answers 503 meanwhile, as a client is told to retry, until it accepts again.
    back = encode_trajectories(make_group("back", [1.0, 0.0]))
    deadline = time.monotonic() + 30
    while (status := post(url, back, TRAJECTORIES_CONTENT_TYPE)[0]) == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 200
    stored = stored_ids(postgres_dsn)
    assert not any(i.startswith("down") for i in stored)
    assert sum(1 for i in stored if i.startswith("ok")) == 40 and stored["back-0"] == 1
