"""Network namespaces as the emulator uses them: create one with sane TCP buffers, list those of
a run by name prefix, and remove them together with every process still inside.

Deleting a namespace also deletes its veth ends (and with them their peers), its qdiscs and its
iptables rules, so a namespace is the unit of clean-up: nothing the emulator makes lives
outside one. `purge(prefix)` is what both a normal teardown's last step and the `cleanup`
command after a crashed run rely on.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from .processes import is_running
from .shell import WanError, run

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")

# Per-namespace TCP settings. Autotuned buffers up to 64 MiB let one stream keep a
# 400 Mbit/s x 300 ms link (15 MB in flight) full; the kernel default max (6 MiB) caps a
# stream at ~20 MB/s on such a link. No cached metrics, so one run's losses do not shape
# the next connection's slow start. IPv6 off: the delay rules are IPv4 (iptables), so IPv6
# link-local traffic would otherwise cross the links undelayed.
NETNS_SYSCTLS = {
    "net.ipv4.tcp_rmem": "4096 131072 67108864",
    "net.ipv4.tcp_wmem": "4096 65536 67108864",
    "net.ipv4.tcp_no_metrics_save": "1",
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}


def create(name: str) -> None:
    """Create a namespace with loopback up and the emulator's sysctls."""
    run(["ip", "netns", "add", name])
    run(["ip", "-n", name, "link", "set", "lo", "up"])
    settings = [f"{key}={value}" for key, value in NETNS_SYSCTLS.items()]
    run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", *settings])


def list_namespaces(prefix: str) -> list[str]:
    """Names of the existing namespaces that start with `prefix` (never the empty prefix)."""
    if not prefix:
        raise WanError("refusing to match every namespace: give a non-empty prefix")
    out = run(["ip", "netns", "list"])
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(prefix))


def pids_in(name: str) -> list[int]:
    """Processes whose network namespace is `name`."""
    out = run(["ip", "netns", "pids", name], check=False)
    return [int(word) for word in out.split() if word.isdigit()]


def kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after `grace_s`."""
    alive = _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if is_running(pid)]
    _signal_all(alive, signal.SIGKILL)


def delete(name: str, grace_s: float = 2.0) -> None:
    """End every process inside `name`, then delete the namespace (and so its links and rules)."""
    end_processes([name], grace_s)
    # A process being killed can hold the namespace for a moment: retry briefly.
    for attempt in range(20):
        if not (NETNS_DIR / name).exists():
            return
        try:
            run(["ip", "netns", "delete", name])
            return
        except WanError:
            if attempt == 19:
                raise
            time.sleep(0.1)


def purge(prefix: str, grace_s: float = 2.0) -> list[str]:
    """Remove every namespace starting with `prefix` and the processes inside; return the names."""
    names = list_namespaces(prefix)
    end_processes(names, grace_s)
    for name in names:
        delete(name, grace_s)
    return names


def end_processes(names: list[str], grace_s: float = 2.0) -> None:
    """End the processes inside all of `names` at once (one grace period for all of them)."""
    pids = [pid for name in names for pid in pids_in(name)]
    if pids:
        log.info("ending %d process(es) left in %s", len(pids), " ".join(names))
        kill_pids(pids, grace_s)


def _signal_all(pids: list[int], signum: int) -> list[int]:
    """Send `signum` to each pid; return those that still existed."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent.append(pid)
        except ProcessLookupError:
            pass
    return sent

