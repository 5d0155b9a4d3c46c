"""The `math` workflow: one policy answers a question with a checkable answer; reward = correctness.

Each task is sampled `n_samples` times as one batch (one group for GRPO-style advantages). The reward
is 1.0 when the extracted final answer equals `metadata["answer"]`, `format_reward` when some answer
was extracted but is wrong, and 0.0 otherwise. The prompt goes to the model as text to continue or as
a chat turn (`prompt_format`, as the code workflows' prompts), optionally with the start of the reply
written for it (`reply_prefix`, e.g. "The answer is"), which then counts as part of the completion the
answer is read from: the final answer (`answer = "final"`: boxed, `####`, "answer is", else the last
number), or the first number of the reply (`"first_number"`: a short reply after such a prefix,
whose later tokens may ramble on). Task families: `digit_sum_tasks` makes the small arithmetic task
that a tiny random-init model with the character tokenizer learns by RL within minutes on a CPU:
prompts "a+b=" with single digits whose sum is one character, so the whole answer is one token.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Literal

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
class MathConfig:
    prompt_template: str = "{prompt}"
    """How a task's prompt is shown to the policy; `{prompt}` is replaced by the task's prompt."""
    format_reward: float = 0.0
    """Reward for a completion whose answer can be extracted but is wrong (helps tiny models start)."""
    prompt_format: PromptFormat = "completion"
    """completion: the prompt as text the model continues; chat: one user turn of the tokenizer's chat
    template; auto: chat when the tokenizer has a template (docs/WORKFLOWS.md, "Prompts")."""
    reply_prefix: str = ""
    """The start of the reply, written after the prompt for the model to continue (e.g. "The answer
    is"); the answer is read from it and the completion together."""
    answer: Literal["final", "first_number"] = "final"
    """How the answer is read: the final answer (boxed, ####, "answer is", else the last number), or
    the first number of the reply."""

    def __post_init__(self) -> None:
        if "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain {prompt}")
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {self.format_reward}")
        if self.prompt_format not in ("auto", "completion", "chat"):
            raise ValueError(f"prompt_format must be auto, completion or chat, got {self.prompt_format!r}")
        if self.answer not in ("final", "first_number"):
            raise ValueError(f"answer must be final or first_number, got {self.answer!r}")


def score(completion: str, reference: str, config: MathConfig) -> tuple[float, str | None, bool]:
    """(reward, extracted answer, correct) of one completion (the reply prefix not included)."""
    reply = config.reply_prefix + completion
    answer = first_number(reply) if config.answer == "first_number" else extract_answer(reply)
    correct = answers_match(answer, reference)
    if correct:
        return 1.0, answer, True
    return (config.format_reward if answer is not None else 0.0), answer, False


async def math_episode(task: Task, ctx: EpisodeContext, config: MathConfig) -> list[Trajectory]:
    reference = task.reference_answer("math")
    started = time.perf_counter()
    model_id, engine = ctx.engine_for("policy")
    chat = uses_chat(engine, config.prompt_format)
    prompt = encode_prompt(engine, render(config.prompt_template, prompt=str(task.prompt)), chat, config.reply_prefix)
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
