"""docs/WORKFLOWS.md's SmolLM2 runs: each command there parses as written into the demo settings its
figures report on. The runs themselves take 7-12 minutes of a 2-core machine and are not run by the
suite; the doc records what they reached."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from deltamesh.mesh.cli import build_parser, command_config
from deltamesh.mesh.cli.demo import overrides
from deltamesh.mesh.demo.config import DemoConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "WORKFLOWS.md"


def smollm2_commands() -> list[str]:
    section = DOC.read_text().split("## On SmolLM2", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`(deltamesh demo [^`]*)`", section)


def test_the_smollm2_commands_parse_as_written_into_the_settings_they_report_on():
    commands = smollm2_commands()
    assert sorted(shlex.split(c)[shlex.split(c).index("--workflow") + 1] for c in commands) == \
        ["code", "solver_selector", "solver_testgen"]
    for line in commands:
        args = build_parser().parse_args(shlex.split(line)[1:])  # an unknown flag would exit here
        config = command_config(args, DemoConfig, "demo", overrides=overrides)
        assert (config.model, config.code_tasks) == ("smollm2", "humaneval")
        assert len({pool.region for pool in config.topology.pools}) == 2  # pools in two regions


def test_the_held_out_evaluation_command_parses_into_a_demo_that_scores_smollm2_on_held_out_arithmetic():
    section = DOC.read_text().split("## Held-out evaluation", 1)[1].split("\n## ", 1)[0]
    (line,) = re.findall(r"`(deltamesh demo [^`]*)`", section)
    config = command_config(build_parser().parse_args(shlex.split(line)[1:]), DemoConfig, "demo", overrides=overrides)
    assert (config.model, config.engine, config.tasks, config.eval.every) == ("smollm2", "vllm", "arithmetic", 5)
    options = config.workflow_options()
    assert config.wording == "equation" and options["prompt_format"] == "completion"
    assert options["prompt_template"].endswith("{prompt}") and options["answer"] == "first_number"
