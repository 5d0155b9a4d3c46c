"""The `solver_verifier` workflow: two policies, a Solver that answers and a Verifier that reviews.

Per sample: the Solver answers the question; the Verifier sees question and answer and replies with
a verdict and feedback; a verdict that does not match `accept_pattern` is a rejection, and then the
Solver answers once more with the feedback in its prompt. The episode's outcome is whether the
Solver's final answer (the retry if there was one) is correct, and every trajectory of the episode,
the Solver's turns and the Verifier's, gets that shared outcome as reward. Each policy's
trajectories go out under its own model_id, grouped per (model_id, lease). The n samples of a task
move through each stage together, as one batched generation per stage. Prompts go as text to continue
or as chat turns (`prompt_format`, as the math workflow's); the Solver's replies may be begun for it
(`solver_prefix`, e.g. "The answer is") and its answer read as the final one or the first number of
the reply (`answer`), as the math workflow reads it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Literal

from deltamesh.data import Trajectory
from deltamesh.mesh.workflows.answers import answers_match, extract_answer, first_number
from deltamesh.mesh.workflows.base import (
    EpisodeContext,
    PromptFormat,
    Task,
    WorkflowSpec,
    encode_prompt,
    finalize_groups,
    render,
    trajectory_from_generation,
    uses_chat,
)


@dataclass
class SolverVerifierConfig:
    solver_template: str = "Question: {prompt}\nAnswer:"
    verifier_template: str = (
        "Question: {prompt}\nProposed answer: {answer}\n"
        "Reply ACCEPT if the proposed answer is correct, else REJECT and say why.\nVerdict:"
    )
    retry_template: str = (
        "Question: {prompt}\nYour answer: {answer}\nA reviewer rejected it: {feedback}\nCorrected answer:"
    )
    accept_pattern: str = r"^\W*(accept|yes|correct)\b"
    """Case-insensitive regex searched in the Verifier's reply: a match accepts, anything else rejects."""
    prompt_format: PromptFormat = "completion"
    """completion, chat or auto, for both roles' prompts (as the math workflow's)."""
    solver_prefix: str = ""
    """The start of each of the Solver's replies, written for it; its answer is read from it and the reply."""
    answer: Literal["final", "first_number"] = "final"
    """How the Solver's answer is read: the final answer, or the first number of its reply."""

    def __post_init__(self) -> None:
        if self.answer not in ("final", "first_number"):
            raise ValueError(f"answer must be final or first_number, got {self.answer!r}")
        for name in ("solver_template", "verifier_template", "retry_template"):
            if "{prompt}" not in getattr(self, name):
                raise ValueError(f"{name} must contain {{prompt}}")
        try:
            re.compile(self.accept_pattern)
        except re.error as e:
            raise ValueError(f"accept_pattern is not a regex: {e}") from e


async def solver_verifier_episode(task: Task, ctx: EpisodeContext, config: SolverVerifierConfig) -> list[Trajectory]:
    reference = task.reference_answer("solver_verifier")
    started = time.perf_counter()
    solver_id, solver = ctx.engine_for("solver")
    verifier_id, verifier = ctx.engine_for("verifier")
    accept = re.compile(config.accept_pattern, re.IGNORECASE)
    question = str(task.prompt)
    n = task.n_samples

    solver_chat, verifier_chat = uses_chat(solver, config.prompt_format), uses_chat(verifier, config.prompt_format)

    def ask_solver(template: str, **values: str) -> list[int]:
        return encode_prompt(solver, render(template, prompt=question, **values), solver_chat, config.solver_prefix)

    def read(reply: str) -> str | None:
        text = config.solver_prefix + reply
        return first_number(text) if config.answer == "first_number" else extract_answer(text)

    first = await solver.generate([ask_solver(config.solver_template)] * n, ctx.params)
    answers = [solver.decode(g.tokens).strip() for g in first]
    shown = [f"{config.solver_prefix} {a}".strip() for a in answers]  # the Solver's whole reply, prefix included
    reviews = await verifier.generate(
        [encode_prompt(verifier, render(config.verifier_template, prompt=question, answer=a), verifier_chat)
         for a in shown], ctx.params,
    )
    replies = [verifier.decode(g.tokens).strip() for g in reviews]
    accepted = [accept.search(r) is not None for r in replies]
    rejected = [i for i in range(n) if not accepted[i]]
    retries = await solver.generate(
        [ask_solver(config.retry_template, answer=shown[i], feedback=replies[i]) for i in rejected], ctx.params,
    ) if rejected else []
    retry_of = dict(zip(rejected, retries))

    episode_s = time.perf_counter() - started
    out = []
    for i in range(n):
        final_text = solver.decode(retry_of[i].tokens).strip() if i in retry_of else answers[i]
        final_answer = read(final_text)
        correct = answers_match(final_answer, reference)
        outcome = 1.0 if correct else 0.0
        shared = {"workflow": "solver_verifier", "sample": i, "accepted": accepted[i], "final_answer": final_answer,
                  "correct": correct}
        common = dict(task=task, reward=outcome, ctx=ctx, timings={"episode_s": episode_s})
        out.append(trajectory_from_generation(
            first[i], trajectory_id=f"{task.group_id}/solver/{i}/0", model_id=solver_id,
            metadata={**shared, "role": "solver", "turn": 0, "completion": answers[i]}, **common,
        ))
        out.append(trajectory_from_generation(
            reviews[i], trajectory_id=f"{task.group_id}/verifier/{i}/0", model_id=verifier_id,
            metadata={**shared, "role": "verifier", "turn": 0, "completion": replies[i]}, **common,
        ))
        if i in retry_of:
            out.append(trajectory_from_generation(
                retry_of[i], trajectory_id=f"{task.group_id}/solver/{i}/1", model_id=solver_id,
                metadata={**shared, "role": "solver", "turn": 1, "completion": final_text}, **common,
            ))
    return finalize_groups(out)


SOLVER_VERIFIER = WorkflowSpec(
    "solver_verifier", ("solver", "verifier"), SolverVerifierConfig, solver_verifier_episode,
    "Solver answers, Verifier accepts or rejects with feedback, Solver retries once; shared outcome reward",
)
