"""docs/ENGINES.md's TRL line, run as written from the repository root: `examples/trl_grpo.py` trains three
GRPO steps of SmolLM2-135M with TRL's GRPOTrainer, its rollouts from a real vLLM server (CPU build) that
takes every version through the deltamesh backend from a relay gateway, and every step's rollouts come
from the version published after the step before (version 0, the starting weights, before step 1)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_three_grpo_steps_each_served_from_the_version_published_before_it():
    pytest.importorskip("trl", reason="the TRL example needs `pip install 'deltamesh[trl]'` (make install has it)")
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "ENGINES.md").read_text(), flags=re.S)
    (line,) = [line for block in blocks for line in block.splitlines() if "examples/trl_grpo.py" in line]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    found = re.search(r"published (\[[\d, ]*\]); rollouts served from (\[[\d, ]*\])", run.stderr)
    assert found, run.stderr[-6000:]
    published, served = ast.literal_eval(found.group(1)), ast.literal_eval(found.group(2))
    assert published == [0, 1, 2, 3] and served == [0, 1, 2]
