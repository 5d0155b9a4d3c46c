"""The real_training propagation figures of two checkouts side by side, in one run.

One harness, this checkout's `benchmarks/transfer.py --scenario real_training`, runs against the
`deltamesh` package of each checkout in turn (`--before PATH`, an older commit such as a `git
worktree`, and this one or `--after PATH`; swap_compare.py's package shim, which every process the
run spawns inherits), over the same emulated fan-out mesh, and prints
per delta version the seconds from the end of its publish (the origin holds it) until a region gateway
holds it: the median over the three regions and the slowest region. Also the seconds from the start
of the publish (which includes encoding), and the median to all pools. Needs root, like transfer.py.

    .venv/bin/python benchmarks/transfer_compare.py --before /tmp/prop-before [--steps 5]
        [--step-seconds 12] [--rounds 1] [--json]
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
FIGURES = ("to_regions_after_publish_seconds", "to_last_region_after_publish_seconds", "to_regions_seconds",
           "all_pools_seconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkout_args(p)
    p.add_argument("--steps", type=int, default=5, help="training versions after the first (default 5)")
    p.add_argument("--step-seconds", type=float, default=12.0, help="seconds between two versions (default 12)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each checkout, alternating (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def run_one(tree: Path, env: dict[str, str], args: argparse.Namespace, out: Path) -> dict:
    """One real_training run against `tree`'s package; its scenario's JSON."""
    cmd = [sys.executable, str(HERE / "transfer.py"), "--scenario", "real_training", "--no-verify",
           "--steps", str(args.steps), "--step-seconds", str(args.step_seconds), "--json", "--save", str(out)]
    # Run from outside both trees, so the working directory's `deltamesh/` shadows neither.
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: transfer.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)["scenarios"][0]


def deltas(scenario: dict) -> list[dict]:
    """Per delta version (the full snapshot of v0 and the periodic fulls' uploads aside), the figures."""
    return [{"version": v["version"], **{k: v.get(k) for k in FIGURES}} for v in scenario["versions"]
            if v["version"] > 0 and v["published"] == "delta"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces), like benchmarks/transfer.py", file=sys.stderr)
        return 2
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in trees.items():
                # Both through a shim, even this checkout: the editable install may point at another tree.
                env = shim_env(tree, Path(tmp) / f"shim-{name}-{r}", os.environ)
                runs[name] += deltas(run_one(tree, env, args, Path(tmp) / f"{name}-{r}.json"))
    medians = {name: {k: _median([v[k] for v in rows]) for k in FIGURES} for name, rows in runs.items()}
    report = {"before": commit_of(trees["before"]), "after": commit_of(trees["after"]), "runs": runs,
              "medians": medians, "command": " ".join(["benchmarks/transfer_compare.py", *(argv or sys.argv[1:])])}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"real_training deltas, seconds: before = {report['before']}, after = {report['after']}")
    print(f"  {'':>7} {'version':>7} {'regions after publish':>22} {'slowest region':>15} "
          f"{'regions from start':>19} {'all pools':>10}")
    for name, rows in runs.items():
        for v in rows + [{"version": "median", **medians[name]}]:
            print(f"  {name:>7} {v['version']:>7} " + " ".join(
                f"{_fmt(v[k]):>{w}}" for k, w in zip(FIGURES, (22, 15, 19, 10))))
    return 0


def _median(values: list) -> float | None:
    values = [x for x in values if x is not None]
    return round(statistics.median(values), 3) if values else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
