"""The config loader: TOML + overrides into typed dataclasses, with clear errors; command-line flags
derived from the same dataclasses (names, types, help); files of an older layout naming what moved."""

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from deltamesh.config import ConfigError, load_config
from deltamesh.config_flags import add_config_flags, config_overrides, flag, flag_name
from deltamesh.config_moved import MOVED_KEYS, REMOVED_KEYS


@dataclass
class Inner:
    connections: int = 4
    cap_mbit: float | None = None


@dataclass
class Outer:
    region: str = "local"
    upstreams: list[str] = field(default_factory=list)
    relay: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        if self.relay.connections < 1:
            raise ValueError("relay.connections must be >= 1")


def refusal(tmp_path: Path, cls: type, text: str, section: str | None = None) -> str:
    """The message of the ConfigError with which loading a file holding `text` fails."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(cls, path, section=section)
    return str(e.value)


def test_defaults_without_file():
    assert load_config(Outer) == Outer()


def test_file_section_and_overrides(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text('[gw]\nregion = "eu"\nupstreams = ["http://a"]\n[gw.relay]\nconnections = 8\ncap_mbit = 100\n')
    cfg = load_config(Outer, p, section="gw", overrides={"region": "us", "relay.connections": 2, "upstreams": None})
    assert cfg.region == "us"
    assert cfg.upstreams == ["http://a"]
    assert cfg.relay == Inner(connections=2, cap_mbit=100.0)


@pytest.mark.parametrize(
    "text, needle",
    [
        ('regoin = "x"\n', "unknown keys"),
        ("region = 3\n", "expected str"),
        ("[relay]\nconnections = 0\n", "must be >= 1"),
        ("[relay]\nconnections = true\n", "got bool"),
        ("region = \n", "cannot read config"),
    ],
)
def test_bad_config_is_an_error(tmp_path: Path, text: str, needle: str):
    assert needle in refusal(tmp_path, Outer, text)


# --- flags derived from the dataclasses -------------------------------------------------------------


@dataclass
class Sync:
    """How the pool follows its gateways. Checked once."""

    gateways: list[str] = field(default_factory=list, metadata=flag("--gateway", metavar="URL"))
    """Gateway base URLs, preferred first."""
    stall_timeout_s: float = 20.0
    """Seconds of silence before an alternate is tried; 100% of them."""

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("gateways must list at least one gateway URL")


@dataclass
class Worker:
    max_episodes: int = 8
    """Episodes run at once."""
    roles: dict[str, str] = field(default_factory=dict, metadata=flag("--role", metavar="ROLE=MODEL_ID"))
    """Workflow role -> model_id."""
    options: dict[str, Any] = field(default_factory=dict)
    """The workflow's options."""


@dataclass
class Policy:
    model_id: str = ""


