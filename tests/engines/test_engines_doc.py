"""docs/ENGINES.md's commands, run as written from the repository root with this environment's `python`
first on PATH: the SGLang check answers SKIP here (no SGLang, no GPU: exit 2), and the same check
against the SGLang stand-in passes. The doc's `deltamesh demo --engine vllm` line is run by
tests/demo/test_demo.py, its TRL example's line by tests/engines/test_trl_example.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def doc_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "ENGINES.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def run_as_written(line: str, timeout_s: float) -> subprocess.CompletedProcess:
    # A wide terminal, so that the check's table keeps each row on one line.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "250"}
    return subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def sglang_lines() -> list[str]:
    return [line for line in doc_lines() if "benchmarks/sglang_check.py" in line]


def test_every_command_of_the_doc_is_one_of_those_tested():
    check, dry_run = sglang_lines()
    assert "--launch-command" not in check and "sglang_standin.py" in dry_run
    # The TRL example's line is run by tests/engines/test_trl_example.py.
    assert [line for line in doc_lines() if line not in (check, dry_run)] == [
        "deltamesh demo --engine vllm --steps 12", "python examples/trl_grpo.py --steps 3"]


def test_the_sglang_check_skips_where_sglang_cannot_run():
    proc = run_as_written(sglang_lines()[0], 120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "SKIP: SGLang is not installed" in proc.stdout


@pytest.mark.slow
def test_the_sglang_check_passes_against_the_standin():
    proc = run_as_written(sglang_lines()[1], 300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("PASS")
    for check in ("in-place update of the changed tensors to v2", "weights read back are v2's",
                  "generation straddling an in-place update"):
        assert check in proc.stdout and "FAILED" not in proc.stdout
