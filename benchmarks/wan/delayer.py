"""The one-way delay of one link direction: a user-space NFQUEUE consumer, run inside the
receiving namespace as `python delayer.py --queue N --delay-ms D`. It takes only each packet's
id (the payload stays in the kernel, and GSO packets stay whole: see nfqueue.py), keeps the ids in
a FIFO with the time each is due (one delay per queue, so release order is arrival order and no
heap is needed), and on each wake-up drains everything readable and accepts everything due with
one batch verdict, so a busy link costs a system call per packet, not a Python callback and a
verdict each. It prints `ready` once bound and exits cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import sys
import time

from nfqueue import Queue

# The kernel holds every delayed packet in the queue: 400 Mbit/s x 150 ms one-way is ~5,000
# full-size packets in flight; ACK-heavy or small-packet traffic needs several times that.
DEFAULT_MAX_LEN = 262144
# Room for the notices the kernel sends while this process is busy releasing a batch.
DEFAULT_SOCK_BYTES = 64 << 20
REALTIME_PRIORITY = 10


class Stopped(Exception):
    """SIGTERM or SIGINT arrived."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Delay every packet of an NFQUEUE by a fixed time.")
    parser.add_argument("--queue", type=int, required=True, help="NFQUEUE number to bind")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay to add")
    parser.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, help="queue length in packets")
    return parser.parse_args(argv)


def run(queue: int, delay_s: float, max_len: int) -> None:
    """Delay every packet of `queue` by `delay_s` until SIGTERM/SIGINT."""

    def stop(_signum: int, _frame: object) -> None:
        # Raising wakes the loop at once (a flag would wait out select's timeout).
        raise Stopped

    clock = time.monotonic
    pending: collections.deque[tuple[float, int]] = collections.deque()
    _prefer_cpu()
    nfq = Queue(queue, max_len, DEFAULT_SOCK_BYTES)
    try:
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        print("ready", flush=True)
        while True:
            timeout = 0.5 if not pending else max(0.0, pending[0][0] - clock())
            readable, _, _ = select.select([nfq], [], [], timeout)
            if readable:
                due = clock() + delay_s
                pending.extend((due, i) for i in nfq.receive())
            now = clock()
            last = None
            while pending and pending[0][0] <= now:
                last = pending.popleft()[1]
            if last is not None:
                nfq.accept_upto(last)
    except Stopped:
        pass  # packets still held are dropped by the kernel when the queue goes away
    finally:
        if nfq.lost:
            print(f"delayer: queue {queue} overflowed its socket {nfq.lost} times; packets were dropped",
                  file=sys.stderr)
        nfq.close()


def _prefer_cpu() -> None:
    """Run under a low real-time priority: on a busy machine an ordinary process wakes
    milliseconds late, and every late wake-up is added to the emulated delay. The delayer
    mostly sleeps, and the kernel's real-time throttling caps it if it ever spins."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except (OSError, AttributeError) as exc:
        print(f"delayer: running without real-time priority ({exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.delay_ms < 0:
        print("delay must be >= 0", file=sys.stderr)
        return 2
    run(args.queue, args.delay_ms / 1000.0, args.max_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
