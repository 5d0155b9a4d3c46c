"""`deltamesh demo --codec-tour` end to end, as a user runs it: a real process on real SmolLM2 weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DELTAMESH = Path(sys.executable).parent / "deltamesh"


@pytest.mark.slow
def test_codec_tour_applies_bit_exactly_and_refuses_a_tampered_piece():
    # A small batch keeps the training step short; the model cache is shared with the other tests.
    proc = subprocess.run(
        [str(DELTAMESH), "demo", "--codec-tour", "--batch", "1", "--seq-len", "64"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "160"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "bit-exact: yes" in out
    assert "refused, weights untouched" in out
    assert "delta" in out and "full snapshot" in out
