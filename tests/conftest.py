"""Shared test fixtures: free ports, weight versions, trajectories, a broker in this process on a real
loopback socket or as its own `deltamesh broker` process (for kill and disk-full tests), and a throwaway
PostgreSQL cluster (benchmarks/postgres_cluster.py) with a fresh database per test; all cleaned up."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import numpy as np
import pytest
from aiohttp import web

from deltamesh.data import Trajectory
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.broker.server import SLOT_KEY, build_app
from deltamesh.mesh.broker.service import Broker
from deltamesh.mesh.demo import processes

# The PostgreSQL cluster helper is shared with the benchmarks, which import each other by name from there.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
from postgres_cluster import PostgresCluster, PostgresMissing  # noqa: E402


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Any:
    """A command's main() run in-process sets up logging on the stream pytest captures for that
    test, which is closed afterwards; later log records would then hit a closed file. Put the root
    logger back as it was after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    return processes.free_port()


DISTRIBUTION = ("pyproject.toml", "setup.py", "README.md", "deltamesh", "delta", "gateway", "trainer", "mesh")
"""What a build of the distribution reads: the packaging files and the package folders."""


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """A copy of what a build of the distribution reads, for installing into a fresh venv: an in-tree
    build would leave build/ and egg-info in the checkout."""
    root, src = Path(__file__).resolve().parent.parent, tmp_path / "src"
    src.mkdir()
    for name in DISTRIBUTION:
        if (root / name).is_dir():
            shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(root / name, src / name)
    return src


@pytest.fixture(scope="session")
def postgres_cluster(request: pytest.FixtureRequest) -> PostgresCluster:
    """One throwaway PostgreSQL server for the whole session (fsync on, trust auth on 127.0.0.1), stopped
    and deleted at the end even after failures. A test may `stop(mode="immediate")` and `start()` it; the
    next `postgres_dsn` starts it again if a test left it down. Skips where PostgreSQL is not installed
    (`make test` installs it: benchmarks/setup_postgres.sh)."""
    try:
        cluster = PostgresCluster.start_new()
    except PostgresMissing as e:
        pytest.skip(str(e))
    request.addfinalizer(cluster.close)
    return cluster


@pytest.fixture
def postgres_dsn(postgres_cluster: PostgresCluster) -> str:
    """A DSN (postgresql://postgres@127.0.0.1:PORT/t_<random>) of an empty database made for this test
    alone. It is not dropped afterwards (DROP DATABASE forces a checkpoint, which costs more than the
    disk): it goes with the cluster at the end of the session."""
    postgres_cluster.ensure_running()
    return postgres_cluster.create_database()


def next_bf16_version(weights: dict, seed: int, share: float = 0.02) -> dict:
    """The weights after one RL optimizer step: `share` of each tensor's bf16 words move by +-1 or 2 ulps.

    A word whose magnitude bits are tiny only grows, so no move crosses zero into the other sign (or NaN).
    """
    import torch  # here, not at the top: most test directories never need torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        words = w.contiguous().view(-1).view(torch.int16).clone()
        hit = torch.rand(words.shape, generator=g) < share
        moves = torch.randint(1, 3, words.shape, generator=g, dtype=torch.int16)
        down = (torch.rand(words.shape, generator=g) < 0.5) & ((words & 0x7FFF) > 2)
        moved = torch.where(down, words - moves, words + moves)
        out[name] = torch.where(hit, moved, words).view(torch.bfloat16).view(w.shape)
    return out


@pytest.fixture(scope="session")
def rl_step():
    """`next_bf16_version`, for test modules (they cannot import a conftest)."""
    return next_bf16_version


DELTAMESH = [sys.executable, "-c", "import sys; from deltamesh.mesh.cli import main; sys.exit(main())"]


def trajectory(tid: str, group_id: str, *, model_id: str = "m", group_size: int = 4, reward: float = 1.0,
               version: int = 0, tokens: int = 12, task_id: str | None = None, seed: int = 0) -> Trajectory:
    """A small valid trajectory: a third prompt (mask 0, version -1), the rest generated at `version`."""
    rng = np.random.default_rng(seed)
    prompt = tokens // 3
    mask = np.r_[np.zeros(prompt, np.uint8), np.ones(tokens - prompt, np.uint8)]
    return Trajectory(
        id=tid, task_id=task_id or f"task-{group_id}", group_id=group_id, group_size=group_size, model_id=model_id,
        tokens=rng.integers(0, 32000, tokens, dtype=np.int32), logprobs=-rng.random(tokens, dtype=np.float32),
        loss_mask=mask, versions=np.where(mask == 1, version, -1).astype(np.int32), reward=reward, pool="p",
        region="r", timings={"generate_s": 0.5}, metadata={"turn": 1})


