"""Secrets never on the command line: every token setting takes `--X-file PATH` or an environment
variable (docs/CONFIG.md, "Secrets"), and its own flag (`--token T`) is refused with a message naming
those, checked on the derived flags and with real processes against a gateway that authenticates (an
admin token reading `deltamesh pools`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from common import wait_healthy

from deltamesh.config_flags import SECRET_ENV, config_overrides, settings
from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.gateway.config import GatewayConfig
from deltamesh.mesh.autoscale.config import AutoscaleConfig
from deltamesh.mesh.cli import build_parser
from deltamesh.mesh.cli.bench import BenchLinkConfig
from deltamesh.mesh.cli.links import LinksConfig
from deltamesh.mesh.cli.pools import PoolsConfig
from deltamesh.mesh.demo.processes import end_process, free_port
from deltamesh.mesh.eval.config import EvalConfig
from deltamesh.mesh.pool.config import PoolConfig
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.trainer.loop_config import TrainLoopConfig
from deltamesh.trainer.publish_config import PublishConfig

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
CONFIGS = (GatewayConfig, PoolSyncConfig, PublishConfig, PoolConfig, AutoscaleConfig, TrainLoopConfig, LinksConfig,
           PoolsConfig, BenchLinkConfig, EvalConfig)


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
    for given in (sync_args("--token", "dm_flag"), sync_args("--token", "dm_flag", "--token-file", str(secret))):
        with pytest.raises(ValueError) as refused:
            config_overrides(build_parser().parse_args(given), PoolSyncConfig, environ={})
        assert "--token would show the token to every user of this host (ps)" in str(refused.value)
        assert "--token-file PATH" in str(refused.value) and "$DELTAMESH_TOKEN" in str(refused.value)
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


def test_every_token_flag_on_the_command_line_is_refused_naming_its_file_flag():
    commands = {PoolSyncConfig: sync_args(), PoolConfig: ["pool", "run", "--model", "/m"], TrainLoopConfig: ["train"],
                GatewayConfig: ["gateway", "--upstream", "http://127.0.0.1:1"], EvalConfig: ["eval"]}
    refused = []
    for cls, argv in commands.items():
        for _, _, found in settings(cls):
            for s in found:
                if SECRET_ENV not in s.field.metadata or s.from_file:
                    continue
                for flag in s.flags:
                    with pytest.raises(ValueError) as e:
                        config_overrides(build_parser().parse_args([*argv, flag, "dm_secret"]), cls, environ={})
                    assert f"{s.flags[0]}-file PATH" in str(e.value) and "dm_secret" not in str(e.value), flag
                    refused.append(flag)
    assert {"--token", "--upstream-token", "--broker-token", "--gateway-token"} <= set(refused)


def test_a_command_given_a_token_flag_exits_2_with_one_line_and_never_shows_it_in_help():
    given = run("pools", "--gateway", "http://127.0.0.1:9", "--token", "dm_secret_on_the_line")
    assert given.returncode == 2, given
    assert given.stderr.strip().splitlines() == [given.stderr.strip()]
    assert "--token-file PATH" in given.stderr and "dm_secret_on_the_line" not in given.stderr
    for argv in (["pool", "sync"], ["pool", "run"], ["gateway"], ["train"], ["autoscale"], ["pools"], ["links"], ["eval"]):
        shown = run(*argv, "--help").stdout
        assert "-token-file" in shown and not any(
            word.rstrip(",") in ("--token", "--upstream-token", "--broker-token", "--gateway-token", "--sync.token")
            for word in shown.split()), argv


def test_no_token_flag_is_left_without_its_file_flag():
    # Every secret's own flag and file flag reach the same setting, in every config that has one.
    for cls in CONFIGS:
        for _, _, found in settings(cls):
            own = {s.path for s in found if SECRET_ENV in s.field.metadata and not s.from_file}
            files = {s.path for s in found if s.from_file}
            assert own == files, cls


ROOT = Path(__file__).resolve().parents[2]
TOKEN_FLAG = re.compile(r"(?<![\w-])--(?:sync\.)?(?:upstream-|broker-|gateway-)?token(?:=|\s+(?!-)\S)")


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every `deltamesh` command the docs show: lines of their code blocks, inline
    code that starts with `deltamesh `, and the deploy files' command lines."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            umask = "umask 077" in block
            for line in block.splitlines():
                if "deltamesh " in line:
                    found.append((f"{path.name} ({'umask 077' if umask else 'no umask'})", line))
        found += [(path.name, code) for code in re.findall(r"`(deltamesh [^`]+)`", text)]
    for path in sorted((ROOT / "deploy").rglob("*")):
        if path.is_file() and path.suffix in ("", ".service", ".yaml", ".yml", ".Dockerfile", ".toml"):
            found += [(path.name, line) for line in path.read_text().splitlines() if "deltamesh " in line]
    return found


def test_no_documented_command_gives_a_token_on_its_command_line():
    commands = documented_commands()
    assert len(commands) > 100 and any("tokens add" in c for _, c in commands)
    on_the_line = [(where, c) for where, c in commands if TOKEN_FLAG.search(c) or re.search(r"\bdm_[A-Za-z0-9_-]{8}", c)]
    assert on_the_line == []
    # A new token goes to a file only its owner reads: `--out FILE`, or a redirect under `umask 077`.
    readable = [(where, c) for where, c in commands
                if "tokens add" in c and ">" in c.split("#")[0] and "(umask 077)" not in where]
    assert readable == []
    assert TOKEN_FLAG.search("deltamesh pool sync --token T") and TOKEN_FLAG.search("x --upstream-token=abc")
    assert not TOKEN_FLAG.search("deltamesh pool sync --token-file pool.token")


def test_tokens_add_out_writes_a_file_only_its_owner_reads(tmp_path):
    out = tmp_path / "eu.token"
    done = run("tokens", "add", "--file", str(tmp_path / "tokens.toml"), "--name", "eu", "--role", "gateway",
               "--out", str(out))
    assert done.returncode == 0, done.stderr
    token = out.read_text().strip()
    assert token.startswith("dm_") and token not in done.stdout + done.stderr
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    again = run("tokens", "add", "--file", str(tmp_path / "tokens.toml"), "--name", "eu2", "--role", "gateway",
                "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and out.read_text().strip() == token
    listed = run("tokens", "list", "--file", str(tmp_path / "tokens.toml")).stdout
    assert "eu2" not in listed  # nothing added when the file could not take the token
