"""The code workflows' scoring, on hand-written programs: completions to programs, hidden-test
rewards from the sandbox's outcomes, the HumanEval and synthetic data, mutants and the Test-Case
Generator's reward."""

from __future__ import annotations

import asyncio

import pytest

from deltamesh.broker_client import TaskLease
from deltamesh.mesh.pool.worker import task_from_lease
from deltamesh.mesh.sandbox import Outcome
from deltamesh.mesh.workflows import WorkflowError
from deltamesh.mesh.workflows.code_reward import failure_report, outcome_counts, pass_reward, program_from_completion
from deltamesh.mesh.workflows.code_tasks import CodeProblem, humaneval_problems, synthetic_problems
from deltamesh.mesh.workflows.mutants import mutants
from deltamesh.mesh.workflows.solver_selector import parse_choice
from deltamesh.mesh.workflows.solver_testgen import extract_asserts, score_tests

ADD = next(p for p in synthetic_problems() if p.entry_point == "add")



def test_a_completion_continues_the_prompt_up_to_the_end_of_the_function():
    prompt = ADD.prompt
    assert program_from_completion(prompt, "    return a + b\n\ndef other():\n    pass", "add") == \
        prompt + "    return a + b\n\n"
    fenced = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\ntrailing"
    assert program_from_completion(prompt, fenced, "add") == "def add(a, b):\n    return a + b\n"
    assert program_from_completion(prompt, "```\n    return b + a\n```", "add") == prompt + "    return b + a\n"


def test_a_correct_program_earns_one_and_a_wrong_or_hostile_one_zero(sandbox, run):
    async def score(body):
        return await sandbox.run(program_from_completion(ADD.prompt, body, "add"), ADD.tests)

    right, wrong, broken, looping, partly = run(_gather(
        score("    return a + b\n"), score("    return a - b\n"), score("    return a +\n"),
        score("    while True: pass\n"), score("    return abs(a) + b\n")))
    assert [pass_reward(r) for r in (right, wrong, broken, looping, partly)] == [1, 0, 0, 0, 0]
    assert pass_reward(partly, partial_credit=True) == pytest.approx(2 / 3)  # add(-4, 4) fails
    assert outcome_counts([right, partly]) == {"passed": 5, "failed": 1, "error": 0, "timeout": 0, "resource_limit": 0}
    assert {t.outcome for t in broken.tests} == {Outcome.ERROR}
    assert Outcome.TIMEOUT in {t.outcome for t in looping.tests}
    report = failure_report(wrong, ADD.tests, 10_000)  # a - b fails all three
    assert "assert add(1, 2) == 3\n-> failed" in report and "add(-4, 4)" in report and "add(10, 5)" in report
    assert len(failure_report(wrong, ADD.tests, 20)) == 20


async def _gather(*coros):
    return await asyncio.gather(*coros)


def test_every_synthetic_reference_passes_its_hidden_tests(sandbox, run):
    problems = synthetic_problems()
    assert len(problems) >= 8 and len({p.task_id for p in problems}) == len(problems)
    results = run(_gather(*(sandbox.run(p.reference, p.tests) for p in problems)))
    assert all(r.passed for r in results), [(p.task_id, r) for p, r in zip(problems, results) if not r.passed]


def test_humaneval_becomes_broker_tasks_and_its_reference_passes(sandbox, tmp_path, run):
    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    first = problems[0]
    record = first.record()
    lease = TaskLease(lease_id="L1", task_id=record["id"], prompt=record["prompt"], group_id="L1",
                      metadata={"metadata": record["metadata"]}, n_samples=2, model_ids=["m"], deadline=0.0, epoch=0)
    assert CodeProblem.from_task(task_from_lease(lease), "code") == first
    wrong = first.prompt + "    return False\n"
    ok, bad = run(_gather(sandbox.run(first.reference, first.tests), sandbox.run(wrong, first.tests)))
    assert pass_reward(ok) == 1.0 and pass_reward(bad) == 0.0


def test_a_task_without_tests_is_refused():
    from deltamesh.mesh.workflows import Task

    with pytest.raises(WorkflowError, match="metadata.entry_point and metadata.tests"):
        CodeProblem.from_task(Task(task_id="t", prompt="x", metadata={"answer": "1"}), "code")


def test_mutants_follow_the_rules_and_are_deterministic():
    clamp = next(p for p in synthetic_problems() if p.entry_point == "clamp")
    made = mutants(clamp.reference, "clamp", 3)
    assert made == mutants(clamp.reference, "clamp", 3)
    assert made and all(m != clamp.reference and '"""x limited to the range [low, high]."""' in m for m in made)
    assert "if x <= low:" in made[0]
    assert mutants(ADD.reference, "add", 3) == [ADD.reference.replace("a + b", "a - b")]  # its one site
    with pytest.raises(ValueError, match="no function"):
        mutants(ADD.reference, "nope", 3)


def test_the_test_generators_reward_counts_asserts_right_on_the_reference_that_kill_a_mutant(sandbox, run):
    asserts = ["assert add(1, 2) == 3",   # right, and kills a - b
               "assert add(0, 0) == 0",   # right, but a - b passes it too
               "assert add(1, 1) == 3"]   # wrong on the reference
    score = run(score_tests(sandbox, ADD.reference, mutants(ADD.reference, "add", 3), asserts))
    assert (score.reward, score.valid, score.killing) == (pytest.approx(1 / 3), 2, 1)
    assert run(score_tests(sandbox, ADD.reference, [], asserts)).reward == 0.0
    assert run(score_tests(sandbox, ADD.reference, ["x = 1"], [])).reward == 0.0


def test_asserts_and_choices_are_read_from_replies():
    text = "assert f(1) == 2\n  assert f(2) == 3\nassert f(\nprint(1)\nassert f(1) == 2\nassert f(3) == 4"
    assert extract_asserts(text, 8) == ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 4"]
    assert extract_asserts(text, 2) == ["assert f(1) == 2", "assert f(2) == 3"]
    assert [parse_choice(r) for r in ("B is right", " A.", "xAB", "(A) or B", "")] == [1, 0, None, 0, None]