def group(group_id: str, rewards: list[float], **kw: Any) -> list[Trajectory]:
    """One complete group: a trajectory per reward, ids `<group_id>-<i>`."""
    return [trajectory(f"{group_id}-{i}", group_id, group_size=len(rewards), reward=r, seed=i, **kw)
            for i, r in enumerate(rewards)]


@pytest.fixture
def make_group() -> Callable[..., list[Trajectory]]:
    return group


@pytest.fixture
def make_trajectory() -> Callable[..., Trajectory]:
    return trajectory


@pytest.fixture
def serve_broker(tmp_path: Path):
    """Factory: `async with serve_broker(config) as (url, broker)` runs a broker in this process on a
    real 127.0.0.1 socket with a real SQLite file; it is shut down when the block ends."""

    @asynccontextmanager
    async def serve(config: BrokerConfig | None = None, db: Path | None = None) -> AsyncIterator[tuple[str, Broker]]:
        config = config or BrokerConfig(models=["m"])
        if not config.tokens_file:  # these tests are not about authentication (tests/broker/test_auth.py is)
            config = dataclasses.replace(config, anonymous=True)
        app = build_app(config, db or tmp_path / "broker.db")
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            yield f"http://{host}:{port}", app[SLOT_KEY].broker
        finally:
            await runner.cleanup()

    return serve


class BrokerProcess:
    """A `deltamesh broker` child process; `start` waits until it answers, `kill` sends SIGKILL."""

    def __init__(self, workdir: Path, db: Path | str, config: str, port: int):
        self.workdir, self.db, self.config, self.port = workdir, db, config, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"broker-{port}.log"

    def start(self, timeout_s: float = 30.0, ready: str = "/v1/status") -> None:
        """Start and wait until `ready` answers 200 (a standby broker answers only `/healthz`)."""
        cfg = self.workdir / "broker.toml"
        cfg.write_text(self.config)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([*DELTAMESH, "broker", "--anonymous", "--listen", f"127.0.0.1:{self.port}", "--db",
                                          str(self.db), "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                self.get(ready)
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        raise RuntimeError(f"broker did not answer within {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def broker_process(tmp_path: Path, free_port: int):
    """Factory of `BrokerProcess`es (not yet started); every one is killed at the end of the test."""
    made: list[BrokerProcess] = []

    def make(config: str = '[broker]\nmodels = ["m"]\n', db: Path | str | None = None,
             port: int | None = None) -> BrokerProcess:
        """`db`: a SQLite file (default: one in the test's folder) or a postgresql:// URL; `port`:
        another than the test's free port, for several brokers at once."""
        bp = BrokerProcess(tmp_path, db or tmp_path / "broker.db", config, port or free_port)
        made.append(bp)
        return bp

    yield make
    for bp in made:
        bp.kill()


WAIT_PORT = """import socket, sys, time
host, _, port = sys.argv[1].rpartition(":")
deadline = time.monotonic() + 60
while socket.socket().connect_ex((host or "127.0.0.1", int(port))) != 0:
    if time.monotonic() > deadline:
        sys.exit(f"nothing listens on {sys.argv[1]}")
    time.sleep(0.1)
"""


@pytest.fixture
def run_documented_lines() -> Callable[..., subprocess.CompletedProcess]:
    """Run the shell lines a document shows, as written, in a network namespace of their own (they use
    fixed ports): `run(lines, cwd, env=None, after=[...], ports=None)`. A line ending in `&` starts a
    server; the next line waits until it answers, on the next of `ports` (`PORT` on 127.0.0.1, or
    `HOST:PORT`; default: each such line's `--listen HOST:PORT`, any loopback address). Skips where
    namespaces are not allowed."""
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no network namespaces here: {probe.stderr.decode().strip()}")

    def run(lines: list[str], cwd: Path, env: dict[str, str] | None = None, after: list[str] = (),
            ports: list[str] | None = None) -> subprocess.CompletedProcess:
        servers = [line for line in lines if line.endswith("&")]
        waits = list(ports) if ports is not None else [
            re.search(r"--listen (127\.[\d.]+:\d+)", line).group(1) for line in servers]
        # `|| true`: with no server left, `kill` alone fails, and the trap's status would be the script's.
        script = ["set -e", "ip link set lo up", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
        for line in lines:
            script.append(line)
            if line.endswith("&"):  # a server: the next line needs it listening
                script.append(f"python -c {shlex.quote(WAIT_PORT)} {waits.pop(0)}")
        env = {**os.environ, **(env or {})}
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        return subprocess.run(["unshare", "--net", "bash", "-c", "\n".join([*script, *after])], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)

    return run

