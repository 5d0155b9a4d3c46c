"""Start-up time of `deltamesh gateway`: from starting the process to its first /healthz answer.

Each run starts an origin gateway (anonymous, on a free loopback port, with an empty store and one
trusted key) and polls /healthz every 5 ms; the time to the first answer is that run's start-up.
Then it sends SIGTERM and times the exit (gateways stop within 2 s). It also reports whether the
running gateway mapped torch's native library (read from /proc/PID/maps on Linux; a gateway must
not need torch) and how long `deltamesh gateway --help` takes. The target is a start-up under 1 s.
`--deltamesh PATH` measures another installation's command (the slim venv a gateway host has).
`--json` prints {"deltamesh", "runs_s", "median_s", "max_s", "stop_s", "help_s", "torch_loaded",
"cpu_median_s" (CPU time the gateway used until it answered), "load_average", "target_s"}.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import bench_parser, emit, parse_bench_args, wait_healthy

from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.mesh.demo.processes import deltamesh_command, end_process, free_port

TARGET_S = 1.0


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) process `pid` has used so far; None where /proc cannot tell. Less moved
    by other load on the machine than the wall-clock start-up."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def torch_mapped(pid: int) -> bool | None:
    """Whether process `pid` has torch's native library mapped; None where /proc cannot tell."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    return "libtorch" in maps


def one_start(command: list[str], workdir: Path, trusted_key: Path) -> tuple[float, float, bool | None, float | None]:
    """(seconds to the first /healthz answer, seconds from SIGTERM to exit, torch mapped, CPU seconds
    used until it answered) of one gateway."""
    port = free_port()
    args = [*command, "gateway", "--listen", f"127.0.0.1:{port}", "--store", str(workdir / f"store-{port}"),
            "--trusted-key", str(trusted_key), "--anonymous"]
    with open(workdir / f"gateway-{port}.log", "wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=30, poll_s=0.005)
            up = time.perf_counter() - started
            cpu, torch = cpu_seconds(proc.pid), torch_mapped(proc.pid)
            stopping = time.perf_counter()
            end_process(proc, grace_s=10)
            return up, time.perf_counter() - stopping, torch, cpu
        finally:
            end_process(proc, grace_s=1)


def help_seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([*command, "gateway", "--help"], check=True, capture_output=True)
    return time.perf_counter() - started


def measure(command: list[str], repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="deltamesh-startup-") as tmp:
        workdir = Path(tmp)
        key = workdir / "trainer.pub"
        save_keypair(generate_key(), workdir / "trainer.key", key)
        help_seconds(command)  # once unmeasured: the first run after an install compiles the bytecode
        runs = [one_start(command, workdir, key) for _ in range(repeats + 1)][1:]
        help_s = help_seconds(command)
    ups = [r[0] for r in runs]
    return {"deltamesh": " ".join(command), "runs_s": [round(u, 3) for u in ups],
            "median_s": round(statistics.median(ups), 3), "max_s": round(max(ups), 3),
            "stop_s": round(max(r[1] for r in runs), 3), "help_s": round(help_s, 3),
            "torch_loaded": any(r[2] for r in runs) if any(r[2] is not None for r in runs) else None,
            "cpu_median_s": round(statistics.median(r[3] for r in runs), 3) if runs[0][3] is not None else None,
            "load_average": round(os.getloadavg()[0], 2), "target_s": TARGET_S}


def print_table(result: dict[str, Any]) -> None:
    print(f"deltamesh gateway start-up ({result['deltamesh']})")
    print(f"  to first /healthz: median {result['median_s']:.3f} s, max {result['max_s']:.3f} s "
          f"over {len(result['runs_s'])} runs (target < {result['target_s']:.0f} s)")
    print(f"  CPU until then:    median {result['cpu_median_s']} s (load average {result['load_average']})")
    print(f"  SIGTERM to exit:   max {result['stop_s']:.3f} s")
    print(f"  gateway --help:    {result['help_s']:.3f} s")
    print(f"  torch loaded:      {result['torch_loaded']}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="one run instead of several", repeats="measured starts")
    parser.add_argument("--deltamesh", metavar="PATH", help="the deltamesh command to measure "
                        "(default: this installation's)")
    args = parse_bench_args(parser, argv)
    command = [args.deltamesh] if args.deltamesh else deltamesh_command()
    emit(measure(command, args.repeats), args, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
