"""What the links did while a run was on them: a `LinkRecorder` samples, once a second in a thread of
its own, every delayer's counts (delayer.py: packets delayed, dropped as asked, released late, the most
held at once, notices the kernel could not report), the kernel's count of packets its NFQUEUE dropped
for want of room, each tbf's sent and dropped packets and queue (the sender's end), and `ss -tni` of
every TCP connection that crosses a link (retransmits, congestion and receive windows, time limited by
the receiver's window). `record(t0, t1)` turns the samples of a run into a `RunRecord` (record_view.py):
one entry per link direction and per connection, and whether the emulator did what was asked.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .record_view import RunRecord, build_record
from .tcp_info import parse_ss

if TYPE_CHECKING:
    from .emulator import Wan
    from .links import DelayLine, Host, Link

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
SNAPSHOT_WAIT_S = 1.0


@dataclass
class Sample:
    """One look at the links: per direction (sender -> receiver) and per host's connections."""

    time: float
    lines: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Direction name -> the delayer's counts, the kernel queue's, and the tbf's."""
    tcp: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Host name -> connection ("local peer") -> what `ss -tni` says of it."""


class LinkRecorder:
    """Samples the given links (default: every link of `wan`) until stopped; use it with `with`."""

    def __init__(self, wan: Wan, links: list[Link] | None = None, interval_s: float = INTERVAL_S):
        self.wan = wan
        self.links = list(wan.links if links is None else links)
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._addresses = _addresses(wan)

    def __enter__(self) -> LinkRecorder:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="link-recorder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a sample that failed (a host going away) must not end the recording
                log.exception("link sample failed")

    def sample(self) -> Sample:
        """Take one sample now (also what `record` does first, so a run's end is in its record)."""
        with self._lock:
            taken = Sample(time.time())
            lines = [line for link in self.links for line in link.lines.values()]
            counts = snapshot_delayers(lines)
            for link in self.links:
                for sender, receiver in ((link.a, link.b), (link.b, link.a)):
                    line = link.lines.get(sender.name)
                    name = f"{sender.name} -> {receiver.name}"
                    taken.lines[name] = {
                        "delayer": counts.get(name),
                        "kernel_queue": kernel_queue(line) if line is not None else None,
                        "tbf": tbf_stats(sender, sender.iface_to(receiver)),
                        "alive": line is None or line.proc is None or line.proc.poll() is None,
                    }
            for host in {h.name: h for link in self.links for h in (link.a, link.b)}.values():
                taken.tcp[host.name] = connections_of(host, self._addresses)
            self.samples.append(taken)
            return taken

    def record(self, t0: float, t1: float) -> RunRecord:
        """What the links did from `t0` to `t1` (wall clock): the samples from the last one before
        `t0` to the first one after `t1` (one is taken now if none is yet)."""
        if not self.samples or self.samples[-1].time < t1:
            self.sample()
        with self._lock:
            before = [s for s in self.samples if s.time <= t0]
            inside = [s for s in self.samples if t0 < s.time]
            after = next((i for i, s in enumerate(inside) if s.time >= t1), len(inside) - 1)
            window = ([before[-1]] if before else []) + inside[:after + 1]
        return build_record(window, self.links, t0, t1)


def _addresses(wan: Wan) -> dict[str, str]:
    """Every address of the network -> the host that owns it (its own, and its ends of its links)."""
    owners = {host.ip: host.name for host in wan.hosts.values()}
    for link in wan.links:
        owners[link.addr_a], owners[link.addr_b] = link.a.name, link.b.name
    return owners


def snapshot_delayers(lines: list[DelayLine]) -> dict[str, dict[str, Any]]:
    """Ask every delayer for its counts (SIGUSR1) and read them back; a delayer that does not answer
    within SNAPSHOT_WAIT_S (or has exited) is left out."""
    asked: dict[str, tuple[DelayLine, int]] = {}
    for line in lines:
        before = _read_counts(line)
        if before is None:
            continue
        try:
            os.kill(int(before["pid"]), signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            continue
        asked[line.name] = (line, int(before["seq"]))
    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while asked and time.monotonic() < deadline:
        for name, (line, seq) in list(asked.items()):
            counts = _read_counts(line)
            if counts is not None and counts["seq"] > seq:
                out[name] = counts
                del asked[name]
        if asked:
            time.sleep(0.005)
    return out


def _read_counts(line: DelayLine) -> dict[str, Any] | None:
    try:
        return json.loads(line.stats_path.read_text())
    except (OSError, ValueError):
        return None


def kernel_queue(line: DelayLine) -> dict[str, int] | None:
    """The kernel's view of a delayer's NFQUEUE (/proc/net/netfilter/nfnetlink_queue of its namespace):
    packets held now, dropped because the queue was full or the delayer's socket was, and seen in all."""
    counts = _read_counts(line)
    if counts is None:
        return None
    try:
        text = open(f"/proc/{int(counts['pid'])}/net/netfilter/nfnetlink_queue").read()
    except OSError:
        return None
    for row in text.splitlines():
        cols = row.split()
        if len(cols) >= 8 and int(cols[0]) == int(counts["queue"]):  # the queue this delayer bound
            return {"held": int(cols[2]), "queue_dropped": int(cols[5]), "user_dropped": int(cols[6]),
                    "seen": int(cols[7])}
    return None


def tbf_stats(host: Host, iface: str) -> dict[str, int] | None:
    """Sent and dropped packets, and the queue now, of the rate limit where `host` sends on `iface`."""
    done = subprocess.run(["tc", "-s", "-j", "-n", host.namespace, "qdisc", "show", "dev", iface],
                          capture_output=True, text=True, check=False)
    try:
        qdiscs = json.loads(done.stdout or "[]")
    except ValueError:
        return None
    for q in qdiscs:
        if q.get("kind") == "tbf":
            return {"packets": q.get("packets", 0), "bytes": q.get("bytes", 0), "drops": q.get("drops", 0),
                    "backlog_bytes": q.get("backlog", 0), "backlog_packets": q.get("qlen", 0)}
    return None


def connections_of(host: Host, owners: dict[str, str]) -> dict[str, dict[str, Any]]:
    """`ss -tni` of `host`'s TCP connections to other hosts of the network (those that cross a link),
    by "local peer" address pairs."""
    done = subprocess.run(["ss", "-tinH", "-N", host.namespace, "state", "established"], capture_output=True,
                          text=True, check=False)
    out = {}
    for conn in parse_ss(done.stdout):
        peer_host = owners.get(conn["peer"].rpartition(":")[0])
        if peer_host is not None and peer_host != host.name:
            conn["host"], conn["peer_host"] = host.name, peer_host
            out[f"{conn['local']} {conn['peer']}"] = conn
    return out
