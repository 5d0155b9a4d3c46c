"""Fixtures of the gateway tests: trainer keys, hand-made versions, and real gateway processes.

Gateways run as real `deltamesh gateway` processes on free loopback ports (or in-process on a real
socket for the quick route tests); every process started here is killed by the fixture's finalizer,
whatever the test did. Gateways run `anonymous` unless a test asks for tokens or TLS: the tests whose
subject is authentication (test_auth_*.py, test_tls.py) make real tokens and certificates.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest
import torch

from deltamesh.delta import read_weights
from deltamesh.delta.hashing import digest, piece_digest
from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.delta.manifest import Manifest, PieceEntry, TensorEntry
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.app import create_app, ssl_context
from deltamesh.http import serving
from deltamesh.mesh.demo.processes import end_process, free_port, log_tail
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync

DELTAMESH = [str(Path(sys.executable).with_name("deltamesh"))]
POOL_TOKEN = "region-token-1"


def _register_helper(name: str) -> None:
    """Make this folder's helper module `name`.py importable as `deltamesh_test_NAME` (tests are imported
    by path, so their folder is not a package); conftest.py is imported before the tests that use it."""
    spec = importlib.util.spec_from_file_location(f"deltamesh_test_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before running it: dataclasses look their module up there
    spec.loader.exec_module(module)


for _helper in ("passthrough", "hostile", "relay_double"):
    _register_helper(_helper)


@dataclass
class TrainerKey:
    key: object
    private: Path
    public: Path


@pytest.fixture
def trainer_key(tmp_path: Path) -> TrainerKey:
    key = generate_key()
    private = tmp_path / "trainer.key"
    public = save_keypair(key, private)
    return TrainerKey(key, private, public)


def fake_version(key, model: str, version: int, kind: str = "delta", *, pieces: int = 3, piece_size: int = 1000,
                 seed: int = 0) -> tuple[Manifest, bytes, list[bytes]]:
    """A signed manifest with random piece bytes: enough for store, relay and protocol tests. The delta
    and the full of one (seed, version) name the same weights (one weights hash per version)."""
    rng = __import__("random").Random(seed * 1000 + version * 2 + (kind == "full"))
    data = [rng.randbytes(piece_size) for _ in range(pieces)]
    manifest = Manifest(
        model_id=model, version=version, base_version=None if kind == "full" else version - 1, kind=kind,
        codec="test", base_hash=None if kind == "full" else "1" * 32,
        tensors=(TensorEntry("w", "U8", (1000,), digest(f"weights {seed} v{version}".encode())),),
        pieces=tuple(PieceEntry(len(d), piece_digest(d), (0,)) for d in data),
    )
    return manifest, manifest.signed(key), data


@dataclass
class GatewayProc:
    region: str
    url: str
    store: Path
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    extra_env: dict = field(default_factory=dict)
    ssl: ssl.SSLContext | None = None
    """How a health check speaks to an https:// gateway (its CA, and a client cert for mTLS)."""

    def launch(self) -> "GatewayProc":
        if self.proc is not None and self.proc.poll() is None:
            # A second process would be left running when the fixture kills the one it knows of.
            raise RuntimeError(f"gateway {self.args[1]} is already running (pid {self.proc.pid})")
        log = open(self.log_path, "ab")
        env = {**os.environ, "DELTAMESH_LOG": os.environ.get("DELTAMESH_LOG", "INFO"), **self.extra_env}
        self.proc = subprocess.Popen(DELTAMESH + ["gateway", *self.args], stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        log.close()
        return self

    def wait(self, timeout: float = 60.0) -> "GatewayProc":
        wait_healthy(self.url, timeout, self, context=self.ssl)
        return self

    def start(self, timeout: float = 60.0) -> "GatewayProc":
        return self.launch().wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
        if sig == signal.SIGKILL and self.proc is not None:
            self.proc.wait(10)

    def log_tail(self, n: int = 4000) -> str:
        return log_tail(self.log_path, n)


def wait_healthy(url: str, timeout: float, proc: GatewayProc | None = None,
                 context: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"gateway {url} exited with {proc.proc.returncode}:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1, context=context) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"gateway {url} not healthy after {timeout}s:\n{proc.log_tail() if proc else ''}")


@pytest.fixture
def spawn_gateway(tmp_path: Path, trainer_key: TrainerKey) -> Callable[..., GatewayProc]:
    """Start a real gateway process: spawn_gateway("A", upstreams=[origin.url], extra=["--keep-deltas", "5"]).

    With start=False the process is launched but not waited for, so several can boot at once. The
    gateway runs `--anonymous` unless `anonymous=False` (then `extra` names its tokens file or client
    CA). With `https`, its URL is https:// and `health` is how the health check connects.
    """
    started: list[GatewayProc] = []

    def spawn(region: str, *, upstreams: list[str] = (), port: int | None = None, store: Path | None = None,
              anonymous: bool = True, extra: list[str] = (), start: bool = True, args: list[str] | None = None,
              https: bool = False, health: ssl.SSLContext | None = None) -> GatewayProc:
        """`args`, when given, replace every default flag (then pass `port` and `store` to match them)."""
        port = port or free_port()
        url = f"{'https' if https else 'http'}://127.0.0.1:{port}"
        store = store or tmp_path / f"store-{region}"
        if args is not None:
            g = GatewayProc(region, url, store, list(args), tmp_path / f"gateway-{region}.log", ssl=health)
            started.append(g)
            return g.start() if start else g.launch()
        args = ["--region", region, "--listen", f"127.0.0.1:{port}", "--store", str(store),
                "--trusted-key", str(trainer_key.public), "--advertise", url,
                "--stall-timeout-s", "3", "--piece-wait-s", "1.5", "--probe-interval-s", "0.5",
                "--heartbeat-timeout-s", "3"]
        for u in upstreams:
            args += ["--upstream", u]
        if anonymous:
            args.append("--anonymous")
        g = GatewayProc(region, url, store, args + list(extra), tmp_path / f"gateway-{region}.log", ssl=health)
        started.append(g)
        return g.start() if start else g.launch()

    yield spawn
    for g in started:
        g.kill()


@dataclass
class PoolProc:
    name: str
    dir: Path
    args: list[str]
    log_path: Path
    token: str = ""
    """Given by the environment ($DELTAMESH_TOKEN): a token never goes on a command line."""
    proc: subprocess.Popen | None = None

    def start(self) -> "PoolProc":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(DELTAMESH + ["pool", "sync", *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "DELTAMESH_TOKEN": self.token})
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            end_process(self.proc, sig)

    def log_tail(self, n: int = 3000) -> str:
        return log_tail(self.log_path, n)


@pytest.fixture
def spawn_pool(tmp_path: Path, trainer_key: TrainerKey) -> Callable[..., PoolProc]:
    """Start a real `deltamesh pool sync` process following `gateways` (preferred first)."""
    started: list[PoolProc] = []

    def spawn(name: str, gateways: list[str], *, token: str = POOL_TOKEN, extra: list[str] = ()) -> PoolProc:
        directory = tmp_path / "pools" / name
        args = ["--name", name, "--dir", str(directory), "--trusted-key", str(trainer_key.public),
                "--heartbeat-s", "0.5", "--stall-timeout-s", "3", *extra]
        for g in gateways:
            args += ["--gateway", g]
        pool = PoolProc(name, directory, args, tmp_path / f"pool-{name}.log", token)
        started.append(pool)
        return pool.start()

    yield spawn
    for pool in started:
        pool.stop(signal.SIGKILL)


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig) -> AsyncIterator[str]:
    """A gateway in this process on a real loopback socket (TLS as its config says); yields its base URL."""
    async with serving(create_app(config), "127.0.0.1:0", ssl_context=ssl_context(config)) as url:
        yield url


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few small bf16 tensors (and one int tensor), like a miniature model."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(64, dtype=torch.bfloat16),
        "step": torch.zeros(1, dtype=torch.int64),
    }


