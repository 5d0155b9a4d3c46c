"""`deltamesh eval` as an operator starts it: an evaluator whose server could not tell its callers apart,
a config with a bad value, or a token given on its command line (where `ps` shows it), stops with exit
code 2 naming the reason, before it opens its results store, syncs any weights or binds its port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.mesh.demo.processes import free_port

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))


def deltamesh(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([DELTAMESH, *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "COLUMNS": "200"})


def config_text(kit, tmp_path: Path, port: int, extra: str = "") -> str:
    return (f'[eval]\nmodel_id = "{kit.model}"\nmodel_path = "{kit.model_dir}"\n'
            f'gateways = ["http://127.0.0.1:9"]\ntrusted_keys = ["{kit.public_key}"]\n'
            f'db = "{tmp_path / "eval.db"}"\ndir = "{tmp_path / "weights"}"\nlisten = "127.0.0.1:{port}"\n{extra}')


def bound(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("extra, reason", [
    ("", "tokens file"),
    ('anonymous = true\ntokens_file = "tokens.toml"\n', "exclude each other"),
    ('anonymous = true\n[eval.heldout]\nlevels = [9]\n', "heldout.levels"),
    ('anonymous = true\nsamples = 0\n', "samples"),
])
def test_an_evaluator_refused_at_start_opens_nothing_and_says_why(kit, tmp_path, extra, reason):
    port = free_port()
    config = tmp_path / "eval.toml"
    config.write_text(config_text(kit, tmp_path, port, extra))
    # The gateway token goes in the environment, never on the command line.
    run = deltamesh("eval", "--config", str(config), env={"DELTAMESH_TOKEN": kit.token})
    assert run.returncode == 2, run.stderr
    assert reason in run.stderr
    assert not (tmp_path / "eval.db").exists() and not (tmp_path / "weights").exists()
    assert not bound(port)


def test_a_token_on_the_evaluators_command_line_is_refused_and_never_echoed(kit, tmp_path):
    port = free_port()
    config = tmp_path / "eval.toml"
    config.write_text(config_text(kit, tmp_path, port, "anonymous = true\n"))
    run = deltamesh("eval", "--config", str(config), "--token", "dm_secret_on_the_line", env={})
    assert run.returncode == 2 and "--token-file PATH" in run.stderr and "dm_secret_on_the_line" not in run.stderr
    assert not (tmp_path / "eval.db").exists() and not (tmp_path / "weights").exists() and not bound(port)
    shown = deltamesh("eval", "--help", env={}).stdout
    assert "--token-file" in shown and "--token " not in shown
