"""The `math` workflow: one policy answers a question with a checkable answer; reward = correctness.

Each task is sampled `n_samples` times as one batch (one group for GRPO-style advantages). The reward
is 1.0 when the extracted final answer equals `metadata["answer"]`, `format_reward` when some answer
was extracted but is wrong, and 0.0 otherwise. `digit_sum_tasks` makes the small arithmetic task
that a tiny random-init model with the character tokenizer learns by RL within minutes on a CPU:
prompts "a+b=" with single digits whose sum is one character, so the whole answer is one token.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from deltamesh.mesh.workflows.answers import answers_match, extract_answer
from deltamesh.mesh.workflows.base import (EpisodeContext, Task, WorkflowSpec, finalize_groups, render,
                                           trajectory_from_generation)
from deltamesh.data import Trajectory


@dataclass
class MathConfig:
    prompt_template: str = "{prompt}"
    """How a task's prompt is shown to the policy; `{prompt}` is replaced by the task's prompt."""
    format_reward: float = 0.0
    """Reward for a completion whose answer can be extracted but is wrong (helps tiny models start)."""

    def __post_init__(self) -> None:
        if "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain {prompt}")
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {self.format_reward}")


def score(completion: str, reference: str, config: MathConfig) -> tuple[float, str | None, bool]:
    """(reward, extracted answer, correct) of one completion."""
    answer = extract_answer(completion)
    correct = answers_match(answer, reference)
    if correct:
        return 1.0, answer, True
    return (config.format_reward if answer is not None else 0.0), answer, False


async def math_episode(task: Task, ctx: EpisodeContext, config: MathConfig) -> list[Trajectory]:
    reference = task.reference_answer("math")
    started = time.perf_counter()
    model_id, engine = ctx.engine_for("policy")
    prompt = engine.encode(render(config.prompt_template, prompt=str(task.prompt)))
    gens = await engine.generate([prompt] * task.n_samples, ctx.params)
    episode_s = time.perf_counter() - started
    out = []
    for i, gen in enumerate(gens):
        completion = engine.decode(gen.tokens)
        reward, answer, correct = score(completion, reference, config)
        out.append(trajectory_from_generation(
            gen, trajectory_id=f"{task.group_id}/policy/{i}", task=task, model_id=model_id, reward=reward,
            ctx=ctx, timings={"episode_s": episode_s},
            metadata={"workflow": "math", "role": "policy", "sample": i, "completion": completion,
                      "answer": answer, "correct": correct},
        ))
    return finalize_groups(out)


MATH = WorkflowSpec(
    "math", ("policy",), MathConfig, math_episode,
    "single policy, verifiable answer; reward 1 when the final answer matches",
)


def digit_sum_tasks(count: int, *, seed: int = 0, max_digit: int = 4) -> list[dict[str, Any]]:
    """`count` dataset records {"id", "prompt", "metadata": {"answer"}} of the task "a+b=" -> a+b.

    With `max_digit` 4 there are 25 distinct prompts and every answer is one digit (0..8).
    """
    if not 0 <= max_digit <= 4:
        raise ValueError("max_digit must be in 0..4 so that every sum is a single digit")
    rng = random.Random(seed)
    records = []
    for i in range(count):
        a, b = rng.randint(0, max_digit), rng.randint(0, max_digit)
        records.append({"id": f"sum-{i}", "prompt": f"{a}+{b}=", "metadata": {"answer": str(a + b)}})
    return records
