"""Teardown leaves nothing behind: after an exception inside `with Wan(...)`, after SIGTERM, and,
through the `cleanup` command, after the emulating process was SIGKILLed. Checked against the
system itself: namespaces, processes, and the root namespace's links and iptables rules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from wan import Wan, WanError
from wan.netns import list_namespaces
from wan.processes import is_running

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("netns_ok")]

CLI = Path(__file__).resolve().parents[2] / "benchmarks" / "wan" / "cli.py"
BENCHMARKS = str(CLI.parents[1])

# A run that builds two linked hosts, starts a long sleep in one, reports its processes and waits.
RUN_SCRIPT = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {benchmarks!r})
    from wan import Wan
    with Wan({prefix!r}, unique=False) as wan:
        a, b = wan.host("a"), wan.host("b")
        wan.link(a, b, mbit=10, rtt_ms=20)
        sleeper = b.spawn(["sleep", "300"])
        pids = [sleeper.pid] + [p.pid for p in wan.delayers]
        print(json.dumps(pids), flush=True)
        time.sleep(300)
""")


def root_state() -> tuple[str, str]:
    """The root namespace's interfaces and iptables rules (the emulator must never touch them)."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    names = "\n".join(sorted(line.split(":")[1].strip() for line in links.splitlines()))
    rules = subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True).stdout
    return names, rules


def start_run(prefix: str, tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "run.py"
    script.write_text(RUN_SCRIPT.format(benchmarks=BENCHMARKS, prefix=prefix))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"the run did not come up (exit {proc.wait()})"
    return proc, json.loads(line)


def test_exception_inside_with_leaves_nothing(prefix):
    before = root_state()
    with pytest.raises(RuntimeError, match="run failed"):
        with Wan(prefix) as wan:
            a, b, c = wan.host("a"), wan.host("b"), wan.host("c")
            wan.link(a, b, mbit=10, rtt_ms=10)
            wan.link(b, c, mbit=10, rtt_ms=10)
            sleeper = c.spawn(["sleep", "300"])
            delayers = wan.delayers
            assert len(list_namespaces(wan.prefix)) == 3 and len(delayers) == 4
            raise RuntimeError("run failed")
    assert list_namespaces(wan.prefix) == []
    assert not any(is_running(p.pid) for p in (sleeper, *delayers))
    assert root_state() == before


@pytest.mark.parametrize("signum, exit_code", [
    (signal.SIGTERM, 128 + signal.SIGTERM),
    (signal.SIGINT, -signal.SIGINT),  # Python ends on KeyboardInterrupt by re-raising SIGINT
])
def test_signal_tears_down(prefix, tmp_path, signum, exit_code):
    proc, pids = start_run(prefix, tmp_path)
    try:
        assert all(is_running(pid) for pid in pids)
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == exit_code
        assert list_namespaces(f"{prefix}-") == []
        assert not any(is_running(pid) for pid in pids)
    finally:
        proc.kill()
        proc.wait()


def test_sigkilled_run_is_removed_by_cleanup(prefix, tmp_path):
    before = root_state()
    proc, pids = start_run(prefix, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Nothing ran at exit: the namespaces and everything in them are still there.
    assert len(list_namespaces(f"{prefix}-")) == 2
    assert all(is_running(pid) for pid in pids)
    done = subprocess.run([sys.executable, str(CLI), "cleanup", "--prefix", prefix],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "removed 2 namespace(s)" in done.stdout
    assert list_namespaces(prefix) == []
    assert not any(is_running(pid) for pid in pids)
    assert root_state() == before


def test_cleanup_refuses_an_empty_prefix():
    done = subprocess.run([sys.executable, str(CLI), "cleanup", "--prefix", ""],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "non-empty prefix" in done.stderr


def test_a_second_network_with_the_same_prefix_is_refused_and_removes_nothing(prefix):
    with Wan(prefix, unique=False) as first:
        first.host("a")
        with pytest.raises(WanError, match="exist already"):
            Wan(prefix, unique=False)
        assert list_namespaces(f"{prefix}-") == [f"{prefix}-a"]
    assert list_namespaces(f"{prefix}-") == []
