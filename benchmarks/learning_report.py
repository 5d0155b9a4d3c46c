"""learning.py's table, plots and pipeline model: what its runs showed, side by side.

The table is the seed's: per mode, held-out accuracy at its start, at the steps every run reached
(equal steps) and at its end, the change, wall time, the trainer's wait fraction and the staleness it
trained on. The plots draw held-out avg@n against the trainer step and against wall time since
training started. The pipeline model says what the runs' own stage times predict on separate
hardware, where rollouts and training do not share cores: a synchronous step is generation, then
training, then the new version's way to every pool, one after another; an asynchronous one (any
staleness bound of 1 or more) is the longer of generation and training, the way overlapping both. It
takes the sync run's medians (generation = its trainer's wait less the version's way to every pool)
and the trainer's compute time; it is arithmetic on measured figures, not a measurement.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def at_step(run: dict[str, Any], step: int) -> float | None:
    """Held-out accuracy of the last scored version at or before `step`."""
    scored = [r for r in run["eval"] if r["step"] <= step]
    return scored[-1]["accuracy"] if scored else None


def equal_step(runs: list[dict[str, Any]]) -> int | None:
    """The largest step every run scored a version at."""
    common = set.intersection(*({r["step"] for r in run["eval"]} for run in runs)) if runs else set()
    return max(common) if common else None


def pipeline_model(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted seconds per step on separate hardware, from the sync run's stage medians (see the
    module docstring); empty without a sync run."""
    sync = next((r for r in runs if r["max_staleness"] == 0 and r["steps"]), None)
    if sync is None or sync["wait_seconds_median"] is None or sync["train_seconds_median"] is None:
        return {}
    way = sync["all_pools_seconds_median"] or 0.0
    generate = max(0.0, sync["wait_seconds_median"] - way)
    train = sync["train_seconds_median"]
    return {"generate_s": generate, "train_s": train, "to_every_pool_s": way,
            "sync_step_s": generate + train + way, "async_step_s": max(generate, train),
            "async_speedup": (generate + train + way) / max(generate, train) if max(generate, train) else None}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def print_runs(console: Console, out: dict[str, Any]) -> None:
    runs = out["runs"]
    equal = equal_step(runs)
    table = Table(title=f"SmolLM2-135M-Instruct through the mesh: held-out avg@{out['settings']['samples']} "
                        f"({out['settings']['problems']} arithmetic problems never trained on), "
                        f"{out['settings']['engine']} pools")
    for col in ("mode", "steps", "start %", f"at step {equal} %", "end %", "change (points)", "wall time",
                "training wall", "trainer wait", "staleness mean/max", "reward first -> last third", "load"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for run in runs:
        curve = run["eval"]
        start, end = (curve[0]["accuracy"], curve[-1]["accuracy"]) if curve else (None, None)
        rewards = run["reward"]
        k = len(rewards) // 3
        thirds = (f"{statistics.fmean(rewards[:k]):.2f} -> {statistics.fmean(rewards[-k:]):.2f}" if k else "-")
        table.add_row(
            run["mode"], str(run["steps"]), _pct(start), _pct(None if equal is None else at_step(run, equal)),
            _pct(end), "-" if start is None else f"{100 * (end - start):+.1f}", f"{run['wall_s'] / 60:.1f} min",
            "-" if run["train_wall_s"] is None else f"{run['train_wall_s'] / 60:.1f} min",
            "-" if run["trainer_wait_fraction"] is None else f"{run['trainer_wait_fraction']:.2f}",
            "-" if run["staleness_mean"] is None else f"{run['staleness_mean']:.2f}/{run['staleness_max']}",
            thirds, f"{run['load_average'][0]}/{run['load_average'][1]}")
    console.print(table)
    model = out.get("pipeline") or {}
    if model:
        console.print(f"separate hardware (pipeline model from the sync run's stages): generate "
                      f"{model['generate_s']:.1f} s, train {model['train_s']:.1f} s, to every pool "
                      f"{model['to_every_pool_s']:.1f} s -> sync {model['sync_step_s']:.1f} s/step, async "
                      f"{model['async_step_s']:.1f} s/step ({model['async_speedup']:.2f}x)")
    for run in runs:
        if run["outcome"] != "completed":
            console.print(f"[red]{run['mode']}: {run['outcome']}: {run['error'][:300]}[/]")


def plot_runs(runs: list[dict[str, Any]], folder: Path) -> list[Path]:
    """learning-vs-step.png and learning-vs-wall.png in `folder`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, name, label in (("step", "learning-vs-step.png", "trainer step"),
                             ("train_s", "learning-vs-wall.png", "wall time since training started (min)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for run in runs:
            points = [(r[key], r["accuracy"]) for r in run["eval"] if r[key] is not None]
            xs = [p[0] / 60 if key == "train_s" else p[0] for p in points]
            ax.plot(xs, [100 * p[1] for p in points], marker="o", label=run["mode"])
        n = runs[0]["eval"][0]["samples"] if runs and runs[0]["eval"] else 4
        ax.set_xlabel(label)
        ax.set_ylabel(f"held-out avg@{n}, %")
        ax.set_title("SmolLM2-135M-Instruct through the mesh: held-out arithmetic")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        paths.append(folder / name)
    return paths
