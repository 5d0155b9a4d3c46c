"""Fixtures of the console tests: a mini-mesh of real processes on loopback (an origin gateway, a relay
region, a broker, two `deltamesh pool sync` pools with status servers, all authenticating from one
tokens file) that a test publishes versions to, and a `deltamesh console` process reading it with
admin tokens. Every process started here is ended by the fixture, whatever the test did."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.mesh.demo.processes import end_process, free_port, log_tail
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.publisher import Publisher

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
MODEL = "policy"


def weights_at(step: int) -> dict[str, torch.Tensor]:
    """A small model's bf16 weights after `step` steps, each moving a few words by one ulp."""
    g = torch.Generator().manual_seed(7)
    weights = {"layer.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16)}
    for s in range(1, step + 1):
        words = weights["layer.weight"].view(torch.int16).reshape(-1)
        mask = torch.rand(words.numel(), generator=torch.Generator().manual_seed(s)) < 0.02
        words[mask] += 1
    return weights


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log: Path
    url: str = ""

    def stop(self) -> None:
        end_process(self.proc)

    def tail(self) -> str:
        return log_tail(self.log, 4000)


@dataclass
class MiniMesh:
    """The running mesh: `processes` by name (origin, relay, broker, pool-us, pool-eu, console)."""

    tmp: Path
    tokens: dict[str, str]
    key: Any
    public: Path
    processes: dict[str, Process] = field(default_factory=dict)
    published: int = -1
    publisher: Publisher | None = None

    @staticmethod
    def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        return wait_for(predicate, timeout, what)

    def url(self, name: str) -> str:
        return self.processes[name].url

    def start(self, name: str, args: list[str], url: str = "", health: str = "/healthz") -> Process:
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([DELTAMESH, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = p = Process(name, proc, log, url)
        if url:
            wait_answering(p, health)
        return p

    def publish(self) -> int:
        """Publish the next version at the origin (v0 a full snapshot, then deltas)."""
        if self.publisher is None:
            self.publisher = Publisher(self.url("origin"), self.key, MODEL, token=self.tokens["trainer"], full_every=0)
        self.published += 1
        asyncio.run(self.publisher.publish(weights_at(self.published)))
        return self.published

    def snapshot(self, console: str = "console", token: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"{self.url(console)}/api/snapshot", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.loads(resp.read())

    def write_token(self, name: str) -> Path:
        path = self.tmp / f"{name}.token"
        path.write_text(self.tokens[name] + "\n")
        path.chmod(0o600)
        return path

    def start_console(self, *extra: str, name: str = "console", token: str = "admin", scheme: str = "http") -> Process:
        """`deltamesh console` on this mesh with `token` at the gateways and the broker (admin by default)."""
        port = free_port()
        return self.start(name, ["console", "--listen", f"127.0.0.1:{port}", "--gateway", self.url("origin"),
                                 "--gateway", self.url("relay"), "--token-file", str(self.write_token(token)),
                                 "--broker", self.url("broker"), "--broker-token-file", str(self.write_token(token)),
                                 "--poll-s", "0.3", "--stale-after-s", "3", *extra],
                          url=f"{scheme}://127.0.0.1:{port}" if scheme == "http" else "")


def wait_answering(p: Process, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")
        try:
            with urllib.request.urlopen(p.url + path, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{p.name} did not answer in {timeout} s:\n{p.tail()}")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, KeyError, ValueError) as e:  # not up yet, or not that far
            last = e
        else:
            if value:
                return value
            last = value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def mini_mesh(tmp_path_factory: pytest.TempPathFactory) -> MiniMesh:
    """One per test module: origin `us` and relay `eu` gateways, a broker, and pools `pool-us`, `pool-eu` (each on its region's
    gateway, with a status server as its endpoint), v0 published and synced; the console not started."""
    tmp_path = tmp_path_factory.mktemp("mesh")
    tokens_file = tmp_path / "tokens.toml"
    specs = {"trainer": TokenSpec("policy-trainer", "trainer", [MODEL]), "admin": TokenSpec("ops", "admin"),
             "metrics": TokenSpec("prometheus", "metrics"), "eu": TokenSpec("eu", "gateway"),
             "pool-us": TokenSpec("pool-us", "pool"), "pool-eu": TokenSpec("pool-eu", "pool")}
    tokens = {name: add_token(tokens_file, spec) for name, spec in specs.items()}
    key = generate_key()
    public = Path(save_keypair(key, tmp_path / "trainer.key"))
    mesh = MiniMesh(tmp_path, tokens, key, public)
    try:
        common = ["--trusted-key", str(public), "--tokens-file", str(tokens_file), "--probe-interval-s", "0.3",
                  "--heartbeat-timeout-s", "3", "--stall-timeout-s", "3", "--piece-wait-s", "1.5"]
        for region, upstream in (("us", None), ("eu", "origin")):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = ["gateway", "--region", region, "--listen", f"127.0.0.1:{port}", "--advertise", url,
                    "--store", str(tmp_path / f"store-{region}"), *common]
            if upstream:
                args += ["--upstream", mesh.url(upstream), "--upstream-token-file", str(mesh.write_token("eu"))]
            mesh.start("origin" if upstream is None else "relay", args, url)
        port = free_port()
        mesh.start("broker", ["broker", "--listen", f"127.0.0.1:{port}", "--db", str(tmp_path / "broker.db"),
                              "--model", MODEL, "--tokens-file", str(tokens_file)], f"http://127.0.0.1:{port}")
        mesh.publish()
        for name, gateway in (("pool-us", "origin"), ("pool-eu", "relay")):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            mesh.start(name, ["pool", "sync", "--gateway", mesh.url(gateway), "--token-file",
                              str(mesh.write_token(name)), "--name", name, "--dir", str(tmp_path / name),
                              "--trusted-key", str(public), "--heartbeat-s", "0.3", "--model", MODEL,
                              "--metrics-listen", f"127.0.0.1:{port}", "--endpoint", url], url)
        yield mesh
    finally:
        for p in reversed(list(mesh.processes.values())):
            p.stop()
