"""The `solver_selector` workflow: a Solver writes two candidate programs, a Selector picks one.

Per sample: the Solver completes the function twice (both candidates in one batch with the other
samples'); the Selector (its own model_id, trainer and weight stream) sees the problem and both
programs and replies; the first standalone `A` or `B` in its reply is its choice. Both candidates
run against the hidden tests in the sandbox (the unchosen one only for the metadata), and the
chosen program's result is the reward of both roles: the Selector's reply and both of the Solver's
candidates (`solver_reward = "own"` scores each candidate by its own tests instead). A reply that
names neither candidate chooses nothing: the Selector's reward is 0 and the Solver is scored on
candidate A.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Literal

from deltamesh.data import Trajectory
from deltamesh.mesh.workflows.base import (
    EpisodeContext,
    PromptFormat,
    Task,
    WorkflowSpec,
    finalize_groups,
    trajectory_from_generation,
)
from deltamesh.mesh.workflows.code_prompts import CodePrompter, check_template
from deltamesh.mesh.workflows.code_reward import outcome_counts, pass_reward, program_from_completion
from deltamesh.mesh.workflows.code_tasks import CodeProblem

_CHOICE = re.compile(r"\b([AB])\b")
LABELS = ("A", "B")


@dataclass
class SolverSelectorConfig:
    solver_template: str | None = None
    selector_template: str | None = None
    """Unset: the prompt format's defaults (code_prompts.py); the Selector's shows `{a}` and `{b}`."""
    prompt_format: PromptFormat = "auto"
    """completion, chat (an instruct model's chat template) or auto (chat when the tokenizer has a template)."""
    solver_reward: Literal["chosen", "own"] = "chosen"
    """"chosen": every candidate gets the chosen program's reward; "own": each its own tests' result."""
    partial_credit: bool = False
    """Rewards are the share of hidden tests passed instead of 1 only when all pass."""

    def __post_init__(self) -> None:
        check_template("solver_template", self.solver_template)
        check_template("selector_template", self.selector_template, "a", "b")


def parse_choice(reply: str) -> int | None:
    """0 for A, 1 for B (the first standalone letter of the reply), None for neither."""
    found = _CHOICE.search(reply)
    return None if found is None else LABELS.index(found.group(1))


async def solver_selector_episode(task: Task, ctx: EpisodeContext, config: SolverSelectorConfig) -> list[Trajectory]:
    problem = CodeProblem.from_task(task, "solver_selector")
    sandbox = ctx.need_sandbox("solver_selector")
    started = time.perf_counter()
    solver_id, solver = ctx.engine_for("solver")
    selector_id, selector = ctx.engine_for("selector")
    n = task.n_samples

    # Candidates 2i and 2i+1 are sample i's A and B.
    solver_prompts = CodePrompter(solver, config.prompt_format)
    selector_prompts = CodePrompter(selector, config.prompt_format)
    values = dict(prompt=problem.prompt, entry_point=problem.entry_point)
    gens = await solver.generate([solver_prompts.encode("solver", config.solver_template, **values)] * (2 * n),
                                 solver_prompts.params("solver", ctx.params))
    programs = [program_from_completion(problem.prompt, solver_prompts.reply("solver", g.tokens), problem.entry_point)
                for g in gens]
    picks, results = await asyncio.gather(
        selector.generate([selector_prompts.encode("selector", config.selector_template, **values,
                                                   a=programs[2 * i], b=programs[2 * i + 1]) for i in range(n)],
                          ctx.params),
        asyncio.gather(*(sandbox.run(p, problem.tests) for p in programs)))
    rewards = [pass_reward(r, partial_credit=config.partial_credit) for r in results]

    episode_s = time.perf_counter() - started
    out = []
    for i in range(n):
        reply = selector.decode(picks[i].tokens)
        choice = parse_choice(reply)
        chosen = 2 * i + (choice or 0)
        shared = {"workflow": "solver_selector", "sample": i, "choice": None if choice is None else LABELS[choice],
                  "correct": results[chosen].passed, "outcomes": outcome_counts(results[2 * i:2 * i + 2])}
        common = dict(task=task, ctx=ctx, timings={"episode_s": episode_s})
        out.append(trajectory_from_generation(
            picks[i], trajectory_id=f"{task.group_id}/selector/{i}", model_id=selector_id,
            reward=rewards[chosen] if choice is not None else 0.0,
            metadata={**shared, "role": "selector", "completion": reply}, **common))
        for j in (0, 1):
            c = 2 * i + j
            out.append(trajectory_from_generation(
                gens[c], trajectory_id=f"{task.group_id}/solver/{i}/{LABELS[j]}", model_id=solver_id,
                reward=rewards[c] if config.solver_reward == "own" else rewards[chosen],
                metadata={**shared, "role": "solver", "candidate": LABELS[j], "program": programs[c],
                          "passed": results[c].passed}, **common))
    return finalize_groups(out)


SOLVER_SELECTOR = WorkflowSpec(
    "solver_selector", ("solver", "selector"), SolverSelectorConfig, solver_selector_episode,
    "Solver writes two programs, Selector picks one; both rewarded by the chosen program's hidden tests",
    needs_sandbox=True,
)
