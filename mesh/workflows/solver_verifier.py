"""The `solver_verifier` workflow: two policies, a Solver that answers and a Verifier that reviews.

Per sample: the Solver answers the question; the Verifier sees question and answer and replies with
a verdict and feedback; a verdict that does not match `accept_pattern` is a rejection, and then the
Solver answers once more with the feedback in its prompt. The episode's outcome is whether the
Solver's final answer (the retry if there was one) is correct, and every trajectory of the episode,
the Solver's turns and the Verifier's, gets that shared outcome as reward. Each policy's
trajectories go out under its own model_id, grouped per (model_id, lease). The n samples of a task
move through each stage together, as one batched generation per stage.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from deltamesh.mesh.workflows.answers import answers_match, extract_answer
from deltamesh.mesh.workflows.base import (EpisodeContext, Task, WorkflowSpec, finalize_groups, render,
                                           trajectory_from_generation)
from deltamesh.data import Trajectory


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

    def __post_init__(self) -> None:
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

    first = await solver.generate([solver.encode(render(config.solver_template, prompt=question))] * n, ctx.params)
    answers = [solver.decode(g.tokens).strip() for g in first]
    reviews = await verifier.generate(
        [verifier.encode(render(config.verifier_template, prompt=question, answer=a)) for a in answers], ctx.params,
    )
    replies = [verifier.decode(g.tokens).strip() for g in reviews]
    accepted = [accept.search(r) is not None for r in replies]
    rejected = [i for i in range(n) if not accepted[i]]
    retries = await solver.generate(
        [solver.encode(render(config.retry_template, prompt=question, answer=answers[i], feedback=replies[i]))
         for i in rejected], ctx.params,
    ) if rejected else []
    retry_of = dict(zip(rejected, retries))

    episode_s = time.perf_counter() - started
    out = []
    for i in range(n):
        final_text = solver.decode(retry_of[i].tokens).strip() if i in retry_of else answers[i]
        final_answer = extract_answer(final_text)
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
