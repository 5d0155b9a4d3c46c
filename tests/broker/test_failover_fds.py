"""A broker's open files across PostgreSQL failovers: a primary crashed, its streaming standby promoted,
a new standby built, four times over, while a pool submits all along.

The chaos soak (benchmarks/soak.py) saw its brokers' open fds step up around failovers. Here nothing
but PostgreSQL fails, and the broker's HTTP callers open a connection per request and close it, so
what stays open is the broker's own: after every failover it must hold at most its two database
connections (the store's and the leadership lease's) and no more fds than after the first one, as
it commits again through the new primary.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
from postgres_cluster import PostgresCluster, PostgresMissing

from deltamesh.data import TRAJECTORIES_CONTENT_TYPE, encode_trajectories

CONFIG = '[broker]\nmodels = ["m"]\n[broker.leader]\nttl_s = 2.0\nmargin_s = 0.4\n'
FAILOVERS = 4
pytestmark = pytest.mark.slow


class Pair:
    """A primary and a streaming standby; `fail_over` crashes the primary, promotes the standby and
    builds a new standby of it on the dead primary's port, so the broker's URL names both for good."""

    def __init__(self) -> None:
        self.primary = PostgresCluster.start_new()
        self.primary.create_database("fds")
        self.standby = PostgresCluster.start_standby(self.primary)
        self.ports = sorted((self.primary.port, self.standby.port))

    @property
    def dsn(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"postgresql://postgres@{hosts}/fds?target_session_attrs=read-write"

    def fail_over(self) -> None:
        dead = self.primary
        dead.stop(mode="immediate")  # a crash: clients cut off mid-whatever
        self.standby.promote()
        self.primary = self.standby
        dead.close()
        self.standby = PostgresCluster.start_standby(self.primary, port=dead.port)

    def close(self) -> None:
        for cluster in (self.standby, self.primary):
            cluster.close()


@pytest.fixture
def pg_pair():
    try:
        pair = Pair()
    except PostgresMissing as e:
        pytest.skip(str(e))
    yield pair
    pair.close()


def submit_forever(url: str, make_group, acked: list[int], stop: threading.Event) -> None:
    """One new connection per request (closed after it): the broker's HTTP side holds nothing open."""
    n = 0
    while not stop.is_set():
        data = encode_trajectories(make_group(f"g{n}", [1.0, 0.0, 1.0, 0.0]))
        req = urllib.request.Request(url + "/v1/trajectories", data=data, method="POST",
                                     headers={"Content-Type": TRAJECTORIES_CONTENT_TYPE})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                resp.read()
            acked.append(n)
            n += 1
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)  # 503 while the database fails over: the same group again


def committed_again(acked: list[int], timeout_s: float = 60.0) -> None:
    target = len(acked) + 5
    deadline = time.monotonic() + timeout_s
    while len(acked) < target:
        assert time.monotonic() < deadline, f"the broker committed nothing within {timeout_s} s of a failover"
        time.sleep(0.05)


def database_connections(proc: psutil.Process, ports: list[int]) -> int:
    return sum(1 for c in proc.net_connections(kind="tcp") if c.raddr and c.raddr.port in ports)


def test_failovers_leave_the_broker_no_more_open_files(pg_pair, broker_process, make_group):
    broker = broker_process(CONFIG, db=pg_pair.dsn)
    broker.start()
    proc = psutil.Process(broker.proc.pid)
    acked: list[int] = []
    stop = threading.Event()
    pool = threading.Thread(target=submit_forever, args=(broker.url, make_group, acked, stop), daemon=True)
    pool.start()
    try:
        committed_again(acked)
        fds, held = [], []
        for _ in range(FAILOVERS):
            pg_pair.fail_over()
            committed_again(acked)
            time.sleep(1.0)  # a lease renewal or two on the new primary
            fds.append(proc.num_fds())
            held.append(database_connections(proc, pg_pair.ports))
    finally:
        stop.set()
        pool.join(timeout=15)
    assert max(held) <= 2, f"database connections after each failover: {held}"
    assert fds[-1] <= fds[0] + 1 and max(fds) <= fds[0] + 2, f"open fds after each failover: {fds}"
