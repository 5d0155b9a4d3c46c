"""The config files of examples/ as their commands read them. Each loads with the project's config
loader into its process's typed config and passes its checks, in a folder holding what the files name
(README.md's trainer key, CA, certificates and tokens); together they describe one mesh (the relay
follows the origin, the pool its region's relay and the broker); no secret is written in them; and
every README.md command that names one parses with the derived flags and loads as the command loads
it. tests/test_readme.py runs the README's gateways and broker from these files."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from deltamesh.certs import issue, make_ca
from deltamesh.config import load_config
from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.gateway.config import GatewayConfig
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.cli import build_parser, command_config, pool_run
from deltamesh.mesh.pool.config import PoolConfig
from deltamesh.tokens import TokenSpec, add_token

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {"gateway-origin.toml": ("gateway", GatewayConfig), "gateway-relay.toml": ("gateway", GatewayConfig),
            "broker.toml": ("broker", BrokerConfig), "pool.toml": ("pool", PoolConfig)}
COMMANDS = {("gateway",): (GatewayConfig, "gateway", None), ("broker",): (BrokerConfig, "broker", None),
            ("pool", "run"): (PoolConfig, "pool", pool_run.overrides)}
"""The command that reads each kind of file: its config, table, and own overrides (as its `run` loads it)."""


@pytest.fixture
def mesh_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The README's scratch folder after its first lines (keys, CA, certificates, tokens), with a copy of
    examples/, as the working directory: the examples' relative paths are taken from there."""
    save_keypair(generate_key(), tmp_path / "trainer.key")
    ca = make_ca(tmp_path / "pki")
    for name in ("gateway/origin", "gateway/eu", "broker/main"):
        issue(ca, tmp_path / "pki", name, hosts=["127.0.0.1"])
    tokens = tmp_path / "tokens.toml"
    for file, spec in {"eu.token": TokenSpec("eu", "gateway"), "pool.token": TokenSpec("eu-1", "pool")}.items():
        (tmp_path / file).write_text(add_token(tokens, spec) + "\n")
        (tmp_path / file).chmod(0o600)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def load(folder: Path, name: str, **overrides: object):
    section, cls = EXAMPLES[name]
    return load_config(cls, folder / "examples" / name, section=section, overrides=overrides)


def test_every_example_is_tested_here():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.toml")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_loads_into_its_typed_config(mesh_folder: Path, name: str):
    # A pool's token is never written in its file (tests below): here it comes as its flag would.
    config = load(mesh_folder, name, **({"sync.token": "dm_from_a_flag"} if name == "pool.toml" else {}))
    assert isinstance(config, EXAMPLES[name][1])


def test_the_examples_describe_one_mesh_and_hold_no_secret(mesh_folder: Path):
    origin = load(mesh_folder, "gateway-origin.toml")
    relay = load(mesh_folder, "gateway-relay.toml")
    broker = load(mesh_folder, "broker.toml")
    pool = load(mesh_folder, "pool.toml", **{"sync.token": "dm_from_a_flag"})
    assert origin.is_origin and origin.tls.serves_tls and origin.tokens_file and not origin.anonymous
    assert relay.upstreams == [f"https://{origin.listen}"] and relay.tls.ca and relay.tokens_file
    assert broker.tls.serves_tls and broker.tokens_file and not broker.anonymous
    assert pool.sync.gateways == [f"https://{relay.listen}"] and pool.broker == f"https://{broker.listen}"
    assert [m.model_id for m in pool.models] == broker.models
    assert not relay.upstream_token and not pool.broker_token
    for path in (mesh_folder / "examples").glob("*.toml"):
        assert not re.search(r"^\s*\w*token\s*=", path.read_text(), flags=re.M), path  # secrets: flags or files


def readme_commands_naming_an_example() -> list[str]:
    """README.md's commands that take an examples/ file: its bash lines, and the one written in its text."""
    text = (ROOT / "README.md").read_text()
    lines = [line.split("#")[0].strip().removesuffix("&").strip()
             for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for line in block.splitlines()]
    inline = [" ".join(code.split()) for code in re.findall(r"`(deltamesh [^`]*)`", text)]
    return [c for c in lines + inline if c.startswith("deltamesh ") and "--config examples/" in c]


def test_the_readme_commands_naming_an_example_load_it_as_written(mesh_folder: Path):
    commands = readme_commands_naming_an_example()
    assert len(commands) >= 4 and any(" pool run " in c for c in commands), commands
    for command in commands:
        argv = shlex.split(command)[1:]
        (cls, section, overrides), = [v for k, v in COMMANDS.items() if tuple(argv[:len(k)]) == k]
        args = build_parser().parse_args(argv)
        config = command_config(args, cls, section, overrides=overrides)
        assert isinstance(config, cls), command
        if cls is PoolConfig:  # its tokens from the files the command names
            assert config.sync.token == config.broker_token == (mesh_folder / "pool.token").read_text().strip()
        if cls is GatewayConfig and config.upstreams:
            assert config.upstream_token == (mesh_folder / "eu.token").read_text().strip()
