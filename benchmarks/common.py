"""What the benchmarks share: the flags and the output every benchmark has (a table, or one JSON
object with --json), and for those that run real `deltamesh` service processes, waiting for a
process to answer and stopping the processes whatever the run did (their ports come from
`deltamesh.mesh.demo.processes.free_port`).

Imported by name, as the benchmarks import each other (they run with this folder on sys.path). Only
the standard library is imported here, so that pure models (simulate.py) stay light.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from deltamesh.tls import TlsSettings


def piece_digest(data: bytes) -> str:
    """The digest a hand-made manifest names a piece by, in the package this run imports: side-by-side
    runs (swap_compare.py's shim) import older checkouts, whose format 2 named pieces by xxh3-128."""
    try:
        from deltamesh.delta.hashing import piece_digest as content_digest
    except ImportError:
        from deltamesh.delta.hashing import digest as content_digest
    return content_digest(data)


def bench_parser(doc: str, *, quick: str, repeats: str) -> argparse.ArgumentParser:
    """A benchmark's parser, described by the first paragraph of `doc`, with the flags measuring
    benchmarks share: --json, --save PATH, --quick (`quick` says what it shrinks) and --repeats
    (`repeats` says of what; `parse_bench_args` makes it 3, or 1 with --quick, when not given)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--save", metavar="PATH", help="also write the JSON object to PATH")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--repeats", type=int, default=None, help=f"{repeats} (default 3, quick 1)")
    return p


def parse_bench_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def emit(result: dict[str, Any], args: argparse.Namespace, print_table: Callable[[dict[str, Any]], None]) -> None:
    """Show a benchmark's result as its flags ask: one JSON object on stdout with --json, else the
    tables `print_table` makes of it; --save PATH (where the benchmark has it) also writes it to PATH."""
    if getattr(args, "save", None):
        Path(args.save).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


@contextlib.contextmanager
def stdout_to_stderr(on: bool) -> Iterator[None]:
    """While `on`, everything written to file descriptor 1 goes to stderr instead, this process's and
    the processes it starts alike (vLLM and its workers log to stdout): with --json, the one object
    `emit` prints after it is all stdout carries."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def wait_healthy(url: str, proc: subprocess.Popen, path: str = "/healthz", tls: TlsSettings | None = None,
                 timeout: float = 60.0, expect: dict[str, Any] | None = None, poll_s: float = 0.1) -> None:
    """Return once `url + path` answers at all (any HTTP status; with `expect`, only a 2xx whose JSON
    body holds those items, e.g. {"role": "active"} for the broker that serves, not a standby);
    RuntimeError if `proc` exits first or nothing answers within `timeout` seconds. It asks every
    `poll_s` seconds (smaller where the wait itself is measured)."""
    from deltamesh.tls import client_context

    deadline = time.monotonic() + timeout
    context = client_context(tls) if tls is not None else None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + path, timeout=1, context=context) as resp:
                if expect is None or expect.items() <= json.loads(resp.read()).items():
                    return
        except urllib.error.HTTPError:
            if expect is None:
                return  # it answers
        except OSError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} did not come up")


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then SIGKILL any that has not exited `grace_s` later."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
