"""Broker failover benchmark: seconds from SIGKILL of the active broker to the first submission that
the standby accepts, with two `deltamesh broker` processes on one throwaway PostgreSQL cluster.

A pool client (`BrokerClient` given both brokers' URLs, as `--broker A,B` does) submits a small
group, then each repeat kills whichever broker is active and times until its next submission is
acknowledged (the client fails over by itself: it retries, follows the standby's
`X-Broker-Leader` and reaches the new active broker), then starts the killed broker again as the
new standby. The figure is the median over --repeats kills. The lease lasts `--ttl-s` (the broker's
default, 3 s): a killed broker is replaced after its lease runs out, so the failover time is bounded
by the ttl plus the new broker's rebuild of its state from the database.
`--json` prints {"failover_s_p50": x, "failover_s_max": x, "failover_s": [x, ...], "ttl_s": x}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import emit, stop_processes, wait_healthy
from postgres_cluster import PostgresCluster

from deltamesh.broker_client import BrokerClient
from deltamesh.data import Trajectory
from deltamesh.http import HttpError, client_session, request_json
from deltamesh.mesh.demo.processes import free_port

DELTAMESH = [str(Path(sys.executable).with_name("deltamesh"))]


def group(name: str) -> list[Trajectory]:
    n = 64
    return [Trajectory(id=f"{name}-{i}", task_id=name, group_id=name, group_size=2, model_id="m",
                       tokens=np.arange(n, dtype=np.int32), logprobs=np.zeros(n, np.float32),
                       loss_mask=np.ones(n, np.uint8), versions=np.zeros(n, np.int32), reward=float(i))
            for i in range(2)]


class Brokers:
    """Two broker processes on one database; `start(i)` (re)starts broker i."""

    def __init__(self, dsn: str, workdir: Path, ttl_s: float) -> None:
        self.dsn, self.workdir = dsn, workdir
        self.config = workdir / "broker.toml"
        self.config.write_text(f'[broker]\nmodels = ["m"]\n[broker.leader]\nttl_s = {ttl_s}\n')
        self.ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen | None] = [None, None]

    def start(self, i: int) -> None:
        log = open(self.workdir / f"broker{i}.log", "a")
        self.procs[i] = subprocess.Popen(
            [*DELTAMESH, "broker", "--anonymous", "--listen", f"127.0.0.1:{self.ports[i]}", "--db", self.dsn,
             "--config", str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.urls[i], self.procs[i])

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.kill()
        proc.wait()


async def active_index(brokers: Brokers, session) -> int:
    while True:
        for i, url in enumerate(brokers.urls):
            try:
                health = await request_json(session, "GET", url + "/healthz", timeout_s=5)
            except HttpError:  # not started yet, or just killed
                continue
            if health.get("role") == "active":
                return i
        await asyncio.sleep(0.05)


async def measure(brokers: Brokers, repeats: int) -> list[float]:
    times: list[float] = []
    async with BrokerClient(brokers.urls, pool="bench") as client, client_session() as session:
        for n in range(repeats):
            active = await active_index(brokers, session)
            await client.submit(group(f"before{n}"))
            brokers.kill(active)
            killed = time.perf_counter()
            await client.submit(group(f"after{n}"))  # retried and failed over by the client until accepted
            times.append(time.perf_counter() - killed)
            await asyncio.to_thread(brokers.start, active)  # back as the standby
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ttl-s", type=float, default=3.0, help="the brokers' lease ttl (leader.ttl_s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cluster = PostgresCluster.start_new()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            brokers = Brokers(cluster.create_database(), Path(tmp), args.ttl_s)
            try:
                brokers.start(0)
                brokers.start(1)
                times = asyncio.run(measure(brokers, args.repeats))
            finally:
                stop_processes(p for p in brokers.procs if p is not None)
    finally:
        cluster.close()
    result = {"failover_s_p50": statistics.median(times), "failover_s_max": max(times), "failover_s": times,
              "ttl_s": args.ttl_s}
    emit(result, args, lambda r: print(f"failover (kill -> first accepted submission), ttl {r['ttl_s']} s: "
                                       f"median {r['failover_s_p50']:.2f} s, max {r['failover_s_max']:.2f} s "
                                       f"over {len(r['failover_s'])} kills"))


if __name__ == "__main__":
    main()
