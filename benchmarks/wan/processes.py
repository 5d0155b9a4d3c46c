"""Ending the processes the emulator started: each runs in its own session, so signalling its
process group reaches whatever it forked too. SIGTERM first, SIGKILL after a grace period, and
every process is reaped, so none is left behind as a zombie or an orphan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path


def stop_process(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """End one process (and its group) and reap it."""
    stop_processes([proc], grace_s)


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 2.0) -> None:
    """End several processes at once: all get SIGTERM, then SIGKILL whoever outlives `grace_s`."""
    procs = list(procs)
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    # Only while the leader is unreaped is its pid certain to still name this group.
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


def is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may itself hold spaces.
    return stat.rpartition(")")[2].split()[0] != "Z"
