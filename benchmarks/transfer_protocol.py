"""The protocol every timed agent of the transfer benchmark follows (benchmarks/transfer_agent.py):
it does its set-up, creates its `--ready` file, waits for the `--go` file to appear, does its work and
writes one JSON object of wall-clock times to `--out`; `Progress` marks each tenth of a transfer.
An agent whose connections' figures matter keeps them open after writing its result until the go
file's `.end` sibling appears (`results_then_linger`), so the run's link record (wan/records.py) can
read their final state with `ss` before they close.
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


LINGER_S = 30.0
"""Longest an agent keeps its connections open after its result, waiting for the end file."""


def end_file(go: str | Path) -> Path:
    """The file whose appearance lets the agents of a batch close their connections and exit."""
    return Path(go).with_suffix(".end")


async def results_then_linger(args: argparse.Namespace, result: dict) -> dict:
    """Write `result`, then wait (connections open) until the batch's end file appears."""
    import asyncio

    write_json(args.out, result)
    deadline = time.monotonic() + LINGER_S
    while not end_file(args.go).exists() and time.monotonic() < deadline:
        await asyncio.sleep(GO_POLL_S * 5)
    return result


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