def next_step(weights: dict[str, torch.Tensor], step: int, changed: float = 0.02) -> dict[str, torch.Tensor]:
    """The weights after one 'RL step': a few percent of bf16 words move by one ulp."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, t in weights.items():
        t = t.clone()
        if t.dtype == torch.bfloat16:
            words = t.view(torch.int16).reshape(-1)
            mask = torch.rand(words.numel(), generator=g) < changed
            words[mask] += 1
        else:
            t += 1
        out[name] = t
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
               and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@dataclass(frozen=True)
class GatewayTestKit:
    """The helpers above, handed to test modules as one fixture (test modules cannot import conftest)."""

    key: TrainerKey
    free_port: Callable[[], int] = free_port
    running_gateway: Callable = running_gateway
    get_json: Callable = get_json
    wait_until: Callable = wait_until
    wait_healthy: Callable = wait_healthy
    tiny_weights: Callable = tiny_weights
    next_step: Callable = next_step
    same_bits: Callable = same_bits

    def version(self, model: str, version: int, kind: str = "delta", **kw) -> tuple[Manifest, bytes, list[bytes]]:
        return fake_version(self.key.key, model, version, kind, **kw)

    async def timed_sync(self, config: PoolSyncConfig, weights: dict[str, torch.Tensor]) -> float:
        """Sync a pool once to the head, which must bring its directory to `weights` bit for bit; the
        seconds that took."""
        async with WeightSync(config) as sync:
            started = time.monotonic()
            assert await sync.sync_once() is True
            took = time.monotonic() - started
            assert same_bits(read_weights(sync.config.dir), weights)
        return took

    def config(self, tmp: Path, **kw) -> GatewayConfig:
        """A gateway's config for an in-process gateway: anonymous unless it names a tokens file or client CA."""
        kw.setdefault("store", str(tmp / "store"))
        kw.setdefault("trusted_keys", [str(self.key.public)])
        tls = kw.get("tls")
        kw.setdefault("anonymous", not kw.get("tokens_file") and not (tls is not None and tls.client_ca))
        kw.setdefault("piece_wait_s", 1.0)
        kw.setdefault("probe_interval_s", 0.5)
        return GatewayConfig(**kw)


@pytest.fixture
def kit(trainer_key: TrainerKey) -> GatewayTestKit:
    return GatewayTestKit(trainer_key)
