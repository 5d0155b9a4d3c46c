"""The one-way delay (and, where asked, the loss) of one link direction: a user-space NFQUEUE
consumer, run inside the receiving namespace as `python delayer.py --queue N --delay-ms D`. It takes
only each packet's id (the payload stays in the kernel, and GSO packets stay whole: see nfqueue.py),
keeps the ids in a FIFO with the time each is due (one delay per queue, so release order is arrival
order and no heap is needed), and accepts everything due with one batch verdict.

It wakes at most once per `--batch-ms` (default 1 ms): what arrived since is stamped then and what
fell due since is released then, so on a busy link a wake-up (a few system calls and a pass of this
loop) carries tens of packets instead of one, and a packet is held at most that much longer than
asked; a lone packet (an RTT probe) is not held at all. `--loss` drops packets at random, and
`--burst-rate` starts bursts that drop `--burst-len` packets in a row on average (a Gilbert model,
loss.py: once per segment a GSO packet carries); a dropped packet gets its own verdict as it arrives.
On SIGUSR2 it reads the loss again from
`--control` (a JSON object of Loss's fields), so a running link can start or stop losing packets.

It counts what it did and, on SIGUSR1, writes the counts to `--stats` as one JSON object (see
`Counts`), so a run's record says what the link actually did. It prints `ready` once bound and exits
cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loss import Dropper, Loss, segments_of
from nfqueue import Queue

# The kernel holds every delayed packet in the queue: 400 Mbit/s x 150 ms one-way is ~5,000
# full-size packets in flight; ACK-heavy or small-packet traffic needs several times that.
DEFAULT_MAX_LEN = 262144
# Room for the notices the kernel sends while this process is busy releasing a batch.
DEFAULT_SOCK_BYTES = 64 << 20
REALTIME_PRIORITY = 10
DEFAULT_BATCH_MS = 1.0
LATE_MS = 2.0
LATE_SHARE_OF_DELAY = 0.02
"""A packet released more than LATE_MS or this share of its delay (whichever is more) after it was due
(batching included) is counted late: 3 ms on a 300 ms link, whose TCP would not notice less."""
IDLE_WAIT_S = 0.5


class Stopped(Exception):
    """SIGTERM or SIGINT arrived."""


@dataclass
class Counts:
    """What the delayer did: counters since it started, maxima since the last snapshot."""

    pid: int
    queue: int
    seq: int = 0
    """Snapshots written so far (this one included)."""
    time: float = 0.0
    received: int = 0
    released: int = 0
    dropped: int = 0
    """Dropped on purpose: the loss asked for."""
    segments: int = 0
    """Wire packets the packets received stood for (counted while the link loses packets)."""
    dropped_segments: int = 0
    late: int = 0
    """Released more than LATE_MS after they were due."""
    overflows: int = 0
    """Times the netlink socket overflowed (the kernel dropped the packets it could not report)."""
    wakeups: int = 0
    max_late_ms: float = 0.0
    max_held: int = 0
    """Most packets held at once (the delay line's depth)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Delay (and drop) the packets of an NFQUEUE.")
    parser.add_argument("--queue", type=int, required=True, help="NFQUEUE number to bind")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay to add")
    parser.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, help="queue length in packets")
    parser.add_argument("--batch-ms", type=float, default=DEFAULT_BATCH_MS,
                        help="wake at most once per this long (0: on every packet)")
    parser.add_argument("--loss", type=float, default=0.0, help="drop each packet with this probability")
    parser.add_argument("--burst-rate", type=float, default=0.0, help="start a burst of drops with this probability")
    parser.add_argument("--burst-len", type=float, default=1.0, help="mean packets a burst drops")
    parser.add_argument("--seed", type=int, default=None, help="seed of the drops (default: random)")
    parser.add_argument("--stats", type=Path, default=None, help="where SIGUSR1 writes the counts (JSON)")
    parser.add_argument("--control", type=Path, default=None,
                        help="JSON of the loss (rate, burst_rate, burst_len), read again on SIGUSR2")
    parser.add_argument("--lossy", action="store_true",
                        help="a link that may lose packets: learn each packet's length, to count its segments")
    return parser.parse_args(argv)


