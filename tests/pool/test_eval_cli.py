"""`deltamesh eval` as an operator starts it: an evaluator whose server could not tell its callers apart,
or a config with a bad value, stops with exit code 2 naming the reason, before it opens its results
store, syncs any weights or binds its port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.mesh.demo.processes import free_port

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))


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
    run = subprocess.run([DELTAMESH, "eval", "--config", str(config)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DELTAMESH_TOKEN": kit.token, "COLUMNS": "200"})
    assert run.returncode == 2, run.stderr
    assert reason in run.stderr
    assert not (tmp_path / "eval.db").exists() and not (tmp_path / "weights").exists()
    assert not bound(port)
