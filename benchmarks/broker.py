"""Broker benchmark: durable trajectory ingest from 8 concurrent pools, and ready-batch latency.

Each configuration runs a real `deltamesh broker` process on loopback with a fresh SQLite file, or a
fresh database on a throwaway PostgreSQL cluster (postgres_cluster.py) started for the run.
Eight pool clients (one process, asyncio) submit trajectories of 2,048 tokens in groups of 8, each
submission acknowledged only once committed, while a trainer consumes batches of 256; the median of
three such rounds is reported. Then, with the
buffer filled, the trainer asks for ready batches of 256 one after another and each request is timed
until the batch is decoded. The broker process's CPU time per trajectory during the ingest rounds
(taking it in and serving it to the trainer; Linux /proc) is printed too: wall-clock rates on a
shared machine depend on what else runs, CPU time per trajectory much less.
Configurations, side by side in one run:
  - deltamesh: binary submissions, group commit, fsync durability (the default)
  - deltamesh on PostgreSQL: the same on a PostgreSQL database (synchronous_commit on, fsync on; the
    broker holds the leadership lease, so every commit is fenced), the server on the same 2 cores
  - deltamesh, process durability: acks survive a killed broker but not power loss
  - deltamesh, JSON submissions: the same broker fed token lists as JSON
  - deltamesh over TLS with tokens: the default configuration as it runs on the open internet (HTTPS,
    every pool and the trainer authenticated by its own token)
  - baseline, commit per submission: group commit switched off (max_commit_trajectories = one submission)
`--json` prints the default configuration's figures as one JSON object:
{"ingest_traj_per_s": x, "batch_latency_ms_p50": x, "batch_latency_ms_p99": x}, plus
"ingest_traj_per_s_tls_auth" when the comparison configurations run and "ingest_traj_per_s_postgres",
"batch_latency_ms_p50_postgres" when PostgreSQL does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from common import wait_healthy
from postgres_cluster import PostgresCluster

from deltamesh.broker_client import BrokerClient
from deltamesh.certs import issue, make_ca
from deltamesh.data import Trajectory
from deltamesh.http import client_session, request_bytes
from deltamesh.mesh.demo.processes import free_port
from deltamesh.tls import TlsSettings
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.batch_client import BatchClient

TOKENS = 2048
GROUP = 8
BATCH = 256
POOLS = 8
DELTAMESH = [sys.executable, "-c", "import sys; from deltamesh.mesh.cli import main; sys.exit(main())"]


@dataclass
class Access:
    """How clients reach the broker: its URL, TLS settings and one token per caller name."""

    url: str
    tls: TlsSettings | None = None
    tokens: dict[str, str] = field(default_factory=dict)

    def pool(self, pool: int) -> BrokerClient:
        return BrokerClient(self.url, token=self.tokens.get(f"pool{pool}", ""), tls=self.tls, pool=f"pool{pool}")

    def trainer(self) -> BatchClient:
        return BatchClient(self.url, "bench", token=self.tokens.get("trainer", ""), tls=self.tls)


def secure(workdir: Path, pool_ids: list[int]) -> tuple[list[str], Access]:
    """A CA, a server certificate and a tokens file with a token per pool and one for the trainer."""
    ca = make_ca(workdir / "ca")
    server = issue(ca, workdir, "broker/bench", hosts=["127.0.0.1"])
    tokens_file = workdir / "tokens.toml"
    tokens = {f"pool{p}": add_token(tokens_file, TokenSpec(f"pool{p}", "pool")) for p in pool_ids}
    tokens["trainer"] = add_token(tokens_file, TokenSpec("trainer", "trainer"))
    flags = ["--tokens-file", str(tokens_file), "--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    return flags, Access("", TlsSettings(ca=str(ca.cert)), tokens)


def start_broker(workdir: Path, config: str, secured: bool, db: str) -> tuple[subprocess.Popen, Access]:
    port = free_port()
    cfg = workdir / "broker.toml"
    cfg.write_text("[broker]\nmodels = [\"bench\"]\n" + config)
    flags, access = secure(workdir, [*range(100), *range(1000, 1000 + POOLS)]) if secured else (["--anonymous"],
                                                                                                  Access(""))
    log = open(workdir / "broker.log", "w")
    proc = subprocess.Popen([*DELTAMESH, "--log-level", "WARNING", "broker", *flags,
                             "--listen", f"127.0.0.1:{port}", "--db", db, "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT)
    access.url = f"{'https' if secured else 'http'}://127.0.0.1:{port}"
    try:
        # on PostgreSQL the broker serves only once it holds the leadership lease
        wait_healthy(access.url, proc, tls=access.tls if secured else None, timeout=60, expect={"role": "active"})
    except RuntimeError as e:
        proc.kill()
        raise RuntimeError(f"broker: {e}: {(workdir / 'broker.log').read_text()[-2000:]}") from None
    return proc, access


def make_group(pool: int, n: int, rng: np.random.Generator) -> list[Trajectory]:
    group_id = f"p{pool}-g{n}"
    prompt = TOKENS // 4
    mask = np.zeros(TOKENS, np.uint8)
    mask[prompt:] = 1
    versions = np.where(mask == 1, 0, -1).astype(np.int32)
    out = []
    for j in range(GROUP):
        out.append(Trajectory(
            id=f"{group_id}-{j}", task_id=f"task{n}", group_id=group_id, group_size=GROUP, model_id="bench",
            tokens=rng.integers(0, 150_000, TOKENS, dtype=np.int32), logprobs=-rng.random(TOKENS, dtype=np.float32),
            loss_mask=mask, versions=versions, reward=float(j % 2), pool=f"pool{pool}", region="local",
            timings={"generate_s": 1.0}))
    return out


def as_json(trajectories: list[Trajectory]) -> bytes:
    return json.dumps({"trajectories": [
        {**t.header(), "tokens": t.tokens.tolist(), "logprobs": t.logprobs.tolist(),
         "loss_mask": t.loss_mask.tolist(), "versions": t.versions.tolist()} for t in trajectories]}).encode()


async def pool_client(access: Access, pool: int, groups: int, per_submission: int, use_json: bool) -> None:
    rng = np.random.default_rng(pool)
    templates = [make_group(pool, i, rng) for i in range(per_submission)]  # token data reused, ids fresh
    url = access.url
    async with access.pool(pool) as client, client_session() as session:
        for start in range(0, groups, per_submission):
            batch = []
            for k in range(min(per_submission, groups - start)):
                for j, t in enumerate(templates[k]):
                    gid = f"p{pool}-g{start + k}"
                    batch.append(Trajectory(**{**t.__dict__, "id": f"{gid}-{j}", "group_id": gid}))
            if use_json:
                await request_bytes(session, "POST", f"{url}/v1/trajectories", data=as_json(batch),
                                    headers={"Content-Type": "application/json"}, timeout_s=300)
            else:
                await client.submit(batch)


async def trainer(access: Access, stop: asyncio.Event, latencies: list[float] | None, batches: int | None) -> int:
    served = 0
    async with access.trainer() as client:
        while not stop.is_set() and (batches is None or served < batches):
            start = time.perf_counter()
            batch = await client.next_batch(BATCH, timeout_s=1.0)
            if batch is None:
                continue
            if latencies is not None:
                latencies.append((time.perf_counter() - start) * 1000)
            served += 1
    return served


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_config(access: Access, pid: int, groups_per_pool: int, per_submission: int, use_json: bool,
                     latency_batches: int, rounds: int) -> dict[str, float]:
    """Ingest in `rounds` equal rounds (median rate reported), then time ready batches."""
    rates, cpu_per_traj = [], []
    per_round = max(1, groups_per_pool // rounds)
    for r in range(rounds):
        stop = asyncio.Event()
        consumer = asyncio.create_task(trainer(access, stop, None, None))
        start, cpu = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(pool_client(access, 10 * r + p, per_round, per_submission, use_json)
                               for p in range(POOLS)))
        elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
        stop.set()
        await consumer
        trajectories = POOLS * per_round * GROUP
        rates.append(trajectories / elapsed)
        cpu_per_traj.append(cpu / trajectories)
    # Ready batches: fill the buffer first (not timed), then time each request.
    await asyncio.gather(*(pool_client(access, 1000 + p, latency_batches * BATCH // GROUP // POOLS, per_submission, False)
                           for p in range(POOLS)))
    latencies: list[float] = []
    await trainer(access, asyncio.Event(), latencies, latency_batches)
    latencies.sort()
    return {"ingest_traj_per_s": round(statistics.median(rates), 1),
            "batch_latency_ms_p50": round(statistics.median(latencies), 2),
            "batch_latency_ms_p99": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
            "broker_cpu_us_per_traj": round(statistics.median(cpu_per_traj) * 1e6, 1)}


@dataclass
class Config:
    name: str
    settings: str = ""  # [broker] settings
    use_json: bool = False  # JSON submissions instead of binary ones
    secured: bool = False  # TLS and a token per caller
    postgres: bool = False  # a PostgreSQL database instead of an SQLite file


DEFAULT = Config("deltamesh (binary, group commit, fsync)")
POSTGRES = Config("deltamesh on PostgreSQL (synchronous_commit on)", postgres=True)
CONFIGS = [
    DEFAULT,
    POSTGRES,
    Config("deltamesh, durability=process", 'durability = "process"\n'),
    Config("deltamesh, JSON submissions", use_json=True),
    Config("deltamesh over TLS with tokens", secured=True),
    Config("baseline: commit per submission", "max_commit_trajectories = 1\n"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the default configuration as one JSON object")
    parser.add_argument("--groups-per-pool", type=int, default=400, help="groups each of the 8 pools submits")
    parser.add_argument("--per-submission", type=int, default=4, help="groups per submission")
    parser.add_argument("--latency-batches", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3, help="ingest rounds per configuration (median reported)")
    parser.add_argument("--only-default", action="store_true", help="skip the comparison configurations")
    parser.add_argument("--backends-only", action="store_true",
                        help="only the default configuration, on SQLite and on PostgreSQL")
    parser.add_argument("--no-postgres", action="store_true", help="skip PostgreSQL (where it is not installed)")
    parser.add_argument("--sweep", type=lambda text: [int(n) for n in text.split(",")], default=[],
                        metavar="N,N,...", help="also the default configuration at each of these groups per "
                                                "submission (JSON: \"sweep\", what benchmarks/report.py plots)")
    args = parser.parse_args()
    configs = [DEFAULT] if args.only_default else [DEFAULT, POSTGRES] if args.backends_only else CONFIGS
    configs = [c for c in configs if not (c.postgres and args.no_postgres)]
    results = []
    load_before = os.getloadavg()[0]
    cluster = PostgresCluster.start_new() if any(c.postgres for c in configs) else None
    try:
        for c in configs:
            with tempfile.TemporaryDirectory(prefix="bench-broker-") as tmp:
                db = cluster.create_database() if c.postgres and cluster else str(Path(tmp) / "broker.db")
                proc, access = start_broker(Path(tmp), c.settings, c.secured, db)
                try:
                    groups = args.groups_per_pool // (4 if c.use_json else 1)  # JSON is slow; keep the run short
                    figures = asyncio.run(run_config(access, proc.pid, groups, args.per_submission, c.use_json,
                                                     args.latency_batches, args.rounds))
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
            results.append((c, figures))
        sweep = [sweep_point(n, args) for n in args.sweep]
    finally:
        if cluster is not None:
            cluster.close()
    if args.json:
        keys = ("ingest_traj_per_s", "batch_latency_ms_p50", "batch_latency_ms_p99")
        out = {k: results[0][1][k] for k in keys}
        for c, f in results:
            if c.secured:
                out["ingest_traj_per_s_tls_auth"] = f["ingest_traj_per_s"]
        for c, f in results:
            if c.postgres:
                out.update(ingest_traj_per_s_postgres=f["ingest_traj_per_s"],
                           batch_latency_ms_p50_postgres=f["batch_latency_ms_p50"])
        if sweep:
            out["sweep"] = sweep
        print(json.dumps(out))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"broker: {POOLS} pools, {TOKENS}-token trajectories, groups of {GROUP}, batches of {BATCH}; "
                        f"{os.cpu_count()} cores, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    for col in ("configuration", "ingest traj/s", "broker CPU us/traj in+out", "ready batch p50 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for c, f in results:
        table.add_row(c.name, f"{f['ingest_traj_per_s']:,.0f}", f"{f['broker_cpu_us_per_traj']:.0f}",
                      f"{f['batch_latency_ms_p50']:.1f}", f"{f['batch_latency_ms_p99']:.1f}")
    Console().print(table)
    for point in sweep:
        print(f"{point['trajectories_per_submission']} trajectories per submission: {point['ingest_traj_per_s']:,.0f} "
              f"traj/s, ready batch p50 {point['batch_latency_ms_p50']:.1f} ms")
    return 0


def sweep_point(per_submission: int, args: argparse.Namespace) -> dict:
    """The default configuration with `per_submission` groups in each pool's submissions."""
    with tempfile.TemporaryDirectory(prefix="bench-broker-") as tmp:
        proc, access = start_broker(Path(tmp), DEFAULT.settings, False, str(Path(tmp) / "broker.db"))
        try:
            f = asyncio.run(run_config(access, proc.pid, args.groups_per_pool, per_submission, False,
                                       args.latency_batches, args.rounds))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {"groups_per_submission": per_submission, "trajectories_per_submission": per_submission * GROUP,
            "ingest_traj_per_s": f["ingest_traj_per_s"], "batch_latency_ms_p50": f["batch_latency_ms_p50"],
            "broker_cpu_us_per_traj": f["broker_cpu_us_per_traj"]}


if __name__ == "__main__":
    sys.exit(main())
