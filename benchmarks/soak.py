"""Chaos soak: the whole mesh under many seeded faults at once, its invariants checked all along.

It starts a real mesh on this machine (soak_mesh.py): an origin gateway and two relay regions over the
WAN emulator's links (soak_net.py), four pools of the tiny model on the transformers engine (and with
`--vllm` a fifth on vLLM's CPU build), two brokers on PostgreSQL with a synchronous streaming standby,
and the trainer publishing every step (a full snapshot every 10 versions), with TLS and tokens on.
Then for `--minutes` it injects faults drawn from `--seed` (soak_schedule.py, soak_faults.py: SIGKILL
and restart of any gateway, pool, broker or the trainer; SIGSTOP/SIGCONT; a PostgreSQL failover; a link
cut, lossy or trickling; a full disk; a corrupted stored piece; a malicious relay; a clock jump), waits
for the mesh to settle, and checks its invariants (soak_checks.py) on every reading and at the end.
The same seed replays the same schedule; every run's fault log is RUN_DIR/faults.jsonl.

Needs root (network namespaces, tmpfs, PostgreSQL as its own user), what benchmarks/wan/setup.sh and
benchmarks/setup_postgres.sh install, and a C compiler (the clock shim, soak_clock.py). An 8-minute run
injects about 35 faults of all 10 kinds; an hour about 240. `--quick` is the short run of the tests and
CI (a 1.5-minute fault phase: 6 faults of 6 kinds with seed 1, about 3 minutes in all).

    .venv/bin/python benchmarks/soak.py --minutes 8 --seed 1 [--json] [--save PATH] [--run-dir DIR] [--vllm]

`--json` prints one object: `faults` ({kind: count}), `violations` (each with `invariant`, `time_s`,
`seed`, `detail` and the log lines around it; empty when every invariant held), `converged_s_max`
(seconds the slowest pool took to reach the head after the last fault), `leaks` ({process:
{"fds_slope", "rss_slope", "threads_slope", "connections_slope", "judged"}} per minute; fds count
established TCP connections apart, reported as connections and not judged), and every invariant's figures. Exit status 1 when an
invariant was violated. The run directory keeps the logs, the fault log, soak.json and versions.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

from common import emit
from soak_mesh import VLLM_POOL
from soak_net import SoakNet
from soak_report import print_tables
from soak_run import Soak, SoakSettings
from soak_schedule import make_schedule

log = logging.getLogger(__name__)

QUICK_MINUTES = 1.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=8.0, help="length of the fault phase (default 8)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--save", metavar="PATH", help="also write the JSON object to PATH")
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_MINUTES}-minute fault phase (what the tests run)")
    p.add_argument("--run-dir", help="where logs, stores and the report go (default runs/soak-<time>)")
    p.add_argument("--vllm", action="store_true", help="add a fifth pool on vLLM's CPU build")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes = QUICK_MINUTES
    if args.minutes <= 0:
        p.error("--minutes must be > 0")
    return args


def log_to(run_dir: Path, quiet: bool) -> None:
    """Everything to RUN_DIR/soak.log; on the terminal only warnings with --json (stdout stays one object)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file = logging.FileHandler(run_dir / "soak.log")
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s"))
    root.addHandler(file)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(logging.WARNING if quiet else logging.INFO)
    terminal.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s"))
    root.addHandler(terminal)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("soak.py needs root: network namespaces, tmpfs stores, PostgreSQL as its own user", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log_to(run_dir, args.json)
    schedule = make_schedule(args.seed, args.minutes, extra_processes=(f"pool-{VLLM_POOL[0]}",) if args.vllm else ())
    (run_dir / "schedule.json").write_text(json.dumps([f.as_json() for f in schedule], indent=1))
    log.info("soak: seed %d, %g min, %d faults planned; run directory %s", args.seed, args.minutes,
             len(schedule), run_dir)
    net = SoakNet()
    try:
        net.build()
        net.enter("core")  # the soak and everything it starts live in the core region from here on
        settings = SoakSettings(args.minutes, args.seed, run_dir, vllm=args.vllm)
        outcome = asyncio.run(Soak(settings, net, schedule).run())
    finally:
        net.close()
    outcome["command"] = " ".join(["benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])])
    (run_dir / "soak.json").write_text(json.dumps(outcome, indent=1))
    emit(outcome, args, print_tables)
    return 1 if outcome["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
