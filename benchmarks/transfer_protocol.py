"""The protocol every timed agent of the transfer benchmark follows (benchmarks/transfer_agent.py):
it does its set-up, creates its `--ready` file, waits for the `--go` file to appear, does its work and
writes one JSON object of wall-clock times to `--out`; `Progress` marks each tenth of a transfer.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

GO_POLL_S = 0.002


def write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def ready_then_wait(args: argparse.Namespace) -> float:
    """Signal ready, then block until the go file exists; returns the time work starts."""
    Path(args.ready).touch()
    while not os.path.exists(args.go):
        time.sleep(GO_POLL_S)
    return time.time()


class Progress:
    """(time, bytes) marks each time another tenth of a transfer has arrived: its ramp, for the report.
    The total may be set after bytes have started arriving (pieces prefetched with the manifest)."""

    def __init__(self, total: int | None = None):
        self.total, self.done, self.marks = total, 0, []

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        while self.total and self.done >= (len(self.marks) + 1) * self.total / 10 and len(self.marks) < 10:
            self.marks.append((round(time.time(), 4), self.done))


def add_sync_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready", required=True, help="file created once set up")
    p.add_argument("--go", required=True, help="file whose appearance starts the work")
    p.add_argument("--out", required=True, help="where the JSON result is written")
