"""`deltamesh bench soak`: the chaos soak of a source checkout (benchmarks/soak.py), flags passed as given.

The soak is a benchmark of this source tree, not of an installed mesh: it starts a whole mesh from the
checkout's own benchmarks folder (the WAN emulator, a PostgreSQL pair, the fault injector). So this
command finds benchmarks/soak.py beside the `deltamesh` package and replaces itself with it (same
interpreter, every argument after `--` unchanged, the soak's exit status): `deltamesh bench soak --
--minutes 8 --seed 7 --json`. The `--` keeps the soak's flags away from the CLI's own parser, which
would refuse them as unknown. From an install without
that folder it says so and exits 2. Who may run it: whoever may run the soak, i.e. root on this
machine (the soak itself refuses anyone else).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import deltamesh


def soak_script() -> Path | None:
    """benchmarks/soak.py of the checkout this `deltamesh` package lives in, or None (an install)."""
    script = Path(deltamesh.__file__).resolve().parent.parent / "benchmarks" / "soak.py"
    return script if script.is_file() else None


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("soak", help="the chaos soak of this source checkout: benchmarks/soak.py with the "
                                      "flags after --",
                         description="Run benchmarks/soak.py of this checkout with the flags after `--` "
                                     "(`deltamesh bench soak -- --help` lists them).")
    p.add_argument("soak_args", nargs=argparse.REMAINDER, metavar="-- SOAK_FLAGS",
                   help="benchmarks/soak.py's flags, e.g. -- --minutes 8 --seed 7 --json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    script = soak_script()
    if script is None:
        print("deltamesh bench soak needs a source checkout: benchmarks/soak.py is not beside the deltamesh "
              "package of this install", file=sys.stderr)
        return 2
    flags = args.soak_args[1:] if args.soak_args[:1] == ["--"] else args.soak_args
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, str(script), *flags])
