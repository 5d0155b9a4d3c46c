"""Run every benchmark in turn (`make bench`), each as its own process, and stop at the first failure.

Each benchmark prints its own table. With `--json`, each prints its JSON object instead, and this
script prints one object gathering them: {"date", "commit", "machine": {"cpus", "load_average"},
"results": {"<benchmark>": <its JSON object>}}, the results file benchmarks/report.py draws
BENCHMARKS.md's plots from (`--save PATH` also writes it there). `--only NAME ...` runs some of them.
Other flags are passed to every benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# In the order a reader would want them: codec, then services, then the mesh end to end.
BENCHMARKS: tuple[str, ...] = (
    "codec",
    "gateway",
    "startup",
    "transfer",
    "latency",
    "stage_speeds",
    "simulate",  # after transfer, latency and stage_speeds: it takes its calibration from their last runs
    "broker",
    "slow_clients",
    "swap",
    "e2e",
    "console",
    "soak",  # last: an hour of faults on the whole mesh
)
OWN_FLAGS: dict[str, list[str]] = {
    "broker": ["--sweep", "1,2,4,8,16"],  # ingest against submission size: report.py's broker plot
    "soak": ["--minutes", "60"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object gathering every benchmark's")
    p.add_argument("--save", metavar="PATH", help="with --json, also write that object to PATH")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME", help="run only these benchmarks")
    args, extra = p.parse_known_args(argv)
    results: dict[str, object] = {}
    for name in args.only or BENCHMARKS:
        command = [sys.executable, str(HERE / f"{name}.py"), *OWN_FLAGS.get(name, []), *extra]
        if not args.json:
            print(f"\n=== benchmarks/{name}.py ===", flush=True)
            rc = subprocess.call(command)
        else:
            done = subprocess.run([*command, "--json"], stdout=subprocess.PIPE, text=True)
            rc = done.returncode
            lines = [line for line in done.stdout.splitlines() if line.strip()]
            results[name] = json.loads(lines[-1]) if rc == 0 and lines else None
        if rc != 0:
            print(f"benchmarks/{name}.py failed with exit code {rc}", file=sys.stderr)
            return rc
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        out = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit.stdout.strip(),
               "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}, "results": results}
        if args.save:
            Path(args.save).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
