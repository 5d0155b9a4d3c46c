"""Fixtures of the rollout pool tests: a trainer key, a tiny model, versions of its weights, gateways
in-process, and real `deltamesh` service processes (broker, gateways, pools) on loopback ports.

Every process started here is killed by the fixture's finalizer, whatever the test did. Helpers are
handed to test modules as one `PoolKit` fixture (test modules cannot import a conftest).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from deltamesh.delta import generate_key, read_weights, save_keypair
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.app import create_app
from deltamesh.http import serving
from deltamesh.mesh.broker.config import BrokerConfig, PoliciesConfig, TasksConfig
from deltamesh.mesh.broker.server import build_app
from deltamesh.mesh.demo.models import TinyModelConfig, tiny_model_dir
from deltamesh.mesh.demo.processes import end_process, free_port, log_tail

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
MODEL = "tiny"
TOKEN = "pool-token"
STOPPED = (0, 130, 143, -signal.SIGKILL, -signal.SIGTERM)
"""Exit statuses of a service that was stopped, not one that failed: done, stopped cleanly by SIGINT or
SIGTERM (128 + the signal: docs/CLI.md), or killed."""


def _register_helper(name: str) -> None:
    """Make this folder's helper module `name`.py importable as `deltamesh_pool_test_NAME` (tests are
    imported by path, so their folder is not a package); conftest.py is imported before the tests."""
    spec = importlib.util.spec_from_file_location(f"deltamesh_pool_test_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_register_helper("weights_kit")


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 10.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2,
               procs: tuple["Service", ...] = ()) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            p.check_alive()
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    tails = "\n".join(f"--- {p.name} ---\n{p.log_tail()}" for p in procs)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


@dataclass
class Service:
    """A real `deltamesh ...` process with its log file."""

    name: str
    args: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None
    health: str = "/healthz"
    env: dict[str, str] = field(default_factory=dict)
    """Set for this process only: its tokens go here, never on its command line."""

    def start(self) -> "Service":
        env = {**os.environ, "DELTAMESH_LOG": os.environ.get("DELTAMESH_LOG", "INFO"), **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([DELTAMESH, *self.args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None and self.proc.returncode not in STOPPED:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def wait_healthy(self, timeout: float = 90.0) -> "Service":
        def healthy() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                    return r.status == 200
            except (OSError, urllib.error.URLError):
                return False

        wait_until(healthy, timeout, f"{self.name} to answer {self.health}")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            end_process(self.proc, sig, grace_s=30)

    def status(self) -> dict:
        return get_json(self.url + "/v1/status")

    def log_tail(self, n: int = 4000) -> str:
        return log_tail(self.log_path, n)


@dataclass
class PoolKit:
    tmp: Path
    public_key: Path
    private_key: object
    model_dir: Path
    next_version: Callable[..., dict[str, torch.Tensor]]
    """The weights after one RL step (the root conftest's `rl_step`)."""
    started: list[Service] = field(default_factory=list)
    model: str = MODEL
    token: str = TOKEN
    get_json = staticmethod(get_json)
    post_json = staticmethod(post_json)
    wait_until = staticmethod(wait_until)
    free_port = staticmethod(free_port)

    def base_weights(self) -> dict[str, torch.Tensor]:
        return read_weights(self.model_dir)

    def _spawn(self, name: str, args: list[str], url: str, health: str = "/healthz",
               env: dict[str, str] | None = None) -> Service:
        service = Service(name, args, url, self.tmp / f"{name}.log", health=health, env=env or {})
        self.started.append(service)
        return service.start()

    def broker(self, *, tasks: list[dict], n_samples: int = 2, lease_timeout_s: float = 30.0,
               epochs: int = 1, max_buffered_groups: int | None = None, max_staleness: int | None = None) -> Service:
        dataset = self.tmp / "tasks.jsonl"
        dataset.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        config = self.tmp / "broker.toml"
        text = (f"[broker]\ndurability = \"process\"\n[broker.tasks]\nn_samples = {n_samples}\n"
                f"lease_timeout_s = {lease_timeout_s}\nepochs = {epochs}\n")
        if max_buffered_groups is not None:
            text += f"max_buffered_groups = {max_buffered_groups}\n"
        if max_staleness is not None:
            text += f"[broker.policies]\nmax_staleness = {max_staleness}\n"
        config.write_text(text)
        port = free_port()
        return self._spawn("broker", ["broker", "--anonymous", "--listen", f"127.0.0.1:{port}", "--db", str(self.tmp / "broker.db"),
                                      "--config", str(config), "--model", MODEL, "--dataset", str(dataset)],
                           f"http://127.0.0.1:{port}", health="/v1/status")

    def gateway(self, region: str, *, upstream: str | None = None) -> Service:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = ["gateway", "--region", region, "--listen", f"127.0.0.1:{port}", "--store", str(self.tmp / f"store-{region}"),
                "--trusted-key", str(self.public_key), "--anonymous", "--advertise", url,
                "--stall-timeout-s", "3", "--piece-wait-s", "1.5", "--heartbeat-timeout-s", "5"]
        if upstream:
            args += ["--upstream", upstream]
        return self._spawn(f"gateway-{region}", args, url)

    def pool(self, name: str, gateway: str, broker: str, *extra: str, max_new_tokens: int = 4) -> Service:
        port = free_port()
        args = ["pool", "run", "--gateway", gateway, "--broker", broker, "--name", name,
                "--model", str(self.model_dir), "--dir", str(self.tmp / "weights" / name),
                "--trusted-key", str(self.public_key), "--listen", f"127.0.0.1:{port}", "--threads", "1",
                "--sampling.max-new-tokens", str(max_new_tokens), "--sync.heartbeat-s", "0.5",
                "--sync.stall-timeout-s", "3", *extra]
        return self._spawn(name, args, f"http://127.0.0.1:{port}", env={"DELTAMESH_TOKEN": TOKEN})

    def broker_config(self, tasks: list[dict], *, models: tuple[str, ...] = (MODEL,), n_samples: int = 2,
                      epochs: int = 1) -> BrokerConfig:
        """An in-process broker's settings, serving `tasks` (written as its JSONL dataset)."""
        dataset = self.tmp / "tasks.jsonl"
        dataset.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        # No trainer reports a version to this broker: its pools serve versions published straight to
        # the gateway, so claims a few versions ahead of "v0" are taken.
        return BrokerConfig(models=list(models), durability="process",
                            tasks=TasksConfig(dataset=str(dataset), n_samples=n_samples, epochs=epochs),
                            policies=PoliciesConfig(max_version_ahead=8))

    def gateway_config(self, **kw) -> GatewayConfig:
        kw.setdefault("store", str(self.tmp / "store"))
        kw.setdefault("trusted_keys", [str(self.public_key)])
        kw.setdefault("anonymous", True)
        kw.setdefault("piece_wait_s", 1.0)
        kw.setdefault("probe_interval_s", 0.5)
        return GatewayConfig(**kw)

    @staticmethod
    def running_gateway(config: GatewayConfig):
        """A gateway in this process on a real loopback socket: `async with ... as url`."""
        return serving(create_app(config), "127.0.0.1:0")

    @staticmethod
    def running_broker(config: BrokerConfig, db: Path):
        """A broker in this process on a real loopback socket: `async with ... as url`."""
        return serving(build_app(dataclasses.replace(config, anonymous=True), db), "127.0.0.1:0")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(TinyModelConfig(seed=5), path=tmp_path_factory.mktemp("pool-model") / "tiny")


@pytest.fixture
def kit(tmp_path: Path, tiny_dir: Path, rl_step) -> PoolKit:
    key = generate_key()
    public = save_keypair(key, tmp_path / "trainer.key")
    k = PoolKit(tmp_path, public, key, tiny_dir, rl_step)
    yield k
    for service in reversed(k.started):
        service.kill()
