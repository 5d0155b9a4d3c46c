"""benchmarks/startup.py as written, once (--quick): a gateway of this installation starts, answers
/healthz without torch loaded, and stops on SIGTERM within the 2 s gateways are given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow  # two gateway starts, ~10 s


def test_startup_benchmark_reports_a_torch_free_gateway():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "startup.py"), "--quick", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert len(result["runs_s"]) == 1 and result["median_s"] > 0 and result["target_s"] == 1.0
    assert result["torch_loaded"] is False and result["stop_s"] < 2.0