@dataclass
class Service:
    sync: Sync
    """The required section."""
    name: str = ""
    """Name of the service."""
    hot_swap: bool = True
    """Swap versions in place."""
    engine: Literal["transformers", "sglang"] = "transformers"
    """The engine."""
    seed: int | None = None
    """Sampling seed."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Two decay rates."""
    models: list[Policy] = field(default_factory=list)
    """Written in the file only."""
    worker: Worker = field(default_factory=Worker)
    """The worker section."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="svc", exit_on_error=False)
    p.add_argument("--config")  # a command's own flag beside the derived ones
    add_config_flags(p, Service, section="svc")
    return p


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_flag_names_are_the_dotted_field_paths_with_dashes():
    assert flag_name("max_episodes") == "--max-episodes"
    assert flag_name("sync.stall_timeout_s") == "--sync.stall-timeout-s"
    found = options(parser())
    for name in ("--name", "--hot-swap", "--no-hot-swap", "--engine", "--seed", "--betas", "--sync.gateways",
                 "--gateway", "--sync.stall-timeout-s", "--worker.max-episodes", "--worker.roles", "--role",
                 "--worker.options", "--config"):
        assert name in found, name
    assert found["--gateway"] is found["--sync.gateways"]  # an alias is the same flag
    assert not any("models" in name for name in found)  # a list of tables has no flag


def test_flag_types_come_from_the_annotations():
    p = parser()
    args = p.parse_args(["--gateway", "http://a", "--sync.gateways", "http://b", "--sync.stall-timeout-s", "2.5",
                         "--no-hot-swap", "--engine", "sglang", "--seed", "7", "--betas", "0.8", "0.9",
                         "--role", "solver=a", "--worker.roles", "verifier=b", "--worker.options", '{"k": [1, 2]}',
                         "--worker.max-episodes", "3"])
    assert config_overrides(args, Service) == {
        "sync.gateways": ["http://a", "http://b"], "sync.stall_timeout_s": 2.5, "hot_swap": False,
        "engine": "sglang", "seed": 7, "betas": [0.8, 0.9], "worker.roles": {"solver": "a", "verifier": "b"},
        "worker.options": {"k": [1, 2]}, "worker.max_episodes": 3}
    assert config_overrides(p.parse_args(["--hot-swap"]), Service) == {"hot_swap": True}
    assert config_overrides(p.parse_args([]), Service) == {}  # nothing given: the file or the default stands
    assert options(p)["--engine"].choices == ["transformers", "sglang"]


@pytest.mark.parametrize("argv, needle", [
    (["--engine", "vllm"], "invalid choice: 'vllm'"),
    (["--worker.max-episodes", "many"], "invalid int value"),
    (["--role", "solver"], "wants ROLE=MODEL_ID, got 'solver'"),
    (["--worker.options", "[1]"], "wants a JSON object"),
    (["--betas", "0.9"], "expected 2 arguments"),
])
def test_bad_flag_values_are_refused_naming_the_flag(argv, needle):
    with pytest.raises(argparse.ArgumentError, match=needle):
        parser().parse_args(argv)


def test_an_unknown_flag_is_refused(capsys):
    p = argparse.ArgumentParser(prog="svc")
    add_config_flags(p, Service, section="svc")
    with pytest.raises(SystemExit):
        p.parse_args(["--max-episodes", "3"])  # it is --worker.max-episodes
    assert "unrecognized arguments: --max-episodes" in capsys.readouterr().err


def test_help_is_the_field_docstring_with_the_default():
    p = parser()
    found = options(p)
    assert found["--worker.max-episodes"].help == "Episodes run at once. (default: 8)"
    assert found["--sync.stall-timeout-s"].help == \
        "Seconds of silence before an alternate is tried; 100%% of them. (default: 20.0)"
    assert found["--gateway"].help == "Gateway base URLs, preferred first. Repeat for more. (default: none)"
    assert found["--seed"].help == "Sampling seed. (default: unset)"
    assert found["--hot-swap"].help == "Swap versions in place. (default: on)"
    text = " ".join(p.format_help().split())  # without the line wrapping
    assert "[svc.sync] settings" in text and "How the pool follows its gateways." in text
    assert "--sync.gateways URL, --gateway URL" in text and "100% of them" in text


def test_flags_and_a_file_make_nested_sections(tmp_path: Path):
    path = tmp_path / "svc.toml"
    path.write_text('[svc]\nname = "a"\n[svc.sync]\ngateways = ["http://file"]\nstall_timeout_s = 5\n'
                    '[svc.worker]\nmax_episodes = 2\n[[svc.models]]\nmodel_id = "m"\n')
    args = parser().parse_args(["--worker.max-episodes", "6", "--name", "b"])
    cfg = load_config(Service, path, section="svc", overrides=config_overrides(args, Service))
    assert (cfg.name, cfg.sync.gateways, cfg.sync.stall_timeout_s) == ("b", ["http://file"], 5.0)
    assert cfg.worker.max_episodes == 6 and cfg.models == [Policy("m")]


def test_a_required_section_left_out_is_reported_under_its_name():
    with pytest.raises(ConfigError, match=r"svc\.sync: gateways must list"):
        load_config(Service, section="svc")


def test_an_unknown_key_in_a_nested_section_is_an_error(tmp_path: Path):
    message = refusal(tmp_path, Service, '[svc.sync]\ngateways = ["http://a"]\nstall_timeout = 5\n', "svc")
    assert "svc.sync: unknown keys ['stall_timeout']" in message


# --- files of an older layout -------------------------------------------------------------------------


def test_an_old_pool_file_names_what_moved(tmp_path: Path):
    from deltamesh.mesh.pool.config import PoolConfig

    message = refusal(tmp_path, PoolConfig, '[pool]\nname = "eu-1"\ngateways = ["http://g"]\nstall_timeout_s = 5\n'
                      'max_episodes = 4\n[[pool.models]]\nmodel_path = "/m"\n', "pool")
    for line in ("`pool.gateways` moved to `pool.sync.gateways`",
                 "`pool.stall_timeout_s` moved to `pool.sync.stall_timeout_s`",
                 "`pool.max_episodes` moved to `pool.worker.max_episodes`", "docs/CONFIG.md"):
        assert line in message, message


def test_a_pool_file_with_submit_retries_names_what_replaced_them(tmp_path: Path):
    from deltamesh.mesh.pool.config import PoolConfig

    message = refusal(tmp_path, PoolConfig, '[pool]\nname = "eu-1"\n[pool.worker]\nsubmit_retries = 3\n', "pool")
    assert "`pool.worker.submit_retries` was removed: a pool retries every broker call" in message, message


def test_the_scaling_thresholds_are_declared_once_and_their_old_keys_name_the_new_ones(tmp_path: Path):
    from deltamesh.mesh.autoscale.config import AutoscaleConfig
    from deltamesh.mesh.broker.config import BrokerConfig, ScaleThresholds

    broker = refusal(tmp_path, BrokerConfig, "[broker.balance]\nscale_up_above = 0.2\n", "broker")
    assert "`broker.balance.scale_up_above` moved to `broker.balance.thresholds.scale_up_above`" in broker, broker
    scaler = refusal(tmp_path, AutoscaleConfig, '[autoscale]\ncommand = ["x"]\nheadroom = 1.5\n', "autoscale")
    assert "`autoscale.headroom` moved to `autoscale.thresholds.headroom`" in scaler, scaler
    path = tmp_path / "ok.toml"
    path.write_text('[autoscale]\ncommand = ["x"]\n[autoscale.thresholds]\nscale_up_above = 0.2\n')
    assert load_config(AutoscaleConfig, path, section="autoscale").thresholds == ScaleThresholds(scale_up_above=0.2)
    with pytest.raises(ValueError, match="scale_down_below <= scale_up_above"):
        ScaleThresholds(scale_up_above=0.01)


def test_the_pools_old_full_every_names_its_new_name(tmp_path: Path):
    """The pool's plan hint was `full_every`, the trainer's name for a full snapshot every N versions."""
    from deltamesh.mesh.pool.config import PoolConfig

    message = refusal(tmp_path, PoolConfig, '[pool]\nname = "eu-1"\n[pool.sync]\nfull_every = 5\n', "pool")
    assert "`pool.sync.full_every` moved to `pool.sync.full_after_deltas`" in message, message


def test_an_old_trainer_file_names_what_moved(tmp_path: Path):
    from deltamesh.trainer.loop_config import TrainLoopConfig

    text = '[trainer]\nmodel_id = "m"\n[train]\nbroker = "http://b"\nbatch_size = 8\n'
    assert "uses an older layout: [train] moved to [trainer]" in refusal(tmp_path, TrainLoopConfig, text, "trainer")


def test_moves_concern_only_the_table_they_touch(tmp_path: Path):
    path = tmp_path / "mesh.toml"
    path.write_text('[gw]\nregion = "eu"\n[train]\nbroker = "http://b"\n[pool]\ngpus = 1\n')
    assert load_config(Outer, path, section="gw").region == "eu"  # an old [train] is not the gateway's business


def test_every_moved_key_names_an_existing_setting():
    from deltamesh.config_flags import settings
    from deltamesh.mesh.autoscale.config import AutoscaleConfig
    from deltamesh.mesh.broker.config import BrokerConfig
    from deltamesh.mesh.pool.config import PoolConfig
    from deltamesh.trainer.loop_config import TrainLoopConfig

    tables = (("pool", PoolConfig), ("trainer", TrainLoopConfig), ("broker", BrokerConfig),
              ("autoscale", AutoscaleConfig))
    known = {f"{table}.{s.path}" for table, cls in tables for _, _, found in settings(cls) for s in found}
    removed = {old for old, _ in REMOVED_KEYS}
    moved_again = {old for old, _ in MOVED_KEYS}
    for old, new in MOVED_KEYS:
        assert old not in known, old
        # moved; or moved, then removed or moved again later (a chain ends at an existing setting)
        assert new == "trainer" or new in known or new in removed or new in moved_again, new


@pytest.mark.parametrize("argv, needle", [
    (["pool", "sync", "--name", "p", "--dir", "d", "--trusted-key", "k"], "gateways must list"),
    (["publish", "--gateway", "http://g", "--key", "k", "weights"], "model is required"),
    (["pools", "--gateway", "g:1"], "gateway must be an http(s) URL"),
    (["gateway", "--region", "eu", "--keep-deltas", "0", "--trusted-key", "k"], "keep_deltas"),
])
def test_commands_refuse_bad_settings_with_exit_code_2(argv, needle, caplog):
    from deltamesh.mesh.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.run(args) == 2
    assert needle in caplog.text, caplog.text


def test_a_pool_refuses_a_negative_prefill_chunk(monkeypatch, caplog):
    from deltamesh.mesh.cli import build_parser

    monkeypatch.setenv("DELTAMESH_TOKEN", "t")
    args = build_parser().parse_args(["pool", "run", "--name", "p", "--broker", "https://b:1", "--gateway", "https://g:1",
                                      "--trusted-key", "k", "--model", "m", "--prefill-chunk-tokens", "-1"])
    assert args.run(args) == 2
    assert "prefill_chunk_tokens" in caplog.text, caplog.text


def test_the_trainer_takes_encode_first_as_auto_on_or_off(tmp_path: Path):
    from deltamesh.trainer.loop_config import TrainLoopConfig

    text = '[trainer]\nmodel_id = "m"\nmodel = "d"\nkey = "k"\ngateway = "http://g:1"\nbroker = "http://b:1"\n'
    path = tmp_path / "t.toml"
    path.write_text(text)
    assert load_config(TrainLoopConfig, path, section="trainer").encode_first == "auto"
    assert "encode_first" in refusal(tmp_path, TrainLoopConfig, text + 'encode_first = "sometimes"\n', "trainer")
