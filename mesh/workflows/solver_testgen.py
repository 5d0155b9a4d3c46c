"""The `solver_testgen` workflow: a Solver writes a program, a Test-Case Generator writes asserts for it.

Per sample: the Solver completes the function and, at the same time, the Test-Case Generator (its
own model_id, trainer and weight stream) writes assert lines for the problem (`extract_asserts`
keeps the lines that start with `assert` and compile, at most `max_asserts`). The program runs
against those asserts in the sandbox; when one of them does not pass, the Solver tries once more,
shown its program and the failing asserts with their output (`code_reward.failure_report`). The
Solver's final program (the retry if there was one) runs against the hidden tests, and that result
is the reward of every Solver turn of the sample.

The Test-Case Generator's reward is the share of its asserts that are right and useful: an assert
counts when it passes on the problem's reference solution and fails (any outcome but passed) on at
least one of `k` mutants of that reference (`mutants.py` has the mutation rules; `k` is 3 by
default). No asserts is reward 0, and so is a problem whose reference has no mutation site (no
mutant, nothing to kill). Its trajectory's metadata says how many asserts it wrote, how many
passed on the reference and how many of those killed a mutant.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Sequence

from deltamesh.data import Trajectory
from deltamesh.mesh.sandbox import ExecutionResult, Sandbox
from deltamesh.mesh.workflows.base import (
    EpisodeContext,
    PromptFormat,
    Task,
    WorkflowError,
    WorkflowSpec,
    finalize_groups,
    trajectory_from_generation,
)
from deltamesh.mesh.workflows.code_prompts import CodePrompter, check_template
from deltamesh.mesh.workflows.code_reward import failure_report, outcome_counts, pass_reward, program_from_completion
from deltamesh.mesh.workflows.code_tasks import CodeProblem
from deltamesh.mesh.workflows.mutants import mutants


@dataclass
class SolverTestgenConfig:
    solver_template: str | None = None
    testgen_template: str | None = None
    retry_template: str | None = None
    """The Solver's second try, showing `{program}` and `{feedback}` (as comments in completion format).
    Unset templates: the prompt format's defaults (code_prompts.py)."""
    prompt_format: PromptFormat = "auto"
    """completion, chat (an instruct model's chat template) or auto (chat when the tokenizer has a template)."""
    k: int = 3
    """Mutants of the reference an assert may kill (the Test-Case Generator's reward)."""
    max_asserts: int = 8
    """Asserts kept from one Test-Case Generator reply."""
    max_feedback_chars: int = 1000
    partial_credit: bool = False
    """Solver reward: the share of hidden tests passed instead of 1 only when all pass."""

    def __post_init__(self) -> None:
        for name in ("solver_template", "testgen_template", "retry_template"):
            check_template(name, getattr(self, name))
        if min(self.k, self.max_asserts, self.max_feedback_chars) < 1:
            raise ValueError("k, max_asserts and max_feedback_chars must be >= 1")


def extract_asserts(text: str, max_asserts: int) -> list[str]:
    """The distinct lines of `text` that are one compilable assert statement, in order, at most `max_asserts`."""
    out: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("assert ") or s in out:
            continue
        try:
            compile(s, "<assert>", "exec")
        except (SyntaxError, ValueError):
            continue
        out.append(s)
        if len(out) == max_asserts:
            break
    return out


@dataclass(frozen=True)
class TestgenScore:
    __test__ = False  # not a pytest class, whatever its name

    reward: float
    valid: int
    """Asserts that passed on the reference."""
    killing: int
    """Of those, the ones that failed on at least one mutant."""
    results: tuple[ExecutionResult, ...]
    """The reference's execution, then each mutant's."""


async def score_tests(sandbox: Sandbox, reference: str, mutant_programs: Sequence[str],
                      asserts: Sequence[str]) -> TestgenScore:
    """The Test-Case Generator's reward of `asserts` (see the module docstring)."""
    if not asserts:
        return TestgenScore(0.0, 0, 0, ())
    ref, *muts = await asyncio.gather(*(sandbox.run(p, asserts) for p in (reference, *mutant_programs)))
    valid = [i for i in range(len(asserts)) if ref.tests[i].passed]
    killing = [i for i in valid if any(not m.tests[i].passed for m in muts)]
    return TestgenScore(len(killing) / len(asserts), len(valid), len(killing), (ref, *muts))


