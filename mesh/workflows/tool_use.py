"""The `tool_use` workflow: a multi-turn episode in which the model runs Python in the sandbox, reads
the output and then answers.

The task is a computation that is easy to program and hard to do in one's head (`tool_tasks`: digit
sums of large powers, counts of primes). Each turn the model writes either `<python>CODE</python>`,
which `PythonToolEnv` runs in the pool's sandbox and answers with the output (the tail of its stdout
and stderr, and the outcome when it did not end normally) as `<output>...</output>`; or
`<answer>X</answer>`, which ends the episode with reward 1.0 when X matches the task's answer
(`answers.answers_match`) and 0.0 otherwise. Whichever tag comes first in the turn's text counts
(a closing tag may be missing: the text runs to the end of the turn). With `require_tool` (the
default) an answer before any tool output was read is refused with a note and the episode goes on,
so every episode that answers has at least two turns; a turn with neither tag gets a note on the
format. An episode that never answers ends after `max_turns` with reward 0.
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass, field
from typing import Any

from deltamesh.data import Trajectory
from deltamesh.mesh.sandbox import ExecutionResult, Outcome, Sandbox
from deltamesh.mesh.workflows.answers import answers_match
from deltamesh.mesh.workflows.base import EpisodeContext, Task, WorkflowSpec, finalize_groups, render
from deltamesh.mesh.workflows.code_reward import outcome_counts
from deltamesh.mesh.workflows.episodes import Step, run_episode

_TAG = re.compile(r"<(python|answer)>(.*?)(?:</\1>|$)", re.S)
NO_TAG = "\n<note>Write <python>code</python> to run code, or <answer>value</answer> to answer.</note>\n"
TOOL_FIRST = "\n<note>Run the python tool before answering.</note>\n"


@dataclass
class ToolUseConfig:
    prompt_template: str = (
        "{prompt}\nYou can run Python: write <python>code</python> and you will see its output. "
        "When you know the answer, write <answer>value</answer>.\n"
    )
    """The first observation; `{prompt}` is the task's question."""
    max_turns: int = 4
    """Model turns per episode at most (each tool call and the answer is one)."""
    max_tokens: int = 2048
    """Most tokens of a whole episode (prompt, turns and observations); past it the episode ends."""
    max_output_chars: int = 400
    """Tool output shown to the model (its tail)."""
    require_tool: bool = True
    """Refuse an answer given before any tool output was read."""

    def __post_init__(self) -> None:
        if "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain {prompt}")
        if self.max_turns < 2:
            raise ValueError("max_turns must be >= 2 (a tool call and an answer)")
        if min(self.max_tokens, self.max_output_chars) < 1:
            raise ValueError("max_tokens and max_output_chars must be >= 1")


@dataclass
class PythonToolEnv:
    """The environment of one episode (see the module docstring)."""

    question: str
    answer: str
    sandbox: Sandbox
    config: ToolUseConfig
    executions: list[ExecutionResult] = field(default_factory=list)
    given: str | None = None
    """The answer the model gave, once it gave one."""

    async def reset(self) -> str:
        self.executions.clear()
        self.given = None
        return render(self.config.prompt_template, prompt=self.question)

    async def step(self, action: str) -> Step:
        found = _TAG.search(action)
        if found is None:
            return Step(NO_TAG)
        kind, body = found.group(1), found.group(2).strip()
        if kind == "python":
            return Step(await self._run(body))
        if self.config.require_tool and not self.executions:
            return Step(TOOL_FIRST)
        self.given = body
        return Step("", reward=1.0 if answers_match(body, self.answer) else 0.0, done=True)

    async def _run(self, code: str) -> str:
        # One test that does nothing: the program's own output is what the model reads.
        result = await self.sandbox.run(code, ["pass"])
        self.executions.append(result)
        test = result.tests[0]
        output = test.stderr[-self.config.max_output_chars:]
        status = "" if test.outcome is Outcome.PASSED else f"[{test.outcome.value}]\n"
        return f"\n<output>\n{status}{output}</output>\n"


async def tool_use_episode(task: Task, ctx: EpisodeContext, config: ToolUseConfig) -> list[Trajectory]:
    reference = task.reference_answer("tool_use")
    sandbox = ctx.need_sandbox("tool_use")
    model_id, engine = ctx.engine_for("policy")
    envs = [PythonToolEnv(str(task.prompt), reference, sandbox, config) for _ in range(task.n_samples)]
    episodes = await asyncio.gather(*(run_episode(engine, env, ctx.params, max_turns=config.max_turns,
                                                  max_tokens=config.max_tokens) for env in envs))
    out = []
    for i, (env, episode) in enumerate(zip(envs, episodes)):
        out.append(episode.trajectory(
            trajectory_id=f"{task.group_id}/policy/{i}", task=task, model_id=model_id, ctx=ctx,
            metadata={"workflow": "tool_use", "role": "policy", "sample": i, "tool_calls": len(env.executions),
                      "answer": env.given, "correct": episode.reward > 0,
                      "outcomes": outcome_counts(env.executions)},
        ))
    return finalize_groups(out)


TOOL_USE = WorkflowSpec(
    "tool_use", ("policy",), ToolUseConfig, tool_use_episode,
    "multi-turn: the policy runs Python in the sandbox, reads the output, then answers", needs_sandbox=True,
)


def tool_tasks(count: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """`count` dataset records {"id", "prompt", "metadata": {"answer"}} of questions worth a tool call."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        if rng.random() < 0.5:
            a, b = rng.randint(2, 9), rng.randint(20, 60)
            prompt, answer = f"What is the sum of the digits of {a}**{b}?", sum(int(d) for d in str(a ** b))
        else:
            n = rng.randint(100, 2000)
            prompt, answer = f"How many prime numbers are smaller than {n}?", _count_primes(n)
        records.append({"id": f"tool-{i}", "prompt": prompt, "metadata": {"answer": str(answer)}})
    return records


def _count_primes(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"[:n]
    for p in range(2, int(n ** 0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = bytearray(len(range(p * p, n, p)))
    return sum(sieve)
