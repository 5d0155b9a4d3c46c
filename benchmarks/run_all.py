"""Run every benchmark in turn (`make bench`), each as its own process, and stop at the first failure.

Each benchmark prints its own table; pass `--json` to have each print its JSON object instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# In the order a reader would want them: codec, then services, then the mesh end to end.
BENCHMARKS: tuple[str, ...] = (
    "codec",
    "gateway",
    "startup",
    "transfer",
    "latency",
    "simulate",  # after latency: it takes its stage costs from latency's last run
    "broker",
    "slow_clients",
    "swap",
    "e2e",
)


def main() -> int:
    extra = sys.argv[1:]
    for name in BENCHMARKS:
        print(f"\n=== benchmarks/{name}.py ===", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / f"{name}.py"), *extra])
        if rc != 0:
            print(f"benchmarks/{name}.py failed with exit code {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
