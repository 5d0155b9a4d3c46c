"""benchmarks/learning.py's parts that need no mesh: its modes and flags, the figures it takes from a
demo report (the held-out curve, trainer wait, staleness, reward), the table at equal steps, the plots
and the pipeline model of separate hardware. The runs themselves (SmolLM2 through the whole mesh, tens
of minutes each) are recorded in BENCHMARKS.md, not run here."""

from __future__ import annotations

import learning
import learning_report
import pytest
from rich.console import Console

PNG = b"\x89PNG\r\n\x1a\n"


def step(v: int, t: float, *, wait: float = 4.0, train: float = 6.0, reward: float = 0.1) -> dict:
    return {"version": v, "time": t, "step_seconds": 10.0, "wait_fraction": wait / 10, "wait_seconds": wait,
            "train_seconds": train, "all_pools_seconds": 1.0, "staleness_mean": 0.5, "staleness_max": 1,
            "reward": reward}


def report(curve: list[tuple[int, float]], steps: int = 10) -> dict:
    return {"outcome": "completed", "error": "", "summary": {"all_pools_bit_exact": True},
            "models": {"policy": {
                "steps": [step(v, 100.0 + 10 * v, reward=v / 20) for v in range(1, steps + 1)],
                "eval": [{"version": v, "step": v, "accuracy": a, "train_s": 10.0 * v, "correct": int(80 * a),
                          "samples": 4, "problems": 20, "by_level": {}, "weights_hash": f"h{v}",
                          "weights_match": True} for v, a in curve]}}}


def test_modes_are_the_issues_and_quick_runs_sync_and_async_m2po_at_4():
    assert list(learning.MODES) == ["sync", "async_m2po_s4", "async_m2po_s8", "async_clip_s8", "solver_verifier"]
    assert learning.parse_args(["--quick"]).mode_names == ["sync", "async_m2po_s4"]
    assert learning.parse_args([]).mode_names == list(learning.MODES)
    with pytest.raises(SystemExit):
        learning.parse_args(["--modes", "sync,nope"])
    args = learning.parse_args(["--modes", "async_clip_s8", "--quick", "--quick-steps", "7", "--engine",
                                "transformers"])
    config = learning.demo_config(learning.MODES["async_clip_s8"], args, learning.Path("/tmp/x"))
    assert (config.steps, config.loss, config.max_staleness, config.engine) == (7, "clip", 8, "transformers")
    assert config.eval.every == 5 and config.tasks == "arithmetic" and len(config.topology.pools) == 2
    # --every 0: the same run without an evaluator (the trainer's wait beside a run with one).
    off = learning.demo_config(learning.MODES["async_m2po_s4"], learning.parse_args(["--every", "0"]),
                               learning.Path("/tmp/x"))
    assert off.eval.every == 0 and off.max_staleness == 4


def test_figures_table_plots_and_pipeline_model_from_two_runs(tmp_path):
    runs = [learning.run_figures(learning.MODES["sync"], report([(0, 0.10), (5, 0.20), (10, 0.30)]), (2.0, 3.0), 600.0),
            learning.run_figures(learning.MODES["async_m2po_s4"], report([(0, 0.10), (5, 0.15)], steps=5),
                                 (2.5, 3.5), 300.0)]
    sync = runs[0]
    assert [r["accuracy"] for r in sync["eval"]] == [0.10, 0.20, 0.30] and sync["steps"] == 10
    assert sync["trainer_wait_fraction"] == pytest.approx(0.4) and sync["train_wall_s"] == pytest.approx(100.0)
    assert sync["reward"][0] == 0.05 and sync["load_average"] == [2.0, 3.0]
    assert learning_report.equal_step(runs) == 5 and learning_report.at_step(sync, 7) == 0.20
    model = learning_report.pipeline_model(runs)
    # generation = the wait less the version's way to every pool; async overlaps it with training.
    assert model["generate_s"] == 3.0 and model["sync_step_s"] == 10.0 and model["async_step_s"] == 6.0
    console = Console(width=200, record=True)
    learning_report.print_runs(console, {"runs": runs, "pipeline": model,
                                         "settings": {"samples": 4, "problems": 20, "engine": "vllm"}})
    text = console.export_text()
    assert "at step 5 %" in text and "+20.0" in text and "+5.0" in text and "1.67x" in text
    for path in learning_report.plot_runs(runs, tmp_path):
        assert path.read_bytes().startswith(PNG)
