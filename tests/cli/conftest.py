"""Fixtures of the command-line tests: a real `deltamesh gateway` process that authenticates from a
tokens file, with one version of a model published to it, and a runner of `deltamesh` commands with
none of the caller's `DELTAMESH_*` settings. Every process started here is ended by the fixture."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from common import wait_healthy

from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.mesh.demo.processes import end_process, free_port, log_tail
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.publisher import Publisher

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
MODEL = "tiny"


def _deltamesh(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
               **options) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAMESH_")}
    return subprocess.run([DELTAMESH, *args], capture_output=True, text=True, timeout=timeout,
                          env={**clean, **(env or {})}, **options)


@pytest.fixture
def deltamesh():
    """`deltamesh(*args, timeout=120, env=None, **subprocess_options)`: run `deltamesh ARGS...` to its end,
    its output captured, without the caller's DELTAMESH_* settings (`env` adds some: a token goes there)."""
    return _deltamesh


@dataclass
class PublishedGateway:
    url: str
    public_key: Path
    tokens_file: Path
    tokens: dict[str, str]
    """name -> token: `trainer`, pools `p1` and `p2`, `admin`, `metrics`."""
    log: Path
    weights: dict[str, torch.Tensor]
    model: str = MODEL
    command: str = DELTAMESH
    """The `deltamesh` executable, for a test that starts another process of it."""

    def log_tail(self) -> str:
        return log_tail(self.log, 100_000)

    def served_bytes(self) -> float:
        """The piece bytes the gateway has served (`deltamesh_gateway_bytes_out_total`, read as Prometheus does)."""
        request = urllib.request.Request(f"{self.url}/metrics", headers={"Authorization": f"Bearer {self.tokens['metrics']}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("deltamesh_gateway_bytes_out_total"))


@pytest.fixture
def published_gateway(tmp_path: Path) -> PublishedGateway:
    """A gateway process on loopback with a tokens file, holding v0 of MODEL (2 MiB in 32 KiB pieces, so a
    transfer has many steps to report)."""
    tokens_file = tmp_path / "tokens.toml"
    tokens = {"trainer": add_token(tokens_file, TokenSpec("t", "trainer", [MODEL])),
              "p1": add_token(tokens_file, TokenSpec("p1", "pool")),
              "p2": add_token(tokens_file, TokenSpec("p2", "pool")),
              "admin": add_token(tokens_file, TokenSpec("ops", "admin")),
              "metrics": add_token(tokens_file, TokenSpec("prometheus", "metrics"))}
    key = generate_key()
    public = save_keypair(key, tmp_path / "trainer.key")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([DELTAMESH, "gateway", "--region", "eu", "--listen", f"127.0.0.1:{port}", "--store",
                                 str(tmp_path / "store"), "--trusted-key", str(public), "--tokens-file",
                                 str(tokens_file)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout=60)
        gen = torch.Generator().manual_seed(1)
        weights = {"layer.weight": torch.randn(1024, 1024, generator=gen).to(torch.bfloat16)}
        asyncio.run(Publisher(url, key, MODEL, piece_bytes=32 * 1024, token=tokens["trainer"]).publish(weights))
        yield PublishedGateway(url, public, tokens_file, tokens, log, weights)
    finally:
        end_process(proc)
