"""benchmarks/slow_clients.py as written, quick (--quick: 100 slow-header clients, a 1 s header timeout):
a gateway and a broker each answer the honest client beside them and close every slow connection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow  # two servers, ~15 s


def test_slow_clients_benchmark_reports_both_servers():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "slow_clients.py"), "--quick", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["slow"] == 100 and result["target_p50_ms"] == 50.0
    for name in ("gateway", "broker"):
        server = result["servers"][name]
        assert server["closed"] == 100 and server["still_open"] == 0, server
        assert server["closed_within_s"] < result["header_timeout_s"] + 1.5, server
        assert server["held_ms"]["p50"] > 0 and server["alone_ms"]["p50"] > 0
