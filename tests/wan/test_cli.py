"""The emulator's command line and topology files: `up` a described network and leave it
running, `verify` it with a table or JSON, `down` it; bad topology files are rejected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from wan import load_topology
from wan.emulator import STATE_DIR
from wan.netns import list_namespaces

from deltamesh.config import ConfigError

CLI = Path(__file__).resolve().parents[2] / "benchmarks" / "wan" / "cli.py"
TOPOLOGIES = CLI.parent / "topologies"

CHAIN = """
[[link]]
a = "origin"
b = "relay"
mbit = 50
rtt_ms = 40

[[link]]
a = "relay"
b = "edge"
mbit = 20
mbit_back = 5
rtt_ms = 10
"""


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *args], capture_output=True, text=True, timeout=timeout)


def test_shipped_topologies_load():
    fanout = load_topology(TOPOLOGIES / "fanout.toml")
    assert len(fanout.link) == 15 and len(fanout.host_names()) == 16
    chain = load_topology(TOPOLOGIES / "relay_chain.toml")
    assert chain.host_names() == ["origin", "regionA", "regionB"]
    assert load_topology(TOPOLOGIES / "long_link.toml").link[0].rtt_ms == 300


@pytest.mark.parametrize("text, error", [
    ('[[link]]\na = "x"\nb = "y"\nmbit = 10\nrtt_ms = 5\ndelay = 3\n', "unknown keys"),
    ('[[link]]\na = "x"\nb = "x"\nmbit = 10\nrtt_ms = 5\n', "to itself"),
    ('[[link]]\na = "x"\nb = "y"\nmbit = "fast"\nrtt_ms = 5\n', "mbit"),
    ('[[link]]\na = "x"\nb = "y"\nmbit = 1\nrtt_ms = 5\n[[link]]\na = "y"\nb = "x"\nmbit = 1\nrtt_ms = 5\n',
     "same pair"),
    ('[[link]]\na = "x"\nb = "y"\nmbit = 1\nrtt_ms = 5\nloss = 1.5\n', "loss must be in"),
])
def test_bad_topology_is_rejected(tmp_path, text, error):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_topology(path)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("netns_ok")
def test_up_verify_down(prefix, tmp_path):
    topology = tmp_path / "chain.toml"
    topology.write_text(CHAIN)
    up = cli("up", "--topology", str(topology), "--prefix", prefix)
    assert up.returncode == 0, up.stderr
    assert list_namespaces(f"{prefix}-") == [f"{prefix}-edge", f"{prefix}-origin", f"{prefix}-relay"]
    assert (STATE_DIR / f"{prefix}.json").exists()

    again = cli("up", "--topology", str(topology), "--prefix", prefix)
    assert again.returncode == 1 and "exist already" in again.stderr

    for _ in range(3):  # a measurement on a shared 2-core machine may catch a busy moment: measure again
        verify = cli("verify", "--prefix", prefix, "--json", "--seconds", "2.5")
        if verify.returncode == 0:
            break
    assert verify.returncode == 0, verify.stdout + verify.stderr
    checks = json.loads(verify.stdout)["links"]
    assert [(c["sender"], c["receiver"], c["asked_mbit"]) for c in checks] == [
        ("origin", "relay", 50), ("relay", "edge", 20)]
    assert all(c["ok"] for c in checks), checks

    for _ in range(3):
        table = cli("verify", "--prefix", prefix, "--rtt-only")
        if table.returncode == 0:
            break
    assert table.returncode == 0, table.stdout + table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["link", "RTT", "asked"]
    assert lines[1].split()[:5] == ["origin", "->", "relay", "40", lines[1].split()[4]]
    assert lines[2].split()[:4] == ["relay", "->", "edge", "10"] and lines[2].split()[-2] == "-"

    down = cli("down", "--prefix", prefix)
    assert down.returncode == 0, down.stderr
    assert list_namespaces(prefix) == []
    assert not (STATE_DIR / f"{prefix}.json").exists()

    missing = cli("verify", "--prefix", prefix)
    assert missing.returncode == 1 and "is up" in missing.stderr
