"""benchmarks/stage_speeds.py: its synthetic step changes words as a real step does, and a quick run
reports every stage on one core and on all of them, saved where simulate.py reads it."""

from __future__ import annotations

import json
import os
import sys

import pytest
import stage_speeds
import torch
from inputs import adam_step_case, qwen3_shapes
from stage_runs import STAGES, change_statistics


def test_a_synthetic_step_moves_about_the_asked_fraction_mostly_small_weights_by_one_ulp():
    shapes = qwen3_shapes(layers=1, hidden=256, intermediate=768, q_heads=4, kv_heads=2, head_dim=64, vocab=1024)
    case = adam_step_case(shapes, changed=0.01, seed=3)
    stats = change_statistics(case)
    assert 0.007 < stats["changed_fraction"] < 0.013
    assert stats["one_ulp_share"] > 0.5
    assert stats["changed_magnitude_over_all"] < 0.05  # changes crowd into the small weights
    assert torch.equal(case.old["model.norm.weight"], case.new["model.norm.weight"])  # gains near 1 stay put
    assert all(torch.equal(case.master[n].to(torch.bfloat16), t) for n, t in case.new.items())
    again = adam_step_case(shapes, changed=0.01, seed=3)
    assert all(torch.equal(again.new[n], t) for n, t in case.new.items())


@pytest.mark.skipif(sys.platform != "linux", reason="pins itself to one CPU with sched_setaffinity")
def test_a_quick_run_reports_every_stage_on_one_core_and_all_and_saves_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stage_speeds, "RESULTS", tmp_path / "stage_speeds" / "results.json")
    affinity = os.sched_getaffinity(0)
    assert stage_speeds.main(["--quick", "--json"]) == 0
    assert os.sched_getaffinity(0) == affinity  # the pinning is undone
    out = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "stage_speeds" / "results.json").read_text()) == out
    assert set(out["per_core"]) == set(STAGES) and all(v > 0 for v in out["per_core"].values())
    (case,) = out["cases"]
    counts = {"1", str(len(affinity))}
    assert set(case["gbps"]) == counts and set(case["seconds"]) == counts
    assert all(len(s) == 1 for s in case["seconds"]["1"].values())  # --quick: one repeat
    assert 0 < out["delta_ratio"] < 0.05 and out["sign_s_per_entry"] > 0 and out["load_s_per_entry"] > 0
    assert out["cores"] == len(affinity) and out["per_core_case"] == case["name"]