async def solver_testgen_episode(task: Task, ctx: EpisodeContext, config: SolverTestgenConfig) -> list[Trajectory]:
    problem = CodeProblem.from_task(task, "solver_testgen")
    if not problem.reference:
        raise WorkflowError(f"task {task.task_id}: the solver_testgen workflow needs metadata.reference")
    sandbox = ctx.need_sandbox("solver_testgen")
    started = time.perf_counter()
    solver_id, solver = ctx.engine_for("solver")
    testgen_id, testgen = ctx.engine_for("testgen")
    n = task.n_samples
    mutant_programs = mutants(problem.reference, problem.entry_point, config.k)

    solver_prompts = CodePrompter(solver, config.prompt_format)
    testgen_prompts = CodePrompter(testgen, config.prompt_format)
    values = dict(prompt=problem.prompt, entry_point=problem.entry_point)
    first, written = await asyncio.gather(
        solver.generate([solver_prompts.encode("solver", config.solver_template, **values)] * n,
                        solver_prompts.params("solver", ctx.params)),
        testgen.generate([testgen_prompts.encode("testgen", config.testgen_template, **values)] * n,
                         testgen_prompts.params("testgen", ctx.params)))
    programs = [program_from_completion(problem.prompt, solver_prompts.reply("solver", g.tokens), problem.entry_point)
                for g in first]
    test_texts = [testgen_prompts.reply("testgen", g.tokens, problem.entry_point) for g in written]
    asserts = [extract_asserts(t, config.max_asserts) for t in test_texts]
    checks = await asyncio.gather(*(sandbox.run(p, a) for p, a in zip(programs, asserts)))

    failing = [i for i in range(n) if checks[i].tests and not checks[i].passed]
    retry_prompts = [solver_prompts.encode(
        "retry", config.retry_template, **values, program=programs[i],
        feedback=failure_report(checks[i], asserts[i], config.max_feedback_chars)) for i in failing]
    retries = dict(zip(failing, await solver.generate(retry_prompts, solver_prompts.params("retry", ctx.params))
                       if failing else []))
    final = [program_from_completion(problem.prompt, solver_prompts.reply("retry", retries[i].tokens),
                                     problem.entry_point)
             if i in retries else programs[i] for i in range(n)]
    hidden, scores = await asyncio.gather(
        asyncio.gather(*(sandbox.run(p, problem.tests) for p in final)),
        asyncio.gather(*(score_tests(sandbox, problem.reference, mutant_programs, a) for a in asserts)))

    episode_s = time.perf_counter() - started
    out = []
    for i in range(n):
        solved = pass_reward(hidden[i], partial_credit=config.partial_credit)
        shared = {"workflow": "solver_testgen", "sample": i, "retried": i in retries, "correct": hidden[i].passed,
                  "asserts": len(asserts[i])}
        common = dict(task=task, ctx=ctx, timings={"episode_s": episode_s})
        solver_meta = {**shared, "role": "solver", "outcomes": outcome_counts([checks[i], hidden[i]])}
        out.append(trajectory_from_generation(
            first[i], trajectory_id=f"{task.group_id}/solver/{i}/0", model_id=solver_id, reward=solved,
            metadata={**solver_meta, "turn": 0, "program": programs[i]}, **common))
        if i in retries:
            out.append(trajectory_from_generation(
                retries[i], trajectory_id=f"{task.group_id}/solver/{i}/1", model_id=solver_id, reward=solved,
                metadata={**solver_meta, "turn": 1, "program": final[i]}, **common))
        s = scores[i]
        out.append(trajectory_from_generation(
            written[i], trajectory_id=f"{task.group_id}/testgen/{i}/0", model_id=testgen_id, reward=s.reward,
            metadata={**shared, "role": "testgen", "turn": 0, "completion": test_texts[i], "valid_asserts": s.valid,
                      "killing_asserts": s.killing, "mutants": len(mutant_programs),
                      "outcomes": outcome_counts(s.results)}, **common))
    return finalize_groups(out)


SOLVER_TESTGEN = WorkflowSpec(
    "solver_testgen", ("solver", "testgen"), SolverTestgenConfig, solver_testgen_episode,
    "Solver writes a program, Test-Case Generator writes asserts, Solver retries once on failure; "
    "hidden-test reward for the Solver, mutant-killing reward for the Generator", needs_sandbox=True,
)
