"""benchmarks/scale.py's contract, on a small model: two trainer ranks (processes) publishing in parts and
through rank 0, three gateways, three pools, every pool bit-identical, and the JSON keys scripts read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_scale_smoke_run_is_bit_identical_and_reports_its_keys(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--quick", "--gb", "0.02", "--steps", "2", "--json",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=BENCH)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("bit_identical", "ranks", "shard_bytes", "publish_peak_rss_over_shard", "all_pools_seconds_median",
                "rank0_path_all_pools_seconds_median", "ep_fetch_fraction"):
        assert key in result, key
    assert result["bit_identical"] is True and result["ranks"] == 2
    assert set(result["ep_fetch_fraction"]) == {"2", "4"}
    assert 0 < result["ep_fetch_fraction"]["4"] < result["ep_fetch_fraction"]["2"] < 1
    assert [v["version"] for v in result["versions"]["sharded"]] == [0, 1, 2]
