"""The `code` workflow: one policy writes a function; its reward comes from the hidden tests run in the sandbox.

Each task (a `CodeProblem`, see code_tasks.py) is sampled `n_samples` times as one batch; every
program runs against the problem's hidden tests in the pool's sandbox, concurrently (the sandbox
bounds how many at once). The reward is `code_reward.pass_reward` of the program's results; each
trajectory's metadata carries the program, the per-test outcomes and their counts, which the pool's
status and the demo's report add up.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

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


@dataclass
class CodeConfig:
    prompt_template: str | None = None
    """How a problem is shown to the policy; `{prompt}` is the function's signature and docstring
    (unset: the prompt format's default, code_prompts.py)."""
    prompt_format: PromptFormat = "auto"
    """completion, chat (an instruct model's chat template) or auto (chat when the tokenizer has a template)."""
    partial_credit: bool = False
    """Reward the share of hidden tests passed instead of 1 only when all pass."""

    def __post_init__(self) -> None:
        check_template("prompt_template", self.prompt_template)


async def code_episode(task: Task, ctx: EpisodeContext, config: CodeConfig) -> list[Trajectory]:
    problem = CodeProblem.from_task(task, "code")
    sandbox = ctx.need_sandbox("code")
    started = time.perf_counter()
    model_id, engine = ctx.engine_for("policy")
    prompter = CodePrompter(engine, config.prompt_format)
    prompt = prompter.encode("solver", config.prompt_template, prompt=problem.prompt, entry_point=problem.entry_point)
    gens = await engine.generate([prompt] * task.n_samples, prompter.params("solver", ctx.params))
    completions = [prompter.reply("solver", g.tokens) for g in gens]
    programs = [program_from_completion(problem.prompt, c, problem.entry_point) for c in completions]
    results = await asyncio.gather(*(sandbox.run(p, problem.tests) for p in programs))
    episode_s = time.perf_counter() - started
    out = []
    for i, (gen, completion, program, result) in enumerate(zip(gens, completions, programs, results)):
        reward = pass_reward(result, partial_credit=config.partial_credit)
        out.append(trajectory_from_generation(
            gen, trajectory_id=f"{task.group_id}/policy/{i}", task=task, model_id=model_id, reward=reward,
            ctx=ctx, timings={"episode_s": episode_s, "sandbox_s": result.seconds},
            metadata={"workflow": "code", "role": "policy", "sample": i, "completion": completion,
                      "program": program, "outcomes": outcome_counts([result]),
                      "tests": [t.outcome.value for t in result.tests], "correct": result.passed},
        ))
    return finalize_groups(out)


CODE = WorkflowSpec(
    "code", ("policy",), CodeConfig, code_episode,
    "single policy writes a function; reward from its hidden tests run in the sandbox", needs_sandbox=True,
)
