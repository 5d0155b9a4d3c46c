"""`deltamesh pool run` with credentials that are refused ends as `pool sync` does (docs/CLI.md): exit code
4, one line on stderr, and nothing downloaded or started. Real processes: a gateway and a broker that
authenticate from one tokens file, and the pool with a token that is wrong (401), another pool's
(403, found when it registers), or right at the gateway and wrong at the broker. The pool's model
directory does not exist, so an engine that started would end it with another code and line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from common import wait_healthy

from deltamesh.mesh.cli.exits import Exit
from deltamesh.mesh.demo.processes import end_process, free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def pool_run(deltamesh, tmp_path):
    """`pool_run(gateway, token, *flags, broker=URL)`: a `deltamesh pool run` process run to its end, and
    the directory it would sync into."""
    def run(gw, token: str, *extra: str, broker: str = "http://127.0.0.1:9",
            broker_token: str = "") -> tuple[subprocess.CompletedProcess, Path]:
        pool_dir = tmp_path / "pool-p1"
        tokens = {"DELTAMESH_TOKEN": token, **({"DELTAMESH_BROKER_TOKEN": broker_token} if broker_token else {})}
        done = deltamesh("pool", "run", "--name", "p1", "--gateway", gw.url, "--trusted-key",
                         str(gw.public_key), "--dir", str(pool_dir), "--model", str(tmp_path / "no-model-here"),
                         "--broker", broker, *extra, env=tokens)
        return done, pool_dir
    return run


def refused_in_one_line(done: subprocess.CompletedProcess, *text: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == Exit.REFUSED, (done.returncode, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(t in lines[0] for t in text), done.stderr


def nothing_fetched(pool_dir) -> bool:
    return not pool_dir.exists() or not any(pool_dir.rglob("*.safetensors"))


def test_a_refused_pool_token_exits_4_before_anything_is_downloaded(published_gateway, pool_run):
    gw = published_gateway
    # A wrong token: 401 on the pool's first request (it asks the gateway for its region and model).
    done, pool_dir = pool_run(gw, "dm_" + "x" * 43)
    refused_in_one_line(done, "refused its credentials", "401")
    assert nothing_fetched(pool_dir)
    # Another pool's token, with the region and model given: 403 when the pool registers, still before
    # an engine starts or a byte of weights moves.
    done, pool_dir = pool_run(gw, gw.tokens["p2"], "--region", "eu", "--model-id", gw.model)
    refused_in_one_line(done, "refused its credentials", "403")
    assert nothing_fetched(pool_dir) and gw.served_bytes() == 0


def test_a_refused_broker_token_exits_4_before_anything_is_downloaded(published_gateway, pool_run, tmp_path):
    gw = published_gateway
    port = free_port()
    with open(tmp_path / "broker.log", "ab") as log:
        broker = subprocess.Popen([gw.command, "broker", "--listen", f"127.0.0.1:{port}", "--db",
                                   str(tmp_path / "broker.db"), "--model", gw.model, "--tokens-file", str(gw.tokens_file)],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, broker, timeout=60)
        done, pool_dir = pool_run(gw, gw.tokens["p1"], "--region", "eu", "--model-id", gw.model, broker=url,
                                  broker_token="dm_" + "y" * 43)
        refused_in_one_line(done, "the broker refused its credentials", "401")
        assert nothing_fetched(pool_dir) and gw.served_bytes() == 0
    finally:
        end_process(broker)
