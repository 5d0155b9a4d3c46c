"""Shaping one direction of a link: a tbf rate limit where packets leave (the sender's veth end,
queue of one bandwidth-delay product) and a one-way delay where they arrive (the receiver's
INPUT chain sends them to an NFQUEUE, without `--queue-bypass`, and a delayer process accepts
each once it is due; netem is not available here). With no bypass a packet never skips the
delay, and a dead delayer darkens its link instead of silently turning it into a LAN.

Loss is the delayer's too (loss.py): it drops what the link should lose, per segment even in GSO
packets. A link asked to carry wire packets (`one_segment_per_packet`: the sender's veth end takes no
GSO packets, so TCP builds no multi-segment ones for it) makes each drop exactly one packet, at a
per-packet cost; otherwise GSO packets pass whole, at a fraction of it.
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import time
from pathlib import Path

from .loss import Loss
from .processes import stop_process
from .shell import WanError, in_netns, run

log = logging.getLogger(__name__)

DELAYER = Path(__file__).resolve().parent / "delayer.py"
# Floors that keep slow links from dropping every TCP burst without letting them run far ahead
# of their rate: 16 KiB is 26 ms at 5 Mbit/s, 64 KiB of queue ~44 full-size packets.
MIN_BURST_BYTES = 16 * 1024
MIN_QUEUE_BYTES = 64 * 1024
READY_TIMEOUT_S = 15.0


def tbf_params(mbit: float, queue_ms: float) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf of `mbit` whose queue holds `queue_ms` of traffic.

    The burst covers 2 ms at full rate (at 400 Mbit/s that is more than one 64 KiB GSO packet,
    so a fast link does not split every TSO burst); the limit is the queue beyond the burst.
    """
    bytes_per_ms = mbit * 1e6 / 8 / 1000
    burst = max(MIN_BURST_BYTES, int(bytes_per_ms * 2))
    limit = max(MIN_QUEUE_BYTES, int(bytes_per_ms * queue_ms)) + burst
    return burst, limit


def limit_rate(namespace: str, iface: str, mbit: float, queue_ms: float) -> None:
    """Limit what leaves `iface` in `namespace` to `mbit` (replaces any earlier root qdisc)."""
    burst, limit = tbf_params(mbit, queue_ms)
    run(in_netns(namespace, [
        "tc", "qdisc", "replace", "dev", iface, "root", "tbf",
        "rate", f"{int(mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit),
    ]))


def one_segment_per_packet(namespace: str, iface: str) -> None:
    """Make every TCP packet sent out of `iface` carry one segment (connections opened from now on)."""
    run(in_netns(namespace, ["ip", "link", "set", "dev", iface, "gso_max_segs", "1"]))


def delayer_files(log_path: Path) -> tuple[Path, Path]:
    """(counts, loss control) files of the delayer that logs to `log_path`."""
    return log_path.with_suffix(".json"), log_path.with_suffix(".loss.json")


def write_loss(control: Path, loss: Loss) -> None:
    tmp = control.with_suffix(".tmp")
    tmp.write_text(json.dumps(loss.as_dict()))
    tmp.replace(control)


def start_delayer(namespace: str, iface: str, queue_num: int, delay_ms: float, log_path: Path, *,
                  loss: Loss = Loss(), lossy: bool = False) -> subprocess.Popen:
    """Start a delayer for what arrives on `iface`, then send that traffic through it.

    The process runs inside `namespace` in its own session (a Ctrl-C on the terminal reaches
    only the emulator, which then ends its delayers in order), with its stderr in `log_path`
    (never the caller's, which a detached network would otherwise hold open), its counts and its
    loss beside it (`delayer_files`); `lossy`: a link that may lose packets (now or later). Raises
    WanError and leaves nothing running if the delayer does not report ready.
    """
    stats, control = delayer_files(log_path)
    write_loss(control, loss)
    cmd = in_netns(namespace, [
        sys.executable, str(DELAYER), "--queue", str(queue_num), "--delay-ms", str(delay_ms),
        "--stats", str(stats), "--control", str(control), *(["--lossy"] if lossy else []),
    ])
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        _wait_ready(proc, f"delayer for {namespace}/{iface}", log_path)
        run(in_netns(namespace, [
            "iptables", "-w", "-A", "INPUT", "-i", iface, "-j", "NFQUEUE", "--queue-num", str(queue_num),
        ]))
    except BaseException:
        stop_process(proc)
        raise
    log.debug("delayer pid %d: %s/%s +%.1f ms", proc.pid, namespace, iface, delay_ms)
    return proc


def _wait_ready(proc: subprocess.Popen, what: str, log_path: Path) -> None:
    """Wait for the first stdout line to be `ready`."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WanError(f"{what} did not start within {READY_TIMEOUT_S:.0f} s")
        readable, _, _ = select.select([proc.stdout], [], [], left)
        if readable:
            line = proc.stdout.readline()
            if line.strip() == b"ready":
                return
            proc.wait(timeout=5)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise WanError(f"{what} failed to start (exit {proc.returncode}): {' | '.join(tail)}")
