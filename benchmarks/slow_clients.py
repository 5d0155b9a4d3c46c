"""An honest client's latency at a gateway and a broker while hundreds of slow-header clients hold connections.

Each server runs as its own process (`deltamesh gateway --anonymous`, `deltamesh broker --anonymous`),
with `--header-timeout-s` as given. First the honest client's `GET /healthz` latency alone (a fresh
connection per request, as a new peer pays it); then `--slow` connections are opened from other
loopback addresses (127.0.0.2 ... , `--per-address` each), each sending a request line and then one
header byte every `--trickle-s` seconds without ever ending its headers, and the honest client is
measured again while they are held; last, how long after its opening the server closed each slow
connection (it should be about the header timeout). The target: p50 under 50 ms while 500 such
connections are held, and every one closed within the header timeout (plus a second). Timing figures
taken beside other work are noisy: compare the two latency columns of one run.
`--json` prints {"slow", "header_timeout_s", "servers": {name: {"alone_ms": {p50, p95}, "held_ms":
{p50, p95}, "held_at_peak", "closed": n, "closed_within_s": max, "still_open"}}, "target_p50_ms"}.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from common import bench_parser, emit, parse_bench_args, stop_processes, wait_healthy

from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.mesh.demo.processes import deltamesh_command, free_port

TARGET_P50_MS = 50.0


def server_args(kind: str, workdir: Path, port: int, header_timeout_s: float, extra: Sequence[str] = ()) -> list[str]:
    """The command line of an anonymous gateway or broker on loopback port `port`."""
    listen = ["--listen", f"127.0.0.1:{port}", "--header-timeout-s", str(header_timeout_s), *extra]
    if kind == "gateway":
        key = workdir / "trainer.pub"
        if not key.exists():
            save_keypair(generate_key(), workdir / "trainer.key", key)
        return ["gateway", *listen, "--store", str(workdir / f"store-{port}"), "--trusted-key", str(key), "--anonymous"]
    return ["broker", *listen, "--db", str(workdir / f"broker-{port}.db"), "--model", "m", "--anonymous"]


def start_server(kind: str, workdir: Path, header_timeout_s: float, extra: Sequence[str] = ()
                 ) -> tuple[subprocess.Popen, int, Path]:
    """A server process answering /healthz: (process, port, its log file)."""
    port = free_port()
    log = workdir / f"{kind}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*deltamesh_command(), *server_args(kind, workdir, port, header_timeout_s, extra)],
                                stdout=out, stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=60)
    return proc, port, log


class SlowClient:
    """One connection that sends a request line, then its headers a byte at a time, never ending them."""

    def __init__(self, port: int, source: str, trickle_s: float) -> None:
        self.port, self.source, self.trickle_s = port, source, trickle_s
        self.opened = self.closed = 0.0
        """When the connection opened and when the server closed it (0: not yet)."""
        self.task: asyncio.Task | None = None

    async def run(self, silent: bool = False) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(self.source, 0))
        self.opened = time.monotonic()
        watching = asyncio.ensure_future(reader.read())  # b"" (EOF) once the server closes it
        try:
            if not silent:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            while not watching.done():
                if not silent:
                    writer.write(b"a")
                    await writer.drain()
                await asyncio.wait([watching], timeout=self.trickle_s)
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed = time.monotonic()
            watching.cancel()
            writer.close()


async def hold(port: int, count: int, per_address: int, trickle_s: float, *, silent_share: float = 0.1,
               first_source: int = 2) -> list[SlowClient]:
    """Open `count` slow clients, `per_address` from each of 127.0.0.N (N from `first_source`); a share of
    them connect and send nothing at all. They run until the server closes them (or are cancelled)."""
    clients = []
    silent = int(count * silent_share)
    for i in range(count):
        client = SlowClient(port, f"127.0.0.{first_source + i // per_address}", trickle_s)
        client.task = asyncio.ensure_future(client.run(silent=i < silent))
        clients.append(client)
        if i % 50 == 49:
            await asyncio.sleep(0)  # let the connections open as they go
    return clients


async def latencies(port: int, requests: int, source: str = "127.0.0.1") -> list[float]:
    """Seconds of each of `requests` honest `GET /healthz` requests, each on a fresh connection."""
    out = []
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    for _ in range(requests):
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(request)
        answer = await reader.read()
        writer.close()
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"/healthz answered {answer[:80]!r}")
        out.append(time.perf_counter() - t0)
    return out


def percentiles(seconds: Sequence[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"p50": round(statistics.median(ms), 2), "p95": round(ms[int(0.95 * (len(ms) - 1))], 2)}


async def measure_one(port: int, slow: int, per_address: int, trickle_s: float, header_timeout_s: float,
                      requests: int) -> dict[str, Any]:
    alone = await latencies(port, requests)
    clients = await hold(port, slow, per_address, trickle_s)
    await asyncio.sleep(min(0.5, header_timeout_s / 4))  # all of them open and trickling
    held_at_peak = sum(1 for c in clients if c.opened and not c.closed)
    during = await latencies(port, requests)
    await asyncio.wait([c.task for c in clients], timeout=header_timeout_s + 5)
    still = [c for c in clients if not c.task.done()]
    for c in still:
        c.task.cancel()
    closed = [c.closed - c.opened for c in clients if c.task.done() and c.opened and c.closed]
    return {"alone_ms": percentiles(alone), "held_ms": percentiles(during), "held_at_peak": held_at_peak,
            "closed": len(closed), "closed_within_s": round(max(closed), 2) if closed else None,
            "still_open": len(still)}


def measure(slow: int, per_address: int, trickle_s: float, header_timeout_s: float, requests: int) -> dict[str, Any]:
    result: dict[str, Any] = {"slow": slow, "header_timeout_s": header_timeout_s, "servers": {},
                              "target_p50_ms": TARGET_P50_MS}
    with tempfile.TemporaryDirectory(prefix="deltamesh-slow-") as tmp:
        for kind in ("gateway", "broker"):
            # Enough for the slow clients of one address, so that the header timeout, not the cap, ends them.
            proc, port, _ = start_server(kind, Path(tmp), header_timeout_s,
                                         ["--max-connections-per-address", str(per_address + 8)])
            try:
                result["servers"][kind] = asyncio.run(
                    measure_one(port, slow, per_address, trickle_s, header_timeout_s, requests))
            finally:
                stop_processes([proc])
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"honest GET /healthz (fresh connection each) while {result['slow']} slow-header connections are held "
          f"(header timeout {result['header_timeout_s']:g} s; target p50 < {result['target_p50_ms']:.0f} ms)")
    print(f"{'server':8} {'alone p50/p95 ms':>18} {'held p50/p95 ms':>18} {'held':>6} {'closed':>7} "
          f"{'closed within s':>16} {'left open':>10}")
    for name, r in result["servers"].items():
        print(f"{name:8} {r['alone_ms']['p50']:>8.2f}/{r['alone_ms']['p95']:<9.2f} "
              f"{r['held_ms']['p50']:>8.2f}/{r['held_ms']['p95']:<9.2f} {r['held_at_peak']:>6} {r['closed']:>7} "
              f"{r['closed_within_s']!s:>16} {r['still_open']:>10}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="100 slow clients and a 1 s header timeout", repeats="unused")
    parser.add_argument("--slow", type=int, default=500, help="slow-header connections held (default 500)")
    parser.add_argument("--per-address", type=int, default=100, help="slow connections per source address")
    parser.add_argument("--trickle-s", type=float, default=0.5, help="seconds between a slow client's bytes")
    parser.add_argument("--header-timeout-s", type=float, default=3.0, help="the servers' header timeout")
    parser.add_argument("--requests", type=int, default=200, help="honest requests measured per phase")
    args = parse_bench_args(parser, argv)
    if args.quick:
        args.slow, args.header_timeout_s, args.requests = 100, 1.0, 50
    emit(measure(args.slow, args.per_address, args.trickle_s, args.header_timeout_s, args.requests), args,
         print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
