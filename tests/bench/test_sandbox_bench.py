"""benchmarks/sandbox.py runs end to end (tiny sizes) and reports every workload and mode with --json."""

from __future__ import annotations

import json
import shutil

import pytest
import sandbox as sandbox_bench


@pytest.mark.slow
def test_the_benchmark_reports_every_workload_and_mode(capsys):
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: run benchmarks/setup_sandbox.sh")
    sandbox_bench.main(["--executions", "4", "--repeats", "1", "--workers", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert set(result["workloads"]) == {"trivial", "humaneval"}
    for row in result["workloads"].values():
        assert min(row["sandboxed_per_s"], row["plain_per_s"], row["bare_per_s"]) > 0
        assert row["sandboxed_over_plain"] > 0
    assert result["cores"] >= 1 and len(result["load_before"]) == 3
