"""How a gateway and its clients are told who they are: a gateway with no way to check callers refuses to
start, an old config with the plain `pool_tokens` list fails naming what replaced it, tokens never
travel in clear text to a host that is not loopback, and the CLI clients carry their tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.config import ConfigError, load_config
from deltamesh.delta import write_weights
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.app import create_app
from deltamesh.gateway_client import GatewayClient
from deltamesh.tls import TlsError, TlsSettings
from deltamesh.tokens import TokenError, TokenSpec, add_token
from deltamesh.trainer.publish_config import PublishConfig
from deltamesh.trainer.publisher import Publisher

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
FAR = "http://10.11.12.13:8700"
"""Plain http to a host that is not loopback: no token goes there unless `insecure`."""


def _run(*args: str, timeout: float = 60, token: str = "") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAMESH_")}
    env = {**clean, "COLUMNS": "200", **({"DELTAMESH_TOKEN": token} if token else {})}  # never on argv
    return subprocess.run([DELTAMESH, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_a_gateway_without_credentials_refuses_to_start(kit, tmp_path):
    base = {"store": str(tmp_path / "store"), "trusted_keys": [str(kit.key.public)]}
    with pytest.raises(ValueError, match="needs a tokens file"):
        create_app(GatewayConfig(**base))
    create_app(GatewayConfig(**base, anonymous=True))
    with pytest.raises(ValueError, match="exclude each other"):
        GatewayConfig(**base, anonymous=True, tokens_file=str(tmp_path / "t.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text('[[token]]\nname = "p1"\nrole = "wizard"\nsha256 = "00"\n')
    with pytest.raises(TokenError, match="wizard"):
        create_app(GatewayConfig(**base, tokens_file=str(bad)))
    with pytest.raises(TokenError):
        create_app(GatewayConfig(**base, tokens_file=str(tmp_path / "missing.toml")))

    refused = _run("gateway", "--trusted-key", str(kit.key.public), "--store", str(tmp_path / "s"),
                   "--listen", "127.0.0.1:0")
    assert refused.returncode == 2 and "needs a tokens file" in refused.stderr
    old = tmp_path / "old.toml"
    old.write_text(f'[gateway]\ntrusted_keys = ["{kit.key.public}"]\npool_tokens = ["region-token"]\n')
    with pytest.raises(ConfigError, match="`gateway.pool_tokens` was removed: use `gateway.tokens_file`"):
        load_config(GatewayConfig, old, section="gateway")
    refused = _run("gateway", "--config", str(old))
    assert refused.returncode == 2 and "`gateway.pool_tokens` was removed" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    refused = _run("gateway", "--anonymous", "--trusted-key", str(kit.key.public), "--pool-token", "x")
    assert refused.returncode == 2 and "--pool-token" in refused.stderr


def test_tokens_never_travel_in_clear_text(kit, tmp_path):
    with pytest.raises(TlsError, match="refusing to send a token over plain http"):
        GatewayClient(FAR, None, token="dm_x")
    GatewayClient(FAR, None, token="dm_x", insecure=True)
    GatewayClient("https://10.11.12.13:8700", None, token="dm_x")
    GatewayClient("http://127.0.0.1:8700", None, token="dm_x")
    GatewayClient(FAR, None)  # no token, nothing to protect
    with pytest.raises(TlsError):
        Publisher(FAR, kit.key.key, "m", token="dm_x")
    Publisher(FAR, kit.key.key, "m", token="dm_x", tls=TlsSettings(insecure=True))

    keys = [str(kit.key.public)]
    with pytest.raises(ValueError, match="refusing to send a token"):
        GatewayConfig(trusted_keys=keys, upstreams=[FAR], upstream_token="dm_x", anonymous=True)
    GatewayConfig(trusted_keys=keys, upstreams=[FAR], upstream_token="dm_x", anonymous=True,
                  tls=TlsSettings(insecure=True))
    with pytest.raises(ValueError, match="refusing to send a token"):
        PublishConfig(gateway=FAR, model="m", key="k", token="dm_x")
    refused = _run("pools", "--gateway", FAR, token="dm_x")
    assert refused.returncode == 2 and "refusing to send a token over plain http://" in refused.stderr


@pytest.mark.slow
def test_cli_clients_carry_their_tokens(kit, spawn_gateway, tmp_path):
    tokens = tmp_path / "tokens.toml"
    trainer = add_token(tokens, TokenSpec("t", "trainer", ["cli-m"]))
    admin = add_token(tokens, TokenSpec("ops", "admin"))
    pool = add_token(tokens, TokenSpec("p1", "pool"))
    gw = spawn_gateway("eu-1", anonymous=False, extra=["--tokens-file", str(tokens)])
    src = tmp_path / "weights"
    write_weights(src, kit.tiny_weights())
    common = ["--gateway", gw.url, "--model", "cli-m", "--key", str(kit.key.private), "--state", str(tmp_path / "st"),
              "--piece-mib", "0.01", str(src)]
    refused = _run("publish", *common)
    assert refused.returncode == 4 and "401" in refused.stderr  # credentials refused (docs/CLI.md)
    published = _run("publish", *common, token=trainer)
    assert published.returncode == 0 and "published cli-m v0: full" in published.stdout, published.stderr

    listed = _run("pools", "--gateway", gw.url, "--json", token=admin)
    assert listed.returncode == 0 and json.loads(listed.stdout)["pools"] == []
    refused = _run("pools", "--gateway", gw.url, token=pool)
    assert refused.returncode == 4 and "403" in refused.stderr and "roles: admin" in refused.stderr
    links = _run("links", "--gateway", gw.url, "--json", token=admin)
    assert links.returncode == 0 and json.loads(links.stdout)["region"] == "eu-1"
    refused = _run("links", "--gateway", gw.url)
    assert refused.returncode == 4 and "401" in refused.stderr
