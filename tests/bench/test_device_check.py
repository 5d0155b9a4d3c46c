"""benchmarks/device_check.py as written, at a tiny size on the CPU (CI has no GPU, and the script's
CUDA run is for a GPU machine by hand): it reports every figure, and the torch path's encode and apply
are bit-identical to the numpy path's."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import device_check
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow  # makes, encodes and applies a 20 MB model several times (~15 s)


def test_device_check_on_cpu_reports_bit_identical_paths():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "device_check.py"), "--device", "cpu", "--gb", "0.02",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["device"] == "cpu" and result["repeats"] == 3
    assert 0.015e9 < result["model_bytes"] < 0.025e9
    assert 0.009 < result["changed_fraction"] < 0.011 and result["delta_bytes"] > 0
    for stage in ("encode", "apply", "scan"):
        assert result[f"device_{stage}_gbps"] > 0 and result[f"cpu_{stage}_gbps"] > 0
        assert result[f"{stage}_ratio"] == pytest.approx(result[f"device_{stage}_gbps"] / result[f"cpu_{stage}_gbps"])
    assert result["same_encoding"] and result["device_apply_exact"] and result["cpu_apply_exact"]
    assert result["bit_identical"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device")
def test_device_check_without_cuda_says_so_and_runs_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="benchmarks.device_check"):
        assert device_check.main(["--device", "cuda", "--gb", "0.02"]) == 2
    assert "sees no CUDA device" in caplog.text and "made on" not in caplog.text


@pytest.mark.parametrize("gb", [0.02, 1.0, 8.0])
def test_model_shapes_come_near_the_asked_size(gb):
    shapes = device_check.model_shapes(gb)
    size = 2 * sum(math.prod(s) for s in shapes.values())
    assert abs(size - gb * 1e9) < 0.12 * gb * 1e9
