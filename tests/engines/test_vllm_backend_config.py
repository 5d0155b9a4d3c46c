"""The `deltamesh` vLLM backend's settings as a client of vLLM's RL API sends them (`init_info`, `update_info`),
and as the `[vllm_backend]` table of the file `$DELTAMESH_VLLM_BACKEND` names: what is accepted, and the
clear errors for what is not (no vLLM is started here)."""

from __future__ import annotations

import pytest

from deltamesh.config import ConfigError
from deltamesh.mesh.vllm_plugin.config import (
    CONFIG_ENV,
    config_from_env,
    parse_backend_config,
    parse_update_info,
)

BASE = {"gateway": "http://127.0.0.1:8701", "model": "policy", "trusted_key": "trainer.key.pub"}


def test_the_contract_keys_are_enough_and_one_url_or_several_are_taken():
    config = parse_backend_config(dict(BASE))
    assert config.gateway == ["http://127.0.0.1:8701"] and config.trusted_key == ["trainer.key.pub"]
    assert not config.follow and config.check and config.wait_s == 60.0
    several = parse_backend_config({**BASE, "gateway": ["http://a:8700/", "http://b:8700"],
                                    "trusted_key": ["k1.pub", "k2.pub"]})
    assert several.gateway == ["http://a:8700", "http://b:8700"] and several.trusted_key == ["k1.pub", "k2.pub"]


@pytest.mark.parametrize("info, error", [
    ({**BASE, "gatway": "x"}, "unknown keys ['gatway']"),
    ({k: v for k, v in BASE.items() if k != "model"}, "model"),
    ({**BASE, "gateway": "ftp://a"}, "gateway must be an http(s) URL"),
    ({**BASE, "gateway": []}, "at least one gateway"),
    ({**BASE, "follow": True}, "follow needs server"),
    ({**BASE, "wait_s": "soon"}, "wait_s"),
    ({**BASE, "metrics_listen": "nowhere"}, "HOST:PORT"),
])
def test_wrong_init_info_is_refused_naming_what_is_wrong(info, error):
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_backend_config(info)


def test_the_token_comes_from_its_file_or_the_environment_and_builds_the_pools_sync(tmp_path, monkeypatch):
    token = tmp_path / "pool.token"
    token.write_text("secret-token\n")
    token.chmod(0o600)
    config = parse_backend_config({**BASE, "token_file": str(token), "name": "eu-vllm-1"})
    sync = config.sync_config(str(tmp_path))
    assert sync.token == "secret-token" and sync.name == "eu-vllm-1" and sync.dir == str(tmp_path)
    assert sync.gateways == config.gateway and sync.trusted_keys == config.trusted_key and sync.model == "policy"
    monkeypatch.setenv("DELTAMESH_TOKEN", "from-env")
    assert parse_backend_config(dict(BASE)).sync_config(str(tmp_path)).token == "from-env"
    monkeypatch.delenv("DELTAMESH_TOKEN")
    with pytest.raises(ValueError, match="token is required"):
        parse_backend_config(dict(BASE)).sync_config(str(tmp_path))


def test_update_info_names_a_version_or_none():
    assert parse_update_info({}).version is None and parse_update_info({"version": 7}).version == 7
    for wrong in ({"version": -1}, {"version": True}, {"version": "7"}, {"versio": 7}):
        with pytest.raises(ConfigError):
            parse_update_info(wrong)


def test_a_file_named_by_the_environment_initialises_the_backend(tmp_path, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert config_from_env() is None  # without it, the backend waits for its init call
    path = tmp_path / "backend.toml"
    path.write_text('[vllm_backend]\ngateway = "http://127.0.0.1:8701"\nmodel = "policy"\n'
                    'trusted_key = "k.pub"\nfollow = true\nserver = "http://127.0.0.1:8000"\n')
    monkeypatch.setenv(CONFIG_ENV, str(path))
    config = config_from_env()
    assert config is not None and config.follow and config.server == "http://127.0.0.1:8000"
    path.write_text('[vllm_backend]\nmodel = "policy"\n')
    with pytest.raises(ConfigError, match=CONFIG_ENV):
        config_from_env()
