"""docs/CONFIG.md as written: every example table loads through the config loader as the process that
reads it would load it, the example of an older layout is refused naming what moved, and every flag
alias a setting declares is listed. The README's commands parse with the derived flags as written."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import tomllib

from deltamesh.config import ConfigError, load_config
from deltamesh.config_flags import ALIASES, settings
from deltamesh.gateway.config import GatewayConfig
from deltamesh.mesh.autoscale.config import AutoscaleConfig
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.cli import build_parser
from deltamesh.mesh.console.config import ConsoleConfig
from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.eval.config import EvalConfig
from deltamesh.mesh.pool.config import PoolConfig
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.vllm_plugin.config import BackendConfig
from deltamesh.trainer.loop_config import TrainLoopConfig
from deltamesh.trainer.publish_config import PublishConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "CONFIG.md"
TABLES = {"gateway": GatewayConfig, "pool": PoolConfig, "broker": BrokerConfig, "trainer": TrainLoopConfig,
          "autoscale": AutoscaleConfig, "demo": DemoConfig, "console": ConsoleConfig, "publish": PublishConfig,
          "vllm_backend": BackendConfig, "eval": EvalConfig}
OLD = "# older layout"


def examples() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_one_example_per_process():
    tables = [next(iter(tomllib.loads(text))) for text in examples() if not text.startswith(OLD)]
    assert sorted(tables) == sorted(TABLES)


@pytest.mark.parametrize("text", [t for t in examples() if not t.startswith(OLD)],
                         ids=lambda t: next(iter(tomllib.loads(t))))
def test_each_example_loads_as_its_process_reads_it(tmp_path: Path, text: str):
    path = tmp_path / "example.toml"
    path.write_text(text)
    (table,) = tomllib.loads(text)
    config = load_config(TABLES[table], path, section=table)
    assert isinstance(config, TABLES[table])


def test_the_older_layout_example_is_refused_naming_the_moves(tmp_path: Path):
    (text,) = [t for t in examples() if t.startswith(OLD)]
    path = tmp_path / "pool.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as pool:
        load_config(PoolConfig, path, section="pool")
    assert (f"config {path} uses an older layout: `pool.gateways` moved to `pool.sync.gateways`; "
            "`pool.max_episodes` moved to `pool.worker.max_episodes` (see docs/CONFIG.md)") == str(pool.value)
    with pytest.raises(ConfigError, match=r"uses an older layout: \[train\] moved to \[trainer\]"):
        load_config(TrainLoopConfig, path, section="trainer")


def test_every_alias_is_listed_in_the_doc():
    doc = DOC.read_text()
    # The vLLM backend's table has no flags: vLLM hands it over as JSON.
    classes = [*(c for c in TABLES.values() if c is not BackendConfig), PoolSyncConfig]
    aliases = {alias for cls in classes for _, _, found in settings(cls) for s in found
               for alias in s.field.metadata.get(ALIASES, ())}
    assert aliases and all(f"`{a}`" in doc for a in aliases), sorted(a for a in aliases if f"`{a}`" not in doc)


def test_every_setting_flag_of_every_command_has_help():
    def actions(parser: argparse.ArgumentParser, name: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from actions(child, f"{name} {sub}")
            elif action.dest.startswith("setting:"):
                yield name, action

    found = list(actions(build_parser(), "deltamesh"))
    assert len({name for name, _ in found}) >= 10  # every command with settings
    missing = [(name, a.option_strings[0]) for name, a in found if not a.help or a.help.startswith(("(", "Repeat"))]
    assert missing == []


def test_the_readme_commands_parse_as_written():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    # Shell around a command (a redirection of its output, `&` to run it in the background) is not its argv.
    lines = [line.split(" > ")[0].split("#")[0].rstrip().removesuffix("&") for block in blocks
             for line in block.splitlines() if line.startswith("deltamesh ")]
    commands = [shlex.split(line) for line in lines]
    assert len(commands) >= 10
    for argv in commands:
        args = build_parser().parse_args(argv[1:])  # an unknown flag would exit here
        assert callable(args.run), argv
