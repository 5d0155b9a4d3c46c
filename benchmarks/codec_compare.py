"""The codec's speeds on real SmolLM2 deltas for two checkouts side by side, in one run.

One harness, this checkout's `benchmarks/codec.py` (deltamesh only, no synthetic model), runs against
the `deltamesh` package of each checkout in turn (`--before PATH`, an older commit such as a `git
worktree`, and this one or `--after PATH`, each through swap_compare.py's package shim), alternating
for `--rounds` rounds, and prints per case the median over rounds of each speed: encode, apply in
place by a fresh receiver, apply by a receiver that applied the version before (as a pool does every
step: "next version"), and apply into a copy. Each codec.py run already reports its own median of
`--repeats` timed runs.

    .venv/bin/python benchmarks/codec_compare.py --before /tmp/codec-before [--rounds 3] [--repeats 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from swap_compare import checkout_args, commit_of, shim_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPEEDS = ("encode_gbps", "apply_gbps", "apply_next_gbps", "apply_copy_gbps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkout_args(p)
    p.add_argument("--rounds", type=int, default=3, help="codec.py runs of each checkout, alternating (default 3)")
    p.add_argument("--repeats", type=int, default=9, help="timed runs per measurement in each codec.py run (default 9)")
    p.add_argument("--lrs", nargs="+", default=["5e-6"], help="learning rates of the one-step real deltas (default 5e-6)")
    p.add_argument("--run-steps", type=int, default=4, help="also the delta of this step of an Adam run (0: skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def run_one(tree: Path, env: dict[str, str], args: argparse.Namespace) -> dict[str, dict]:
    """One codec.py run against `tree`'s package: per case, deltamesh's figures."""
    cmd = [sys.executable, str(HERE / "codec.py"), "--json", "--no-synthetic", "--methods", "deltamesh",
           "--lrs", *args.lrs, "--run-steps", str(args.run_steps), "--repeats", str(args.repeats)]
    # Run from outside both trees, so the working directory's `deltamesh/` shadows neither.
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: codec.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {case["name"]: case["results"]["deltamesh"] for case in json.loads(done.stdout)["cases"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, dict]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in trees.items():
                # Both through a shim, even this checkout: the editable install may point at another tree.
                env = shim_env(tree, Path(tmp) / f"shim-{name}-{r}", os.environ)
                runs[name].append(run_one(tree, env, args))
    cases = list(runs["after"][0])
    medians = {name: {case: {s: round(statistics.median(run[case][s] for run in rows), 3) for s in SPEEDS}
                      for case in cases} for name, rows in runs.items()}
    ratios = {case: {s: round(medians["after"][case][s] / medians["before"][case][s], 2) for s in SPEEDS}
              for case in cases}
    report = {"before": commit_of(trees["before"]), "after": commit_of(trees["after"]), "rounds": args.rounds,
              "repeats": args.repeats, "runs": runs, "medians": medians, "after_over_before": ratios,
              "command": " ".join(["benchmarks/codec_compare.py", *(argv if argv is not None else sys.argv[1:])])}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"GB/s of model bytes, medians of {args.rounds} rounds: before = {report['before']}, after = {report['after']}")
    print(f"  {'case':<36} {'':>7} " + " ".join(f"{s.removesuffix('_gbps'):>11}" for s in SPEEDS))
    for case in cases:
        for name in trees:
            print(f"  {case:<36} {name:>7} " + " ".join(f"{medians[name][case][s]:>11.3f}" for s in SPEEDS))
        print(f"  {case:<36} {'ratio':>7} " + " ".join(f"{ratios[case][s]:>10.2f}x" for s in SPEEDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
