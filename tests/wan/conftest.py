"""Fixtures for the WAN emulator's tests: the emulator package on sys.path, and a check that
this machine can build namespaces (root, iproute2 and iptables from setup.sh)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SETUP = BENCHMARKS / "wan" / "setup.sh"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip when network namespaces cannot be made here; fail when setup.sh was not run."""
    if os.geteuid() != 0:
        pytest.skip("the WAN emulator needs root to create network namespaces")
    probe = f"wanprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", probe], check=True)
    missing = [tool for tool in ("iptables", "tc") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run {SETUP}")


@pytest.fixture
def prefix() -> str:
    """A fresh namespace prefix; whatever a test leaves under it is removed afterwards."""
    from wan import purge
    from wan.emulator import STATE_DIR, remove_state

    name = f"wt{secrets.token_hex(3)}"
    yield name
    purge(name)
    for path in STATE_DIR.glob(f"{name}*"):
        remove_state(path.name.removesuffix(".json"))

