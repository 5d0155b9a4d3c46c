"""The slim install a gateway host makes: `pip install 'deltamesh[gateway]'` into a clean venv brings no
torch, transformers or matplotlib, and its `deltamesh gateway` starts there and serves /healthz (with
a key that venv's own `deltamesh keys generate` made). Its start-up time is `benchmarks/startup.py`'s
to measure; this checks only that it starts."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def test_gateway_extra_installs_and_starts_without_torch(tmp_path, project_copy):
    src = project_copy
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python, deltamesh = env_dir / "bin" / "python", env_dir / "bin" / "deltamesh"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", f"{src}[gateway]"],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]

    for heavy in ("torch", "transformers", "matplotlib"):
        probe = subprocess.run([str(python), "-c", f"import {heavy}"], capture_output=True, text=True)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, heavy

    assert subprocess.run([str(deltamesh), "gateway", "--help"], capture_output=True, timeout=60).returncode == 0
    keys = subprocess.run([str(deltamesh), "keys", "generate", "--out", str(tmp_path / "trainer.key")],
                          capture_output=True, text=True, timeout=60)
    assert keys.returncode == 0, keys.stderr

    # The benchmark starts that venv's gateway, waits for /healthz and stops it.
    started = subprocess.run([sys.executable, str(BENCHMARKS / "startup.py"), "--quick", "--json",
                              "--deltamesh", str(deltamesh)], capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    result = json.loads(started.stdout)
    assert result["torch_loaded"] is False and result["stop_s"] < 2.0
