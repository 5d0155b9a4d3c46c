"""The pool's in-place swap of a SmolLM2 delta, two checkouts side by side in one run.

One harness, benchmarks/swap.py of the `--after` checkout (a real gateway, a pool's weight stream, a
live transformers engine generating throughout, SmolLM2-135M's real one-Adam-step delta, in place
only), runs against two versions of the `deltamesh` package, so it must speak both's APIs: the one
at `--before PATH` (an older commit, e.g. a `git worktree`) and this checkout's, or the one at
`--after PATH`. A PATH needs no install: a folder of symlinks lays out its top-level parts as the
`deltamesh` package (setup.py's mapping) and goes first on PYTHONPATH, ahead of the editable
install; each process checks which tree it imported. The two take turns, `--rounds` times, each a
fresh process timing `--repeats` versions, so both see the same background load. Reported: medians
over all runs of "served" (version available at the gateway -> engine serving it), "proven" (-> the
pool's check of what the engine serves passed: it leases rollouts on the version), "round" (-> the
synced directory written too) and "next" (a version published the moment the one before is served
-> serving it: what the previous round still holds up), and before / after.

    .venv/bin/python benchmarks/swap_compare.py --before /tmp/swap-before [--after PATH] [--rounds 2]
        [--repeats 3] [--json]
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
from typing import Mapping

from common import emit

from deltamesh.cache import cache_dir

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("delta", "gateway", "trainer", "mesh")  # setup.py maps each top-level folder to deltamesh.<part>
MEASURES = {"served": "in_place_runs", "proven": "in_place_proven_runs", "round": "in_place_round_runs",
            "next": "in_place_next_runs"}


def checkout_args(p: argparse.ArgumentParser) -> None:
    """`--before` and `--after`: the two checkouts a side-by-side benchmark runs."""
    p.add_argument("--before", required=True, type=Path, help="checkout of the older commit (e.g. a git worktree)")
    p.add_argument("--after", type=Path, default=ROOT, help="checkout to compare it with (default: this one)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkout_args(p)
    p.add_argument("--rounds", type=int, default=2, help="turns each checkout takes, alternating (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="versions timed per turn (default 3)")
    p.add_argument("--lr", type=float, default=5e-6, help="Adam learning rate of SmolLM2's real step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    for tree in (args.before, args.after):
        if not all((tree / part).is_dir() for part in ("deltamesh", *PARTS)):
            p.error(f"{tree} is not a deltamesh checkout (needs deltamesh/ and {', '.join(PARTS)}/)")
    return args


def package_shim(tree: Path, into: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes `import deltamesh...` load `tree`'s code."""
    package = into / "deltamesh"
    package.mkdir(parents=True)
    for entry in (tree / "deltamesh").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for part in PARTS:
        (package / part).symlink_to((tree / part).resolve())
    return into


def shim_env(tree: Path, shim: Path, base: Mapping[str, str]) -> dict[str, str]:
    """`base` with PYTHONPATH led by a package shim made in `shim`: its `import deltamesh` loads `tree`."""
    path = os.pathsep.join(filter(None, [str(package_shim(tree, shim)), base.get("PYTHONPATH")]))
    return {**base, "PYTHONPATH": path}


def _env_for(tree: Path, shim: Path, base: dict[str, str]) -> dict[str, str]:
    """The environment whose `import deltamesh` loads `tree` (this checkout: the editable install)."""
    return base if tree.resolve() == ROOT else shim_env(tree, shim, base)


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + (" + working-tree changes" if dirty else "")


def run_turn(env: dict[str, str], expect: Path, args: argparse.Namespace, cwd: Path) -> dict:
    """One process of swap.py timing the in-place delta; its case, after checking which code it ran.
    `cwd` is a neutral folder: a checkout's own deltamesh/ would shadow the PYTHONPATH entry."""
    check = subprocess.run([sys.executable, "-c", "import deltamesh.delta as d; print(d.__file__)"],
                           env=env, capture_output=True, text=True, check=True, cwd=cwd)
    imported = Path(check.stdout.strip()).resolve()
    if not imported.is_relative_to(expect.resolve()):
        raise RuntimeError(f"imported {imported}, expected code from {expect}")
    cmd = [sys.executable, str(args.after / "benchmarks" / "swap.py"), "--json", "--no-synthetic",
           "--kinds", "delta", "--ways", "in_place", "--engines", "transformers", "--repeats", str(args.repeats), "--lr", str(args.lr)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"swap.py against {expect} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (case,) = json.loads(done.stdout.strip().splitlines()[-1])["cases"]
    return case


def summarize(runs: dict[str, dict[str, list[float]]]) -> dict:
    out: dict = {"before": {}, "after": {}, "before_over_after": {}}
    for measure in MEASURES:
        for side in ("before", "after"):
            out[side][f"{measure}_median_s"] = statistics.median(runs[side][measure])
            out[side][f"{measure}_runs_s"] = runs[side][measure]
        out["before_over_after"][measure] = out["before"][f"{measure}_median_s"] / out["after"][f"{measure}_median_s"]
    return out


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SmolLM2-135M delta, in place: version available -> (median s)")
    for col in ("checkout", "engine serving it", "check passed", "round over (directory written)",
                "next version, published as it serves"):
        table.add_column(col, justify="left" if col == "checkout" else "right")
    for side in ("before", "after"):
        r = result[side]
        table.add_row(f"{side}: {result['commits'][side]}", f"{r['served_median_s']:.3f}", f"{r['proven_median_s']:.3f}",
                      f"{r['round_median_s']:.3f}", f"{r['next_median_s']:.3f}")
    ratio = result["before_over_after"]
    table.add_row("before / after", f"{ratio['served']:.2f}x", f"{ratio['proven']:.2f}x", f"{ratio['round']:.2f}x",
                  f"{ratio['next']:.2f}x")
    console = Console(width=140)
    console.print(table)
    console.print(f"{result['runs_per_side']} runs per checkout ({result['rounds']} alternating turns of "
                  f"{result['repeats']}); payload {result['payload_bytes'] / 1e6:.2f} MB.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_env = dict(os.environ)
    # Both sides use this checkout's built models (SmolLM2 is dequantized and stepped once, then cached).
    base_env.setdefault("DELTAMESH_CACHE", str(cache_dir()))
    runs = {side: {m: [] for m in MEASURES} for side in ("before", "after")}
    payload = 0
    with tempfile.TemporaryDirectory(prefix="swap-compare-") as tmp:
        sides = {side: (_env_for(tree, Path(tmp) / side, base_env), tree)
                 for side, tree in (("before", args.before), ("after", args.after))}
        for _ in range(args.rounds):
            for side, (env, tree) in sides.items():
                case = run_turn(env, tree, args, Path(tmp))
                payload = case["payload_bytes"]
                for measure, key in MEASURES.items():
                    runs[side][measure] += case[key]
    result = summarize(runs)
    result.update(commits={"before": commit_of(args.before), "after": commit_of(args.after)}, rounds=args.rounds,
                  repeats=args.repeats, runs_per_side=args.rounds * args.repeats, payload_bytes=payload,
                  command=" ".join([".venv/bin/python", "benchmarks/swap_compare.py", *(argv or sys.argv[1:])]))
    emit(result, args, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
