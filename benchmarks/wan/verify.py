"""Checking that a link is what was asked for: RTT (the least of probe.py's echo round trips) and
bulk TCP payload throughput (receiver-side, over the second half of a parallel-stream run, past
slow start) within a tolerance, 10% by default, of the asked RTT and rate; a check that is off
says so in its message rather than raising. Payload rate is ~4.4% under the wire rate at MTU
1500 (headers), inside the tolerance; the RTT check allows at least RTT_SLACK_MS because each
delayer adds ~0.1-0.3 ms of wake-up latency per direction, noise on a WAN link but 20% of a 2 ms one.
The least round trip, as ping's min, is the link's delay: what the other processes on a busy machine
add (a delayer or the echo woken late) only ever lengthens a sample, by up to 1.5 ms on 2 loaded
cores, so a median would fail a right link there, while a delay set too short still shows in every
sample. Even the least of RTT_SAMPLES can carry that lateness when the machine stays busy (a CI run
read 11.3 ms on a 10 ms link), so a long reading gets LATE_WAKEUP_MS more room than a short one:
lateness can only lengthen a round trip, never shorten it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .processes import stop_process
from .shell import WanError

if TYPE_CHECKING:
    from .emulator import Host, Wan

PROBE = Path(__file__).resolve().parent / "probe.py"
RTT_SLACK_MS = 0.5
LATE_WAKEUP_MS = 1.5
RTT_SAMPLES = 15


@dataclass(frozen=True)
class LinkCheck:
    """The result of measuring one direction of a link."""

    sender: str
    receiver: str
    asked_rtt_ms: float
    rtt_ms: float | None
    asked_mbit: float
    mbit: float | None
    ok: bool
    message: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_seconds(rtt_ms: float) -> float:
    """Bulk run length: long enough that its second half is past slow start (~7 RTTs)."""
    return min(15.0, max(3.0, 2.0 + 20 * rtt_ms / 1000))


def verify_link(sender: Host, receiver: Host, *, seconds: float | None = None, streams: int = 4,
                rtt_count: int = RTT_SAMPLES, tolerance: float = 0.10, measure_rate: bool = True) -> LinkCheck:
    """Measure the link from `sender` to `receiver`; a link that is off target, dark or unreachable
    gives a check that says so (ok=False) rather than an exception. A direction that loses packets on
    purpose carries less than its rate (that is what loss does to TCP): only its RTT is measured."""
    link = sender.link_to(receiver)
    measure_rate = measure_rate and not link.loss_from(sender).active
    asked_mbit = link.mbit_from(sender)
    seconds = default_seconds(link.rtt_ms) if seconds is None else seconds
    dead = link.dead_delayers()
    if dead:  # the link drops everything in that direction: nothing to measure
        return judge(sender.name, receiver.name, link.rtt_ms, None, asked_mbit, None, tolerance,
                     f"delayer(s) exited: {'; '.join(dead)}")
    rtt_ms = mbit = failure = None
    try:
        rtt_ms, mbit = _measure(sender, receiver, seconds, streams, rtt_count, measure_rate)
    except WanError as exc:
        failure = f"measurement failed: {exc}"
    return judge(sender.name, receiver.name, link.rtt_ms, rtt_ms, asked_mbit, mbit, tolerance, failure)


def _measure(sender: Host, receiver: Host, seconds: float, streams: int, rtt_count: int,
             measure_rate: bool) -> tuple[float, float | None]:
    """(RTT ms, payload Mbit/s or None) from sender to receiver."""
    link = sender.link_to(receiver)
    target = sender.addr_of(receiver)
    timeout = str(10 + 3 * link.rtt_ms / 1000)
    probe = [sys.executable, str(PROBE)]
    with _server(receiver, realtime=True) as echo:
        out = sender.run([*probe, "rtt", "--to", f"{target}:{echo.port}", "--count", rtt_count, "--timeout", timeout],
                         timeout=30 + rtt_count * link.rtt_ms / 1000).stdout
    rtt_ms = min(json.loads(out)["samples_ms"])
    if not measure_rate:
        return rtt_ms, None
    with _server(receiver) as sink:
        sender.run([*probe, "send", "--to", f"{target}:{sink.port}", "--streams", streams,
                    "--seconds", seconds, "--timeout", timeout], timeout=seconds + 60)
    return rtt_ms, _steady_mbit(sink.report)


def verify_all(wan: Wan, **options: Any) -> list[LinkCheck]:
    """Check every link, in the direction it was declared (a to b), one after another."""
    return [verify_link(link.a, link.b, **options) for link in wan.links]


def _rtt_allowance(off_ms: float, asked_rtt_ms: float, tolerance: float) -> float:
    base = max(tolerance * asked_rtt_ms, RTT_SLACK_MS)
    return base + LATE_WAKEUP_MS if off_ms > 0 else base


def judge(sender: str, receiver: str, asked_rtt_ms: float, rtt_ms: float | None, asked_mbit: float,
          mbit: float | None, tolerance: float, failure: str | None = None) -> LinkCheck:
    """Compare measurements (None: not measured) with what was asked and say what is off."""
    problems = [failure] if failure else []
    if rtt_ms is not None and abs(rtt_ms - asked_rtt_ms) > _rtt_allowance(rtt_ms - asked_rtt_ms, asked_rtt_ms,
                                                                         tolerance):
        problems.append(f"RTT {rtt_ms:.1f} ms is {rtt_ms - asked_rtt_ms:+.1f} ms off {asked_rtt_ms:g} ms")
    if mbit is not None:
        rate_off = (mbit - asked_mbit) / asked_mbit
        if abs(rate_off) > tolerance:
            problems.append(f"throughput {mbit:.0f} Mbit/s is {rate_off:+.0%} off {asked_mbit:g} Mbit/s")
    rtt_text = "RTT not measured" if rtt_ms is None else f"RTT {rtt_ms:.1f} ms of {asked_rtt_ms:g}"
    rate_text = "rate not measured" if mbit is None else f"{mbit:.1f} Mbit/s of {asked_mbit:g}"
    summary = f"{rtt_text}, {rate_text}"
    message = summary if not problems else summary + ": " + "; ".join(problems)
    return LinkCheck(sender, receiver, asked_rtt_ms, rtt_ms, asked_mbit, mbit, not problems, message)


def format_table(checks: list[LinkCheck]) -> str:
    """A plain-text table of link checks."""
    rows = [("link", "RTT asked", "RTT ms", "Mbit asked", "Mbit/s", "ok")]
    for c in checks:
        rows.append((f"{c.sender} -> {c.receiver}", f"{c.asked_rtt_ms:g}", "-" if c.rtt_ms is None else f"{c.rtt_ms:.1f}",
                     f"{c.asked_mbit:g}", "-" if c.mbit is None else f"{c.mbit:.1f}",
                     "yes" if c.ok else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.extend(f"  {c.sender} -> {c.receiver}: {c.message}" for c in checks if not c.ok)
    return "\n".join(lines)


class _server:
    """A probe server inside `host` for the duration of a `with` (listening on `.port`).

    On a clean exit it is stopped with SIGTERM and its receive report kept in `.report`.
    """

    def __init__(self, host: Host, realtime: bool = False) -> None:
        self.host = host
        self.argv = [sys.executable, str(PROBE), "serve", "--port", "0"] + (["--realtime"] if realtime else [])
        self.report: dict[str, Any] = {}

    def __enter__(self) -> _server:
        self.proc = self.host.spawn(self.argv, stdout=subprocess.PIPE)
        readable, _, _ = select.select([self.proc.stdout], [], [], 15.0)
        line = self.proc.stdout.readline().decode() if readable else ""
        if not line:
            stop_process(self.proc)
            raise WanError(f"probe server in {self.host.name} did not start (exit {self.proc.poll()})")
        self.port = json.loads(line)["listening"]
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=15)
            self.report = json.loads(out.decode().strip().splitlines()[-1])
        else:
            stop_process(self.proc)


def _steady_mbit(report: dict[str, Any]) -> float:
    """Mean payload rate over the second half of the receive bins, leaving out the last partial bin."""
    bins = report["bins"][:-1]
    if len(bins) < 4:
        return 0.0
    half = bins[len(bins) // 2:]
    return sum(half) * 8 / (len(half) * report["bin_s"]) / 1e6