def write_counts(path: Path | None, counts: Counts) -> None:
    """Write a snapshot (atomically) and start the next window of maxima."""
    counts.seq += 1
    counts.time = time.time()
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(counts)))
        os.replace(tmp, path)
    counts.max_late_ms = 0.0
    counts.max_held = 0


def read_loss(path: Path) -> Loss:
    return Loss.of(json.loads(path.read_text()))


def run(queue: int, delay_s: float, max_len: int, *, batch_s: float = DEFAULT_BATCH_MS / 1000,
        loss: Loss = Loss(), seed: int | None = None, stats: Path | None = None,
        control: Path | None = None, lossy: bool = False) -> None:
    """Delay every packet of `queue` by `delay_s` (dropping some, if `loss` says so) until SIGTERM/SIGINT."""

    def stop(_signum: int, _frame: object) -> None:
        # Raising wakes the loop at once (a flag would wait out select's timeout).
        raise Stopped

    counts = Counts(os.getpid(), queue)
    clock = time.monotonic
    late_s = max(LATE_MS / 1000, LATE_SHARE_OF_DELAY * delay_s)
    pending: collections.deque[tuple[float, int]] = collections.deque()
    rng = random.Random(seed)
    dropper = Dropper(loss, rng) if loss.active else None

    def reload(_signum: int, _frame: object) -> None:
        nonlocal dropper
        try:
            new = read_loss(control) if control is not None else Loss()
        except (OSError, ValueError, TypeError) as exc:
            print(f"delayer: loss not changed: {exc}", file=sys.stderr)
            return
        dropper = Dropper(new, rng) if new.active else None

    _prefer_cpu()
    nfq = Queue(queue, max_len, DEFAULT_SOCK_BYTES, sized=lossy or loss.active)
    try:
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGUSR1, lambda *_: write_counts(stats, counts))
        signal.signal(signal.SIGUSR2, reload)
        write_counts(stats, counts)
        print("ready", flush=True)
        woke = 0.0
        while True:
            timeout = IDLE_WAIT_S if not pending else max(0.0, pending[0][0] - clock())
            readable, _, _ = select.select([nfq], [], [], timeout)
            now = clock()
            if now - woke < batch_s:  # a busy link: let the next packets gather first
                time.sleep(batch_s - (now - woke))
                now = clock()
            woke = now
            counts.wakeups += 1
            if readable or batch_s:
                ids = arrivals(nfq, dropper, counts)
                due = now + delay_s
                pending.extend((due, i) for i in ids)
                counts.max_held = max(counts.max_held, len(pending))
            last = None
            released = 0
            cutoff = now - late_s
            while pending and pending[0][0] <= now:
                due, last = pending.popleft()
                released += 1
                if due < cutoff:
                    counts.late += 1
                    counts.max_late_ms = max(counts.max_late_ms, (now - due) * 1000)
            if last is not None:
                nfq.accept_upto(last)
                counts.released += released
            counts.overflows = nfq.lost
    except Stopped:
        pass  # packets still held are dropped by the kernel when the queue goes away
    finally:
        if nfq.lost:
            print(f"delayer: queue {queue} overflowed its socket {nfq.lost} times; packets were dropped",
                  file=sys.stderr)
        nfq.close()


def arrivals(nfq: Queue, dropper: Dropper | None, counts: Counts) -> list[int]:
    """Ids of the packets that arrived since the last call and are to be delayed: all of them, or those
    the dropper keeps (the others are dropped at once)."""
    if dropper is None or not nfq.sized:
        ids = nfq.receive()
        counts.received += len(ids)
        return ids
    kept = []
    for packet_id, size in nfq.receive_sized():
        segments = segments_of(size)
        counts.received += 1
        counts.segments += segments
        if dropper.drop(segments):
            nfq.drop(packet_id)
            counts.dropped += 1
            counts.dropped_segments += segments
        else:
            kept.append(packet_id)
    return kept


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
    if args.delay_ms < 0 or args.batch_ms < 0:
        print("delay and batch must be >= 0", file=sys.stderr)
        return 2
    try:
        loss = read_loss(args.control) if args.control else Loss(args.loss, args.burst_rate, args.burst_len)
    except (OSError, ValueError, TypeError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    run(args.queue, args.delay_ms / 1000.0, args.max_len, batch_s=args.batch_ms / 1000.0, loss=loss,
        seed=args.seed, stats=args.stats, control=args.control, lossy=args.lossy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
