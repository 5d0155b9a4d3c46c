"""The command line: a gateway from a TOML config, `publish` (full then delta), `pool sync --once`,
`pools` and `links`, each as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.delta import dir_manifest, read_weights, write_weights

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
pytestmark = pytest.mark.slow


def _run(*args: str, timeout: float = 60, token: str = "") -> subprocess.CompletedProcess:
    # A wide terminal, so that rich does not wrap the tables' cells; a token by the environment, never argv.
    env = {**os.environ, "COLUMNS": "200", **({"DELTAMESH_TOKEN": token} if token else {})}
    return subprocess.run([DELTAMESH, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_gateway_config_publish_sync_and_tables(kit, spawn_gateway, tmp_path):
    port = kit.free_port()
    config = tmp_path / "gw.toml"
    config.write_text(
        "[gateway]\n"
        f'region = "eu-1"\nlisten = "127.0.0.1:{port}"\nstore = "{tmp_path / "store"}"\n'
        f'trusted_keys = ["{kit.key.public}"]\nanonymous = true\nkeep_deltas = 4\n'
    )
    bad = tmp_path / "bad.toml"
    bad.write_text('[gateway]\nregion = "x"\nkeep_deltaz = 4\n')
    refused = _run("gateway", "--config", str(bad))
    assert refused.returncode == 2 and "keep_deltaz" in refused.stderr

    gw = spawn_gateway("eu-1", port=port, store=tmp_path / "store", args=["--config", str(config)])
    assert kit.get_json(f"{gw.url}/healthz")["region"] == "eu-1"

    w0 = kit.tiny_weights()
    w1 = kit.next_step(w0, 1)
    src = tmp_path / "weights"
    state = tmp_path / "publish-state"
    common = ["--gateway", gw.url, "--model", "cli-m", "--key", str(kit.key.private), "--state", str(state),
              "--piece-mib", "0.01", str(src)]
    write_weights(src, w0)
    first = _run("publish", *common)
    assert first.returncode == 0, first.stderr
    assert "published cli-m v0: full" in first.stdout
    write_weights(src, w1)
    second = _run("publish", *common)
    assert second.returncode == 0, second.stderr
    assert "published cli-m v1: delta" in second.stdout
    versions = kit.get_json(f"{gw.url}/v1/models/cli-m/versions")["versions"]
    assert [(v["version"], v["kind"]) for v in versions] == [(0, "full"), (1, "delta")]

    pool_dir = tmp_path / "pool"
    sync = _run("pool", "sync", "--gateway", gw.url, "--name", "cli-pool",
                "--dir", str(pool_dir), "--trusted-key", str(kit.key.public), "--once", token="cli-token")
    assert sync.returncode == 0, sync.stderr
    assert sync.stdout.strip() == "cli-m v1"
    assert dir_manifest(pool_dir).version == 1 and kit.same_bits(read_weights(pool_dir), w1)

    wrong_key = tmp_path / "other.pub"
    from deltamesh.delta import generate_key, save_keypair

    save_keypair(generate_key(), tmp_path / "other", wrong_key)
    refused = _run("pool", "sync", "--gateway", gw.url, "--name", "p2",
                   "--dir", str(tmp_path / "p2"), "--trusted-key", str(wrong_key), "--once", token="cli-token")
    # Its gateway's head statement is the first thing signed by a key it does not trust: refused.
    assert refused.returncode == 1 and "which is not trusted" in refused.stderr
    assert dir_manifest(tmp_path / "p2") is None

    pools = _run("pools", "--gateway", gw.url, "--json")
    assert pools.returncode == 0
    listed = json.loads(pools.stdout)["pools"]
    assert [(p["name"], p["version"], p["versions_behind"]) for p in listed] == [("cli-pool", 1, 0)]
    table = _run("pools", "--gateway", gw.url)
    assert table.returncode == 0 and "cli-pool" in table.stdout
    table = _run("links", "--gateway", gw.url)
    assert table.returncode == 0 and "links of region eu-1" in table.stdout and "cli-pool" in table.stdout
    down = _run("links", "--gateway", f"http://127.0.0.1:{kit.free_port()}")
    assert down.returncode == 3 and "cannot read links" in down.stderr  # unreachable (docs/CLI.md)
