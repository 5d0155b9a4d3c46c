"""Secrets never required on the command line: every token setting also takes `--X-file PATH` and an
environment variable (docs/CONFIG.md, "Secrets"), checked on the derived flags and with real processes
against a gateway that authenticates (an admin token reading `deltamesh pools`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from common import wait_healthy

from deltamesh.config_flags import SECRET_ENV, config_overrides, settings
from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.gateway.config import GatewayConfig, PoolSyncConfig, PublishConfig
from deltamesh.mesh.autoscale.config import AutoscaleConfig
from deltamesh.mesh.cli import build_parser
from deltamesh.mesh.cli.bench import BenchLinkConfig
from deltamesh.mesh.cli.links import LinksConfig
from deltamesh.mesh.cli.pools import PoolsConfig
from deltamesh.mesh.demo.processes import end_process, free_port
from deltamesh.mesh.pool.config import PoolConfig
from deltamesh.trainer.loop_config import TrainLoopConfig

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
CONFIGS = (GatewayConfig, PoolSyncConfig, PublishConfig, PoolConfig, AutoscaleConfig, TrainLoopConfig, LinksConfig,
           PoolsConfig, BenchLinkConfig)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAMESH_")}
    return subprocess.run([DELTAMESH, *args], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def test_every_token_setting_is_a_secret():
    tokens = [(cls.__name__, s.path, s.field.metadata.get(SECRET_ENV)) for cls in CONFIGS
              for _, _, found in settings(cls) for s in found if s.field.name.endswith("token") and not s.from_file]
    assert len(tokens) >= 8 and all(env and env.startswith("DELTAMESH_") for _, _, env in tokens), tokens


def sync_args(*extra: str) -> list[str]:
    return ["pool", "sync", "--gateway", "http://127.0.0.1:9", "--name", "p", "--dir", "d", "--trusted-key", "k",
            *extra]


def test_a_token_comes_from_its_file_or_its_environment_variable(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("dm_from_file\n")
    secret.chmod(0o600)
    given = build_parser().parse_args(sync_args("--token-file", str(secret)))
    assert config_overrides(given, PoolSyncConfig, environ={"DELTAMESH_TOKEN": "dm_env"})["token"] == "dm_from_file"
    bare = build_parser().parse_args(sync_args())
    assert config_overrides(bare, PoolSyncConfig, environ={"DELTAMESH_TOKEN": "dm_env"})["token"] == "dm_env"
    assert "token" not in config_overrides(bare, PoolSyncConfig, environ={})
    flag = build_parser().parse_args(sync_args("--token", "dm_flag"))
    assert config_overrides(flag, PoolSyncConfig, environ={"DELTAMESH_TOKEN": "dm_env"})["token"] == "dm_flag"
    both = build_parser().parse_args(sync_args("--token", "dm_flag", "--token-file", str(secret)))
    with pytest.raises(ValueError, match="--token-file and --token exclude each other"):
        config_overrides(both, PoolSyncConfig, environ={})
    # A pool's settings: the nested section's secret and the broker's, each from its own variable.
    pool = build_parser().parse_args(["pool", "run", "--model", "/m", "--sync.token-file", str(secret)])
    out = config_overrides(pool, PoolConfig, environ={"DELTAMESH_BROKER_TOKEN": "dm_broker"})
    assert out["sync.token"] == "dm_from_file" and out["broker_token"] == "dm_broker"
    loop = build_parser().parse_args(["train", "--gateway-token-file", str(secret)])
    assert config_overrides(loop, TrainLoopConfig, environ={})["gateway_token"] == "dm_from_file"
    relay = build_parser().parse_args(["gateway", "--upstream", "http://127.0.0.1:1", "--upstream-token-file",
                                       str(secret)])
    assert config_overrides(relay, GatewayConfig, environ={})["upstream_token"] == "dm_from_file"


@pytest.fixture
def authenticating_gateway(tmp_path):
    """(URL, admin token) of a gateway process that authenticates from a tokens file."""
    tokens = tmp_path / "tokens.toml"
    added = run("tokens", "add", "--file", str(tokens), "--name", "ops", "--role", "admin")
    assert added.returncode == 0, added.stderr
    save_keypair(generate_key(), tmp_path / "trainer.key", tmp_path / "trainer.pub")
    port = free_port()
    proc = subprocess.Popen([DELTAMESH, "gateway", "--listen", f"127.0.0.1:{port}", "--store", str(tmp_path / "s"),
                             "--trusted-key", str(tmp_path / "trainer.pub"), "--tokens-file", str(tokens)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=30)
        yield url, added.stdout.strip()
    finally:
        end_process(proc)


def test_an_operator_passes_the_token_by_file_or_environment(authenticating_gateway, tmp_path):
    url, token = authenticating_gateway
    secret = tmp_path / "admin-token"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    assert run("pools", "--gateway", url, "--json", "--token-file", str(secret)).returncode == 0
    assert run("pools", "--gateway", url, "--json", env={"DELTAMESH_TOKEN": token}).returncode == 0
    refused = run("pools", "--gateway", url, "--json")
    assert refused.returncode != 0

    missing = run("pools", "--gateway", url, "--token-file", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [missing.stderr.strip()]
    assert f"--token-file {tmp_path / 'nope'}: cannot read it (No such file or directory)" in missing.stderr
    directory = run("pools", "--gateway", url, "--token-file", str(tmp_path))
    assert directory.returncode == 2 and "cannot read it (Is a directory)" in directory.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    blank = run("pools", "--gateway", url, "--token-file", str(empty))
    assert blank.returncode == 2 and "the file is empty" in blank.stderr
    shared = tmp_path / "shared-token"
    shared.write_text(token)
    shared.chmod(0o644)
    warned = run("pools", "--gateway", url, "--json", "--token-file", str(shared))
    assert warned.returncode == 0 and "others may read it" in warned.stderr


def test_no_token_flag_is_left_without_its_file_flag():
    # Every secret's own flag and file flag reach the same setting, in every config that has one.
    for cls in CONFIGS:
        for _, _, found in settings(cls):
            own = {s.path for s in found if SECRET_ENV in s.field.metadata and not s.from_file}
            files = {s.path for s in found if s.from_file}
            assert own == files, cls
